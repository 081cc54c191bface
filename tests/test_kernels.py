"""Attention kernels against the textbook formula, and the overflow-free merge."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_fpdt.attention import fpdt_attention, get_kernel, update_out_and_lse
from lightning_fpdt.attention.kernels import MathKernel, SdpaKernel
from lightning_fpdt.attention.merge import merge_sink, sink_grad
from tests.reference import naive_attention, rel_error


def _qkv(dtype, seed: int, heads=4, kv_heads=2, seq_q=12, seq_k=12, std=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, seq_q, heads, 16, generator=g, dtype=dtype) * std
    k = torch.randn(2, seq_k, kv_heads, 16, generator=g, dtype=dtype) * std
    v = torch.randn(2, seq_k, kv_heads, 16, generator=g, dtype=dtype)
    dout = torch.randn(2, seq_q, heads, 16, generator=g, dtype=dtype)
    return q, k, v, dout


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kernel", [MathKernel(), SdpaKernel()], ids=lambda k: k.name)
def test_kernel_forward_backward_float64(kernel, causal: bool, fresh_seed: int) -> None:
    q, k, v, dout = _qkv(torch.float64, fresh_seed)
    out, lse = kernel.forward(q, k, v, causal, 0.25)
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, causal, 0.25)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    ref_out, ref_lse = naive_attention(q, k, v, causal, 0.25)
    ref_out.backward(dout)
    for a, b in ((out, ref_out), (lse.transpose(1, 2), ref_lse), (dq, q.grad), (dk, k.grad), (dv, v.grad)):
        assert rel_error(a, b.detach()) <= 1e-12


@pytest.mark.parametrize("causal", [True, False])
def test_sdpa_matches_math_in_float32(causal: bool, fresh_seed: int) -> None:
    q, k, v, dout = _qkv(torch.float32, fresh_seed, seq_q=40, seq_k=40)
    m_out, m_lse = MathKernel().forward(q, k, v, causal, 0.25)
    s_out, s_lse = SdpaKernel().forward(q, k, v, causal, 0.25)
    assert rel_error(s_out, m_out) <= 1e-5 and rel_error(s_lse, m_lse) <= 1e-5
    m_grads = MathKernel().backward(dout, q, k, v, m_out, m_lse, causal, 0.25)
    s_grads = SdpaKernel().backward(dout, q, k, v, s_out, s_lse, causal, 0.25)
    for a, b in zip(s_grads, m_grads):
        assert rel_error(a, b) <= 1e-5


def test_auto_picks_sdpa_on_cpu() -> None:
    assert get_kernel("auto", torch.device("cpu"), torch.float32).name == "sdpa"
    assert get_kernel("auto", torch.device("cpu"), torch.float64).name == "sdpa"
    with pytest.raises(ValueError, match="flash_attn' needs a CUDA device"):
        get_kernel("flash_attn", torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ValueError, match="is not one of"):
        get_kernel("xformers", torch.device("cpu"), torch.float32)


def test_merge_of_two_halves_equals_whole(fresh_seed: int) -> None:
    q, k, v, _ = _qkv(torch.float64, fresh_seed, seq_k=20)
    whole_out, whole_lse = MathKernel().forward(q, k, v, False, 0.25)
    o1, l1 = MathKernel().forward(q, k[:, :7], v[:, :7], False, 0.25)
    o2, l2 = MathKernel().forward(q, k[:, 7:], v[:, 7:], False, 0.25)
    out, lse = update_out_and_lse(*update_out_and_lse(None, None, o1, l1), o2, l2)
    assert rel_error(out, whole_out) <= 1e-13 and rel_error(lse, whole_lse) <= 1e-13


def test_merge_does_not_overflow_when_lse_grows_by_hundreds() -> None:
    o = torch.randn(1, 3, 1, 4)
    lse_small = torch.full((1, 1, 3), -50.0)
    lse_big = torch.full((1, 1, 3), 400.0)  # exp(450) overflows float32
    out, lse = update_out_and_lse(*update_out_and_lse(None, None, o, lse_small), -o, lse_big)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert torch.allclose(out, -o) and torch.allclose(lse, lse_big)


@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_large_logits_float32_chunked_stays_close_to_float64(backend: str, fresh_seed: int) -> None:
    """Attention logits with std ~64: float32 chunked attention is finite and within 1e-4 of float64."""
    # q.k / sqrt(16) has std 8 * 8 * 4 / 4 = 64
    q, k, v, dout = _qkv(torch.float64, fresh_seed, seq_q=32, seq_k=32, std=8.0)
    ref, ref_lse = naive_attention(q, k, v, True)
    out32, lse32 = fpdt_attention(q.float(), k.float(), v.float(), chunk_size=8, backend=backend, return_lse=True)
    assert ref_lse.std() > 40
    assert torch.isfinite(out32).all() and torch.isfinite(lse32).all()
    assert (out32.double() - ref).abs().max() <= 1e-4
    assert ((lse32.double() - ref_lse).abs() / ref_lse.abs().clamp_min(1)).max() <= 1e-4


def _masked_reference(q, k, v, dout, causal: bool, lower: int | None, softcap: float | None, scale: float):
    """Textbook attention with the causal diagonal, a window edge ``b - a >= lower`` and a softcap; autograd."""
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    groups = q.shape[2] // k.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(groups, dim=2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    a, b = torch.arange(q.shape[1]).view(-1, 1), torch.arange(k.shape[1]).view(1, -1)
    seen = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool)
    if causal:
        seen &= b <= a
    if lower is not None:
        seen &= b - a >= lower
    s = s.masked_fill(~seen, float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1), v.repeat_interleave(groups, dim=2))
    out.backward(dout)
    return out.detach(), torch.logsumexp(s, dim=-1).detach(), q.grad, k.grad, v.grad


# (seq_q, seq_k, causal, lower, softcap): a diagonal with a window, off-diagonal edges, a cap with and without one
VARIANTS = [(12, 12, True, -4, None), (8, 12, False, 2, None), (12, 6, False, -7, None), (12, 12, True, None, 5.0),
            (10, 12, False, -1, 5.0)]


@pytest.mark.parametrize(("seq_q", "seq_k", "causal", "lower", "softcap"), VARIANTS)
@pytest.mark.parametrize("kernel", [MathKernel(), SdpaKernel()], ids=lambda k: k.name)
def test_kernel_window_edge_and_softcap_float64(kernel, seq_q, seq_k, causal, lower, softcap, fresh_seed: int) -> None:
    q, k, v, dout = _qkv(torch.float64, fresh_seed, seq_q=seq_q, seq_k=seq_k, std=3.0)  # scores of order 10
    out, lse = kernel.forward(q, k, v, causal, 0.25, lower, softcap)
    grads = kernel.backward(dout, q, k, v, out, lse, causal, 0.25, lower, softcap)
    ref_out, ref_lse, *ref_grads = _masked_reference(q, k, v, dout, causal, lower, softcap, 0.25)
    for a, b in ((out, ref_out), (lse, ref_lse), *zip(grads, ref_grads)):
        assert rel_error(a, b) <= 1e-12


def test_merging_a_sink_is_one_more_softmax_column(fresh_seed: int) -> None:
    """merge_sink after the blocks equals the softmax over the keys and the sink's logit (gpt-oss), and
    sink_grad is that column's gradient."""
    q, k, v, dout = _qkv(torch.float64, fresh_seed, seq_k=20, std=3.0)
    sink = (torch.randn(4, generator=torch.Generator().manual_seed(fresh_seed + 1), dtype=torch.float64) * 4 + 8)
    out, lse = update_out_and_lse(None, None, *MathKernel().forward(q, k, v, False, 0.25))
    out, lse = merge_sink(out, lse, sink)
    sink_leaf, v_leaf = sink.clone().requires_grad_(), v.clone().requires_grad_()
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(2, dim=2)) * 0.25
    s = torch.cat([s, sink_leaf.view(1, -1, 1, 1).expand(*s.shape[:3], 1)], dim=-1)
    ref = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1)[..., :-1], v_leaf.repeat_interleave(2, dim=2))
    ref.backward(dout)
    assert rel_error(out, ref.detach()) <= 1e-12 and rel_error(lse, torch.logsumexp(s, -1).detach()) <= 1e-12
    assert rel_error(sink_grad(dout, out, lse, sink), sink_leaf.grad) <= 1e-12


# (rows, keys, causal, lower, softcap, v's width): the blocks sdpa hands math (a softcap), and windows
MATH_BAND_BLOCKS = [
    pytest.param(24, 24, True, None, 20.0, 16, id="causal-softcap"),
    pytest.param(24, 40, False, None, 20.0, 16, id="rectangle-softcap"),
    pytest.param(24, 24, True, -5, 20.0, 16, id="causal-window-softcap"),
    pytest.param(24, 30, False, 3, None, 8, id="window-edge-narrower-v"),
]


@pytest.mark.parametrize(("s_q", "s_k", "causal", "lower", "softcap", "dv"), MATH_BAND_BLOCKS)
def test_math_in_bands_is_math(monkeypatch: pytest.MonkeyPatch, s_q: int, s_k: int, causal: bool, lower: int | None,
                               softcap: float | None, dv: int, fresh_seed: int) -> None:
    """The banded math (``sdpa``'s kernel for softcapped blocks) against the whole block, forward and backward in
    float64, bands of 5 rows (the last one short), the backward given rows whose lse covers other keys too."""
    from lightning_fpdt.attention import math_kernel

    q, k, _, dout = _qkv(torch.float64, fresh_seed, seq_q=s_q, seq_k=s_k)
    g = torch.Generator().manual_seed(fresh_seed + 1)
    v, dout = torch.randn(2, s_k, 2, dv, generator=g, dtype=torch.float64), dout[..., :dv]
    math = MathKernel()
    out, lse = math.forward(q, k, v, causal, 0.25, lower, softcap)
    lse = torch.logaddexp(lse, torch.randn(lse.shape, generator=g, dtype=torch.float64))  # other keys' share
    grads = math.backward(dout, q, k, v, out, lse, causal, 0.25, lower, softcap)
    monkeypatch.setattr(math_kernel, "MATH_BAND_SCORES", 2 * 4 * s_k * 5)  # batch x heads x keys x 5 rows
    assert len(MathKernel._bands(q, k, causal)) == -(-s_q // 5)
    b_out, b_lse = math.forward_in_bands(q, k, v, causal, 0.25, lower, softcap)
    b_grads = math.backward_in_bands(dout, q, k, v, out, lse, causal, 0.25, lower, softcap)
    ref_lse = math.forward(q, k, v, causal, 0.25, lower, softcap)[1]
    assert rel_error(b_out, out) <= 1e-14 and rel_error(b_lse, ref_lse) <= 1e-14
    for a, b in zip(b_grads, grads, strict=True):
        assert a.shape == b.shape and rel_error(a, b) <= 1e-13
    no_rows = math.forward_in_bands(q[:, :0], k, v, False, 0.25, None, softcap)  # a direct call on no rows
    assert no_rows[0].shape == (2, 0, 4, dv) and no_rows[1].shape == (2, 4, 0)


def test_a_softcapped_block_never_holds_its_scores_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """``sdpa``'s softcapped block in bands: its peak of live tensors stays near the band's scores, where the whole
    block's math holds ``[b, h, rows, keys]`` several times over."""
    from lightning_fpdt.attention import math_kernel
    from lightning_fpdt.offload.memtrack import TensorMemoryTracker

    q, k, v, dout = _qkv(torch.float32, 5, heads=4, kv_heads=4, seq_q=512, seq_k=512)
    out, lse = MathKernel().forward(q, k, v, True, 0.25, None, 30.0)
    peaks = {}
    for name, band in (("whole", 1 << 30), ("bands", 2 * 4 * 512 * 32)):  # 32 rows a band
        monkeypatch.setattr(math_kernel, "MATH_BAND_SCORES", band)
        with TensorMemoryTracker() as tracker:
            SdpaKernel().forward(q, k, v, True, 0.25, None, 30.0)
            SdpaKernel().backward(dout, q, k, v, out, lse, True, 0.25, None, 30.0)
        peaks[name] = tracker.peak_bytes
    scores = 2 * 4 * 512 * 512 * 4  # one whole block's float32 scores: 8 MiB
    # measured: 57.5 MiB whole, 6.2 MiB in bands of 32 rows (the backward's few band-sized intermediates)
    assert peaks["whole"] >= 3 * scores and peaks["bands"] < scores and 6 * peaks["bands"] < peaks["whole"], peaks


class _BlockCopies(TorchDispatchMode):
    """Counts the ops that copy a tensor's elements (``clone``, ``copy_``, ``_to_copy``)."""

    def __init__(self) -> None:
        super().__init__()
        self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in ("clone", "copy_", "_to_copy"):
            self.copies += 1
        return func(*args, **(kwargs or {}))


class _CopyCountingKernel(SdpaKernel):
    """``sdpa`` with every copy made inside its forward and backward calls counted."""

    def __init__(self) -> None:
        self.calls, self.mode = 0, _BlockCopies()

    def forward(self, *args, **kwargs):
        self.calls += 1
        with self.mode:
            return super().forward(*args, **kwargs)

    def backward(self, *args, **kwargs):
        self.calls += 1
        with self.mode:
            return super().backward(*args, **kwargs)


def test_the_pipelines_block_calls_copy_nothing_on_cpu(monkeypatch: pytest.MonkeyPatch, fresh_seed: int) -> None:
    """The CPU op reads q, k, v, out, dout and lse by their strides: a block's call copies none of them (a per-block
    copy of dout and lse was most of the chunked pipeline's extra cost over one call on the whole sequence)."""
    kernel = _CopyCountingKernel()
    monkeypatch.setattr("lightning_fpdt.attention.get_kernel", lambda *_: kernel)
    q, k, v, dout = _qkv(torch.float32, fresh_seed, kv_heads=4, seq_q=64, seq_k=64)  # GQA's k/v expand is a copy
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    fpdt_attention(q, k, v, chunk_size=8, backend="sdpa").backward(dout)
    assert kernel.calls == 2 * 36  # 8 chunks: 36 causal blocks, forward and backward
    assert kernel.mode.copies == 0


class _OpCalls(TorchDispatchMode):
    """Counts the calls of torch's CPU attention backward op."""

    def __init__(self) -> None:
        super().__init__()
        self.backward = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.backward += func.overloadpacket.__name__ == "_scaled_dot_product_flash_attention_for_cpu_backward"
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("seq", "kv_heads", "v_width"), [(33, 4, 16), (129, 2, 16), (300, 1, 8)])
def test_sdpa_runs_a_causal_squares_backward_in_bands_on_cpu_exactly(
    seq: int, kv_heads: int, v_width: int, fresh_seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A causal square of more than ``causal_band`` rows: its backward on CPU is two op calls per band of keys but the
    last (the band's causal square, the rectangle below it), in float64 equal to the textbook formula (GQA, a v
    narrower than q) and to the one call."""
    monkeypatch.setattr(SdpaKernel, "causal_band", 16)
    q, k, v, dout = _qkv(torch.float64, fresh_seed, kv_heads=kv_heads, seq_q=seq, seq_k=seq)
    v, dout = v[..., :v_width], dout[..., :v_width]
    kernel = SdpaKernel()
    out, lse = kernel.forward(q, k, v, True, 0.25)
    with _OpCalls() as calls:
        grads = kernel.backward(dout, q, k, v, out, lse, True, 0.25)
    assert calls.backward == 2 * -(-seq // 16) - 1
    kernel.banded_rows = 0  # every causal square in one call
    one_call = kernel.backward(dout, q, k, v, out, lse, True, 0.25)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    ref_out, _ = naive_attention(q, k, v, True, 0.25)
    ref_out.backward(dout)
    for got, single, ref in zip(grads, one_call, (q.grad, k.grad, v.grad)):
        assert got.shape == ref.shape and got.dtype == ref.dtype
        assert rel_error(got, ref) <= 1e-12 and rel_error(got, single) <= 1e-12


@pytest.mark.parametrize(("dtype", "causal", "lower", "banded_rows", "calls"), [
    (torch.float32, True, None, 4096, 5),  # banded: 3 bands of 16 keys
    (torch.bfloat16, True, None, 4096, 1),  # bfloat16's op is slower in bands
    (torch.float32, False, None, 4096, 1),  # no diagonal
    (torch.float32, True, -7, 4096, 1),  # a window's edge: one masked call
    (torch.float32, True, None, 40, 1),  # a square over banded_rows: its diagonal is a small share
])
def test_sdpa_bands_only_the_causal_squares_it_gains_on(dtype, causal, lower, banded_rows, calls,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(SdpaKernel, "causal_band", 16)
    q, k, v, dout = _qkv(dtype, 0, seq_q=48, seq_k=48)
    kernel = SdpaKernel()
    kernel.banded_rows = banded_rows
    out, lse = kernel.forward(q, k, v, causal, 0.25, lower)
    with _OpCalls() as counted:
        kernel.backward(dout, q, k, v, out, lse, causal, 0.25, lower)
    assert counted.backward == calls


def test_fpdt_attention_on_sdpa_with_banded_diagonals_float64(fresh_seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The chunked pipeline on sdpa (one process, chunks of 64 rows, diagonal blocks' backward in bands of 16 keys)
    against the textbook formula in float64: loss side and every gradient."""
    monkeypatch.setattr(SdpaKernel, "causal_band", 16)
    q, k, v, dout = _qkv(torch.float64, fresh_seed, seq_q=192, seq_k=192, std=2.0)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    with _OpCalls() as calls:
        out = fpdt_attention(*leaves, chunk_size=64, backend="sdpa")
        out.backward(dout)
    assert calls.backward == 3 + 3 * 7  # 3 blocks below the diagonal, 3 diagonal ones in 4 bands
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    ref_out, _ = naive_attention(q, k, v, True)
    ref_out.backward(dout)
    for got, ref in zip((out, *(x.grad for x in leaves)), (ref_out, q.grad, k.grad, v.grad)):
        assert rel_error(got.detach(), ref.detach()) <= 1e-10
