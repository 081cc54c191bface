"""Long documents from local files, packed back to back: plain text through a byte tokenizer, and
pre-tokenized token files (for data tokenized with the model's own tokenizer, see :class:`HFDataModule`)."""

from __future__ import annotations

import glob
import os
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_fpdt.data.byte_tokenizer import ByteTokenizer
from lightning_fpdt.errors import FPDTError


class PackedTokenDataset(Dataset):
    """Fixed-length windows over one long token stream (documents packed back to back).

    Sample ``i`` is tokens ``[i * seq_len, (i + 1) * seq_len)``. Document boundaries are kept as
    position-id resets: the token after each ``eos_token_id`` starts again at position 0, so RoPE and
    learned positions see each document from its start, and attention stays inside each document
    (``FPDTStrategy`` and ``CausalLM`` read the resets as document starts:
    ``lightning_fpdt.parallel.packed_documents``).

    Args:
        tokens: a 1-D integer array (e.g. a ``numpy.memmap``; read lazily, window by window).
        seq_len: tokens per sample.
        eos_token_id: the document separator, or ``None`` for one document.
    """

    def __init__(self, tokens: Any, seq_len: int, eos_token_id: int | None = None) -> None:
        if seq_len < 2:
            raise FPDTError(f"PackedTokenDataset: seq_len must be >= 2, got {seq_len}.")
        if len(tokens) < seq_len:
            raise FPDTError(
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
            raise FPDTError(f"val_fraction={val_fraction} must be in [0, 1).")
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
            raise FPDTError(f"TokenFileDataModule: dtype={dtype!r} must be 'uint16' or 'uint32'.")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"TokenFileDataModule: no token file at {path!r}.")
        size = os.path.getsize(path)
        width = np.dtype(dtype).itemsize
        if size % width:
            raise FPDTError(f"TokenFileDataModule: {path!r} has {size} bytes, not a whole number of {dtype} tokens.")
        self.path, self.dtype = path, dtype

    def _tokens(self) -> Any:
        return np.memmap(self.path, dtype=self.dtype, mode="r")


class TextFileDataModule(_PackedDataModule):
    """Plain text files, tokenized to bytes (:class:`~lightning_fpdt.data.byte_tokenizer.ByteTokenizer`), packed.

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
