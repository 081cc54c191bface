"""A world without a single target token (every label ignored on every rank) gives loss 0 and zero gradients,
not 0 / 0 = NaN: the token-weighted loss divides by at least one token."""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_fpdt import FPDTStrategy
from lightning_fpdt.layers.loss import cross_entropy_sum, token_weighted_loss
from lightning_fpdt.models import LlamaConfig, LlamaLM
from lightning_fpdt.parallel.dtensors import full_tensor
from tests.helpers import TokenDataset, dataloader

CONFIG = LlamaConfig.tiny(num_attention_heads=4, num_key_value_heads=2, hidden_size=32, intermediate_size=64,
                          vocab_size=64)


class NoTargets(TokenDataset):
    """Random tokens, every label ignored."""

    def __getitem__(self, i: int) -> dict:
        item = super().__getitem__(i)
        item["labels"] = torch.full_like(item["labels"], -100)
        return item


class CaptureBackward(L.Callback):
    """Saves, on every rank, the loss back-propagated, the logged loss and the synchronised gradients of the
    first step (read after the backward: the strategy skips the update of a window without targets)."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_after_backward(self, trainer, pl_module) -> None:
        self.grads = {n: full_tensor(p.grad).detach().clone() for n, p in pl_module.named_parameters()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        torch.save({"loss": outputs["loss"].detach().clone(), "logged": trainer.callback_metrics["train/loss"].clone(),
                    "grads": self.grads}, self.out / f"rank{trainer.global_rank}.pt")


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_world_without_targets_has_loss_zero_and_zero_gradients(tmp_path: Path) -> None:
    module = LlamaLM(CONFIG, learning_rate=1e-3, warmup_steps=1)
    trainer = L.Trainer(
        accelerator="cpu", devices=4, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[CaptureBackward(tmp_path)],
        # skip, not raise: without the guard's help a NaN must show in the assertions below
        strategy=FPDTStrategy(sequence_parallel_size=2, nonfinite_loss="skip", start_method="fork"),
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*no target token.*")
        trainer.fit(module, dataloader(NoTargets(2, 16, CONFIG.vocab_size, seed=3), 1))  # dp=2 x sp=2, a sample each
    for rank in range(4):
        res = torch.load(tmp_path / f"rank{rank}.pt")
        assert res["loss"].item() == 0.0 and res["logged"].item() == 0.0, (rank, res["loss"], res["logged"])
        assert len(res["grads"]) == len(list(module.parameters()))
        for name, grad in res["grads"].items():
            assert torch.isfinite(grad).all() and not grad.any(), f"rank {rank}: gradient of {name}: {grad}"


def test_one_process_without_targets_has_loss_zero_and_zero_gradients() -> None:
    logits = torch.randn(2, 5, 7, dtype=torch.float64, requires_grad=True)
    loss, mean = token_weighted_loss(*cross_entropy_sum(logits, torch.full((2, 5), -100)))
    loss.backward()
    assert loss.item() == 0.0 and mean.item() == 0.0
    assert torch.isfinite(logits.grad).all() and not logits.grad.any(), logits.grad
