"""Misconfigurations fail fast, on every rank, with the numbers in the message and no hang."""

from __future__ import annotations

import re

import lightning as L
import pytest
import torch

import lightning_fpdt
from lightning_fpdt import FPDTStrategy
from lightning_fpdt.comm import check_heads
from lightning_fpdt.layout import shard_batch
from lightning_fpdt.models import LlamaConfig, LlamaLM
from lightning_fpdt.options import FPDTOptions
from tests.helpers import TokenDataset, dataloader


def test_strategy_names_resolve() -> None:
    for name, start in (("fpdt", "popen"), ("fpdt_spawn", "spawn"), ("fpdt_fork", "fork")):
        trainer = L.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)
        assert isinstance(trainer.strategy, FPDTStrategy)
        assert trainer.strategy._start_method == start
    assert lightning_fpdt.FPDTStrategy is FPDTStrategy


def _fit(strategy: FPDTStrategy, devices: int, config: LlamaConfig, data) -> None:
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(LlamaLM(config), data)


class _NoIds(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> dict:
        return {"tokens": torch.zeros(8, dtype=torch.long)}


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("sp", "devices", "heads", "kv", "data", "match"),
    [
        (3, 2, 4, 4, "ok", r"sequence_parallel_size=3 does not divide the world size 2.*use one of \[1, 2\]"),
        (4, 4, 2, 2, "ok", r"n_heads=2 is not divisible by sequence_parallel_size=4"),
        (4, 4, 4, 3, "ok", r"not a multiple of num_key_value_heads=3"),
        (2, 2, 4, 4, "no_ids", r"the batch has no 'input_ids'; its keys are \['tokens'\]"),
    ],
    ids=["sp-not-dividing-world", "heads-not-divisible", "bad-gqa", "missing-input_ids"],
)
def test_misconfiguration_fails_on_every_rank(sp, devices, heads, kv, data, match) -> None:
    data_loader = dataloader(_NoIds(), 2) if data == "no_ids" else dataloader(TokenDataset(4, 16, 64, 0), 2)
    with pytest.raises(Exception, match=match):
        config = LlamaConfig.tiny(num_attention_heads=heads, num_key_value_heads=kv, hidden_size=8 * heads * 3,
                                  vocab_size=64)
        _fit(FPDTStrategy(sequence_parallel_size=sp, start_method="fork"), devices, config, data_loader)


def _check_run(options: FPDTOptions, world_size: int, sequence_parallel_size: int) -> None:
    options.check_run(world_size=world_size, num_nodes=1, num_processes=world_size,
                      sequence_parallel_size=sequence_parallel_size, precision="32-true", device_type="cpu")


def test_bad_arguments_are_refused_at_construction() -> None:
    # chunk_size against sequence_parallel_size needs the world first (below), so it is checked at setup
    with pytest.raises(ValueError, match=r"chunk_size=10 is not divisible by sequence_parallel_size=4.*e.g. 8 or 12"):
        _check_run(FPDTStrategy(sequence_parallel_size=4, chunk_size=10).options, 4, 4)
    with pytest.raises(ValueError, match="sequence_parallel_size must be a positive int or 'auto', got 0"):
        FPDTStrategy(sequence_parallel_size=0)
    with pytest.raises(ValueError, match="attention_backend='cudnn' is not one of"):
        FPDTStrategy(attention_backend="cudnn")


def test_head_checks_name_the_numbers() -> None:
    check_heads(8, 2, 4)  # kv heads replicated: fine
    check_heads(8, 8, 4)
    with pytest.raises(ValueError, match=r"n_heads=6 is not divisible by sequence_parallel_size=4.*\[1, 2, 3, 6\]"):
        check_heads(6, 6, 4)
    with pytest.raises(ValueError, match="n_kv_heads=3 and sequence_parallel_size=2"):
        check_heads(6, 3, 2)


def test_non_dict_batch_under_sequence_parallelism() -> None:
    strategy = FPDTStrategy(sequence_parallel_size=2)
    with pytest.raises(TypeError, match="needs dict batches with 'input_ids'.*got a tuple"):
        strategy.shard_batch((torch.zeros(2, 8),))


def test_a_sequence_parallel_size_that_does_not_divide_the_devices_is_reported_before_the_chunk_size() -> None:
    # tiny_cpu.yaml's chunk_size=128 with sequence_parallel_size=3 on 2 devices: the size is the problem
    options = FPDTStrategy(sequence_parallel_size=3, chunk_size=128).options
    with pytest.raises(ValueError, match=r"sequence_parallel_size=3 does not divide the world size 2.*one of \[1, 2\]"):
        _check_run(options, 2, 3)
    with pytest.raises(ValueError, match=r"chunk_size=128 is not divisible by sequence_parallel_size=3.*126 or 129"):
        _check_run(options, 3, 3)


@pytest.mark.parametrize("shape", [(2, 29), (2, 32, 2), (32,)], ids=["short", "extra-dim", "no-batch-dim"])
def test_a_loss_mask_of_the_wrong_shape_names_the_key_and_the_shape(shape: tuple[int, ...]) -> None:
    batch = {"input_ids": torch.zeros(2, 32, dtype=torch.long), "loss_mask": torch.ones(shape, dtype=torch.long)}
    expected = rf"FPDTStrategy: sequence key 'loss_mask' has shape {re.escape(str(shape))}, expected \[2, 32\] like"
    for sp in (1, 2):  # before, a raw "shape '[2, 32]' is invalid for input of size 58" from mask_targets
        with pytest.raises(ValueError, match=expected + r" 'input_ids'; it marks each target token"):
            shard_batch(batch, sp, 0, owner="FPDTStrategy")
    with pytest.raises(ValueError, match=r"LlamaLM: sequence key 'loss_mask' has shape"):
        LlamaLM(LlamaConfig.tiny(vocab_size=64)).training_step(batch, 0)
