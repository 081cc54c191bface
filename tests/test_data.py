"""The embedded pass-key task: its format, where the answer sits, and a held-out validation set."""

from __future__ import annotations

import re

import pytest
import torch

from lightning_fpdt.data import PasskeyDataModule, PasskeyDataset
from lightning_fpdt.data.byte_tokenizer import ByteTokenizer


def _text(item: dict) -> str:
    return ByteTokenizer().decode(item["input_ids"].tolist())


def test_one_key_by_default_and_the_answer_mask_points_at_its_digits(fresh_seed: int) -> None:
    item = PasskeyDataset(1, 256, depth=0.5, digits=5, seed=fresh_seed)[0]
    text = _text(item)
    keys = re.findall(r"#(\d+)", text)
    assert len(keys) == 2 and keys[0] == keys[1] and len(keys[0]) == 5, text
    assert f" The pass key is #{keys[0]}. Remember it. " in text
    assert text.endswith(f" What is the pass key? #{keys[0]}")
    ids, mask = item["input_ids"], item["answer_mask"]
    assert ids.shape == mask.shape == (256,) and int(mask.sum()) == 5
    assert ByteTokenizer().decode(ids[1:][mask[:-1]].tolist()) == keys[0]  # the next token of each set position


def test_a_repeated_key_is_written_that_many_times_and_answered_once(fresh_seed: int) -> None:
    dataset = PasskeyDataset(1, 256, digits=1, seed=fresh_seed, loss_on="answer", key_repeats=8)
    item = dataset[0]
    text = _text(item)
    key = text[-1]
    assert " The pass key is" + f" #{key}" * 8 + ". Remember it. " in text, text
    assert re.findall(r"\d", text) == [key] * 9  # 8 in the needle, 1 in the answer
    assert (item["labels"] != -100).nonzero().flatten().tolist() == [255]
    assert int(item["answer_mask"].sum()) == 1 and bool(item["answer_mask"][254])


def test_keys_and_depths_are_drawn_per_sample() -> None:
    dataset = PasskeyDataset(64, 256, digits=1, key_repeats=8)
    assert len({_text(dataset[i])[-1] for i in range(64)}) == 10
    assert len({float(dataset[i]["depth"]) for i in range(64)}) == 64


def test_validation_is_held_out_and_scored_like_training() -> None:
    data = PasskeyDataModule(seq_len=256, digits=1, key_repeats=8, loss_on="answer", train_samples=256,
                             val_samples=64)
    train = {_text(data.train_set[i]) for i in range(256)}
    assert not train & {_text(data.val_set[i]) for i in range(64)}
    longer = PasskeyDataModule(seq_len=256, val_seq_len=1024, depth=0.05, digits=1, key_repeats=8, loss_on="answer")
    for i in range(16):  # validation loss on the answer, as in training; the key 5% into the filler
        item = longer.val_set[i]
        assert torch.equal((item["labels"] != -100).nonzero().flatten(), torch.tensor([1023]))
        assert _text(item).index("#") < 0.1 * 1024


def test_bad_key_repeats_is_refused() -> None:
    with pytest.raises(ValueError, match=r"PasskeyDataset: key_repeats=0 must be at least 1\."):
        PasskeyDataset(1, 256, key_repeats=0)
