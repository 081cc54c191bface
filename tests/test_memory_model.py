"""The analytic memory model: what each FPDT feature removes, and chunk_size='auto' selection."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_fpdt.block import FPDTBlock, SequenceParallelContext
from lightning_fpdt.layout import shard_batch
from lightning_fpdt.loss import token_weighted_loss
from lightning_fpdt.memory import ModelShape, auto_chunk_size, estimate
from lightning_fpdt.memtrack import peak_step_bytes
from lightning_fpdt.models import LlamaConfig, LlamaLM
from tests.distributed import run_distributed

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
    with pytest.raises(ValueError, match=r"chunk_size='auto': nothing fits a budget of 0.10 GiB per rank"):
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
    for index, block in enumerate(m for m in module.modules() if isinstance(m, FPDTBlock)):
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
