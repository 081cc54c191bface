"""The analytic memory model: what each FPDT feature removes, and chunk_size='auto' selection."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist

from lightning_fpdt import FPDTStrategy
from lightning_fpdt.block import SequenceParallelContext, fpdt_blocks
from lightning_fpdt.layout import shard_batch
from lightning_fpdt.loss import token_weighted_loss
from lightning_fpdt.memory import ModelShape, auto_chunk_size, estimate
from lightning_fpdt.memtrack import TensorMemoryTracker, peak_step_bytes
from lightning_fpdt.models import LlamaConfig, LlamaLM
from tests.distributed import run_distributed
from tests.helpers import TokenDataset, dataloader

SHAPE = ModelShape.from_config(LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                                           num_attention_heads=8, num_key_value_heads=4, vocab_size=32000))


def test_parameter_count_matches_the_model() -> None:
    from lightning_fpdt.models import Llama

    config = LlamaConfig.tiny()
    assert ModelShape.from_config(config).num_params == sum(p.numel() for p in Llama(config).parameters())


def test_each_feature_lowers_the_device_peak() -> None:
    seq = 1 << 17
    plain = estimate(SHAPE, seq, sequence_parallel_size=4)
    chunked = estimate(SHAPE, seq, sequence_parallel_size=4, chunk_size=1 << 14, mlp_tiled=True, loss_tiled=True)
    ckpt = estimate(SHAPE, seq, sequence_parallel_size=4, chunk_size=1 << 14, mlp_tiled=True, loss_tiled=True,
                    activation_checkpointing=True)
    offloaded = estimate(SHAPE, seq, sequence_parallel_size=4, chunk_size=1 << 14, mlp_tiled=True, loss_tiled=True,
                         activation_checkpointing=True, offload=True, offload_checkpoints=True)
    assert plain.device_peak > chunked.device_peak > ckpt.device_peak > offloaded.device_peak
    assert offloaded.host > 0 and plain.host == 0
    # saved activations grow linearly with the sequence; parameters do not depend on it
    double = estimate(SHAPE, 2 * seq, sequence_parallel_size=4)
    assert double.parameters == plain.parameters
    assert double.saved_activations == pytest.approx(2 * plain.saved_activations, rel=0.01)


def test_auto_chunk_size_fits_the_budget_or_refuses() -> None:
    seq = 1 << 16
    options = dict(activation_checkpointing=True, mlp_tiled=True, loss_tiled=True)
    whole = estimate(SHAPE, seq, sequence_parallel_size=2, **options).device_peak
    assert auto_chunk_size(SHAPE, seq, whole + 1, sequence_parallel_size=2, **options) is None  # one chunk fits
    budget = whole - 1
    chunk = auto_chunk_size(SHAPE, seq, budget, sequence_parallel_size=2, **options)
    assert chunk is not None and chunk % 2 == 0 and chunk < seq
    assert estimate(SHAPE, seq, sequence_parallel_size=2, chunk_size=chunk, **options).device_peak <= budget
    with pytest.raises(ValueError, match=r"chunk_size='auto': nothing fits a budget of 102.4 MiB per rank at 65536 tokens"):
        auto_chunk_size(SHAPE, seq, int(0.1 * 2**30), sequence_parallel_size=2, **options)


def _measured_and_estimated(rank: int, world: int, seq: int, full: bool) -> tuple[int, int]:
    """One training step of a small Llama at sp=``world``: measured peak of live tensors (parameters,
    gradients, AdamW state and activations) and the estimator's device peak."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, mlp_tiles=None if full else 1,
                         loss_tiles=None if full else 1)
    module = LlamaLM(config)
    chunk = seq // 4 if full else None
    context = SequenceParallelContext(group=dist.group.WORLD, chunk_size=chunk, attention_backend="sdpa",
                                      activation_checkpointing=full)
    for index, (_, block) in enumerate(fpdt_blocks(module)):
        block.bind(context, layer_index=index)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    ids = torch.randint(0, config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(seq))
    batch = shard_batch({"input_ids": ids}, world, rank, chunk)

    def step() -> None:
        loss, _ = token_weighted_loss(*module.loss_terms(batch))
        loss.backward()
        for p in module.parameters():
            dist.all_reduce(p.grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # creates the optimizer state
    measured = peak_step_bytes(step, module, optimizer)
    estimated = estimate(ModelShape.from_config(config), seq, sequence_parallel_size=world, chunk_size=chunk,
                         mlp_tiled=full, loss_tiled=full, activation_checkpointing=full).device_peak
    return measured, estimated


@pytest.mark.parametrize("full", [False, True], ids=["ulysses", "chunked_tiled_checkpointed"])
def test_estimate_matches_a_measured_step_at_two_lengths(full: bool) -> None:
    for seq in (1024, 4096):
        measured, estimated = run_distributed(_measured_and_estimated, 2, seq, full)[0]
        assert abs(estimated / measured - 1) <= 0.15, (seq, measured / 2**20, estimated / 2**20)


class _PeakOfStep(L.Callback):
    """Rank 0's picked chunk size and peak of live tensors over the first training step."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.tracker = TensorMemoryTracker().__enter__()
        self.tracker.track(*pl_module.parameters())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.tracker.__exit__(None, None, None)
        if trainer.global_rank == 0 and batch_idx == 0:
            torch.save({"peak": self.tracker.peak_bytes, "chunk_size": trainer.strategy.chunk_size,
                        "budget": trainer.strategy.memory_budget_bytes}, self.out)


# attention-heavy (small MLP, no GQA) so that the chunk size decides the peak
AUTO_CONFIG = LlamaConfig.tiny(num_attention_heads=4, num_key_value_heads=4, hidden_size=64, intermediate_size=32,
                               vocab_size=64)
AUTO_OPTIONS = dict(batch_size=2, sequence_parallel_size=2, activation_checkpointing=True, mlp_tiled=True,
                    loss_tiled=True, precision="64-true", attention_backend="sdpa")


def _fit_auto(budget_gib: float, tmp_path) -> dict:
    out = str(tmp_path / "auto.pt")
    trainer = L.Trainer(
        accelerator="cpu", devices=2, precision="64-true", max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[_PeakOfStep(out)],
        strategy=FPDTStrategy(sequence_parallel_size=2, chunk_size="auto", memory_budget=budget_gib,
                              activation_checkpointing=True, attention_backend="sdpa", start_method="fork"),
    )
    trainer.fit(LlamaLM(AUTO_CONFIG), dataloader(TokenDataset(2, 256, AUTO_CONFIG.vocab_size, seed=0), 2))
    return torch.load(out)


@pytest.mark.timeout(120)
def test_auto_chunk_size_in_training_fits_the_budget(tmp_path) -> None:
    shape = ModelShape.from_config(AUTO_CONFIG)
    peak = {c: estimate(shape, 256, chunk_size=c, **AUTO_OPTIONS).device_peak for c in (128, 64)}
    budget = (peak[128] + peak[64]) / 2  # 128-token chunks do not fit, 64-token chunks do
    result = _fit_auto(budget / 2**30, tmp_path)
    assert result["chunk_size"] == 64
    assert result["budget"] == int(budget)
    assert result["peak"] <= budget, (result["peak"], budget)  # measured, not estimated


@pytest.mark.timeout(120)
def test_auto_chunk_size_refuses_when_nothing_fits(tmp_path) -> None:
    with pytest.raises(Exception, match=r"FPDTStrategy: chunk_size='auto': nothing fits a budget of 1 KiB per rank at 256 tokens;"
                                        r" the smallest chunk \(2\) still needs 3.7 MiB"):
        _fit_auto(1024 / 2**30, tmp_path)


def test_auto_needs_a_model_it_can_size_and_sane_options() -> None:
    with pytest.raises(ValueError, match="Linear has no LlamaConfig/GPTConfig `config` attribute.*explicit chunk_size"):
        ModelShape.from_module(torch.nn.Linear(2, 2))
    shape, tiling = ModelShape.from_module(LlamaLM(AUTO_CONFIG))
    assert shape == ModelShape.from_config(AUTO_CONFIG) and tiling == {"mlp_tiled": True, "loss_tiled": True}
    with pytest.raises(ValueError, match="memory_budget=4 only applies to chunk_size='auto', but chunk_size=64"):
        FPDTStrategy(chunk_size=64, memory_budget=4)
    with pytest.raises(ValueError, match="memory_budget must be a positive number of GiB, got -1"):
        FPDTStrategy(chunk_size="auto", memory_budget=-1)
    with pytest.raises(ValueError, match="chunk_size must be a positive int, None or 'auto', got 'big'"):
        FPDTStrategy(chunk_size="big")
