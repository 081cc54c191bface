"""Long-context data with no downloads: a generated pass-key retrieval task (the default)."""

from __future__ import annotations

import random
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_fpdt.tokenizer import ByteTokenizer

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


class PasskeyDataset(Dataset):
    """Pass-key retrieval (Mohtashami & Jaggi 2023): a number hidden in filler text at a chosen depth,
    asked for at the end. Only a model that attends back over the distance can answer.

    Each sample is ``seq_len`` byte tokens::

        <filler> The pass key is 48213. Remember it. 48213 is the pass key. <filler>
        What is the pass key? The pass key is 48213

    Items: ``input_ids`` ``[seq_len]``, ``answer_mask`` ``[seq_len]`` (True at positions whose *next*
    token is an answer digit: aligned with shifted labels), ``depth`` (float).

    Args:
        num_samples: dataset length.
        seq_len: tokens per sample.
        depth: where the key sits, as a fraction of the filler (0 = start); ``None`` draws it per sample.
        digits: length of the pass key.
        seed: samples are a pure function of ``(seed, index)``.
    """

    def __init__(self, num_samples: int, seq_len: int, depth: float | None = None, digits: int = 5, seed: int = 0) -> None:
        self.tokenizer = ByteTokenizer()
        self.num_samples, self.seq_len, self.depth, self.digits, self.seed = num_samples, seq_len, depth, digits, seed
        minimum = len(self._tail("0" * digits)) + len(self._needle("0" * digits)) + 1
        if seq_len < minimum:
            raise ValueError(f"PasskeyDataset: seq_len={seq_len} is too short for the task; use at least {minimum}.")
        if depth is not None and not 0.0 <= depth <= 1.0:
            raise ValueError(f"PasskeyDataset: depth={depth} must be in [0, 1].")

    def _needle(self, key: str) -> list[int]:
        return self.tokenizer.encode(f" The pass key is {key}. Remember it. {key} is the pass key. ")

    def _tail(self, key: str) -> list[int]:
        return self.tokenizer.encode(f" What is the pass key? The pass key is {key}")

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
        return {"input_ids": torch.tensor(ids, dtype=torch.long), "answer_mask": answer_mask, "depth": depth}


class PasskeyDataModule(pl.LightningDataModule):
    """The embedded long-context task as a LightningDataModule.

    Args:
        seq_len: tokens per sample (global, before sequence sharding).
        batch_size: samples per data-parallel rank per step.
        train_samples / val_samples: dataset sizes (train samples are drawn from a different seed).
        depth: key depth for validation samples (``None``: random); training depth is always random.
        digits: pass-key length.
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
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.seq_len, self.batch_size, self.num_workers = seq_len, batch_size, num_workers
        self.train_set = PasskeyDataset(train_samples, seq_len, None, digits, seed=1)
        self.val_set = PasskeyDataset(val_samples, seq_len, depth, digits, seed=2)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers)
