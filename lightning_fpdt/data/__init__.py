"""Data modules: every one yields dict batches of whole sequences (``input_ids``, optional ``labels`` /
``position_ids`` / ``loss_mask``) that ``FPDTStrategy`` shards; packed documents travel as ``position_ids``
restarting at 0.

- :class:`PasskeyDataModule` (``passkey.py``): the generated pass-key retrieval task, no downloads;
- :class:`TextFileDataModule`, :class:`TokenFileDataModule` (``token_files.py``): local text through a byte
  tokenizer, or pre-tokenized token files, packed back to back;
- :class:`HFDataModule` (``hf_datamodule.py``, with ``files.py``, ``tokenizing.py``, ``packing.py`` and
  ``cache.py``): local ``datasets`` files through the model's own tokenizer, as text documents or chat
  conversations, packed and cached under a key of their content;
- ``toy.py``: a small tokenizer with a chat template and generated rows, for tests and examples.
"""

from typing import Any

from lightning_fpdt.data.passkey import FILLER, PasskeyDataModule, PasskeyDataset
from lightning_fpdt.data.token_files import (
    PackedTokenDataset,
    TextFileDataModule,
    TokenFileDataModule,
    document_positions,
)

__all__ = [
    "FILLER",
    "HFDataModule",
    "PackedTokenDataset",
    "PasskeyDataModule",
    "PasskeyDataset",
    "TextFileDataModule",
    "TokenFileDataModule",
    "document_positions",
]


def __getattr__(name: str) -> Any:
    # HFDataModule loads `datasets` (seconds of imports): only when asked for, not by every fpdt-train start
    if name == "HFDataModule":
        from lightning_fpdt.data.hf_datamodule import HFDataModule  # optional dependency: datasets, on first use

        return HFDataModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
