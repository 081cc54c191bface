"""The analytic memory model: what each FPDT feature removes, and chunk_size='auto' selection."""

from __future__ import annotations

import pytest

from lightning_fpdt.memory import ModelShape, auto_chunk_size, estimate
from lightning_fpdt.models import LlamaConfig

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
