"""The CUDA attention calls, checked on CPU (no GPU is lent to check them any other way).

``SdpaKernel`` sends every tensor that is not on the CPU down its CUDA route, so meta tensors run that
route through the fused ops' meta functions. A dispatch mode records each fused op call, which is then
checked three ways:

- against ``torch.ops.aten.<op>.default._schema``: argument count, names and the type of every value;
- against torch's own autograd formula (``derivatives.yaml``, shipped in torchgen): every backward
  argument that the formula takes from the forward gets what the recorded forward returned. This is what
  keeps optionals that torch's CUDA code tests with ``defined()`` undefined (a defined ``cum_seq_q``
  selects the varlen kernel, a defined ``attn_bias`` is read as a bias) and hands the memory-efficient
  backward the lse padded as its forward returned it;
- against what the CUDA kernels require beyond the schema (head dim, native GQA, layouts).

flash-attn's private calls are checked the same way against a fake ``flash_attn_interface`` with the
signatures of the releases in ``FLASH_ATTN_REQUIREMENT``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torchgen
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_fpdt import backends
from lightning_fpdt.attention import kernels
from lightning_fpdt.attention.kernels import FlashAttnKernel, MathKernel, SdpaKernel, get_kernel
from tests.reference import flash_reference, rel_error

aten = torch.ops.aten
FLASH = aten._scaled_dot_product_flash_attention.default
FLASH_BWD = aten._scaled_dot_product_flash_attention_backward.default
EFF = aten._scaled_dot_product_efficient_attention.default
EFF_BWD = aten._scaled_dot_product_efficient_attention_backward.default
CUDNN = aten._scaled_dot_product_cudnn_attention.default
CUDNN_BWD = aten._scaled_dot_product_cudnn_attention_backward.default
BACKWARD_OF = {FLASH: FLASH_BWD, EFF: EFF_BWD, CUDNN: CUDNN_BWD}


@dataclass
class Call:
    op: Any
    args: tuple
    kwargs: dict
    out: Any


class _Recorder(TorchDispatchMode):
    """Records every call of the fused CUDA attention ops, with its arguments and what it returned."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Call] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (*BACKWARD_OF, *BACKWARD_OF.values()):
            self.calls.append(Call(func, args, dict(kwargs or {}), out))
        return out


# ---- checking one call against its schema ----------------------------------------------------------------


def _type_ok(value: Any, jit_type: Any, n: int | None) -> bool:
    kind = jit_type.kind()
    if kind == "OptionalType":
        return value is None or _type_ok(value, jit_type.getElementType(), n)
    if kind == "TensorType":
        # None is an undefined tensor, which a C++ `const Tensor&` may be (torch's autograd passes them)
        return value is None or isinstance(value, torch.Tensor)
    if kind in ("IntType", "SymIntType"):  # SymInt shows as int in Python schemas
        return isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool)
    if kind == "FloatType":
        return isinstance(value, float)
    if kind == "BoolType":
        return isinstance(value, bool)
    if kind == "ListType":
        items_ok = isinstance(value, (list, tuple)) and all(_type_ok(x, jit_type.getElementType(), None) for x in value)
        return items_ok and (n is None or len(value) == n)
    raise AssertionError(f"no check for schema type {jit_type}")


def _bind(call: Call) -> dict[str, Any]:
    """The call's arguments by schema name, after checking count, names and the type of every value."""
    schema = call.op._schema
    positional = [a for a in schema.arguments if not a.kwarg_only]
    assert len(call.args) <= len(positional), f"{schema.name}: {len(call.args)} positional args > {len(positional)}"
    bound = {a.name: value for a, value in zip(positional, call.args)}
    names = [a.name for a in schema.arguments]
    assert set(call.kwargs) <= set(names), f"{schema.name}: unknown keywords {set(call.kwargs) - set(names)}"
    assert not set(call.kwargs) & set(bound), f"{schema.name}: given twice {set(call.kwargs) & set(bound)}"
    bound.update(call.kwargs)
    for a in schema.arguments:
        if a.name not in bound:
            assert a.has_default_value(), f"{schema.name}: argument {a.name} missing"
            bound[a.name] = a.default_value
        assert _type_ok(bound[a.name], a.type, a.N), f"{schema.name}: {a.name}={bound[a.name]!r} is not a {a.type}"
    return bound


# ---- torch's autograd formula: which backward argument is which forward input or output -------------------


def _autograd_formula(forward_op: Any) -> list[str]:
    """The backward's argument expressions in derivatives.yaml, e.g. ``['grad', 'query', ..., 'cum_seq_q', ...]``."""
    text = (Path(torchgen.__file__).parent / "packaged" / "autograd" / "derivatives.yaml").read_text()
    name = forward_op._schema.name.split("::")[1]
    entry = re.search(rf"^- name: {name}\(.*?\n((?:  .*\n)+)", text, re.MULTILINE)
    assert entry is not None, f"{name} not in derivatives.yaml"
    formula = re.search(r"^  query, key, value(?:, attn_bias)?: \w+\((.*)\)$", entry[1], re.MULTILINE)
    assert formula is not None, entry[1]
    return [x.strip() for x in formula[1].split(",")]


def _same(received: Any, expected: Any, *, strides: bool) -> bool:
    if expected is None or received is None:
        return expected is None and received is None
    if isinstance(expected, torch.Tensor):
        same = isinstance(received, torch.Tensor) and received.shape == expected.shape
        return same and received.dtype == expected.dtype and (not strides or received.stride() == expected.stride())
    return received == expected


def _check_fed_as_autograd_does(forward: Call, backward: Call) -> None:
    """Each backward argument is what torch's autograd would pass: the forward's input or output of that name."""
    fwd_in, bwd_in = _bind(forward), _bind(backward)
    fwd_out = dict(zip([r.name for r in forward.op._schema.returns], forward.out))
    formula = _autograd_formula(forward.op)
    assert len(formula) == len(backward.op._schema.arguments), formula
    wrong = []
    for arg, expr in zip(backward.op._schema.arguments, formula):
        received = bwd_in[arg.name]
        if expr == "grad":  # the output's gradient has the output's shape
            ok, expected, what = _same(received, fwd_out["output"], strides=False), fwd_out["output"], "returned output"
        elif expr == "grad_input_mask":  # no gradient for a bias there is none of
            ok, expected, what = received == [True, True, True, False], [True, True, True, False], "needs"
        elif expr in fwd_out:
            # strides too: the efficient backward reads `out` and the lse with the forward's layout
            expected, what = fwd_out[expr], f"returned {expr}"
            ok = _same(received, expected, strides=isinstance(received, torch.Tensor))
        else:
            ok, expected, what = _same(received, fwd_in[expr], strides=False), fwd_in[expr], f"took {expr}"
        if not ok:
            wrong.append(f"{arg.name} is {_describe(received)}, but the forward {what} = {_describe(expected)}")
    assert not wrong, f"{backward.op._schema.name}:\n  " + "\n  ".join(wrong)


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a defined tensor {tuple(x.shape)} {x.dtype} stride {x.stride()}"
    return repr(x)


# ---- the sdpa kernel's CUDA routes on meta tensors --------------------------------------------------------

CASES = [
    pytest.param(dtype, causal, kv_heads, head_dim, id=f"{str(dtype)[6:]}-{causal=}-kv{kv_heads}-d{head_dim}")
    for dtype in (torch.bfloat16, torch.float16, torch.float32)
    for causal in (True, False)
    for kv_heads in (4, 2)
    for head_dim in (16, 12)
]


@pytest.mark.parametrize("dtype, causal, kv_heads, head_dim", CASES)
def test_sdpa_cuda_calls_match_schemas_and_autograd(
    dtype: torch.dtype, causal: bool, kv_heads: int, head_dim: int
) -> None:
    b, heads, s_q = 2, 4, 40  # 40 queries: the efficient op pads its lse to 64
    s_k = s_q if causal else 24
    q = torch.empty(b, s_q, heads, head_dim, dtype=dtype, device="meta")
    k = torch.empty(b, s_k, kv_heads, head_dim, dtype=dtype, device="meta")
    v, dout = torch.empty_like(k), torch.empty_like(q)
    kernel = SdpaKernel()
    with _Recorder() as rec:
        out, lse = kernel.forward(q, k, v, causal, 0.25)
        dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, causal, 0.25)
    assert (out.shape, lse.shape, lse.dtype) == (q.shape, (b, heads, s_q), torch.float32)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)

    forward_op = FLASH if dtype in (torch.float16, torch.bfloat16) else EFF
    assert [c.op for c in rec.calls] == [forward_op, BACKWARD_OF[forward_op]]
    forward, backward = rec.calls
    fwd_in, bwd_in = _bind(forward), _bind(backward)
    assert len(forward.out) == len(forward_op._schema.returns)
    assert (fwd_in["dropout_p"], fwd_in["is_causal"], fwd_in["scale"]) == (0.0, causal, 0.25)
    assert (bwd_in["dropout_p"], bwd_in["is_causal"], bwd_in["scale"]) == (0.0, causal, 0.25)
    _check_fed_as_autograd_does(forward, backward)
    if forward_op is FLASH:
        # native GQA: k/v keep their head count; the kernels need a dense head dim that is a multiple of 8
        assert fwd_in["key"].shape[1] == bwd_in["key"].shape[1] == kv_heads
        for call_in in (fwd_in, bwd_in):
            for name in ("query", "key", "value", "grad_out", "out"):
                if name in call_in:
                    assert call_in[name].shape[-1] % 8 == 0 and call_in[name].stride(-1) == 1, name
        assert bwd_in["cum_seq_q"] is None and bwd_in["cum_seq_k"] is None
        assert (bwd_in["max_q"], bwd_in["max_k"]) == (s_q, s_k)
    else:
        assert fwd_in["key"].shape[1] == bwd_in["key"].shape[1] == heads  # the efficient op needs equal heads
        assert fwd_in["attn_bias"] is None and bwd_in["attn_bias"] is None
        assert forward.out[1].shape[-1] == bwd_in["logsumexp"].shape[-1] == 64


WINDOW_CASES = [
    pytest.param(dtype, causal, kv_heads, head_dim, id=f"{str(dtype)[6:]}-{causal=}-kv{kv_heads}-d{head_dim}")
    for dtype in (torch.bfloat16, torch.float16, torch.float32)
    for causal in (True, False)
    for kv_heads in (4, 2)
    for head_dim in (16, 12)
]


@pytest.mark.parametrize("dtype, causal, kv_heads, head_dim", WINDOW_CASES)
def test_sdpa_cuda_window_edge_goes_to_the_efficient_op_with_a_bias(
    dtype: torch.dtype, causal: bool, kv_heads: int, head_dim: int
) -> None:
    """A cut block (a window's edge, ``lower``): the memory-efficient op in every dtype (the flash op takes no
    mask), with the edge as an ``attn_bias`` [b, h, s_q, s_k] of the query dtype whose rows start at multiples of
    16 elements, fed to the backward as torch's autograd would, the head dim padded to a multiple of 8."""
    b, heads, s_q = 2, 4, 40
    # a trimmed rectangle of blocks.BlockRules: the last row still sees a key (lower <= s_k - s_q)
    s_k, lower = (s_q, -5) if causal else (24, -20)
    q = torch.empty(b, s_q, heads, head_dim, dtype=dtype, device="meta")
    k = torch.empty(b, s_k, kv_heads, head_dim, dtype=dtype, device="meta")
    v, dout = torch.empty_like(k), torch.empty_like(q)
    with _Recorder() as rec:
        out, lse = SdpaKernel().forward(q, k, v, causal, 0.25, lower)
        dq, dk, dv = SdpaKernel().backward(dout, q, k, v, out, lse, causal, 0.25, lower)
    assert (out.shape, lse.shape, lse.dtype) == (q.shape, (b, heads, s_q), torch.float32)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert [c.op for c in rec.calls] == [EFF, EFF_BWD]
    forward, backward = rec.calls
    fwd_in, bwd_in = _bind(forward), _bind(backward)
    assert (fwd_in["is_causal"], bwd_in["is_causal"]) == (causal, causal)
    _check_fed_as_autograd_does(forward, backward)
    bias = fwd_in["attn_bias"]
    assert bias is not None and bias.shape == (b, heads, s_q, s_k) and bias.dtype == dtype
    assert bias.stride(-1) == 1 and bias.stride(-2) % 16 == 0
    # the backward's is built by the same call (efficient_bias), so equal in content; here: in layout
    assert (bwd_in["attn_bias"].shape, bwd_in["attn_bias"].stride()) == (bias.shape, bias.stride())
    for call_in in (fwd_in, bwd_in):
        for name in ("query", "key", "value", "grad_out_", "out"):
            if name in call_in:
                assert call_in[name].shape[-1] % 8 == 0 and call_in[name].stride(-1) == 1, name


def test_sdpa_cuda_softcap_runs_the_math_kernel() -> None:
    """The fused ops cannot cap the scores: a softcapped block calls none of them."""
    q = torch.empty(1, 8, 2, 16, dtype=torch.bfloat16, device="meta")
    with _Recorder() as rec:
        out, lse = SdpaKernel().forward(q, q, q, True, 0.25, None, 50.0)
        SdpaKernel().backward(q, q, q, q, out, lse, True, 0.25, None, 50.0)
    assert rec.calls == []


def test_float64_on_cuda_stays_off_the_fused_ops() -> None:
    q = torch.empty(1, 8, 2, 16, dtype=torch.float64, device="meta")
    with _Recorder() as rec:
        out, lse = SdpaKernel().forward(q, q, q, True, 0.25)
        SdpaKernel().backward(q, q, q, q, out, lse, True, 0.25)
    assert rec.calls == []


# ---- flash-attn's private calls against the signatures of FLASH_ATTN_REQUIREMENT ------------------------


def _fake_flash_attn_interface(calls: list[tuple[str, int, tuple[str, ...]]],
                               variants: list[tuple[int, int, float]] | None = None) -> ModuleType:
    """flash-attn 2.7-2.8's ``_flash_attn_forward``/``_flash_attn_backward`` (their signatures and return arity,
    no defaults where the releases have none), computed by :func:`flash_reference`, recording how they are
    called (and, in ``variants``, each call's ``(window_size_left, window_size_right, softcap)``)."""
    variants = [] if variants is None else variants

    def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                            softcap, alibi_slopes, return_softmax):
        assert (dropout_p, alibi_slopes, return_softmax) == (0.0, None, False)
        assert isinstance(softcap, float) and softcap >= 0.0
        assert all(x.shape[-1] % 8 == 0 and x.stride(-1) == 1 for x in (q, k, v))
        assert q.shape[-1] == k.shape[-1] == v.shape[-1]  # flash-attn 2 takes one head_size (its CHECK_SHAPE of v)
        variants.append((window_size_left, window_size_right, softcap))
        out, lse = flash_reference(q, k, v, softmax_scale, causal, window_size_left, window_size_right, softcap)
        return out, lse.float(), torch.empty(0, dtype=q.dtype), torch.empty(2, dtype=torch.int64)

    def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                             window_size_left, window_size_right, softcap, alibi_slopes, deterministic, rng_state=None):
        assert (dropout_p, alibi_slopes, deterministic) == (0.0, None, False)
        assert softmax_lse.dtype == torch.float32 and softmax_lse.shape == (q.shape[0], q.shape[2], q.shape[1])
        assert [x.shape for x in (dq, dk, dv)] == [q.shape, k.shape, v.shape]
        assert all(x.shape[-1] % 8 == 0 and x.stride(-1) == 1 for x in (dout, q, k, v, out, dq, dk, dv))
        assert len({x.shape[-1] for x in (dout, q, k, v, out)}) == 1  # one head_size
        variants.append((window_size_left, window_size_right, softcap))
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        ref_out, _ = flash_reference(*leaves, softmax_scale, causal, window_size_left, window_size_right, softcap)
        grads = torch.autograd.grad(ref_out, leaves, dout)  # a whole block: its own lse is the row's
        for buf, grad in zip((dq, dk, dv), grads):
            buf.copy_(grad)
        return torch.empty(q.shape[0], q.shape[2], q.shape[1])  # softmax_d

    def recorded(fn):
        def call(*args, **kwargs):
            calls.append((fn.__name__, len(args), tuple(sorted(kwargs))))
            return fn(*args, **kwargs)
        return call

    module = ModuleType("flash_attn.flash_attn_interface")
    module._flash_attn_forward = recorded(_flash_attn_forward)
    module._flash_attn_backward = recorded(_flash_attn_backward)
    return module


# How this module calls them: positional count and keyword names.
FLASH_ATTN_CALLS = [
    ("_flash_attn_forward", 5,
     ("alibi_slopes", "causal", "return_softmax", "softcap", "window_size_left", "window_size_right")),
    ("_flash_attn_backward", 17, ()),
]


@pytest.mark.parametrize("causal", [True, False])
def test_flash_attn_calls_match_the_supported_releases(causal: bool, fresh_seed: int) -> None:
    calls: list[tuple[str, int, tuple[str, ...]]] = []
    variants: list[tuple[int, int, float]] = []
    kernel = FlashAttnKernel(_fake_flash_attn_interface(calls, variants))
    g = torch.Generator().manual_seed(fresh_seed)
    # GQA and a head dim of 12: the kernel pads to 16 for flash-attn and slices back
    q, dout = (torch.randn(2, 10, 4, 12, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, 10, 2, 12, generator=g, dtype=torch.float64) for _ in range(2))
    out, lse = kernel.forward(q, k, v, causal, 0.3)
    grads = kernel.backward(dout, q, k, v, out, lse, causal, 0.3)
    assert calls == FLASH_ATTN_CALLS
    assert variants == [(-1, -1, 0.0)] * 2  # no window, no cap
    ref_out, ref_lse = MathKernel().forward(q, k, v, causal, 0.3)
    ref_grads = MathKernel().backward(dout, q, k, v, ref_out, ref_lse, causal, 0.3)
    assert rel_error(out, ref_out) <= 1e-12 and rel_error(lse, ref_lse) <= 1e-6  # flash-attn's lse is float32
    for a, b in zip(grads, ref_grads):
        assert a.shape == b.shape and rel_error(a, b) <= 1e-6  # the float32 lse again


# (rows, keys, causal, lower, softcap): rectangles blocks.BlockRules makes, against flash-attn's own window rule
FLASH_VARIANTS = [
    pytest.param(10, 10, True, -3, None, id="diagonal-window"),
    pytest.param(7, 7, False, 0, None, id="trimmed-off-diagonal-window"),
    pytest.param(10, 6, False, -4, None, id="tall-rectangle-window"),
    pytest.param(4, 10, False, 2, None, id="wide-rectangle-window"),
    pytest.param(10, 10, True, None, 5.0, id="diagonal-softcap"),
    pytest.param(10, 8, False, -2, 5.0, id="window-and-softcap"),
]


@pytest.mark.parametrize(("s_q", "s_k", "causal", "lower", "softcap"), FLASH_VARIANTS)
def test_flash_attn_window_and_softcap_mean_what_flash_attn_computes(
    s_q: int, s_k: int, causal: bool, lower: int | None, softcap: float | None, fresh_seed: int
) -> None:
    """``window_size``/``softcap`` passed so that flash-attn's definition of them (bottom-right aligned windows)
    gives what the math kernel computes for the block's edge and cap, forward and backward."""
    calls: list[tuple[str, int, tuple[str, ...]]] = []
    variants: list[tuple[int, int, float]] = []
    kernel = FlashAttnKernel(_fake_flash_attn_interface(calls, variants))
    g = torch.Generator().manual_seed(fresh_seed)
    q, dout = (torch.randn(2, s_q, 4, 12, generator=g, dtype=torch.float64) * 3 for _ in range(2))
    k, v = (torch.randn(2, s_k, 2, 12, generator=g, dtype=torch.float64) * 3 for _ in range(2))
    out, lse = kernel.forward(q, k, v, causal, 0.3, lower, softcap)
    grads = kernel.backward(dout, q, k, v, out, lse, causal, 0.3, lower, softcap)
    assert calls == FLASH_ATTN_CALLS and variants[0] == variants[1]
    assert variants[0][2] == (softcap or 0.0) and (variants[0][0] == -1) == (lower is None)
    ref_out, ref_lse = MathKernel().forward(q, k, v, causal, 0.3, lower, softcap)
    ref_grads = MathKernel().backward(dout, q, k, v, ref_out, ref_lse, causal, 0.3, lower, softcap)
    assert rel_error(out, ref_out) <= 1e-12 and rel_error(lse, ref_lse) <= 1e-6  # flash-attn's lse is float32
    for a, b in zip(grads, ref_grads):
        assert a.shape == b.shape and rel_error(a, b) <= 1e-10


def test_flash_attn_refuses_a_window_edge_that_leaves_rows_without_keys() -> None:
    q = torch.zeros(1, 10, 2, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"lower=1 on a 10 x 10 block leaves its last rows without keys"):
        FlashAttnKernel(_fake_flash_attn_interface([])).forward(q, q, q, False, 0.3, 1)


# ---- selecting flash-attn: import it, check its version, fall back ------------------------------------


class _BrokenExtension(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A flash_attn package that is installed but whose CUDA extension fails to load."""

    def find_spec(self, name, path=None, target=None):
        if name == "flash_attn":
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise ImportError("flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEi")


class _NotInstalled(importlib.abc.MetaPathFinder):
    """No flash_attn package on this machine, whatever is installed."""

    def find_spec(self, name, path=None, target=None):
        if name == "flash_attn":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


@pytest.fixture
def no_flash_attn_imported(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """A fresh look for flash-attn (the kernels remember the first one per process) in a patched world."""
    for name in ("flash_attn", "flash_attn.flash_attn_interface"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    backends.load_flash_attn.cache_clear()
    yield monkeypatch
    backends.load_flash_attn.cache_clear()  # the next test sees this machine's flash-attn, not the patched one


def _install_fake_flash_attn(monkeypatch: pytest.MonkeyPatch, version: str) -> ModuleType:
    package = ModuleType("flash_attn")
    package.__version__ = version
    package.__path__ = []
    interface = _fake_flash_attn_interface([])
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", interface)
    return interface


CUDA = torch.device("cuda")


def test_flash_attn_whose_extension_fails_to_import_falls_back_to_sdpa(
    no_flash_attn_imported: pytest.MonkeyPatch,
) -> None:
    no_flash_attn_imported.setattr(sys, "meta_path", [_BrokenExtension(), *sys.meta_path])
    assert kernels.flash_attn_available() is False
    assert "installed but does not import (ImportError: flash_attn_2_cuda.so: undefined symbol" in (
        kernels.flash_attn_unavailable_reason() or ""
    )
    assert get_kernel("auto", CUDA, torch.bfloat16).name == "sdpa"
    with pytest.raises(ValueError, match=r"'flash_attn' but the flash-attn package is installed but does not import"):
        get_kernel("flash_attn", CUDA, torch.bfloat16)


def test_missing_flash_attn_falls_back_to_sdpa(no_flash_attn_imported: pytest.MonkeyPatch) -> None:
    no_flash_attn_imported.setattr(sys, "meta_path", [_NotInstalled(), *sys.meta_path])
    assert kernels.flash_attn_unavailable_reason() == "the flash-attn package is not installed"
    assert get_kernel("auto", CUDA, torch.float16).name == "sdpa"
    with pytest.raises(ValueError, match=r"the flash-attn package is not installed; install the 'flash' extra"):
        get_kernel("flash_attn", CUDA, torch.float16)


@pytest.mark.parametrize("version", ["2.6.3", "2.9.0", "3.0.0b1", "unknown"])
def test_flash_attn_outside_the_supported_releases_falls_back_to_sdpa(
    no_flash_attn_imported: pytest.MonkeyPatch, version: str
) -> None:
    _install_fake_flash_attn(no_flash_attn_imported, version)
    assert kernels.flash_attn_available() is False
    assert f"flash-attn {version} is installed" in (kernels.flash_attn_unavailable_reason() or "")
    assert get_kernel("auto", CUDA, torch.bfloat16).name == "sdpa"
    with pytest.raises(ValueError, match=rf"flash-attn {re.escape(version)} is installed.*flash-attn>=2\.7,<2\.9"):
        get_kernel("flash_attn", CUDA, torch.bfloat16)


@pytest.mark.parametrize("version", ["2.7.0", "2.7.4.post1", "2.8.3"])
def test_supported_flash_attn_is_picked_by_auto(no_flash_attn_imported: pytest.MonkeyPatch, version: str) -> None:
    interface = _install_fake_flash_attn(no_flash_attn_imported, version)
    assert kernels.flash_attn_unavailable_reason() is None
    kernel = get_kernel("auto", CUDA, torch.bfloat16)
    assert isinstance(kernel, FlashAttnKernel) and kernel._fa is interface
    assert get_kernel("auto", CUDA, torch.float32).name == "sdpa"  # flash-attn has no float32


def test_flash_extra_declares_the_checked_range() -> None:
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert re.search(r"^flash = \[(.*)\]$", pyproject, re.MULTILINE)[1] == f'"{kernels.FLASH_ATTN_REQUIREMENT}"'
