"""The tokenizer of ``HFDataModule`` and the function its ``datasets`` map runs on each batch of rows.

The tokenizer is loaded from local files once per process (each map worker loads its own) and again when its
files change (:func:`lightning_fpdt.data.cache.tokenizer_hash`); a bad row is returned as its reason, never
raised in a worker, so the data module names its file and row.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_fpdt.data import cache, files
from lightning_fpdt.data.cache import no_tokenizer
from lightning_fpdt.data.packing import OWNER, DataError, chat_tokens, text_tokens
from lightning_fpdt.data.sources import DataSource, as_documents

_TOKENIZERS: dict[str, tuple[str | None, Any]] = {}  # per process: path -> (files' digest, tokenizer)


def load_tokenizer(path: str, digest: str | None = None) -> Any:
    """``AutoTokenizer.from_pretrained(path)`` from local files, once per process and version of its files.

    Args:
        digest: :func:`lightning_fpdt.data.cache.tokenizer_hash` of ``path``: a tokenizer saved again at the
            same path since it was loaded is loaded again. ``None``: the one this process holds, if any.
    """
    held = _TOKENIZERS.get(path)
    if held is not None and (digest is None or held[0] == digest):
        return held[1]
    from transformers import AutoTokenizer  # optional dependency: only HFDataModule needs transformers

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as err:
        raise no_tokenizer(path, f"{type(err).__name__}: {str(err)[:200]}") from None
    _TOKENIZERS[path] = (digest, tokenizer)
    return tokenizer


def tokenize_rows(rows: dict[str, list[Any]], tokenizer_path: str, tokenizer_digest: str,
                  source: dict[str, Any]) -> dict[str, list]:
    """A batch of rows to ``input_ids`` (and ``labels``); a bad row gives its reason in ``problem``, never
    raises (a worker's exception would reach the user as a raw traceback without the row).

    ``tokenizer_digest`` (the tokenizer files' hash): a worker process holding a tokenizer saved earlier at the
    same path loads it again. ``source``: the dataset's row format (:meth:`~lightning_fpdt.data.sources.DataSource.
    spec`); every chat format is read as messages first (:func:`~lightning_fpdt.data.sources.as_documents`)."""
    tokenizer = load_tokenizer(tokenizer_path, tokenizer_digest)
    values, chat = as_documents(rows, source), source["format"] != "text"
    out: dict[str, list] = {"input_ids": [[] for _ in values], "labels": [[] for _ in values],
                            "problem": [""] * len(values), "skipped": [False] * len(values)}
    if not chat:  # one call of the Rust tokenizer for the batch's good rows
        good = [i for i, text in enumerate(values) if isinstance(text, str) and text]
        encoded = tokenizer([values[i] for i in good])["input_ids"] if good else []
        for i, ids in zip(good, encoded):
            out["input_ids"][i] = list(ids) + [tokenizer.eos_token_id]
    for i, value in enumerate(values):
        try:
            if not chat:
                if not out["input_ids"][i]:
                    text_tokens(tokenizer, value)  # raises the reason
                continue
            made = chat_tokens(tokenizer, value)
            if made is None:
                out["skipped"][i] = True
            else:
                out["input_ids"][i], out["labels"][i] = made
        except ValueError as err:
            out["problem"][i] = str(err)
    return out


def tokenize_source(source: DataSource, paths: list[str], tokenizer_path: str, digest: str, contents: dict[str, str],
                    cache_dir: Path, num_proc: int, seq_len: int | None, truncate: bool,
                    option: str) -> tuple[list[list[int]], list[list[int]], int, int]:
    """Every row of a dataset's ``paths`` tokenized (``num_proc`` processes): ``(ids, labels)`` per kept document,
    and the numbers of conversations skipped (no assistant turn) and longer than ``seq_len`` (``None``: no limit;
    ``truncate``: cut to it, else dropped).

    ``datasets`` keeps a file's rows and tokens in a directory of that content (:func:`cache.datasets_dir`), the
    tokens in a file named by what else determines them: never those of another content or tokenizer.

    Raises:
        DataError: a file without the columns the format reads (naming ``option``), a bad row (its file, row and
            reason), no rows, or no document left."""
    ids: list[list[int]] = []
    labels: list[list[int]] = []
    skipped = too_long = rows = 0
    tokens = cache.digest({"version": cache.VERSION, "libraries": cache.versions(), "tokenizer": digest,
                           "source": source.spec()})
    for path in paths:
        where = cache.datasets_dir(cache_dir, contents[path])
        cache.check_writable(where)
        data = files.load(path, str(where))
        for column in source.needed_columns():
            files.check_field(data, column, option, path)
        rows += len(data)
        if len(data) == 0:
            continue
        kwargs = {"tokenizer_path": tokenizer_path, "tokenizer_digest": digest, "source": source.spec()}
        made = data.map(tokenize_rows, batched=True, batch_size=256, fn_kwargs=kwargs,
                        remove_columns=data.column_names, num_proc=min(num_proc, len(data)),
                        cache_file_name=str(where / f"tokens-{tokens}.arrow"),
                        new_fingerprint=cache.digest([tokens, contents[path]]),
                        desc=f"HFDataModule: tokenizing {Path(path).name}")
        problems = made["problem"]
        bad = next((i for i, p in enumerate(problems) if p), None)
        if bad is not None:
            raise DataError(f"{OWNER}{path!r} row {bad} (field {source.field!r}) {problems[bad]}.")
        for row_ids, row_labels, skip in zip(made["input_ids"], made["labels"], made["skipped"]):
            if skip:
                skipped += 1
            elif seq_len is not None and len(row_ids) > seq_len:
                too_long += 1
                if truncate:
                    ids.append(row_ids[:seq_len])
                    labels.append(row_labels[:seq_len])
            else:
                ids.append(row_ids)
                labels.append(row_labels)
    if rows == 0:
        raise DataError(f"{OWNER}the {source.split} files {paths} have no rows; give files with data.")
    if not ids:
        raise DataError(
            f"{OWNER}none of the {rows} {source.split} rows of {paths} ({source.format}) is left: {skipped}"
            f" conversations without an assistant turn, {too_long} longer than seq_len={seq_len} dropped. Check the"
            " data (its speakers' names: roles), seq_len and too_long."
        )
    return ids, labels, skipped, too_long


def check_tokenizer(tokenizer: Any, path: str, chat: bool) -> None:
    """Refuse a tokenizer without an EOS, or without a chat template for chat rows.

    Raises:
        DataError: naming the tokenizer's path and the fix.
    """
    if chat and not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"{OWNER}format='chat' needs a chat template, and the tokenizer at {path!r} has none. Use the tokenizer"
            " of a chat model (its tokenizer_config.json has 'chat_template'), set tokenizer.chat_template and save"
            " it, or use format='text'."
        )
    if tokenizer.eos_token_id is None:
        raise DataError(f"{OWNER}the tokenizer at {path!r} has no eos_token; set one and save it.")
