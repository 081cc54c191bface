"""A sharded module stays usable in its process: fit, then validate, then fit again (as with the
default ``popen`` launcher, where rank 0 is the calling process)."""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch

from lightning_fpdt import FPDTStrategy
from lightning_fpdt.models import LlamaConfig, LlamaLM
from lightning_fpdt.testing import run_on_ranks
from tests.helpers import TokenDataset, dataloader

pytestmark = pytest.mark.distributed  # every test here starts several processes


def _fit_validate_fit(rank: int, world: int) -> list[float]:
    # the processes exist already (like torchrun's): Lightning launches nothing and runs here
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world), RANK=str(rank))
    torch.manual_seed(0)
    config = LlamaConfig.tiny(num_attention_heads=4, num_key_value_heads=2, hidden_size=32, intermediate_size=64,
                              vocab_size=64)
    module = LlamaLM(config, learning_rate=1e-3, warmup_steps=1)
    data = dataloader(TokenDataset(4, 16, config.vocab_size, seed=0), 2)
    losses = []
    for max_steps in (1, 2):
        trainer = L.Trainer(accelerator="cpu", devices=world, precision="64-true", max_steps=max_steps, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            strategy=FPDTStrategy(sequence_parallel_size=world, shard_parameters=True))
        trainer.fit(module, data)
        losses.append(trainer.validate(module, data, verbose=False)[0]["val/loss"])
    return losses


@pytest.mark.timeout(120)
def test_sharded_module_can_be_validated_and_trained_again() -> None:
    results = run_on_ranks(_fit_validate_fit, 2)
    assert results[0] == results[1]  # every rank logs the same validation loss
    first, second = results[0]
    assert first != second  # the second fit trained further
