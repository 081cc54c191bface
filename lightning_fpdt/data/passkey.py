"""The pass-key retrieval task, generated with no downloads: a key hidden in filler text and asked for at the
end, so the answer needs attention across the whole context (the quick start and ``passkey_cpu.yaml``)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_fpdt.data.byte_tokenizer import ByteTokenizer
from lightning_fpdt.errors import FPDTError

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = " What is the pass key? #"


def needle_text(key: str, key_repeats: int = 1) -> str:
    """The sentence that hides the key, written ``key_repeats`` times: ``" The pass key is #7 #7. Remember it. "``."""
    return " The pass key is" + f" #{key}" * key_repeats + ". Remember it. "


def passkey_sample(
    encode: Callable[[str], list[int]], seq_len: int, rng: random.Random, depth: float | None, digits: int,
    key_repeats: int = 1,
) -> tuple[list[int], int, float, str]:
    """One pass-key sample of exactly ``seq_len`` tokens from ``encode`` (a tokenizer's text to ids)::

        <filler> The pass key is #48213. Remember it. <filler> What is the pass key? #48213

    The random draws, in this order: the key's digits, the depth (only when ``depth`` is ``None``), the filler's
    offset. :class:`PasskeyDataset` (the byte tokenizer) and the evaluation's ``PasskeyTask`` (any tokenizer) both
    build their samples here.

    Returns:
        ``(ids, answer_len, depth, key)``: ``ids`` (``seq_len`` ids) end with the ``answer_len`` ids of the key,
        right after the question; ``depth`` is where the needle sits, a fraction of the filler.

    Raises:
        ValueError: ``seq_len`` too short for the needle, the question and the answer (the minimum named).
    """
    key = "".join(rng.choice("0123456789") for _ in range(digits))
    needle, question, answer = encode(needle_text(key, key_repeats)), encode(QUESTION), encode(key)
    n_filler = seq_len - len(needle) - len(question) - len(answer)
    if n_filler < 1:
        raise FPDTError(f"passkey_sample: seq_len={seq_len} is too short for the task; use at least"
                        f" {seq_len - n_filler + 1}.")
    depth = rng.random() if depth is None else depth
    unit = encode(FILLER)
    offset = rng.randrange(len(FILLER)) % len(unit)  # bytes: an offset in characters; other tokenizers: in tokens
    filler = (unit * ((offset + n_filler) // len(unit) + 2))[offset : offset + n_filler]
    cut = int(round(depth * n_filler))
    return filler[:cut] + needle + filler[cut:] + question + answer, len(answer), depth, key


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
            raise FPDTError(f"PasskeyDataset: loss_on={loss_on!r} must be 'all' or 'answer'.")
        if key_repeats < 1:
            raise FPDTError(f"PasskeyDataset: key_repeats={key_repeats} must be at least 1.")
        self.loss_on, self.key_repeats = loss_on, key_repeats
        self.tokenizer = ByteTokenizer()
        self.num_samples, self.seq_len, self.depth, self.digits, self.seed = num_samples, seq_len, depth, digits, seed
        minimum = len(self._tail("0" * digits)) + len(self._needle("0" * digits)) + 1
        if seq_len < minimum:
            raise FPDTError(f"PasskeyDataset: seq_len={seq_len} is too short for the task; use at least {minimum}.")
        if depth is not None and not 0.0 <= depth <= 1.0:
            raise FPDTError(f"PasskeyDataset: depth={depth} must be in [0, 1].")

    def _needle(self, key: str) -> list[int]:
        return self.tokenizer.encode(needle_text(key, self.key_repeats))

    def _tail(self, key: str) -> list[int]:
        return self.tokenizer.encode(QUESTION + key)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, Any]:
        rng = random.Random(self.seed * 1_000_003 + index)
        ids, _, depth, _ = passkey_sample(self.tokenizer.encode, self.seq_len, rng, self.depth, self.digits,
                                          self.key_repeats)
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
        self.tokenizer = ByteTokenizer()  # the samples' tokenizer, read by lightning_fpdt.evaluation
        self.train_set = PasskeyDataset(train_samples, seq_len, None, digits, 1, loss_on, key_repeats)
        # held out: another seed draws other keys, depths and filler offsets
        self.val_set = PasskeyDataset(val_samples, val_seq_len or seq_len, depth, digits, 2, loss_on, key_repeats)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers)


