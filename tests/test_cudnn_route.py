"""The ``cudnn`` route (cuDNN's fused attention through torch's aten op), checked on CPU as the other CUDA routes are
(``tests/test_cuda_calls.py``): each call on meta tensors against its schema and against torch's autograd formula,
which blocks it takes and which go on as ``sdpa`` runs them, and when ``auto`` picks it (no GPU is lent to check it
any other way)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from lightning_fpdt import backends
from lightning_fpdt.attention.fused_ops import contiguous_strides
from lightning_fpdt.attention.kernels import CudnnKernel, get_kernel
from tests.test_cuda_calls import (
    CUDNN,
    CUDNN_BWD,
    EFF,
    EFF_BWD,
    FLASH,
    FLASH_BWD,
    _bind,
    _check_fed_as_autograd_does,
    _Recorder,
)

CASES = [
    pytest.param(dtype, causal, kv_heads, head_dim, id=f"{str(dtype)[6:]}-{causal=}-kv{kv_heads}-d{head_dim}")
    for dtype in (torch.bfloat16, torch.float16)
    for causal in (True, False)
    for kv_heads in (4, 2)
    for head_dim in (16, 12)
]


def _run(kernel: CudnnKernel, dtype: torch.dtype, causal: bool, kv_heads: int, head_dim: int,
         **block: Any) -> tuple[_Recorder, tuple[torch.Tensor, ...]]:
    b, heads, s_q = 2, 4, 40  # 40: not a multiple of 128 (the lengths old cuDNN releases mishandle)
    s_k = s_q if causal or block.get("lower") is not None else 24
    q = torch.empty(b, s_q, heads, head_dim, dtype=dtype, device="meta")
    k = torch.empty(b, s_k, kv_heads, head_dim, dtype=dtype, device="meta")
    v, dout = torch.empty_like(k), torch.empty_like(q)
    with _Recorder() as rec:
        out, lse = kernel.forward(q, k, v, causal, 0.25, **block)
        grads = kernel.backward(dout, q, k, v, out, lse, causal, 0.25, **block)
    assert (out.shape, lse.shape, lse.dtype) == (q.shape, (b, heads, s_q), torch.float32)
    assert tuple(g.shape for g in grads) == (q.shape, k.shape, v.shape)
    return rec, (q, k, v)


@pytest.mark.parametrize("dtype, causal, kv_heads, head_dim", CASES)
def test_cudnn_calls_match_schemas_and_autograd(dtype: torch.dtype, causal: bool, kv_heads: int,
                                                head_dim: int) -> None:
    """Half precision, a whole or causal block: one cuDNN forward and its backward, fed what torch's autograd would
    feed it (the forward's output with its strides, its lse with the trailing 1, undefined cum_seq and bias, the
    sequence lengths), k/v at q's head count, a dense head dim that is a multiple of 8; the lse comes back
    ``[b, h, s_q]``."""
    rec, _ = _run(CudnnKernel(), dtype, causal, kv_heads, head_dim)
    assert [c.op for c in rec.calls] == [CUDNN, CUDNN_BWD]
    forward, backward = rec.calls
    fwd_in, bwd_in = _bind(forward), _bind(backward)
    assert (fwd_in["compute_log_sumexp"], fwd_in["dropout_p"], fwd_in["is_causal"], fwd_in["scale"]) == (
        True, 0.0, causal, 0.25)
    assert fwd_in["attn_bias"] is None and bwd_in["attn_bias"] is None
    assert forward.out[1].shape[-1] == 1 and bwd_in["logsumexp"].shape[-1] == 1  # cuDNN's trailing dimension
    _check_fed_as_autograd_does(forward, backward)
    for call_in in (fwd_in, bwd_in):
        assert call_in["key"].shape[1] == call_in["value"].shape[1] == 4  # GQA: k/v repeated to q's heads
        for name in ("query", "key", "value", "grad_out", "out"):
            if name in call_in:
                assert call_in[name].shape[-1] % 8 == 0 and call_in[name].stride(-1) == 1, name


@pytest.mark.parametrize("batch", [1, 2])
def test_cudnn_gets_one_layout_whatever_views_come_in(batch: int) -> None:
    """cuDNN caches a graph by q's, k's and v's sizes and strides alone and gives out and dout q's layout: a
    pipeline's chunks are views of a longer sequence (one batch row: a size-1 dim of another stride) one call and
    fresh tensors the next, so every tensor reaches the op with the exact strides of a fresh contiguous
    ``[b, s, h, d8]``, transposed, out and dout with q's (the views restrided, not copied, where they are dense)."""
    heads, kv_heads, s, d = 4, 2, 40, 16
    longer = [torch.empty(batch, 3 * s, n, d, dtype=torch.bfloat16, device="meta") for n in (heads, kv_heads,
                                                                                          kv_heads, heads)]
    q, k, v, dout = (x[:, s:2 * s] for x in longer)
    kernel = CudnnKernel()
    with _Recorder() as rec:
        out, lse = kernel.forward(q, k, v, True, 0.25)
        kernel.backward(dout, q, k, v, out, lse, True, 0.25)
    assert [c.op for c in rec.calls] == [CUDNN, CUDNN_BWD]
    for call_in in map(_bind, rec.calls):
        for name in ("query", "key", "value", "out", "grad_out"):
            if name in call_in:
                x = call_in[name]
                assert x.transpose(1, 2).stride() == contiguous_strides(x.transpose(1, 2).shape), (name, x.stride())
        if "out" in call_in:
            assert call_in["out"].stride() == call_in["grad_out"].stride() == call_in["query"].stride()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_what_cudnn_does_not_compute_goes_on_as_sdpa_runs_it(dtype: torch.dtype) -> None:
    """A window's edge (the memory-efficient op with the edge as a bias: cuDNN gets no mask), a softcap (math: no
    fused op caps), float32 (the memory-efficient op) and a head wider than 128 (the flash op) never reach cuDNN."""
    kernel = CudnnKernel()
    rec, _ = _run(kernel, dtype, False, 2, 16, lower=3)
    assert [c.op for c in rec.calls] == [EFF, EFF_BWD]
    rec, _ = _run(kernel, dtype, True, 2, 16, softcap=30.0)
    assert rec.calls == []
    if dtype == torch.float32:
        rec, _ = _run(kernel, dtype, True, 2, 16)
        assert [c.op for c in rec.calls] == [EFF, EFF_BWD]
    else:
        rec, _ = _run(kernel, dtype, True, 2, 160)
        assert [c.op for c in rec.calls] == [FLASH, FLASH_BWD]


def test_a_window_edge_square_reaches_cudnn_reversed() -> None:
    """An edge square of a sliding window (row a sees keys b >= a) runs as a causal call on reversed rows and keys:
    on cuDNN, as any causal block."""
    rec, _ = _run(CudnnKernel(), torch.bfloat16, False, 2, 16, lower=0)
    assert [c.op for c in rec.calls] == [CUDNN, CUDNN_BWD] and _bind(rec.calls[0])["is_causal"] is True


# ---- when auto picks it -----------------------------------------------------------------------------------


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """A pretend CUDA machine: its compute capability, loaded cuDNN and installed cuDNN wheel, as set in the dict."""
    machine: dict[str, Any] = {"capability": (9, 0), "cudnn": 91501, "wheel": "9.15.1.9"}

    def wheel_version(name: str) -> str:
        if machine["wheel"] is None or name != "nvidia-cudnn-cu12":
            raise backends.importlib.metadata.PackageNotFoundError(name)
        return machine["wheel"]

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: machine["capability"])
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: machine["cudnn"])
    monkeypatch.setattr(backends.importlib.metadata, "version", wheel_version)
    monkeypatch.setattr(backends, "flash_attn_available", lambda: False)
    backends.cudnn_unusable_reason.cache_clear()
    backends._say_once.cache_clear()
    yield machine
    backends.cudnn_unusable_reason.cache_clear()
    backends._say_once.cache_clear()


def test_auto_picks_cudnn_on_hopper_with_a_working_cudnn(gpu: dict[str, Any]) -> None:
    assert isinstance(get_kernel("auto", torch.device("cuda"), torch.bfloat16), CudnnKernel)
    assert get_kernel("auto", torch.device("cuda"), torch.float32).name == "sdpa"  # cuDNN's route is half precision
    assert get_kernel("auto", torch.device("cpu"), torch.bfloat16).name == "sdpa"
    assert backends.route_description("auto", "cuda", torch.bfloat16) == (
        f"cudnn (cuDNN 9.15.1 through torch {torch.__version__}, sm90; the blocks its op declines: sdpa (torch"
        f" {torch.__version__}'s FlashAttention-2 op))")


@pytest.mark.parametrize("machine, reason", [
    ({"capability": (8, 0)}, "the GPU is sm80, and cuDNN attention is picked on Hopper (sm90) and newer"),
    ({"cudnn": 91400, "wheel": "9.14.0.64"}, "the loaded cuDNN is 9.14.0; releases before 9.15.1 mishandle lengths"),
    ({"cudnn": 90100, "wheel": "9.15.1.9"}, "the loaded cuDNN is 9.1.0 (the 9.15.1 wheel is installed: a cuDNN"
                                            " earlier on the library path, LD_LIBRARY_PATH, shadows it)"),
])
def test_auto_says_once_why_it_does_not_pick_cudnn(gpu: dict[str, Any], machine: dict[str, Any], reason: str,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    gpu.update(machine)
    with caplog.at_level("INFO"):
        for _ in range(3):  # every attention call asks
            assert get_kernel("auto", torch.device("cuda"), torch.bfloat16).name == "sdpa"
    said = [r.getMessage() for r in caplog.records if "cuDNN's attention" in r.getMessage()]
    assert len(said) == 1 and reason in said[0], said
    with pytest.raises(ValueError, match=r"attention_backend='cudnn' but " + re.escape(reason)):
        get_kernel("cudnn", torch.device("cuda"), torch.bfloat16)


def test_cudnn_is_refused_where_it_cannot_run(gpu: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"'cudnn' but cuDNN attention runs on CUDA devices, not cpu"):
        get_kernel("cudnn", torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ValueError, match=r"'cudnn' but it computes in float16/bfloat16, not torch.float32"):
        get_kernel("cudnn", torch.device("cuda"), torch.float32)


def test_cudnn_release_numbers() -> None:
    assert backends._cudnn_release(91501) == (9, 15, 1)
    assert backends._cudnn_release(90100) == (9, 1, 0)
    assert backends._cudnn_release(8902) == (8, 9, 2)


def test_cudnn_needs_half_precision_in_lightnings_terms(gpu: dict[str, Any]) -> None:
    from lightning_fpdt.options import check_attention_backend

    check_attention_backend("cudnn", "cuda", "bf16-mixed")
    with pytest.raises(ValueError, match=r"attention_backend='cudnn' needs float16/bfloat16 attention inputs, but"
                                         r" precision='32-true'\. Use precision='bf16-mixed'"):
        check_attention_backend("cudnn", "cuda", "32-true")


def test_the_route_is_said_in_words() -> None:
    """What the strategy logs at setup beside ``attention_backend``: the route and its library."""
    version = torch.__version__
    assert backends.route_description("auto", "cpu", torch.float32) == f"sdpa (torch {version}'s cpu flash kernel)"
    assert backends.route_description("math", "cpu", torch.float64) == "math (torch matrix products)"


# ---- every block's kernel, said: the first step's tally -----------------------------------------------------


@pytest.mark.parametrize("dtype, head_dim, block, said", [
    (torch.bfloat16, 16, {}, ("cudnn", "")),
    (torch.bfloat16, 16, {"lower": 0}, ("cudnn", "")),  # a square on a window's edge: reversed, a causal call
    (torch.bfloat16, 16, {"softcap": 30.0}, ("math", "cuDNN's op cannot cap the scores (softcap)")),
    (torch.bfloat16, 16, {"lower": -3}, ("sdpa: memory-efficient op", "cuDNN's op takes no window edge")),
    (torch.float16, 192, {}, ("sdpa: FlashAttention-2 op", "head width 192 is over cuDNN's 128")),
    (torch.float32, 16, {}, ("sdpa: memory-efficient op",
                             "cuDNN's op takes float16/bfloat16 on CUDA, not torch.float32 on meta")),
])
def test_each_block_notes_the_kernel_it_ran_on_and_why(dtype: torch.dtype, head_dim: int, block: dict[str, Any],
                                                       said: tuple[str, str]) -> None:
    """What the strategy says after the first step: cuDNN's route, or the kernel a block went to and why."""
    from lightning_fpdt.attention import routes

    q = torch.empty(2, 40, 4, head_dim, dtype=dtype, device="meta")
    with routes.tally() as counts:
        CudnnKernel().forward(q, q, q, "lower" not in block, 0.25, **block)
    assert counts == {said: 1}
    assert routes.describe(counts) == f"{said[0]}: 1 call" + (f" ({said[1]})" if said[1] else "")
    CudnnKernel().forward(q, q, q, "lower" not in block, 0.25, **block)  # no tally open: nothing kept
    assert counts == {said: 1}


def test_tallies_nest_and_the_first_batch_is_said_once() -> None:
    from lightning_fpdt.attention import routes

    with routes.tally() as outer:
        routes.note("cudnn")
        with routes.tally() as inner:  # equal counts to the outer one when it closes: removed by identity
            routes.note("cudnn")
        routes.note("math", "softcap")
    routes.note("cudnn")  # none open: kept by none
    assert inner == {("cudnn", ""): 1} and outer == {("cudnn", ""): 2, ("math", "softcap"): 1}
    assert routes.describe(outer) == "cudnn: 2 calls; math: 1 call (softcap)"
    said: list[str] = []
    first = routes.FirstStep()
    for _ in range(3):
        with first.watch(said.append):
            routes.note("cudnn")
    assert said == ["cudnn: 1 call"] and first.said == "cudnn: 1 call"
    quiet = routes.FirstStep()
    with quiet.watch(said.append):  # no attention through the kernels: nothing to say
        pass
    assert quiet.said is None and said == ["cudnn: 1 call"]


def test_a_window_edge_square_stays_on_cudnn_beside_a_fallback() -> None:
    """A square on a window's edge is reversed into a causal call cuDNN's op takes, whether or not a FlashAttention
    package would take the blocks cuDNN declines; only those go to the package."""
    from lightning_fpdt.attention import routes

    class Refusing:  # a fallback that must not be asked
        def forward_declined(self, *args: Any) -> Any:
            raise AssertionError("a window edge square went to the fallback")

        backward = forward_declined

    rec, _ = _run(CudnnKernel(Refusing()), torch.bfloat16, False, 2, 16, lower=0)
    assert [c.op for c in rec.calls] == [CUDNN, CUDNN_BWD]
    q = torch.empty(2, 40, 4, 16, dtype=torch.bfloat16, device="meta")
    with routes.tally() as counts, pytest.raises(AssertionError, match="went to the fallback"):
        CudnnKernel(Refusing()).forward(q, q, q, True, 0.25, softcap=30.0)  # a softcap does go there
    with routes.tally() as counts:
        CudnnKernel(Refusing()).forward(q, q, q, False, 0.25, lower=0)
    assert counts == {("cudnn", ""): 1}
