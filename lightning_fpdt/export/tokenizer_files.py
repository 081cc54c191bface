"""The tokenizer an export writes beside the model: refused where its ids run past the model's embedding."""

from __future__ import annotations

from pathlib import Path

from transformers import PretrainedConfig

from lightning_fpdt.data.tokenizing import load_tokenizer
from lightning_fpdt.errors import FPDTError
from lightning_fpdt.export.checks import OWNER


def check_tokenizer_fits(tokenizer_dir: str | None, config: PretrainedConfig) -> None:
    """Refuse to write beside the model a tokenizer with more tokens than the model's vocabulary: its ids past the
    embedding's rows would fail the first forward of whoever loads the export (fewer is fine: padded vocabularies).

    Raises:
        FPDTError: naming both sizes and the fix.
    """
    vocab = getattr(config, "vocab_size", None)
    if tokenizer_dir is None or not (Path(tokenizer_dir) / "tokenizer.json").is_file() or not isinstance(vocab, int):
        return
    try:
        tokens = len(load_tokenizer(str(tokenizer_dir)))
    except (FPDTError, OSError, ValueError):  # not loadable here: its files are copied as they are, unchecked
        return
    if tokens > vocab:
        raise FPDTError(f"{OWNER}the tokenizer of {tokenizer_dir} has {tokens} tokens, more than the model's"
                        f" vocab_size={vocab}: ids {vocab} to {tokens - 1} have no embedding row. Give the tokenizer"
                        " the model was trained with (--tokenizer). Nothing was written.")
