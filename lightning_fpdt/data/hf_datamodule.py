"""``HFDataModule``: local ``datasets`` files and the model's own tokenizer, packed into long-context samples.

Life cycle (docs/data.md):

1. ``prepare_data`` (one process per node): read the files, tokenize every row with ``num_proc`` workers
   (:mod:`lightning_fpdt.data.tokenizing`, :mod:`lightning_fpdt.data.packing`), pack, and write the samples to
   ``cache_dir/<key>/`` as ``.npy`` files. The key hashes the files' and the tokenizer's content and every option
   that changes the samples (:mod:`lightning_fpdt.data.cache`), so other ranks and later runs reuse it. A bad
   input is not raised there but written next to the cache.
2. ``setup`` (every rank): raise that error, or a check's own (the tokenizer's vocabulary against the
   model's embedding), on every rank alike, before any collective; then memory-map the samples.
3. The loaders: each data-parallel group reads its own samples (the strategy's ``distributed_sampler_kwargs``)
   in an order drawn from ``seed`` and the epoch; the strategy's data-position resume skips what a
   checkpoint already trained on.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_fpdt.data import cache, files
from lightning_fpdt.data.packing import OWNER, DataError, build_samples, fill, has_generation_prompt, hold_out, shared
from lightning_fpdt.data.sources import DataSource, chosen, mixture_report
from lightning_fpdt.data.tokenizing import check_tokenizer, load_tokenizer, tokenize_source
from lightning_fpdt.errors import FPDTError
from lightning_fpdt.parallel.batches import input_vocab_size

KEYS = ("input_ids", "labels", "position_ids")


class PackedSamples(Dataset):
    """Packed samples memory-mapped from the cache: items ``input_ids``, ``labels`` (unshifted, -100 ignored)
    and ``position_ids`` (restarting per document), each ``[seq_len]`` long."""

    def __init__(self, directory: Path, split: str) -> None:
        self.arrays = {k: np.load(directory / f"{split}_{k}.npy", mmap_mode="r") for k in KEYS}

    def __len__(self) -> int:
        return len(self.arrays["input_ids"])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {k: torch.from_numpy(np.asarray(a[index], dtype=np.int64)) for k, a in self.arrays.items()}


class HFDataModule(pl.LightningDataModule):
    """Local ``datasets`` files, tokenized with the model's tokenizer and packed into ``seq_len`` samples.

    Batches: ``input_ids``, ``labels`` (Hugging Face convention: unshifted, -100 ignored) and ``position_ids``
    ``[batch_size, seq_len]``; positions restart at every document, so attention and targets stay inside it.

    Args:
        train_files: jsonl, json, parquet or csv files (globs allowed), or ``save_to_disk`` directories; or give
            ``mixture`` instead.
        val_files: the same for validation; ``None``: ``val_fraction`` of the training documents.
        mixture: datasets mixed into one set of samples (:class:`~lightning_fpdt.data.sources.DataSource`: files,
            row format such as ShareGPT or Alpaca, field and role names, a weight or a number of documents, the
            split), instead of ``train_files``/``val_files``; its counts are logged and kept in ``stats``.
        tokenizer: a local path for ``AutoTokenizer.from_pretrained``; ``None``: the path the
            ``HFCausalLM`` was loaded from (its ``model`` argument), so a config does not repeat it.
        format: ``"text"`` (documents packed back to back) or ``"chat"`` (conversations, loss on assistant
            turns only, bin-packed whole).
        seq_len: tokens per sample (global, before sequence sharding).
        batch_size: samples per data-parallel rank per step.
        text_field: the field of a text row.
        messages_field: the field of a chat row: a list of ``{"role", "content"}``.
        too_long: a conversation longer than ``seq_len`` is ``"truncate"``-d to its first ``seq_len`` tokens
            or ``"drop"``-ped; either is counted in a warning.
        val_fraction: without ``val_files``, the fraction of training documents held out (drawn from ``seed``).
        seed: the held-out documents and each epoch's sample order are a function of it.
        num_proc: tokenizer processes in ``prepare_data``.
        cache_dir: where the packed samples are kept (default ``~/.cache/lightning_fpdt/data``).
        num_workers: DataLoader workers.

    Raises:
        ValueError: an option out of range (at construction); bad data (at ``setup``, on every rank): see
            docs/troubleshooting.md, "Data".
    """

    def __init__(
        self,
        train_files: str | list[str] | None = None,
        val_files: str | list[str] | None = None,
        mixture: list[DataSource] | None = None,
        tokenizer: str | None = None,
        format: Literal["text", "chat"] = "text",
        seq_len: int = 4096,
        batch_size: int = 1,
        text_field: str = "text",
        messages_field: str = "messages",
        too_long: Literal["truncate", "drop"] = "drop",
        val_fraction: float = 0.0,
        seed: int = 0,
        num_proc: int = 1,
        cache_dir: str | None = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if format not in ("text", "chat"):
            raise FPDTError(f"{OWNER}format={format!r} must be 'text' or 'chat'.")
        if too_long not in ("truncate", "drop"):
            raise FPDTError(f"{OWNER}too_long={too_long!r} must be 'truncate' or 'drop'.")
        if seq_len < 2 or batch_size < 1 or num_proc < 1:
            raise FPDTError(f"{OWNER}seq_len={seq_len} (>= 2), batch_size={batch_size} and num_proc={num_proc}"
                            " (>= 1) are out of range.")
        if not 0.0 <= val_fraction < 1.0:
            raise FPDTError(f"{OWNER}val_fraction={val_fraction} must be in [0, 1).")
        if (train_files is None) == (mixture is None) or (mixture is not None and val_files is not None):
            raise FPDTError(f"{OWNER}give train_files (and val_files), or a mixture of datasets (each with its split),"
                            " not both.")
        self.save_hyperparameters()
        chat = format == "chat"
        if mixture is None:  # the given files as the one-dataset mixture they are
            field = messages_field if chat else text_field
            named = [DataSource(train_files, field=field)]
            named += [DataSource(val_files, field=field, split="val")] * (val_files is not None)
        else:
            named = [DataSource(**m) if isinstance(m, dict) else m for m in mixture]
        self.sources = [source.resolved(chat, i) for i, source in enumerate(named)]
        if not any(source.split == "train" for source in self.sources):
            raise FPDTError(f"{OWNER}the mixture has no dataset of split 'train'.")
        self.train_files, self.val_files, self.tokenizer = train_files, val_files, tokenizer
        self.format, self.seq_len, self.batch_size = format, seq_len, batch_size
        self.too_long, self.val_fraction, self.seed, self.num_proc = too_long, val_fraction, seed, num_proc
        self.cache_dir = Path(cache_dir or Path.home() / ".cache" / "lightning_fpdt" / "data")
        self.num_workers = num_workers
        self.train_set: PackedSamples | None = None
        self.val_set: PackedSamples | None = None
        self.stats: dict[str, Any] = {}
        self._failed: DataError | None = None

    # ---- the inputs and their cache key -------------------------------------------------------------------

    def tokenizer_path(self) -> str:
        """The tokenizer's local path: ``tokenizer``, or the attached ``HFCausalLM``'s model path.

        Raises:
            DataError: none given and the model was not loaded from a path.
        """
        if self.tokenizer is not None:
            return self.tokenizer
        module = self.trainer.lightning_module if self.trainer is not None else None
        model = getattr(module, "hparams", {}).get("model") if module is not None else None
        if isinstance(model, str):
            return model
        raise DataError(
            f"{OWNER}no tokenizer: give data.tokenizer (a local tokenizer directory). It is taken from the model"
            " only when the model is an HFCausalLM loaded from a path (model: /path/to/checkpoint); this model"
            f" is {type(module).__name__ if module is not None else 'not attached yet'}."
        )

    def _sources(self) -> list[tuple[DataSource, list[str]]]:
        """Each dataset with its files, globs expanded."""
        what = {"train": "train_files", "val": "val_files"}
        return [(s, files.resolve(s.path, f"mixture[{i}].path" if self.hparams.mixture else what[s.split]))
                for i, s in enumerate(self.sources)]

    def cache_key(self) -> str:
        """SHA-256 of the files' and the tokenizer's content, the libraries' versions and the options (16 digits).

        Raises:
            DataError: a data file or the tokenizer path does not exist.
        """
        return self._key()[0]

    def _key(self) -> tuple[str, str, dict[str, str]]:
        """The cache key, the tokenizer's hash and each data file's (a path's content hash)."""
        memo = self.cache_dir / "hashes"
        tokenizer = cache.tokenizer_hash(self.tokenizer_path(), memo)
        sources = [(s, [[p, cache.source_hash(p, memo)] for p in paths]) for s, paths in self._sources()]
        options = {k: self.hparams[k] for k in ("format", "seq_len", "too_long", "val_fraction", "seed")}
        key = {"version": cache.VERSION, "libraries": cache.versions(), "tokenizer": tokenizer,
               "files": [[s.split, s.spec(), s.weight, s.samples, [[os.path.abspath(p), h] for p, h in f]]
                         for s, f in sources], **options}
        return cache.digest(key), tokenizer, {p: h for _, f in sources for p, h in f}

    # ---- prepare_data: one process per node --------------------------------------------------------------

    def prepare_data(self) -> None:
        """Tokenize and pack into the cache unless it is there; a bad input is written next to the cache
        (``<key>.error``) for ``setup`` to raise on every rank."""
        try:
            key, digest, contents = self._key()
            target, error = self.cache_dir / key, self.cache_dir / f"{key}.error"
            if (target / "meta.json").is_file():
                return
            cache.check_writable(self.cache_dir)
        except DataError:
            return  # every rank's setup meets the same error
        error.unlink(missing_ok=True)
        self._failed = None
        try:
            self._build(target, digest, contents)
        except DataError as err:
            self._failed = err  # setup raises it in this process even if it cannot be written
            error.write_text(str(err))

    def _build(self, target: Path, digest: str, contents: dict[str, str]) -> None:
        tokenizer = load_tokenizer(self.tokenizer_path(), digest)
        check_tokenizer(tokenizer, self.tokenizer_path(), self.format == "chat")
        start = time.perf_counter()
        docs = self._mix(digest, contents)
        self.stats["tokenize_s"], start = time.perf_counter() - start, time.perf_counter()
        if "val" in docs:  # given files: a document in both is counted in a warning
            self.stats["val_in_train"] = shared(docs["val"][0], docs["train"][0])
        elif self.val_fraction > 0:  # every copy of a held-out document is held out
            kept = dict(zip(("train", "val"), hold_out(docs["train"][0], self.val_fraction, self.seed)))
            docs = {name: tuple([col[i] for i in at] for col in docs["train"]) for name, at in kept.items()}
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        building = target.with_name(target.name + f".tmp{os.getpid()}")
        shutil.rmtree(building, ignore_errors=True)
        building.mkdir(parents=True)
        meta: dict[str, Any] = {"vocab": len(tokenizer), "tokenizer": self.tokenizer_path()}
        if self.format == "chat":  # without one, chat_tokens finds each assistant header another way; _report says so
            meta["generation_prompt"] = has_generation_prompt(tokenizer)
        for split, (ids, labels) in docs.items():
            if not ids:
                if split == "train":
                    raise DataError(f"{OWNER}no training documents are left; check train_files and val_fraction.")
                continue
            samples = build_samples(ids, labels if self.format == "chat" else None, self.seq_len,
                                    whole=self.format == "chat", pad_id=pad)
            for k in KEYS:
                np.save(building / f"{split}_{k}.npy", samples[k])
            meta[split] = {"documents": len(ids), "samples": len(samples["input_ids"]),
                           "tokens": int((~samples["pad"]).sum()), "fill": fill(samples["input_ids"], samples["pad"])}
        self.stats["pack_s"] = time.perf_counter() - start  # with the .npy writes
        (building / "meta.json").write_text(json.dumps({**meta, **self.stats}))
        shutil.rmtree(target, ignore_errors=True)
        os.replace(building, target)

    def _mix(self, digest: str, contents: dict[str, str]) -> dict[str, tuple[list[list[int]], list[list[int]]]]:
        """``(ids, labels)`` of every document per split: each dataset's documents, as many as its weight or
        sample count asks for (:func:`~lightning_fpdt.data.sources.chosen`), in the order of the list."""
        docs: dict[str, tuple[list[list[int]], list[list[int]]]] = {}
        counts = []
        option = "a mixture dataset's field" if self.hparams.mixture else (
            "messages_field" if self.format == "chat" else "text_field")
        self.stats.update(train_skipped=0, train_too_long=0, val_skipped=0, val_too_long=0)
        for index, (source, paths) in enumerate(self._sources()):
            ids, labels, skipped, too_long = tokenize_source(
                source, paths, self.tokenizer_path(), digest, contents, self.cache_dir, num_proc=self.num_proc,
                seq_len=self.seq_len if self.format == "chat" else None, truncate=self.too_long == "truncate",
                option=option)
            self.stats[f"{source.split}_skipped"] += skipped
            self.stats[f"{source.split}_too_long"] += too_long
            keep = chosen(len(ids), source, self.seed, index)
            split_ids, split_labels = docs.setdefault(source.split, ([], []))
            split_ids.extend(ids[i] for i in keep)
            split_labels.extend(labels[i] for i in keep)
            counts.append({"name": ", ".join(Path(p).name for p in paths), "format": source.format,
                           "split": source.split, "documents": len(ids), "chosen": len(keep)})
        self.stats["mixture"] = counts
        return docs

    # ---- setup: every rank --------------------------------------------------------------------------------

    def setup(self, stage: str | None = None) -> None:
        """Raise a bad input on every rank, check the vocabulary against the model, memory-map the samples.

        Raises:
            DataError: the error ``prepare_data`` met, a missing file or tokenizer, or a tokenizer vocabulary
                larger than the model's embedding.
        """
        key = self.cache_key()
        directory, error = self.cache_dir / key, self.cache_dir / f"{key}.error"
        if error.is_file():
            raise DataError(error.read_text())
        if not (directory / "meta.json").is_file():
            cache.check_writable(self.cache_dir)  # on every rank: prepare_data could not say so
            self.prepare_data()  # used without a Trainer (or prepare_data was skipped): one process
            if error.is_file():
                raise DataError(error.read_text())
            if self._failed is not None:
                raise self._failed
        meta = json.loads((directory / "meta.json").read_text())
        module = self.trainer.lightning_module if self.trainer is not None else None
        embedded = input_vocab_size(module) if module is not None else None
        if embedded is not None and meta["vocab"] > embedded:
            raise DataError(
                f"{OWNER}the tokenizer at {meta['tokenizer']!r} has {meta['vocab']} tokens but the model embeds"
                f" {embedded}: ids from {embedded} up would be out of range. Use the model's own tokenizer, or a"
                f" model with vocab_size >= {meta['vocab']}."
            )
        self._report(meta)
        self.train_set = PackedSamples(directory, "train")
        self.val_set = PackedSamples(directory, "val") if "val" in meta else None
        self.stats = meta

    def _report(self, meta: dict[str, Any]) -> None:
        if meta.get("generation_prompt") is False:
            rank_zero_warn(
                f"{OWNER}the chat template of the tokenizer at {meta['tokenizer']!r} renders nothing for"
                " add_generation_prompt=True (it has no generation-prompt branch). Each assistant turn's header was"
                " found by rendering the turn with two different replies, so it is not trained on; but generation"
                " with this template will not open an assistant turn: add {% if add_generation_prompt %} and the"
                " assistant header {% endif %} to the template."
            )
        lost = {s: (meta.get(f"{s}_skipped", 0), meta.get(f"{s}_too_long", 0)) for s in ("train", "val")}
        for split, (skipped, too_long) in lost.items():
            if skipped or too_long:
                rank_zero_warn(
                    f"{OWNER}{split}: {skipped} conversations without an assistant turn were skipped and"
                    f" {too_long} longer than seq_len={self.seq_len} were {self.too_long}"
                    f"{'d' if self.too_long == 'truncate' else 'ped'}."
                )
        if meta.get("val_in_train"):
            rank_zero_warn(f"{OWNER}{meta['val_in_train']} of the {meta['val']['documents']} validation documents"
                           " (val_files) are also training documents (train_files), so the validation loss is partly"
                           " measured on trained text; remove them from one of the files.")
        if self.hparams.mixture:
            rank_zero_info(f"HFDataModule: mixture: {mixture_report(meta['mixture'])}")
        for split in ("train", "val"):
            if split in meta:
                m = meta[split]
                rank_zero_info(f"HFDataModule: {split}: {m['documents']} documents, {m['tokens']} tokens in"
                               f" {m['samples']} samples of {self.seq_len} (fill {m['fill']:.1%})")

    # ---- loaders ------------------------------------------------------------------------------------------

    def _sampler(self, data: Dataset, shuffle: bool) -> DistributedSampler:
        # the strategy's data-parallel coordinates (every rank of a sequence-parallel group reads the same
        # samples); a DistributedSampler is kept as it is by Lightning, so the order is drawn from our seed
        kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) if self.trainer else None
        kwargs = kwargs or {"num_replicas": 1, "rank": 0}
        return DistributedSampler(data, shuffle=shuffle, seed=self.seed, **kwargs)

    def train_dataloader(self) -> DataLoader:
        if self.train_set is None:
            raise RuntimeError(f"{OWNER}train_dataloader() before setup(); call setup('fit') first.")
        return DataLoader(self.train_set, batch_size=self.batch_size, sampler=self._sampler(self.train_set, True),
                          num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader | list:
        if self.val_set is None:
            return []
        return DataLoader(self.val_set, batch_size=self.batch_size, sampler=self._sampler(self.val_set, False),
                          num_workers=self.num_workers)
