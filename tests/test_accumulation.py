"""Gradient accumulation weighted by tokens: ``accumulate_grad_batches=N`` over micro-batches holding very
different numbers of target tokens gives, at every optimizer step, the gradient (clipped or not) and the
logged loss of one step on the union of the window's micro-batches (float64, one process, relative error
<= 1e-10), in one process and under dp=2 x sp=2 chunked, replicated or sharded."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision
from torch.amp import GradScaler
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_fpdt import FPDTStrategy
from lightning_fpdt.models import LlamaConfig, LlamaLM
from lightning_fpdt.parallel.dtensors import full_tensor
from tests.helpers import assert_same_step, reference_step

CONFIG = LlamaConfig.tiny(num_attention_heads=4, num_key_value_heads=2, hidden_size=32, intermediate_size=64,
                          vocab_size=64)
SEQ_LEN = 32
SAMPLES = 4


class TargetCounts(Dataset):
    """Random tokens; sample ``i`` has exactly ``counts[i]`` target tokens (labels elsewhere ignored)."""

    def __init__(self, counts: tuple[int, ...], seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, CONFIG.vocab_size, (len(counts), SEQ_LEN), generator=g)
        self.labels = torch.full_like(self.ids, -100)
        for i, n in enumerate(counts):
            keep = 1 + torch.randperm(SEQ_LEN - 1, generator=g)[:n]  # labels[0] is nobody's target
            self.labels[i, keep] = self.ids[i, keep]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}

    def batch(self, indices: list[int]) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[indices], "labels": self.labels[indices]}


class InOrder(L.LightningDataModule):
    """The samples in order, DP rank ``r`` reading every ``dp``-th from ``r`` (Lightning's own distributed
    sampler would shuffle them), so each window's micro-batches are known."""

    def __init__(self, ds: Dataset, batch_size: int) -> None:
        super().__init__()
        self.ds, self.batch_size = ds, batch_size

    def train_dataloader(self) -> DataLoader:
        kwargs = self.trainer.distributed_sampler_kwargs
        sampler = None if kwargs is None else DistributedSampler(self.ds, shuffle=False, **kwargs)
        return DataLoader(self.ds, batch_size=self.batch_size, sampler=sampler)


@dataclass(frozen=True)
class Case:
    name: str
    dp: int = 1
    sp: int = 1
    accumulate: int = 2
    counts: tuple[int, ...] = (29, 2, 0, 7)  # targets per sample: micro-batches of 31 and 7 targets
    fpdt: bool = True  # False: Lightning's own single-device strategy
    chunk_size: int | None = None
    shard: bool = False
    clip: float | None = None  # gradient_clip_val (by norm), small enough to clip
    micro_batches: int = 2  # per epoch; two: the same micro-batches in every parallelism
    fp16: bool = False  # 16-mixed with a gradient scaler (float16 autocast on CPU), else 64-true

    @property
    def batch_size(self) -> int:
        return SAMPLES // (self.dp * self.micro_batches)

    def windows(self) -> list[list[int]]:
        """The samples of each optimizer step: micro-batch ``k`` holds samples ``k * dp * b ...`` (:class:`InOrder`
        gives DP rank ``r`` every ``dp``-th sample), windows of ``accumulate`` micro-batches, the last one cut
        short by the epoch's end."""
        per = self.dp * self.batch_size
        starts = range(0, self.micro_batches, self.accumulate)
        return [list(range(k * per, min(k + self.accumulate, self.micro_batches) * per)) for k in starts]


CASES = [
    Case("lightning-one-process", fpdt=False),  # CausalLM.on_before_optimizer_step finishes the window
    # first window: two micro-batches without a target, then one; the second window one micro-batch (of 3)
    Case("fpdt-one-process-short-window", accumulate=3, counts=(0, 0, 5, 31), micro_batches=4),
    Case("fpdt-dp2xsp2-chunked", dp=2, sp=2, chunk_size=8),
    Case("fpdt-dp2xsp2-chunked-sharded", dp=2, sp=2, chunk_size=8, shard=True),
    Case("fpdt-dp2xsp2-clipped", dp=2, sp=2, chunk_size=8, clip=1e-3),
    # loss scaling: the window's gradient is as big as a mean's, so the scaler neither overflows nor skips
    Case("fpdt-one-process-fp16-scaled", fp16=True),
]


def gradients(module: L.LightningModule) -> dict[str, torch.Tensor]:
    return {n: full_tensor(p.grad).detach().clone() for n, p in module.named_parameters()}


class CaptureWindows(L.Callback):
    """Saves, on every rank and per global step, the gradients a callback sees before the step (before
    clipping) and those the optimizer stepped with (after clipping), and the logged ``train/loss`` after
    every micro-batch."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.before: dict[int, dict[str, torch.Tensor]] = {}
        self.grads: dict[int, dict[str, torch.Tensor]] = {}
        self.losses: dict[int, torch.Tensor] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        def after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
            self.grads[trainer.global_step] = gradients(pl_module)

        trainer.optimizers[0].register_step_post_hook(after_step)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.before[trainer.global_step] = gradients(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses[batch_idx] = trainer.callback_metrics["train/loss"].detach().clone()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        scale = None if scaler is None else scaler.get_scale()
        torch.save({"before": self.before, "grads": self.grads, "losses": self.losses, "scale": scale},
                   self.out / f"rank{trainer.global_rank}.pt")


def clipped(grads: dict[str, torch.Tensor], max_norm: float) -> dict[str, torch.Tensor]:
    """``grads`` as ``torch.nn.utils.clip_grad_norm_`` leaves them (Lightning's clipping by norm)."""
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
    assert norm > max_norm, f"the case is meant to clip: gradient norm {norm.item():.3g} <= {max_norm}"
    return {n: g * (max_norm / (norm + 1e-6)) for n, g in grads.items()}


@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.distributed] if c.fpdt else [])
                                  for c in CASES], ids=lambda c: c.name)
def test_accumulated_step_equals_one_step_on_the_window(case: Case, tmp_path: Path, fresh_seed: int) -> None:
    torch.manual_seed(fresh_seed)
    module = LlamaLM(CONFIG, learning_rate=0.0, warmup_steps=1)  # lr 0: every window sees the same weights
    ds = TargetCounts(case.counts, fresh_seed)
    strategy: Any = "auto"
    if case.fpdt:
        strategy = FPDTStrategy(sequence_parallel_size=case.sp, chunk_size=case.chunk_size, attention_backend="math",
                                shard_parameters=case.shard, start_method="fork")
    # Lightning turns 16-mixed on CPU into bf16-mixed: the plugin keeps float16 and its gradient scaler
    precision: Any = {"plugins": [MixedPrecision("16-mixed", "cpu", GradScaler("cpu"))]} if case.fp16 else {
        "precision": "64-true"}
    trainer = L.Trainer(
        accelerator="cpu", devices=case.dp * case.sp, strategy=strategy, **precision, max_epochs=1,
        accumulate_grad_batches=case.accumulate, gradient_clip_val=case.clip, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[CaptureWindows(tmp_path)], use_distributed_sampler=False,
    )
    initial = copy.deepcopy(module)
    trainer.fit(module, datamodule=InOrder(ds, case.batch_size))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(case.dp * case.sp)]
    tol = 1e-10
    if case.fp16:  # float16 rounding against the float64 oracle; a mean of micro-batch means is off by > 0.1
        tol = 2e-2
        assert all(r["scale"] == 2.0**16 for r in ranks), [r["scale"] for r in ranks]  # no step skipped
    for step, samples in enumerate(case.windows()):
        label = f"{case.name} step {step} {samples}"
        ref_loss, ref_grads = reference_step(initial, ds.batch(samples))
        last = samples[-1] // (case.dp * case.batch_size)  # the window's last micro-batch
        if case.fpdt:  # FPDTStrategy finishes the window before the step guard and every callback
            before = [{"grads": r["before"][step], "loss": r["losses"][last]} for r in ranks]
            assert_same_step(before, ref_loss, ref_grads, tol=tol, label=f"{label} (callbacks)")
        if case.clip is not None:
            ref_grads = clipped(ref_grads, case.clip)
        results = [{"grads": r["grads"][step], "loss": r["losses"][last]} for r in ranks]
        assert_same_step(results, ref_loss, ref_grads, tol=tol, label=label)
    assert all(sorted(r["grads"]) == list(range(len(case.windows()))) for r in ranks), "one step per window"
