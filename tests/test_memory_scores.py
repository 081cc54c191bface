"""The memory model's attention scores where a route materializes them: a softcapped block on ``math`` in bands
(``lightning_fpdt.memory.scores``), against measured peaks of live tensors, for one block and for a training step of
a model that caps its attention logits (Gemma-2)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import transformers

from lightning_fpdt.attention import math_kernel
from lightning_fpdt.attention.kernels import MathKernel, SdpaKernel
from lightning_fpdt.memory import EstimateOptions, ModelShape, estimate
from lightning_fpdt.memory.scores import capped_block_bytes, caps_in_kernel
from lightning_fpdt.models import HFCausalLM
from lightning_fpdt.offload.memtrack import TensorMemoryTracker
from lightning_fpdt.testing import run_on_ranks
from tests.test_memory_model import _measured_step


@pytest.mark.parametrize(("kernel", "heads", "seq", "head_dim", "causal", "band_scores"), [
    (SdpaKernel(), 2, 2048, 32, False, 1 << 24),  # one band: the whole block
    (SdpaKernel(), 2, 4096, 32, True, 1 << 24),  # two bands
    (SdpaKernel(), 4, 4096, 64, False, 1 << 22),  # 16 bands: k/v expanded once, their gradients, the bands' dq
    (MathKernel(), 2, 4096, 32, True, 1 << 22),  # the math backend: whole, however many scores
], ids=["sdpa-one-band", "sdpa-two-bands", "sdpa-16-bands", "math-whole"])
def test_a_capped_blocks_scores_are_what_the_estimate_counts(monkeypatch: pytest.MonkeyPatch, kernel: Any, heads: int,
                                                             seq: int, head_dim: int, causal: bool,
                                                             band_scores: int) -> None:
    """``sdpa`` runs a softcapped block on ``math`` in bands, the ``math`` backend whole: the peak of live tensors of
    its forward and of its backward, beyond inputs and outputs, within 15% of :func:`capped_block_bytes` (the memory
    model's tolerance)."""
    monkeypatch.setattr(math_kernel, "MATH_BAND_SCORES", band_scores)  # the kernel's bands and the estimate's
    g = torch.Generator().manual_seed(seq)
    q, k, v, dout = (torch.randn(1, seq, heads, head_dim, generator=g) for _ in range(4))
    with TensorMemoryTracker() as tracker:
        tracker.reset_peak()
        out, lse = kernel.forward(q, k, v, causal, head_dim**-0.5, None, 30.0)
        forward = tracker.peak_bytes - tracker.current_bytes  # beyond the outputs
        tracker.reset_peak()
        grads = kernel.backward(dout, q, k, v, out, lse, causal, head_dim**-0.5, None, 30.0)
        backward = tracker.peak_bytes - sum(x.numel() * x.element_size() for x in grads)
    estimated = capped_block_bytes(1, heads, seq, seq, head_dim, head_dim, 4, banded=kernel.name == "sdpa")
    assert abs(estimated[0] / forward - 1) <= 0.15, (forward / 2**20, estimated[0] / 2**20)
    assert abs(estimated[1] / backward - 1) <= 0.15, (backward / 2**20, estimated[1] / 2**20)


def _gemma2(cap: float | None, full: bool) -> HFCausalLM:
    config = transformers.Gemma2Config(
        vocab_size=1024, hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, attn_logit_softcapping=cap, final_logit_softcapping=None,
        sliding_window=4096)
    return HFCausalLM(config, mlp_tiles=None if full else 1, loss_tiles=None if full else 1)


def _gemma2_step(rank: int, world: int, seq: int, full: bool) -> tuple[int, int]:
    torch.manual_seed(0)
    module = _gemma2(50.0, full)
    shape, tiling = ModelShape.from_module(module)
    return _measured_step(module, shape, tiling, rank, world, seq, full)


@pytest.mark.distributed
@pytest.mark.parametrize("full", [False, True], ids=["ulysses", "chunked_tiled_checkpointed"])
def test_estimate_of_a_softcapped_model_on_sdpa_matches_a_measured_step(full: bool) -> None:
    """Gemma-2 caps its attention logits, which ``sdpa`` computes on ``math``: the estimate counts those scores
    (without them it was a sixth of the measured peak at 4096 tokens, plain Ulysses)."""
    for seq in (1024, 4096):
        measured, estimated = run_on_ranks(_gemma2_step, 2, seq, full)[0]
        assert abs(estimated / measured - 1) <= 0.15, (seq, measured / 2**20, estimated / 2**20)


def test_the_shape_says_whether_attention_caps_and_only_uncapping_routes_count_the_scores() -> None:
    capped, _ = ModelShape.from_module(_gemma2(50.0, True))
    plain, _ = ModelShape.from_module(_gemma2(None, True))
    assert capped.capped_attention and not plain.capped_attention
    assert dataclasses.replace(capped, capped_attention=False) == plain

    def peak(shape: ModelShape, **options: Any) -> int:
        run = EstimateOptions(sequence_parallel_size=8, chunk_size=16384, **options)
        return estimate(shape, 65536, run).device_peak

    assert peak(capped) > peak(plain)
    assert peak(capped, precision="bf16-mixed", attention_backend="flash_attn") == peak(
        plain, precision="bf16-mixed", attention_backend="flash_attn")  # flash-attn caps in its kernel
    # math holds every block's scores whole: capped, one more of them and the backward's
    assert peak(capped, attention_backend="math") > peak(plain, attention_backend="math") > peak(capped)


def test_which_routes_cap_in_a_kernel() -> None:
    """Known without asking the GPU or the installed packages (the estimate runs in the process that starts the
    ranks): auto and cudnn count the banded scores, FlashAttention-4 is held to its sm100 rule."""
    assert caps_in_kernel("flash_attn", 256) and caps_in_kernel("flash_attn_3", 256)
    assert caps_in_kernel("flash_attn_4", 128) and not caps_in_kernel("flash_attn_4", 256)
    assert not any(caps_in_kernel(backend, 128) for backend in ("sdpa", "math", "auto", "cudnn"))
