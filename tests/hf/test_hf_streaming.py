"""Decoder layers that stream beyond plain attention (``lightning_fpdt.hf.streamed``): a router whose statistics feed
the auxiliary loss (Qwen3-MoE, one routed layer and one dense), Gemma-4's layers (per-layer inputs with a gradient,
the experts block beside the MLP, the ``shared_kv_states`` mapping passed through) and Llama-4's (temperature-tuned
NoPE queries, chunked attention, experts).

At sp=2 with four chunks per rank and the full memory stack: loss and every gradient equal one process's on the
whole batch (float64, 1e-10), on packed documents and, for the auxiliary loss, on padded samples (the router weighs
each chunk's own tokens), and every decoder layer's backward ran streamed. In one process: no op inside a streamed
layer makes a tensor sized by the local sequence, forward or backward, which the same check finds in layers recomputed
whole. The families' own float32 steps (routers, norms, rotary) run in float64 on both sides (the fixtures below).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import transformers

import lightning_fpdt.hf.recurrent as recurrent
import lightning_fpdt.hf.short_conv as short_conv
import lightning_fpdt.layers.carried as carried
import lightning_fpdt.layers.streaming as streaming
from lightning_fpdt.hf.layers import decoder_modules
from lightning_fpdt.memory import EstimateOptions, ModelShape, estimate
from lightning_fpdt.memory.unstreamed import report_unstreamed
from lightning_fpdt.models import HFCausalLM
from lightning_fpdt.parallel.batches import shard_batch
from lightning_fpdt.parallel.binding import bind
from lightning_fpdt.testing import run_on_ranks
from tests.hf.test_hf_causal_lm import VOCAB, _redraw
from tests.hf.test_hf_families import _released
from tests.hf.test_hf_families import llama4_in_float64 as llama4_in_float64  # autouse fixtures
from tests.hf.test_hf_gemma4 import _config as gemma4_config
from tests.hf.test_hf_gemma4 import gemma4_in_float64 as gemma4_in_float64
from tests.hf.test_hf_moe import _config as moe_config
from tests.hf.test_hf_moe import routers_in_float64 as routers_in_float64
from tests.hf.test_recurrent import _config as recurrent_config
from tests.hf.test_recurrent import _hybrid
from tests.hf.test_recurrent import kernels_in_float64 as kernels_in_float64
from tests.hf.test_short_conv import _lfm2
from tests.reference import rel_error
from tests.test_streaming import _batch, _context, _step, assert_layer_work_is_chunk_sized

FAMILIES = {
    "qwen3_moe": lambda: moe_config("qwen3_moe", 1),  # the auxiliary loss on; layer 1 dense
    "gemma4": lambda: gemma4_config("experts"),  # per-layer inputs, experts beside the MLP
    "llama4": lambda: _released("llama4", 1),  # NoPE layer with temperature tuning, chunked attention, experts
    # hybrids: gated delta-net layers around an attention layer (Qwen3.5), with routed experts and the auxiliary
    # loss (Qwen3-Next); Mamba-2 layers (Nemotron-H); short convolutions (LFM2)
    "qwen3_5_text": lambda: recurrent_config("qwen3_5_text"),
    "qwen3_next": lambda: recurrent_config("qwen3_next"),
    "nemotron_h": lambda: recurrent_config("nemotron_h"),
    "granitemoehybrid": lambda: recurrent_config("granitemoehybrid"),  # Mamba-2 layers around attention
    "olmo_hybrid": lambda: recurrent_config("olmo_hybrid"),  # gated delta-net layers
    "lfm2": lambda: _lfm2(0).model.config,
}
ROUTER_LOSS = {"qwen3_moe", "qwen3_next"}


def _model(family: str, seed: int) -> HFCausalLM:
    torch.manual_seed(seed)
    with warnings.catch_warnings():  # the families' "falling back to the torch implementation" notices
        warnings.simplefilter("ignore")
        module = HFCausalLM(FAMILIES[family](), mlp_tiles=2, loss_tiles=3).double()
    _redraw(module.model, seed)
    assert (module.router_loss is not None) == (family in ROUTER_LOSS)
    return module


def _data(seed: int, seq: int, padded: bool) -> dict[str, torch.Tensor]:
    """Packed documents, or right-padded samples (the second one's last 11 tokens, across a chunk boundary)."""
    if not padded:
        return _batch(seed, seq)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, seq), generator=g)
    mask = torch.ones_like(ids)
    mask[1, -11:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _counted(backward: Any, calls: list[int]) -> Any:
    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(len(self.bounds))
        return backward(self, *args, **kwargs)

    return counted


def _sharded_step(rank: int, world: int, family: str, padded: bool, seed: int, seq: int, chunk: int
                  ) -> dict[str, Any]:
    module = _model(family, seed)
    streamed: list[int] = []
    for kind in (streaming._Streamed, carried._Carried):  # this forked rank's own copies of the modules
        kind.backward = _counted(kind.backward, streamed)
    bind(module, _context(dist.group.WORLD, chunk))
    loss_sum, grads = _step(module, shard_batch(_data(seed, seq, padded), world, rank, chunk))
    dist.all_reduce(loss_sum)
    for g in grads.values():
        dist.all_reduce(g)
    return {"loss": loss_sum, "grads": grads, "streamed": streamed}


CASES = [("qwen3_moe", False), ("qwen3_moe", True), ("gemma4", False), ("llama4", False), ("qwen3_5_text", False),
         ("qwen3_next", True), ("nemotron_h", False), ("lfm2", False), ("granitemoehybrid", False),
         ("olmo_hybrid", False)]


@pytest.mark.distributed
@pytest.mark.parametrize("family,padded", CASES, ids=[f"{f}-{'padded' if p else 'packed'}" for f, p in CASES])
def test_layers_stream_and_match_one_process(family: str, padded: bool, fresh_seed: int) -> None:
    seq, chunk = 64, 16
    results = run_on_ranks(_sharded_step, 2, family, padded, fresh_seed, seq, chunk)
    reference = _model(family, fresh_seed)
    ref_loss, ref_grads = _step(reference, _data(fresh_seed, seq, padded))
    layers = len(decoder_modules(reference.model))
    for result in results:
        assert result["streamed"] == [4] * layers, f"{family}: streamed backwards {result['streamed']}"
        assert rel_error(result["loss"], ref_loss) <= 1e-10, f"{family} seed={fresh_seed}: loss"
        for name, g in ref_grads.items():
            assert rel_error(result["grads"][name], g) <= 1e-10, f"{family} seed={fresh_seed}: {name}"


def test_the_auxiliary_loss_moves_the_streamed_step(fresh_seed: int) -> None:
    """The router's share is in the streamed step: without it, loss and router gradients are far off."""
    seq, chunk = 64, 16
    batch = shard_batch(_data(fresh_seed, seq, True), 1, 0, chunk)
    steps = []
    for coefficient in (None, 0.0):
        module = _model("qwen3_moe", fresh_seed)
        if coefficient is not None:
            module.router_loss.coefficient = coefficient
        bind(module, _context(None, chunk))
        steps.append(_step(module, batch))
    (loss, grads), (plain_loss, plain_grads) = steps
    assert rel_error(loss, plain_loss) > 1e-6
    gates = [name for name in grads if name.endswith("mlp.gate.weight")]
    assert gates and all(rel_error(grads[n], plain_grads[n]) > 1e-3 for n in gates), gates


@pytest.mark.parametrize("family", list(FAMILIES))
def test_no_layer_work_is_sized_by_the_local_sequence(family: str, fresh_seed: int) -> None:
    """A full-stack step with seven chunks: inside the decoder layers, forward and backward, no op makes a tensor
    sized by the local sequence (beyond the output and gradient buffers filled chunk by chunk); the same check fails
    with layers recomputed whole, and both give the same loss and gradients. (112 tokens: no width of these models.)"""
    seq, chunk = 112, 16
    batch = shard_batch(_data(fresh_seed, seq, family == "qwen3_moe"), 1, 0, chunk)
    assert_layer_work_is_chunk_sized(lambda: _model(family, fresh_seed),
                                     lambda m: [layer for _, layer in decoder_modules(m.model)], batch, seq, family)


def _options(**changes: Any) -> EstimateOptions:
    return EstimateOptions(sequence_parallel_size=2, chunk_size=64, offload=True, activation_checkpointing=True,
                           offload_checkpoints=True, mlp_tiled=True, loss_tiled=True).replace(**changes)


def test_layers_that_cannot_stream_are_named_once_with_their_cost(fresh_seed: int) -> None:
    """At bind: one line names the layers recomputed whole, why, and the memory model's cost of it per token
    (Falcon-H1's layers, attention and a Mamba-2 mixer side by side; Gemma-4's layers that share keys and values);
    nothing for a model whose layers all stream (hybrids too), or without checkpointing; and the memory model counts
    such layers whole."""
    lines: list[str] = []
    hybrid = _hybrid("falcon_h1", fresh_seed)  # attention and a Mamba-2 mixer side by side in every layer
    line = report_unstreamed(hybrid, _options(), log=lines.append)
    assert lines == [line] and line is not None
    assert "3 of 3 decoder layers are recomputed whole" in line and "attention and a FalconH1Mixer" in line, line
    assert "model.model.layers.0, model.model.layers.1, model.model.layers.2:" in line, line
    cost = float(line.split("counts them whole: ")[1].split()[0])
    assert cost > 2, line  # whole-sequence activations, against two hidden vectors per token streamed
    assert report_unstreamed(hybrid, _options(activation_checkpointing=False), log=lines.append) is None
    for family in ("gemma4", "qwen3_next", "lfm2"):  # every layer streams
        assert report_unstreamed(_model(family, fresh_seed), _options(), log=lines.append) is None, family
    assert len(lines) == 1

    shared = HFCausalLM(gemma4_config("kv_shared"))
    line = report_unstreamed(shared, _options(chunk_size="auto"), log=lines.append)
    assert line is not None and "4 of 4 decoder layers" in line and "num_kv_shared_layers" in line, line
    assert "hidden vectors" not in line  # the chunk is picked per batch: no cost before it is known
    # the memory model: a layer that cannot stream counts whole (a Llama's layers, marked so, against as they are)
    shape, _ = ModelShape.from_module(
        HFCausalLM(transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2)))
    assert [k.streams for k in shape.layer_kinds()] == [True, True]
    whole = dataclasses.replace(shape, layers=tuple(dataclasses.replace(k, streams=False)
                                                    for k in shape.layer_kinds()))
    assert estimate(whole, 4096, _options()).device_peak > estimate(shape, 4096, _options()).device_peak


def test_a_state_not_carried_or_not_restarted_at_a_document_is_caught(monkeypatch: pytest.MonkeyPatch,
                                                                       fresh_seed: int) -> None:
    """A streamed gated delta-net layer (its convolution and its delta rule) equals the layer run whole; with its carry
    dropped between chunks, or its state and convolution history kept across document starts, it does not."""
    seq, chunk = 64, 16
    batch = shard_batch(_data(fresh_seed, seq, False), 1, 0, chunk)

    def step(streamed: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        module = _model("qwen3_5_text", fresh_seed)
        bind(module, _context(None, chunk, streamed))
        return _step(module, batch)

    whole_loss, whole_grads = step(False)
    loss, grads = step(True)
    assert rel_error(loss, whole_loss) <= 1e-10
    assert all(rel_error(grads[n], g) <= 1e-10 for n, g in whole_grads.items())

    pieces, positions = recurrent.run_pieces, short_conv.token_positions
    breakages = {
        "not carried": [(carried.MixerStream, "carried", lambda self, key: None)],
        "not restarted": [  # one piece per chunk, every lag of the convolution read
            (recurrent, "run_pieces", lambda run, lo, hi, documents, *rest: pieces(run, lo, hi, None, *rest)),
            (short_conv, "token_positions", lambda s, p, r, c, documents, *rest: positions(s, p, r, c, None, *rest)),
        ],
    }
    for name, patches in breakages.items():
        with monkeypatch.context() as patched:
            for owner, attribute, replacement in patches:
                patched.setattr(owner, attribute, replacement)
            broken_loss, broken_grads = step(True)
        assert rel_error(broken_loss, whole_loss) > 1e-6, name
        mixer = [n for n in whole_grads if "linear_attn.in_proj_qkv" in n]
        assert mixer and all(rel_error(broken_grads[n], whole_grads[n]) > 1e-4 for n in mixer), name


def test_a_ring_names_the_mixer_layers_it_keeps_whole(fresh_seed: int) -> None:
    """Under a ring a hybrid's mixer layers are recomputed whole (their chunks are not in sequence order): named with
    the ring as the reason, and counted whole by the memory model."""
    lines: list[str] = []
    hybrid = _hybrid("qwen3_next", fresh_seed)
    line = report_unstreamed(hybrid, _options(sequence_parallel_size=4, ring_size=2), log=lines.append)
    assert line is not None and "2 of 3 decoder layers" in line and "under a ring (ring_size > 1" in line, line
    assert report_unstreamed(hybrid, _options(), log=lines.append) is None
