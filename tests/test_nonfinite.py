"""A non-finite loss on one rank: raise on every rank with the step and rank, or skip the step everywhere."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_fpdt import FPDTStrategy
from lightning_fpdt.models import LlamaConfig, LlamaLM
from tests.helpers import TokenDataset, dataloader

CONFIG = LlamaConfig.tiny(num_attention_heads=4, num_key_value_heads=2, hidden_size=32, intermediate_size=64,
                          vocab_size=64)


class NaNOnRank1(LlamaLM):
    """Rank 1's loss is NaN at the second batch (only that rank's shard of the sequence goes wrong)."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if batch_idx == 1 and self.global_rank == 1:
            loss = loss * float("nan")
        return loss


class Record(L.Callback):
    """Rank 0 writes, per batch, whether the weights changed during it."""

    def __init__(self, out: Path) -> None:
        self.out, self.changed = out, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.before = [p.detach().clone() for p in pl_module.parameters()]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.changed.append(any(not torch.equal(a, p) for a, p in zip(self.before, pl_module.parameters())))

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            self.out.write_text(" ".join(str(c) for c in self.changed))


def _fit(policy: str, out: Path, shard: bool = False) -> LlamaLM:
    module = NaNOnRank1(CONFIG, learning_rate=1e-3, warmup_steps=1)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[Record(out)],
        strategy=FPDTStrategy(sequence_parallel_size=2, nonfinite_loss=policy, shard_parameters=shard,
                              start_method="fork"),
    )
    trainer.fit(module, dataloader(TokenDataset(8, 16, CONFIG.vocab_size, seed=3), 2))  # 4 batches
    return module


@pytest.mark.timeout(120)
def test_nonfinite_loss_raises_with_step_and_rank(tmp_path: Path) -> None:
    with pytest.raises(Exception, match=r"non-finite loss at global step 1 on rank\(s\) \[1\].*nonfinite_loss='skip'"):
        _fit("raise", tmp_path / "steps.txt")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
def test_nonfinite_loss_skips_the_step_on_every_rank(tmp_path: Path, shard: bool) -> None:
    module = _fit("skip", tmp_path / "steps.txt", shard)
    # the second batch's update was dropped (AdamW would move the weights even on zero gradients)
    assert (tmp_path / "steps.txt").read_text() == "True False True True"
    assert all(torch.isfinite(p).all() for p in module.parameters())  # the NaN never reached the weights


def test_bad_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="nonfinite_loss must be 'raise' or 'skip', got 'ignore'"):
        FPDTStrategy(nonfinite_loss="ignore")
    with pytest.raises(ValueError, match="offload_optimizer=True needs shard_parameters=True"):
        FPDTStrategy(offload_optimizer=True)
