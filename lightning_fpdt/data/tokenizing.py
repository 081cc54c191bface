"""The tokenizer of ``HFDataModule`` and the function its ``datasets`` map runs on each batch of rows.

The tokenizer is loaded from local files once per process (each map worker loads its own) and again when its
files change (:func:`lightning_fpdt.data.cache.tokenizer_hash`); a bad row is returned as its reason, never
raised in a worker, so the data module names its file and row.
"""

from __future__ import annotations

from typing import Any

from lightning_fpdt.data.cache import no_tokenizer
from lightning_fpdt.data.packing import OWNER, DataError, chat_tokens, text_tokens

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


def tokenize_rows(rows: dict[str, list[Any]], tokenizer_path: str, tokenizer_digest: str, field: str,
                  chat: bool) -> dict[str, list]:
    """A batch of rows to ``input_ids`` (and ``labels``); a bad row gives its reason in ``problem``, never
    raises (a worker's exception would reach the user as a raw traceback without the row).

    ``tokenizer_digest`` (the tokenizer files' hash): a worker process holding a tokenizer saved earlier at the
    same path loads it again."""
    tokenizer = load_tokenizer(tokenizer_path, tokenizer_digest)
    values = rows[field]
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
