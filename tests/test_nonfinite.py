"""A non-finite loss on one rank: raise on every rank with the step and rank, or skip the step everywhere."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_fpdt import FPDTStrategy
from lightning_fpdt.models import LlamaConfig, LlamaLM
from lightning_fpdt.parallel.batches import target_tokens
from lightning_fpdt.strategy.step_guard import StepGuard
from tests.helpers import TokenDataset, dataloader

pytestmark = pytest.mark.distributed  # every test here starts several processes

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


class FindSample(L.Callback):
    """Rank 0 writes the batch index at which sample ``index`` arrives (the strategy's sampler orders samples)."""

    def __init__(self, out: Path, index: int) -> None:
        self.out, self.index = out, index

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.is_global_zero and self.index in batch["index"].tolist():
            self.out.write_text(str(batch_idx))


def _fit_on_an_infinite_embedding(policy: str, out: Path) -> LlamaLM:
    """The guard meets a value that really is non-finite: one token of one sample has an infinite embedding row,
    so the forward itself makes the loss NaN (the ranks whose chunks attend to it; masked, its NaN value still
    reaches their products) and the backward the gradients."""
    module = LlamaLM(CONFIG, learning_rate=1e-3, warmup_steps=1)
    data = TokenDataset(8, 16, CONFIG.vocab_size - 1, seed=3)  # token 63 appears nowhere else
    data.ids[2, 12] = CONFIG.vocab_size - 1
    data.labels[2] = data.ids[2]  # every position of that sample trains (none is ignored)
    with torch.no_grad():
        module.model.embed_tokens.weight[-1] = float("inf")
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[Record(out / "steps.txt"), FindSample(out / "where.txt", 2)],
        strategy=FPDTStrategy(sequence_parallel_size=2, nonfinite_loss=policy, start_method="fork"),
    )
    trainer.fit(module, dataloader(data, 2))  # 4 batches
    return module


@pytest.mark.timeout(120)
def test_a_really_infinite_value_raises_with_its_step_and_rank(tmp_path: Path) -> None:
    with pytest.raises(Exception, match=r"non-finite loss at global step (\d) on rank\(s\) \[[01, ]+\]; non-finite"
                                        r" gradients") as raised:
        _fit_on_an_infinite_embedding("raise", tmp_path)
    step = re.search(r"non-finite loss at global step (\d)", str(raised.value)).group(1)
    assert step == (tmp_path / "where.txt").read_text()  # the step of the batch that holds the sample


@pytest.mark.timeout(120)
def test_a_really_infinite_value_skips_its_step_on_every_rank(tmp_path: Path) -> None:
    module = _fit_on_an_infinite_embedding("skip", tmp_path)
    where = int((tmp_path / "where.txt").read_text())
    assert (tmp_path / "steps.txt").read_text() == " ".join(str(i != where) for i in range(4))
    finite = [bool(torch.isfinite(p).all()) for n, p in module.named_parameters() if "embed_tokens" not in n]
    assert all(finite)  # the NaN gradients of the skipped step reached no weight
    assert torch.isfinite(module.model.embed_tokens.weight[:-1]).all()


def test_bad_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="nonfinite_loss must be 'raise' or 'skip', got 'ignore'"):
        FPDTStrategy(nonfinite_loss="ignore")
    with pytest.raises(ValueError, match="offload_optimizer=True needs shard_parameters=True"):
        FPDTStrategy(offload_optimizer=True)


class FinalWeights(L.Callback):
    """Rank 0 writes whether every parameter is finite at the end of training, and the steps taken."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            finite = all(bool(torch.isfinite(p).all()) for p in pl_module.parameters())
            self.out.write_text(f"{finite} {trainer.global_step}")


def _fit_huge_lr(policy: str, out: Path) -> None:
    """AdamW at learning rate 1e6: the first update is applied (finite loss and gradients), after which the
    logits overflow; the non-finite losses and gradients of the next steps must never reach the weights."""
    module = LlamaLM(CONFIG, learning_rate=1e6, warmup_steps=0)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=6, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[FinalWeights(out)],
        strategy=FPDTStrategy(sequence_parallel_size=2, nonfinite_loss=policy, start_method="fork"),
    )
    trainer.fit(module, dataloader(TokenDataset(16, 16, CONFIG.vocab_size, seed=4), 2))


@pytest.mark.timeout(120)
def test_huge_learning_rate_never_leaves_nonfinite_weights_with_skip(tmp_path: Path) -> None:
    _fit_huge_lr("skip", tmp_path / "final.txt")
    finite, steps = (tmp_path / "final.txt").read_text().split()
    assert finite == "True"


@pytest.mark.timeout(120)
def test_huge_learning_rate_raises_before_the_damaging_update(tmp_path: Path) -> None:
    with pytest.raises(
        Exception, match=r"non-finite (loss|gradients) at global step [1-9] .*The update was not applied"
    ):
        _fit_huge_lr("raise", tmp_path / "final.txt")


class IgnoredSecondBatch(torch.utils.data.Dataset):
    """Four samples; the second batch (samples 2 and 3) has every label ignored."""

    def __init__(self) -> None:
        self.data = TokenDataset(4, 16, CONFIG.vocab_size, seed=5)

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> dict:
        item = dict(self.data[i])
        if i >= 2:
            item["labels"] = torch.full_like(item["labels"], -100)
        return item


@pytest.mark.timeout(120)
def test_a_batch_without_targets_skips_its_update(tmp_path: Path) -> None:
    module = LlamaLM(CONFIG, learning_rate=1e-3, warmup_steps=1)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_epochs=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[Record(tmp_path / "steps.txt")],
        strategy=FPDTStrategy(sequence_parallel_size=2, start_method="fork"),
        use_distributed_sampler=False,  # the same order every epoch (dp=1: both ranks read every sample)
    )
    trainer.fit(module, dataloader(IgnoredSecondBatch(), 2))
    # (weight decay would otherwise move the weights on a batch with zero gradients)
    assert (tmp_path / "steps.txt").read_text() == "True False True False"


def test_the_guard_warns_once_about_windows_without_targets() -> None:
    guard = StepGuard("raise")
    grads = [torch.ones(3)]
    with pytest.warns(UserWarning, match=r"no target token in the batches of global step 7 on any rank"):
        guard.observe(torch.tensor(0.0), tokens=0)
        assert not guard.allows_step(grads, 7, 0, 1, torch.device("cpu"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second empty window is skipped silently
        guard.observe(torch.tensor(0.0), tokens=0)
        assert not guard.allows_step(grads, 8, 0, 1, torch.device("cpu"))
        guard.observe(torch.tensor(1.0), tokens=5)
        assert guard.allows_step(grads, 9, 0, 1, torch.device("cpu"))
    guard.observe(torch.tensor(1.0), tokens=5)
    with pytest.raises(FloatingPointError, match=r"non-finite gradients at global step 10 on rank\(s\) \[0\]"
                                                 r" \(the loss was finite: the backward overflowed\)\."
                                                 r" The update was not applied"):
        guard.allows_step([torch.tensor([1.0, float("inf")])], 10, 0, 1, torch.device("cpu"))


class _HostReads(TorchDispatchMode):
    """Counts the reads of a tensor's value by the host (``item()``, ``bool()``, ``int()``: a device sync on CUDA)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.reads += func.overloadpacket.__name__ in ("_local_scalar_dense", "is_nonzero")
        return func(*args, **(kwargs or {}))


def test_the_guard_reads_nothing_per_micro_batch() -> None:
    """A micro-batch's loss and target tokens stay on the device (on CUDA a host read would stall the queue between
    forward and backward); the window is read once, at the step, and decides as before."""
    guard = StepGuard("raise")
    batches = [{"shift_labels": torch.tensor([[3, -100, 5]])}, {"shift_labels": torch.tensor([[-100, -100, 7]])}]
    with _HostReads() as host:
        for batch, loss in zip(batches, (torch.tensor(2.0), torch.tensor(1.5))):
            guard.observe(loss, target_tokens(batch))
    assert host.reads == 0
    assert guard.allows_step([torch.ones(3)], 1, 0, 1, torch.device("cpu"))
    guard.observe(torch.tensor(float("nan")), target_tokens(batches[0]))
    guard.observe(torch.tensor(1.0), target_tokens(batches[1]))  # a later finite loss does not hide the NaN
    with pytest.raises(FloatingPointError, match=r"non-finite loss at global step 2 on rank\(s\) \[0\]"):
        guard.allows_step([torch.ones(3)], 2, 0, 1, torch.device("cpu"))



class _ManualSteps(LlamaLM):
    """Manual optimization: each training_step steps the optimizer itself; rank 0 records whether it moved weights."""

    def __init__(self, *args, path: Path, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False
        self.path = path

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        before = [p.detach().clone() for p in self.parameters()]
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        opt.step()
        opt.zero_grad()
        moved = any(not torch.equal(a, p) for a, p in zip(before, self.parameters()))
        if self.global_rank == 0:
            with open(self.path, "a") as f:
                f.write(f"{moved} ")
        return loss


def test_manual_optimization_steps_from_its_first_batch(tmp_path: Path) -> None:
    """With manual optimization the loss reaches the strategy only after the user's step: the guard judges each step
    by its gradients. (It judged them by the previous batch's loss and tokens: the first step was skipped as one
    without a target token.)"""
    config = LlamaConfig.tiny(num_attention_heads=4, num_key_value_heads=2, hidden_size=32, intermediate_size=64,
                              vocab_size=64)
    module = _ManualSteps(config, learning_rate=1e-3, warmup_steps=1, path=tmp_path / "moved.txt")
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        strategy=FPDTStrategy(sequence_parallel_size=2, start_method="fork"))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*no target token.*")  # the forked ranks inherit the filter
        trainer.fit(module, dataloader(TokenDataset(4, 16, config.vocab_size, seed=3), 2))
    assert (tmp_path / "moved.txt").read_text().split() == ["True", "True"]
