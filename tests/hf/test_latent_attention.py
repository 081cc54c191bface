"""Multi-head latent attention: v of another head width than q and k, through the FPDT pipeline exactly.

DeepSeek-V2/V3, Kimi-K2, MiniCPM3 and others attend with q and k of ``qk_nope_head_dim + qk_rope_head_dim`` and
v of ``v_head_dim``; the output has v's width. ``math`` computes it directly; the fused ops take one head width,
so ``sdpa`` (torch's CPU op refuses "Q/K/V should have the same head size") and ``flash_attn`` get q, k and v
padded with zero columns to a common width, the padded columns sliced off after.

The oracles: textbook attention on the whole sequence (``tests/reference.py``, ``tests/test_attention_variants.py``
for windows, softcaps, sinks and documents), and plain transformers in one process for DeepSeek-V3 and MiniCPM3
(``tests/hf/test_hf_causal_lm.py``'s machinery). ``flash_attn`` runs on a fake of flash-attn 2's private interface
that computes in float64 from the lse it is handed, as the real one does: that lse is float32 (the kernel's
contract), so it is checked bitwise against v zero-padded by hand (the equal-width path), and against the oracle
to float32 rounding.
"""

from __future__ import annotations

import itertools
from types import ModuleType
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from transformers import DeepseekV3Config, MiniCPM3Config

import lightning_fpdt.attention as attention_package
from lightning_fpdt.attention import fpdt_attention
from lightning_fpdt.attention.kernels import FlashAttnKernel, MathKernel, SdpaKernel, get_kernel
from lightning_fpdt.hf.attention import head_widths
from lightning_fpdt.memory import EstimateOptions, ModelShape, estimate
from lightning_fpdt.models import HFCausalLM
from lightning_fpdt.parallel.layout import shard_sequence, unshard_sequence
from lightning_fpdt.testing import run_on_ranks
from tests.helpers import TokenDataset, assert_same_step
from tests.hf.test_hf_causal_lm import (
    SEQ,
    SIZES,
    VOCAB,
    Case,
    Packed,
    _fit,
    _max_error,
    _mean_ce,
    _plain,
    _redraw,
    each_sample_alone,
    one_process_step,
)
from tests.reference import naive_attention, rel_error
from tests.test_attention_variants import DOCS, _check, _documents, _reference, _step, _visible
from tests.test_cuda_calls import BACKWARD_OF, EFF, FLASH, _bind, _check_fed_as_autograd_does, _Recorder

HEADS, HEAD_DIM, BATCH = 4, 8, 2
SCALE = HEAD_DIM**-0.5
V_WIDTHS = {"narrow": 6, "wide": 12}  # v's head width: below q's (MLA) and above it


# ---- a flash-attn 2 fake the pipeline can run on ------------------------------------------------------------


def _flash_scores(q: Tensor, k: Tensor, scale: float, causal: bool, left: int, right: int, softcap: float) -> Tensor:
    """flash-attn's masked scores ``[b, h, s_q, s_k]`` (bottom-right aligned window, its README)."""
    s_q, s_k, h = q.shape[1], k.shape[1], q.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(h // k.shape[2], dim=2)) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    shift = torch.arange(s_k).view(1, -1) - torch.arange(s_q).view(-1, 1) - (s_k - s_q)
    seen = torch.ones(s_q, s_k, dtype=torch.bool)
    if left >= 0:
        seen &= shift >= -left
    if causal or right >= 0:
        seen &= shift <= (0 if causal else right)
    return s.masked_fill(~seen, float("-inf"))


def flash_interface() -> ModuleType:
    """flash-attn 2.7-2.8's ``_flash_attn_forward``/``_flash_attn_backward`` (signatures as the releases), with
    their shape requirements asserted (one head size for q, k and v, a multiple of 8, contiguous last dim). The
    backward works from the ``out`` and ``softmax_lse`` it is given (the row's, after the pipeline's merge), as the
    real kernel does; the forward's lse is float32, as the real one's."""

    def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                            softcap, alibi_slopes, return_softmax):
        assert q.shape[-1] == k.shape[-1] == v.shape[-1] and q.shape[-1] % 8 == 0
        assert all(x.stride(-1) == 1 for x in (q, k, v))
        s = _flash_scores(q, k, softmax_scale, causal, window_size_left, window_size_right, softcap)
        lse = torch.logsumexp(s, dim=-1)
        out = torch.einsum("bhqk,bkhd->bqhd", torch.exp(s - lse.unsqueeze(-1)),
                           v.repeat_interleave(q.shape[2] // v.shape[2], dim=2))
        return out, lse.float(), torch.empty(0, dtype=q.dtype), torch.empty(2, dtype=torch.int64)

    def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                             window_size_left, window_size_right, softcap, alibi_slopes, deterministic, rng_state=None):
        assert len({x.shape[-1] for x in (dout, q, k, v, out, dq, dk, dv)}) == 1 and q.shape[-1] % 8 == 0
        assert softmax_lse.dtype == torch.float32 and [x.shape for x in (dq, dk, dv)] == [q.shape, k.shape, v.shape]
        h, g = q.shape[2], k.shape[2]
        s = _flash_scores(q, k, softmax_scale, causal, window_size_left, window_size_right, softcap)
        p = torch.exp(s - softmax_lse.to(s.dtype).unsqueeze(-1))
        vv, kk = v.repeat_interleave(h // g, dim=2), k.repeat_interleave(h // g, dim=2)
        dp = torch.einsum("bqhd,bkhd->bhqk", dout, vv)
        ds = p * (dp - (dout * out).sum(-1).transpose(1, 2).unsqueeze(-1)) * softmax_scale
        if softcap > 0:  # s above is capped: d(cap tanh(x / cap)) = 1 - (s / cap)^2
            ds = ds * (1 - (s.masked_fill(s == float("-inf"), 0) / softcap).square())
        b, s_k, d = k.shape[0], k.shape[1], k.shape[3]
        dq.copy_(torch.einsum("bhqk,bkhd->bqhd", ds, kk))
        dk.copy_(torch.einsum("bhqk,bqhd->bkhd", ds, q).view(b, s_k, g, h // g, d).sum(3))
        dv.copy_(torch.einsum("bhqk,bqhd->bkhd", p, dout).view(b, s_k, g, h // g, d).sum(3))
        return torch.empty(q.shape[0], q.shape[2], q.shape[1])

    module = ModuleType("flash_attn.flash_attn_interface")
    module._flash_attn_forward = _flash_attn_forward
    module._flash_attn_backward = _flash_attn_backward
    return module


def _kernel(backend: str, device: torch.device, dtype: torch.dtype) -> Any:
    return FlashAttnKernel(flash_interface()) if backend == "flash_attn" else get_kernel(backend, device, dtype)


# ---- fpdt_attention against textbook attention ---------------------------------------------------------------

# (v width, backend, chunk_size, offload, packed documents, causal); kv heads 1 (below sp=2) for narrow v, 2 for wide
MODES = {"ulysses": (None, False, False, True), "chunked": (8, False, False, True), "offload": (8, True, False, True),
         "packed": (8, False, True, True)}
CASES = [(w, backend, *MODES[mode]) for w, backend, mode in itertools.product(
    V_WIDTHS, ("math", "sdpa", "flash_attn"), MODES)] + [(w, "math", 8, False, False, False) for w in V_WIDTHS]


def _inputs(seed: int, dv: int, kv_heads: int) -> tuple[Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, SEQ, HEADS, HEAD_DIM, generator=g, dtype=torch.float64) * 2
    k = torch.randn(BATCH, SEQ, kv_heads, HEAD_DIM, generator=g, dtype=torch.float64) * 2
    v = torch.randn(BATCH, SEQ, kv_heads, dv, generator=g, dtype=torch.float64)
    dout = torch.randn(BATCH, SEQ, HEADS, dv, generator=g, dtype=torch.float64)
    return q, k, v, dout


def _one_step(rank: int, world: int, chunk: int | None, q, k, v, dout, backend: str, **options: Any) -> list[Tensor]:
    """One sharded forward and backward: this rank's out, lse, dq, dk, dv."""
    group = dist.group.WORLD if world > 1 else None
    shards = [shard_sequence(x, world, rank, chunk).requires_grad_() for x in (q, k, v)]
    with mock.patch.object(attention_package, "get_kernel", _kernel):
        out, lse = fpdt_attention(*shards, group=group, chunk_size=chunk, backend=backend, scale=SCALE,
                                  return_lse=True, **options)
        out.backward(shard_sequence(dout, world, rank, chunk))
    return [t.detach() for t in (out, lse, *(x.grad for x in shards))]


def _run_cases(rank: int, world: int, seed: int) -> list[list[Tensor]]:
    results = []
    for case_id, (width, backend, chunk, offload, packed, causal) in enumerate(CASES):
        dv = V_WIDTHS[width]
        q, k, v, dout = _inputs(seed + case_id, dv, 1 if dv < HEAD_DIM else 2)
        options = dict(offload=offload, causal=causal, documents=_documents(DOCS) if packed else None)
        results.append(_one_step(rank, world, chunk, q, k, v, dout, backend, **options))
        if backend == "flash_attn":  # the same with v zero-padded by hand to q's width (or q and k to v's)
            width_all = max(HEAD_DIM, dv)
            padded = [F.pad(x, (0, width_all - x.shape[-1])) for x in (q, k, v, dout)]
            results.append(_one_step(rank, world, chunk, *padded, backend, **options))
    return results


def _expected(q, k, v, dout, causal: bool, packed: bool) -> list[Tensor]:
    if packed:
        ref = _reference(q, k, v, dout, _visible(BATCH, None, DOCS), None, None)
        return [ref[name] for name in ("out", "lse", "dq", "dk", "dv")]
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out, lse = naive_attention(q, k, v, causal, SCALE)
    out.backward(dout)
    return [out.detach(), lse.detach(), q.grad, k.grad, v.grad]


@pytest.mark.parametrize("sp", [1, pytest.param(2, marks=pytest.mark.distributed)])
def test_latent_attention_matches_textbook_attention(sp: int, fresh_seed: int) -> None:
    """v narrower and wider than q and k, plain Ulysses, 4 chunks per rank with and without offload, packed
    documents, GQA with one KV head below sp=2: output, lse and every gradient, on ``math``, ``sdpa`` and the
    flash-attn path (bitwise the equal-width path with v padded by hand; float32-lse rounding from the oracle)."""
    per_rank = run_on_ranks(_run_cases, sp, fresh_seed) if sp > 1 else [_run_cases(0, 1, fresh_seed)]
    at = 0
    for case_id, (width, backend, chunk, offload, packed, causal) in enumerate(CASES):
        dv = V_WIDTHS[width]
        q, k, v, dout = _inputs(fresh_seed + case_id, dv, 1 if dv < HEAD_DIM else 2)
        got = [unshard_sequence([r[at][t] for r in per_rank], chunk) for t in range(5)]
        at += 1
        what = f"sp={sp} v={dv} {backend} chunk={chunk} offload={offload} packed={packed} causal={causal}"
        assert got[0].shape == (BATCH, SEQ, HEADS, dv) and got[4].shape == v.shape, what
        tol = 1e-10
        expected = _expected(q, k, v, dout, causal, packed)
        if backend == "flash_attn":
            padded = [unshard_sequence([r[at][t] for r in per_rank], chunk) for t in range(5)]
            at += 1
            for name, a, b, n in zip(("out", "lse", "dq", "dk", "dv"), got, padded, (dv, None, HEAD_DIM, HEAD_DIM, dv)):
                assert torch.equal(a, b if n is None else b[..., :n]), f"{what}: {name} differs from v padded by hand"
            # flash-attn's lse is float32, and so is the fake's: rounding it moves exp(s - lse), so every probability,
            # by up to |lse| * 2**-24 (relative); the outputs and gradients inherit that, a few times over
            tol = 4 * 2**-24 * expected[1].abs().max().item()
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, expected):
            err = rel_error(a, b)
            assert err <= tol, f"{what}: {name} rel. error {err:.2e} (seed={fresh_seed})"


# windows, softcap and sinks with v narrower and wider, sp=2, one KV head: (v width, chunk, window, packed,
# softcap, sinks, offload, backend)
VARIANTS = [
    ("narrow", 8, 6, True, None, True, False, "math"),
    ("narrow", 4, 5, True, 5.0, True, True, "sdpa"),
    ("wide", 8, 3, False, 5.0, False, False, "math"),
    ("wide", 4, None, False, None, True, False, "sdpa"),
]


def _variant_inputs(seed: int, dv: int) -> tuple[Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(len(DOCS), SEQ, HEADS, HEAD_DIM, generator=g, dtype=torch.float64) * 3
    k = torch.randn(len(DOCS), SEQ, 1, HEAD_DIM, generator=g, dtype=torch.float64) * 3
    v = torch.randn(len(DOCS), SEQ, 1, dv, generator=g, dtype=torch.float64)
    dout = torch.randn(len(DOCS), SEQ, HEADS, dv, generator=g, dtype=torch.float64)
    sinks = 8.0 + 4.0 * torch.randn(HEADS, generator=g, dtype=torch.float64)
    return q, k, v, dout, sinks


def _run_variants(rank: int, world: int, seed: int) -> list[dict]:
    results = []
    for case_id, (width, chunk, window, packed, softcap, with_sinks, offload, backend) in enumerate(VARIANTS):
        q, k, v, dout, sinks = _variant_inputs(seed + case_id, V_WIDTHS[width])
        results.append(_step(rank, world, chunk, q, k, v, dout, sinks if with_sinks else None, window=window,
                             documents=_documents(DOCS) if packed else None, softcap=softcap, offload=offload,
                             backend=backend))
    return results


@pytest.mark.distributed
def test_latent_attention_with_windows_softcaps_and_sinks_at_sp2(fresh_seed: int) -> None:
    per_rank = run_on_ranks(_run_variants, 2, fresh_seed)
    for case_id, (width, chunk, window, packed, softcap, with_sinks, _, backend) in enumerate(VARIANTS):
        q, k, v, dout, sinks = _variant_inputs(fresh_seed + case_id, V_WIDTHS[width])
        got = {name: unshard_sequence([r[case_id][name] for r in per_rank], chunk)
               for name in ("out", "lse", "dq", "dk", "dv")}
        got["dsinks"] = sum(r[case_id]["dsinks"] for r in per_rank) if with_sinks else None
        seen = _visible(len(DOCS), window, DOCS if packed else None)
        expected = _reference(q, k, v, dout, seen, softcap, sinks if with_sinks else None)
        _check(got, expected, f"v={V_WIDTHS[width]} {backend} chunk={chunk} window={window} softcap={softcap}"
                              f" sinks={with_sinks} seed={fresh_seed}")


def test_mismatched_shapes_are_refused_by_name() -> None:
    """Only v's width may differ: q and k of other widths, or a batch, length or head count that does not agree,
    are a ValueError naming the shapes, before any collective."""
    q, k, v = torch.zeros(1, 8, 4, 8), torch.zeros(1, 8, 2, 8), torch.zeros(1, 8, 2, 6)
    for bad, problem in (((q, k[..., :6], v), "q and k must have one head width"),
                         ((q, k[:, :4], v), "batch and local length"),
                         ((q, k, torch.zeros(2, 8, 2, 6)), "batch and local length"),
                         ((q, k, v[:, :, :1]), "k and v must have one head count"),
                         ((q, k, v[0]), "4 dims")):
        with pytest.raises(ValueError, match=problem) as error:
            fpdt_attention(*bad)
        assert "got q (1, 8, 4, 8)" in str(error.value)
    with pytest.raises(ValueError, match=r"v's width may differ, q's and k's may not.*k \(1, 8, 2, 6\)"):
        MathKernel().forward(q, k[..., :6], v, True, 0.3)


# ---- the CUDA routes of sdpa on meta tensors (tests/test_cuda_calls.py's recorder) ----------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("lower", [None, -5], ids=["no-edge", "window-edge"])
@pytest.mark.parametrize("dv", list(V_WIDTHS.values()))
def test_sdpa_cuda_ops_get_one_head_width(dtype: torch.dtype, lower: int | None, dv: int) -> None:
    """torch's fused CUDA ops (flash for half precision, memory-efficient for float32 and for a window's edge)
    get q, k, v (and out, dout) at one head width, a multiple of 8, fed to their backward as autograd would;
    the output and dv come back at v's width."""
    b, s = 2, 40
    q, dout = torch.empty(b, s, HEADS, 12, dtype=dtype, device="meta"), torch.empty(b, s, HEADS, dv, dtype=dtype,
                                                                                    device="meta")
    k = torch.empty(b, s, 2, 12, dtype=dtype, device="meta")
    v = torch.empty(b, s, 2, dv, dtype=dtype, device="meta")
    with _Recorder() as rec:
        out, lse = SdpaKernel().forward(q, k, v, True, 0.25, lower)
        dq, dk, dv_ = SdpaKernel().backward(dout, q, k, v, out, lse, True, 0.25, lower)
    assert (out.shape, dq.shape, dk.shape, dv_.shape) == (dout.shape, q.shape, k.shape, v.shape)
    op = FLASH if dtype == torch.bfloat16 and lower is None else EFF
    assert [c.op for c in rec.calls] == [op, BACKWARD_OF[op]]
    _check_fed_as_autograd_does(*rec.calls)
    for call in rec.calls:
        bound = _bind(call)
        widths = {name: bound[name].shape[-1] for name in ("query", "key", "value", "out", "grad_out", "grad_out_")
                  if name in bound}
        assert set(widths.values()) == {16}, (call.op, widths)  # 12 and 6 or 12 padded to one multiple of 8


# ---- memory model and FLOPs ----------------------------------------------------------------------------------


def test_memory_model_sizes_v_and_the_output_at_v_width() -> None:
    """The attention buffers count q and k at their width and v and the output at v's: with v's width set to q's
    the estimate is the default one; each narrower v column saves exactly its bytes in the chunk buffers."""
    base = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=256,
                num_params=10**5, head_dim=24)
    options = EstimateOptions(precision="32-true")
    same = estimate(ModelShape(**base), 256, options)
    assert estimate(ModelShape(**base, v_head_dim=24), 256, options) == same
    narrow = estimate(ModelShape(**base, v_head_dim=16), 256, options)
    # one chunk (256 tokens), current and prefetched: out (4 heads) and v (2 heads) lose 8 columns each, 4 bytes
    assert same.chunk_buffers - narrow.chunk_buffers == 2 * 256 * (4 + 2) * 8 * 4
    assert narrow.saved_activations < same.saved_activations


MLA = dict(qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6, kv_lora_rank=8, q_lora_rank=8)


def _deepseek(**overrides: Any) -> DeepseekV3Config:
    """Dense layers only (first_k_dense_replace = every layer): no MoE layer."""
    config = dict(SIZES, **MLA, num_key_value_heads=SIZES["num_attention_heads"], first_k_dense_replace=2,
                  n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=16)
    config.update(overrides)
    return DeepseekV3Config(**config)


def _minicpm3(**overrides: Any) -> MiniCPM3Config:
    """``dim_model_base = hidden_size`` (``logits_scaling`` 1); the released 256, which scales the hidden states
    before the output embedding: the test after the model cases."""
    config = dict(SIZES, **MLA, num_key_value_heads=SIZES["num_attention_heads"], dim_model_base=SIZES["hidden_size"])
    config.update(overrides)
    return MiniCPM3Config(**config)


def test_head_widths_and_flops_count_v_at_its_width() -> None:
    """MLA configs: q/k at ``qk_nope + qk_rope`` (their ``head_dim`` is the rotary part only), v at ``v_head_dim``;
    the attention FLOPs are 6 x heads x (qk + v) x keys per layer (QK^T and PV, forward and backward)."""
    assert head_widths(_deepseek()) == head_widths(_minicpm3()) == (8, 6)
    assert head_widths(_deepseek(q_lora_rank=None)) == (8, 6)
    seq = 64
    for config in (_deepseek(), _minicpm3()):
        module = HFCausalLM(config)
        flops = module.flops_per_token(seq)
        dense = flops - 6 * HEADS * (8 + 6) * 2 * seq / 2  # two layers, causal: seq / 2 keys per query
        params = sum(p.numel() for n, p in module.model.named_parameters() if "embed_tokens" not in n)
        if module.model.config.tie_word_embeddings:  # MiniCPM3: the output embedding is still a matmul
            params += VOCAB * SIZES["hidden_size"]
        assert dense == pytest.approx(6 * params, rel=1e-12), type(config).__name__


# ---- DeepSeek-V3 (dense layers) and MiniCPM3 under FPDTStrategy against plain transformers -------------------

# (family, packed, config overrides): DeepSeek-V3 as released (q LoRA, interleaved rope) and V2-Lite-style (q_proj
# without LoRA, rope not interleaved); MiniCPM3 (DeepSeek-V2's MLA, plain rope; embedding and residual scales)
HF_CASES = [
    ("deepseek_v3", False, {}),
    ("deepseek_v3", True, {"q_lora_rank": None, "rope_interleave": False}),
    ("minicpm3", False, {}),
    ("minicpm3", True, {}),
]


@pytest.mark.distributed
@pytest.mark.parametrize(("family", "packed", "overrides"), HF_CASES,
                         ids=[f"{f}-{'packed' if p else 'plain'}{'-no-q-lora' if o else ''}" for f, p, o in HF_CASES])
def test_latent_attention_models_fit_step_equals_plain_transformers(
    family: str, packed: bool, overrides: dict, tmp_path, fresh_seed: int
) -> None:
    """sp=2, 4 chunks of 8 tokens on 32, offload emulation: loss and every gradient as plain transformers (sdpa,
    float64), each document alone when packed."""
    torch.manual_seed(fresh_seed)
    config = _deepseek(**overrides) if family == "deepseek_v3" else _minicpm3()
    module = HFCausalLM(config, learning_rate=1e-3, warmup_steps=1, mlp_tiles=1, loss_tiles=1)
    _redraw(module.model, fresh_seed)
    attn = module.model.model.layers[0].self_attn
    assert attn.o_proj.in_features == HEADS * MLA["v_head_dim"]  # the output really is v's width
    assert (attn.q_proj is None) == (config.q_lora_rank is not None)
    ref = _plain(module)
    if packed:
        data: Any = Packed(fresh_seed)
        samples = data.documents()
    else:
        data = TokenDataset(2, SEQ, VOCAB, fresh_seed)
        samples = [(data.ids[i:i + 1], data.labels[i:i + 1]) for i in range(len(data))]
    case = Case(family, sp=2, chunk_size=8, offload="emulate")
    results = _fit(module, data, case, tmp_path)
    ref_loss, ref_grads = _mean_ce(ref, samples)
    label = f"{family} packed={packed} {overrides} seed={fresh_seed}"
    print(f"{label}: max rel. error {_max_error(results, ref_loss, ref_grads):.2e}")
    assert_same_step(results, ref_loss, ref_grads, tol=1e-10, label=label)



def test_minicpm3_scaled_hidden_states_are_reproduced(fresh_seed: int) -> None:
    """The released ``dim_model_base`` (256, hidden 32 here): MiniCPM3's forward divides the hidden states by
    ``hidden_size / dim_model_base`` before ``lm_head``, so its logits are 8x the output embedding's of the base
    model's hidden states. The head probe sees what the output embedding is given and the loss scales the logits
    alike: one process's loss and every gradient equal plain transformers'."""
    module = HFCausalLM(_minicpm3(dim_model_base=256), mlp_tiles=1, loss_tiles=1).double()
    assert module.head_transform.multiplier == pytest.approx(8.0, rel=1e-12)
    _redraw(module.model, fresh_seed)
    ref = _plain(module)
    data = TokenDataset(2, SEQ, VOCAB, fresh_seed)
    ref_loss, ref_grads = each_sample_alone(ref, data)
    assert_same_step([one_process_step(module, data)], ref_loss, ref_grads, tol=1e-10,
                     label=f"minicpm3 dim_model_base=256 seed={fresh_seed}")
