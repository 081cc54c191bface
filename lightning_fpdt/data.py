"""Long-context data with no downloads: a generated pass-key retrieval task (the default), plain
text files through a byte tokenizer, and pre-tokenized token files."""

from __future__ import annotations

import glob
import os
import random
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_fpdt.hf_data import HFDataModule  # noqa: F401  (lightning_fpdt.data.HFDataModule in configs)
from lightning_fpdt.tokenizer import ByteTokenizer

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


class PasskeyDataset(Dataset):
    """Pass-key retrieval (after Mohtashami & Jaggi 2023): a number hidden in filler text at a chosen
    depth, asked for at the end. Only a model that attends back over the distance can answer.

    Each sample is ``seq_len`` byte tokens::

        <filler> The pass key is #48213. Remember it. <filler> What is the pass key? #48213

    The filler has no digits and no ``#``, so the key is the only thing to copy. With
    ``key_repeats=R`` the key is written R times in the needle (``The pass key is #7 #7 #7 ...``): the
    answer still has to be read from the needle, but R copies give the attention R times the signal
    at the start: a one-digit key written 8 times is learnt in 40-60 steps
    (``examples/configs/tiny_cpu.yaml``), where a 5-digit key written once (induction over ``#`` and
    the digits) reaches about 0.3 per digit in 3000 (``passkey_cpu.yaml``).

    Items: ``input_ids`` ``[seq_len]``, ``answer_mask`` ``[seq_len]`` (True at positions whose *next*
    token is an answer digit: aligned with shifted labels), ``depth`` (float), and with
    ``loss_on="answer"`` also ``labels`` that ignore (-100) everything but the answer digits.

    Args:
        num_samples: dataset length.
        seq_len: tokens per sample.
        depth: where the key sits, as a fraction of the filler (0 = start); ``None`` draws it per sample.
        digits: length of the pass key.
        seed: samples are a pure function of ``(seed, index)``.
        loss_on: ``"all"`` tokens (language modelling of the filler too) or only the ``"answer"``.
        key_repeats: times the key is written in the needle (the answer gives it once).
    """

    def __init__(
        self, num_samples: int, seq_len: int, depth: float | None = None, digits: int = 5, seed: int = 0,
        loss_on: str = "all", key_repeats: int = 1,
    ) -> None:
        if loss_on not in ("all", "answer"):
            raise ValueError(f"PasskeyDataset: loss_on={loss_on!r} must be 'all' or 'answer'.")
        if key_repeats < 1:
            raise ValueError(f"PasskeyDataset: key_repeats={key_repeats} must be at least 1.")
        self.loss_on, self.key_repeats = loss_on, key_repeats
        self.tokenizer = ByteTokenizer()
        self.num_samples, self.seq_len, self.depth, self.digits, self.seed = num_samples, seq_len, depth, digits, seed
        minimum = len(self._tail("0" * digits)) + len(self._needle("0" * digits)) + 1
        if seq_len < minimum:
            raise ValueError(f"PasskeyDataset: seq_len={seq_len} is too short for the task; use at least {minimum}.")
        if depth is not None and not 0.0 <= depth <= 1.0:
            raise ValueError(f"PasskeyDataset: depth={depth} must be in [0, 1].")

    def _needle(self, key: str) -> list[int]:
        return self.tokenizer.encode(" The pass key is" + f" #{key}" * self.key_repeats + ". Remember it. ")

    def _tail(self, key: str) -> list[int]:
        return self.tokenizer.encode(f" What is the pass key? #{key}")

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, Any]:
        rng = random.Random(self.seed * 1_000_003 + index)
        key = "".join(rng.choice("0123456789") for _ in range(self.digits))
        needle, tail = self._needle(key), self._tail(key)
        n_filler = self.seq_len - len(needle) - len(tail)
        depth = rng.random() if self.depth is None else self.depth
        filler = self.tokenizer.encode(FILLER * (n_filler // len(FILLER) + 2))
        offset = rng.randrange(len(FILLER))
        filler = filler[offset : offset + n_filler]
        cut = int(round(depth * n_filler))
        ids = filler[:cut] + needle + filler[cut:] + tail
        answer_mask = torch.zeros(self.seq_len, dtype=torch.bool)
        answer_mask[self.seq_len - self.digits - 1 : self.seq_len - 1] = True  # next token is a key digit
        item = {"input_ids": torch.tensor(ids, dtype=torch.long), "answer_mask": answer_mask, "depth": depth}
        if self.loss_on == "answer":  # Hugging Face convention: labels[t] is token t, unshifted
            labels = torch.full((self.seq_len,), -100, dtype=torch.long)
            labels[-self.digits :] = item["input_ids"][-self.digits :]
            item["labels"] = labels
        return item


class PasskeyDataModule(pl.LightningDataModule):
    """The embedded long-context task as a LightningDataModule.

    Args:
        seq_len: tokens per training sample (global, before sequence sharding).
        batch_size: samples per data-parallel rank per step.
        train_samples / val_samples: dataset sizes (train samples are drawn from a different seed).
        depth: key depth for validation samples (``None``: random); training depth is always random.
        digits: pass-key length.
        val_seq_len: tokens per validation sample (default ``seq_len``); longer than ``seq_len``
            tests whether retrieval learnt on short samples holds over longer distances.
        loss_on: loss on ``"all"`` tokens or only on the ``"answer"``, in training and validation alike.
        key_repeats: times the key is written in the needle (see :class:`PasskeyDataset`).
        num_workers: DataLoader workers.
    """

    def __init__(
        self,
        seq_len: int = 512,
        batch_size: int = 4,
        train_samples: int = 2048,
        val_samples: int = 64,
        depth: float | None = None,
        digits: int = 5,
        val_seq_len: int | None = None,
        loss_on: str = "all",
        key_repeats: int = 1,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.seq_len, self.batch_size, self.num_workers = seq_len, batch_size, num_workers
        self.train_set = PasskeyDataset(train_samples, seq_len, None, digits, 1, loss_on, key_repeats)
        # held out: another seed draws other keys, depths and filler offsets
        self.val_set = PasskeyDataset(val_samples, val_seq_len or seq_len, depth, digits, 2, loss_on, key_repeats)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers)


class PackedTokenDataset(Dataset):
    """Fixed-length windows over one long token stream (documents packed back to back).

    Sample ``i`` is tokens ``[i * seq_len, (i + 1) * seq_len)``. Document boundaries are kept as
    position-id resets: the token after each ``eos_token_id`` starts again at position 0, so RoPE and
    learned positions see each document from its start, and attention stays inside each document
    (``FPDTStrategy`` and ``CausalLM`` read the resets as document starts: ``lightning_fpdt.layout``).

    Args:
        tokens: a 1-D integer array (e.g. a ``numpy.memmap``; read lazily, window by window).
        seq_len: tokens per sample.
        eos_token_id: the document separator, or ``None`` for one document.
    """

    def __init__(self, tokens: Any, seq_len: int, eos_token_id: int | None = None) -> None:
        if seq_len < 2:
            raise ValueError(f"PackedTokenDataset: seq_len must be >= 2, got {seq_len}.")
        if len(tokens) < seq_len:
            raise ValueError(
                f"PackedTokenDataset: {len(tokens)} tokens are fewer than one sample of seq_len={seq_len};"
                " use a shorter seq_len or more data."
            )
        self.tokens, self.seq_len, self.eos_token_id = tokens, seq_len, eos_token_id

    def __len__(self) -> int:
        return len(self.tokens) // self.seq_len

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        tokens = self.tokens[index * self.seq_len : (index + 1) * self.seq_len]
        window = torch.as_tensor(np.asarray(tokens).astype(np.int64))
        return {"input_ids": window, "position_ids": document_positions(window, self.eos_token_id)}


def document_positions(ids: torch.Tensor, eos_token_id: int | None) -> torch.Tensor:
    """Positions that restart at 0 after every ``eos_token_id`` in a 1-D ``ids``."""
    n = ids.numel()
    positions = torch.arange(n)
    if eos_token_id is None:
        return positions
    starts = torch.zeros(n, dtype=torch.long)
    boundary = (ids[:-1] == eos_token_id).nonzero().flatten() + 1  # first token of each new document
    starts[boundary] = boundary
    return positions - torch.cummax(starts, dim=0).values


class _PackedDataModule(pl.LightningDataModule):
    """Train/validation split of a packed token stream (the last ``val_fraction`` is validation)."""

    def __init__(
        self, seq_len: int, batch_size: int, val_fraction: float, eos_token_id: int | None, num_workers: int
    ) -> None:
        super().__init__()
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction} must be in [0, 1).")
        self.seq_len, self.batch_size, self.val_fraction = seq_len, batch_size, val_fraction
        self.eos_token_id, self.num_workers = eos_token_id, num_workers
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None

    def _tokens(self) -> Any:
        raise NotImplementedError

    def setup(self, stage: str | None = None) -> None:
        tokens = self._tokens()
        n_val = int(len(tokens) * self.val_fraction) // self.seq_len * self.seq_len
        cut = len(tokens) - n_val
        self.train_set = PackedTokenDataset(tokens[:cut], self.seq_len, self.eos_token_id)
        if n_val:
            self.val_set = PackedTokenDataset(tokens[cut:], self.seq_len, self.eos_token_id)

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader | list:
        if self.val_set is None:
            return []
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers)


class TokenFileDataModule(_PackedDataModule):
    """Pre-tokenized corpora: a flat binary file of token ids (``numpy.memmap``), packed into samples.

    Args:
        path: the token file (raw little-endian ``uint16`` or ``uint32``, no header).
        dtype: ``"uint16"`` (vocabularies up to 65536) or ``"uint32"``.
        seq_len: tokens per sample.
        batch_size: samples per data-parallel rank per step.
        eos_token_id: document separator (position ids restart after it); ``None`` for none.
        val_fraction: the last fraction of the file used for validation.
        num_workers: DataLoader workers.
    """

    def __init__(
        self,
        path: str,
        dtype: str = "uint16",
        seq_len: int = 4096,
        batch_size: int = 1,
        eos_token_id: int | None = None,
        val_fraction: float = 0.01,
        num_workers: int = 0,
    ) -> None:
        super().__init__(seq_len, batch_size, val_fraction, eos_token_id, num_workers)
        if dtype not in ("uint16", "uint32"):
            raise ValueError(f"TokenFileDataModule: dtype={dtype!r} must be 'uint16' or 'uint32'.")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"TokenFileDataModule: no token file at {path!r}.")
        size = os.path.getsize(path)
        width = np.dtype(dtype).itemsize
        if size % width:
            raise ValueError(f"TokenFileDataModule: {path!r} has {size} bytes, not a whole number of {dtype} tokens.")
        self.path, self.dtype = path, dtype

    def _tokens(self) -> Any:
        return np.memmap(self.path, dtype=self.dtype, mode="r")


class TextFileDataModule(_PackedDataModule):
    """Plain text files, tokenized to bytes (:class:`~lightning_fpdt.tokenizer.ByteTokenizer`), packed.

    Files are joined with a NUL byte (id 0), which is the document separator.

    Args:
        paths: text files, or directories (every ``*.txt`` file inside, sorted).
        seq_len, batch_size, val_fraction, num_workers: as for :class:`TokenFileDataModule`.
    """

    def __init__(
        self,
        paths: list[str],
        seq_len: int = 1024,
        batch_size: int = 4,
        val_fraction: float = 0.05,
        num_workers: int = 0,
    ) -> None:
        super().__init__(seq_len, batch_size, val_fraction, 0, num_workers)
        files: list[str] = []
        for path in [paths] if isinstance(paths, str) else paths:
            if os.path.isdir(path):
                files += sorted(glob.glob(os.path.join(path, "*.txt")))
            elif os.path.isfile(path):
                files.append(path)
            else:
                raise FileNotFoundError(f"TextFileDataModule: {path!r} is neither a file nor a directory.")
        if not files:
            raise FileNotFoundError(f"TextFileDataModule: no .txt files in {paths!r}.")
        self.files = files

    def _tokens(self) -> Any:
        tokenizer = ByteTokenizer()
        ids: list[int] = []
        for path in self.files:
            with open(path, encoding="utf-8", errors="replace") as f:
                ids += tokenizer.encode(f.read()) + [0]
        return np.asarray(ids, dtype=np.uint8)
