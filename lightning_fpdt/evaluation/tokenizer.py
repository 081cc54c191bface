"""The model's own tokenizer, found once for the evaluation, and one way to call it.

Contract: :func:`find_tokenizer` returns, in this order, the tokenizer the user gave (an object with ``encode``,
or a local directory for ``AutoTokenizer``), the attached data module's (its ``tokenizer`` object, or the path
its ``tokenizer_path()`` names: ``HFDataModule``), or the byte tokenizer for a model of exactly 256 tokens (the
pass-key and text-file data modules' models); otherwise it raises, naming the fix. :func:`encoder` turns any of
them into ``text -> list[int]`` without special tokens (no BOS/EOS inside a haystack).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

from lightning_fpdt.data.byte_tokenizer import ByteTokenizer
from lightning_fpdt.data.tokenizing import load_tokenizer
from lightning_fpdt.errors import FPDTError, WrongType
from lightning_fpdt.parallel.batches import input_vocab_size


def find_tokenizer(tokenizer: Any, datamodule: Any = None, module: nn.Module | None = None) -> Any:
    """The tokenizer the evaluation writes its samples with.

    Args:
        tokenizer: an object with ``encode(text)``, a local tokenizer directory (``AutoTokenizer``), or ``None``.
        datamodule: the trainer's data module, or ``None``.
        module: the model, for its vocabulary size (the byte tokenizer's fallback).

    Raises:
        ValueError: nothing names a tokenizer and the model's vocabulary is not the byte tokenizer's 256.
    """
    if isinstance(tokenizer, str):
        return load_tokenizer(tokenizer)
    if tokenizer is not None:
        if not callable(getattr(tokenizer, "encode", None)):
            raise WrongType(f"LongContextEvaluation: tokenizer {type(tokenizer).__name__} has no encode(text);"
                            " give a tokenizer object, a local tokenizer directory, or None (the data module's).")
        return tokenizer
    found = getattr(datamodule, "tokenizer", None)
    if found is not None and callable(getattr(found, "encode", None)):
        return found
    path = getattr(datamodule, "tokenizer_path", None)
    if callable(path):
        return load_tokenizer(path())
    vocab = input_vocab_size(module) if module is not None else None
    if vocab == ByteTokenizer.vocab_size:
        return ByteTokenizer()
    raise FPDTError(
        f"LongContextEvaluation: no tokenizer: the data module ({type(datamodule).__name__}) names none and the"
        f" model's vocabulary has {vocab} tokens, not the byte tokenizer's 256. Give tokenizer= (a local tokenizer"
        " directory or a tokenizer object) so the samples are written with the model's own tokenizer."
    )


def encoder(tokenizer: Any) -> Callable[[str], list[int]]:
    """``text -> ids`` of ``tokenizer``, without special tokens when its ``encode`` takes ``add_special_tokens``
    (Hugging Face tokenizers): a haystack or a question never holds a BOS or EOS in the middle of a sample."""
    encode = tokenizer.encode
    try:
        special = "add_special_tokens" in inspect.signature(encode).parameters
    except (TypeError, ValueError):  # a builtin without a signature: call it plainly
        special = False
    if special:
        return lambda text: list(encode(text, add_special_tokens=False))
    return lambda text: list(encode(text))
