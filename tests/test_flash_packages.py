"""The FlashAttention-3 and -4 routes, checked on CPU against fakes with the packages' interfaces.

No GPU and neither package here, so each fake has the argument list of the package's private functions as
flash-attention's sources define them (FlashAttention-3's ``hopper/flash_attn_interface.py`` of release 3.0.0,
registered as ``torch.library`` custom ops as the package registers them; FlashAttention-4's
``flash_attn/cute/interface.py``) and computes attention by flash-attn's own definition
(:func:`tests.reference.flash_reference`, bottom-right aligned windows, the cap), reading each argument by name: an
argument passed under another name fails to bind, one passed in the wrong place computes something else. Checked:
forward and backward against the math kernel on every block shape ``blocks.BlockRules`` makes, the keywords each
route passes against :data:`lightning_fpdt.backends.FLASH_PACKAGES`, the interface check that loading makes, and
when ``auto`` picks each route.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import Tensor

from lightning_fpdt import backends
from lightning_fpdt.attention.flash_kernels import FlashAttn3Kernel, FlashAttn4Kernel
from lightning_fpdt.attention.kernels import MathKernel, get_kernel
from lightning_fpdt.attention.merge import update_out_and_lse
from tests.reference import flash_block_backward, flash_reference, rel_error

Opt = Tensor | None
CUDA = torch.device("cuda")


def _width_checks(*xs: Tensor) -> None:
    assert len({x.shape[-1] for x in xs}) == 1 and all(x.shape[-1] % 8 == 0 and x.stride(-1) == 1 for x in xs)


# ---- FlashAttention-3 3.0.0: hopper/flash_attn_interface.py's two ops --------------------------------------

@torch.library.custom_op("fpdt_fake_fa3::_flash_attn_forward", mutates_args=())
def _fa3_forward(
    q: Tensor, k: Tensor, v: Tensor, k_new: Opt = None, v_new: Opt = None, qv: Opt = None, out_: Opt = None,
    cu_seqlens_q: Opt = None, cu_seqlens_k: Opt = None, cu_seqlens_k_new: Opt = None, seqused_q: Opt = None,
    seqused_k: Opt = None, max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
    page_table: Opt = None, kv_batch_idx: Opt = None, leftpad_k: Opt = None, rotary_cos: Opt = None,
    rotary_sin: Opt = None, seqlens_rotary: Opt = None, q_descale: Opt = None, k_descale: Opt = None,
    v_descale: Opt = None, softmax_scale: float | None = None, causal: bool = False, window_size_left: int = -1,
    window_size_right: int = -1, attention_chunk: int = 0, softcap: float = 0.0, rotary_interleaved: bool = True,
    scheduler_metadata: Opt = None, num_splits: int = 1, pack_gqa: bool | None = None, sm_margin: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    _width_checks(q, k, v)
    out, lse = flash_reference(q, k, v, softmax_scale, causal, window_size_left, window_size_right, softcap)
    return out.to(q.dtype), lse.float(), torch.empty(0), torch.empty(0)


@torch.library.custom_op("fpdt_fake_fa3::_flash_attn_backward", mutates_args=("dq", "dk", "dv"))
def _fa3_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor, cu_seqlens_q: Opt = None,
    cu_seqlens_k: Opt = None, sequed_q: Opt = None, sequed_k: Opt = None, max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None, dq: Opt = None, dk: Opt = None, dv: Opt = None,
    softmax_scale: float | None = None, is_causal: bool = False, window_size_left: int = -1,
    window_size_right: int = -1, softcap: float = 0.0, deterministic: bool = False, sm_margin: int = 0,
) -> Tensor:
    _width_checks(dout, q, k, v, out, dq, dk, dv)
    assert softmax_lse.dtype == torch.float32 and softmax_lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    assert [x.shape for x in (dq, dk, dv)] == [q.shape, k.shape, v.shape]  # k/v at their own head count
    grads = flash_block_backward(dout, q, k, v, out, softmax_lse, softmax_scale, is_causal, window_size_left,
                                 window_size_right, softcap)
    for buf, grad in zip((dq, dk, dv), grads, strict=True):
        buf.copy_(grad)
    return torch.empty(q.shape[0], q.shape[2], q.shape[1])  # softmax_d


class _Recorded:
    """A package function that records the keywords each call passes, with the signature (a plain function's) or
    the ``_opoverload`` (an op's) that the interface check reads."""

    def __init__(self, function: Any, name: str, calls: list[tuple[str, int, tuple[str, ...]]]) -> None:
        self.function, self.name, self.calls = function, name, calls
        if hasattr(function, "_opoverload"):
            self._opoverload = function._opoverload
        else:
            self.__signature__ = inspect.signature(function)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((self.name, len(args), tuple(sorted(kwargs))))
        return self.function(*args, **kwargs)


def _fake_module(name: str, functions: dict[str, Any], calls: list | None) -> ModuleType:
    """A package's interface module whose functions record their calls into ``calls``."""
    module = ModuleType(name)
    calls = [] if calls is None else calls
    for attribute, function in functions.items():
        setattr(module, attribute, _Recorded(function, attribute, calls))
    return module


def fake_fa3(calls: list | None = None) -> ModuleType:
    functions = {"_flash_attn_forward": _fa3_forward, "_flash_attn_backward": _fa3_backward}
    return _fake_module("flash_attn_interface", functions, calls)


# ---- FlashAttention-4: flash_attn/cute/interface.py's two functions (plain Python) -------------------------

def _fa4_fwd(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
             max_seqlen_q=None, max_seqlen_k=None, min_seqlen_k=None, page_table=None, softmax_scale=None,
             causal=False, softcap=None, window_size_left=None, window_size_right=None, learnable_sink=None,
             tile_mn=None, mma_pv_is_rs=None, intra_wg_overlap=None, num_threads=384, num_splits=1, pack_gqa=None,
             _arch=None, score_mod=None, mask_mod=None, block_sparse_tensors=None, return_lse=False, out=None,
             lse=None, aux_tensors=None, aux_scalars=None, q_descale=None, k_descale=None, v_descale=None,
             gather_kv_indices=None, scheduler_metadata=None, seqlen_k_per_split=None,
             disable_scheduler_metadata=False):
    _width_checks(q, k, v)
    assert return_lse  # without it and without a gradient to take, the package returns no lse
    softcap = 0.0 if softcap is None else softcap
    left, right = (-1 if x is None else x for x in (window_size_left, window_size_right))
    out, lse = flash_reference(q, k, v, softmax_scale, causal, left, right, softcap)
    return out.to(q.dtype), lse.float(), None, None  # (out, lse, p, row_max) since 2026


def _fa4_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0, window_size_left=None,
             window_size_right=None, m_block_size=64, n_block_size=128, num_threads=256, pack_gqa=False,
             num_stages_Q=2, num_stages_dO=2, SdP_swapAB=False, dKV_swapAB=False, dQ_swapAB=False,
             AtomLayoutMSdP=2, AtomLayoutNdKV=2, AtomLayoutMdQ=2, V_in_regs=False, cu_seqlens_q=None,
             cu_seqlens_k=None, seqused_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None,
             deterministic=False, dq=None, dk=None, dv=None, score_mod=None, score_mod_bwd=None, mask_mod=None,
             aux_tensors=None, aux_scalars=None, block_sparse_tensors=None, dlse=None, learnable_sink=None):
    _width_checks(dout, q, k, v, out)
    assert lse.dtype == torch.float32 and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    left, right = (-1 if x is None else x for x in (window_size_left, window_size_right))
    return flash_block_backward(dout, q, k, v, out, lse, softmax_scale, causal, left, right, softcap)


def fake_fa4(calls: list | None = None) -> ModuleType:
    return _fake_module("flash_attn.cute.interface", {"_flash_attn_fwd": _fa4_fwd, "_flash_attn_bwd": _fa4_bwd}, calls)


ROUTES = [pytest.param(FlashAttn3Kernel, fake_fa3, id="flash_attn_3"),
          pytest.param(FlashAttn4Kernel, fake_fa4, id="flash_attn_4")]

# (rows, keys, causal, lower, softcap, v's head width): the rectangles blocks.BlockRules makes
BLOCKS = [
    pytest.param(10, 10, True, None, None, 12, id="diagonal"),
    pytest.param(10, 14, False, None, None, 12, id="off-diagonal"),
    pytest.param(10, 10, True, -3, None, 12, id="diagonal-window"),
    pytest.param(7, 7, False, 0, None, 12, id="trimmed-off-diagonal-window"),
    pytest.param(10, 6, False, -4, None, 12, id="tall-rectangle-window"),
    pytest.param(4, 10, False, 2, None, 12, id="wide-rectangle-window"),
    pytest.param(10, 10, True, None, 5.0, 12, id="diagonal-softcap"),
    pytest.param(10, 8, False, -2, 5.0, 12, id="window-and-softcap"),
    pytest.param(10, 10, True, None, None, 6, id="narrower-v"),
]


@pytest.mark.parametrize(("kernel_class", "fake"), ROUTES)
@pytest.mark.parametrize(("s_q", "s_k", "causal", "lower", "softcap", "dv"), BLOCKS)
def test_the_route_computes_each_block_as_math_does(
    kernel_class: type, fake: Any, s_q: int, s_k: int, causal: bool, lower: int | None, softcap: float | None,
    dv: int, fresh_seed: int,
) -> None:
    """Forward and backward of one block (GQA 4:2, head width 12 padded to 16) against the math kernel; the
    backward is handed its rows' final out and lse, as the pipeline hands them: the rows also see a second key
    block, merged in, so a route that passed the block's own out or lse (or none) would be wrong."""
    calls: list[tuple[str, int, tuple[str, ...]]] = []
    kernel = kernel_class(fake(calls))
    g = torch.Generator().manual_seed(fresh_seed)
    q, dout = (torch.randn(2, s_q, 4, n, generator=g, dtype=torch.float64) * 2 for n in (12, dv))
    k, k_more = (torch.randn(2, n, 2, 12, generator=g, dtype=torch.float64) * 2 for n in (s_k, 5))
    v, v_more = (torch.randn(2, n, 2, dv, generator=g, dtype=torch.float64) * 2 for n in (s_k, 5))
    math = MathKernel()
    out, lse = kernel.forward(q, k, v, causal, 0.3, lower, softcap)
    ref_out, ref_lse = math.forward(q, k, v, causal, 0.3, lower, softcap)
    assert out.shape == ref_out.shape and rel_error(out, ref_out) <= 1e-12
    assert lse.dtype == torch.float32 and rel_error(lse.double(), ref_lse) <= 1e-6  # the packages' lse is float32
    row_out, row_lse = update_out_and_lse(ref_out, ref_lse, *math.forward(q, k_more, v_more, False, 0.3, None,
                                                                          softcap))
    grads = kernel.backward(dout, q, k, v, row_out, row_lse, causal, 0.3, lower, softcap)
    ref_grads = math.backward(dout, q, k, v, row_out, row_lse, causal, 0.3, lower, softcap)
    for a, b in zip(grads, ref_grads, strict=True):
        assert a.shape == b.shape and rel_error(a, b) <= 1e-5  # exp(S - lse) with the float32 lse the route passes
    package = backends.FLASH_PACKAGES[kernel.name]
    assert calls == [(name, 0, tuple(sorted(passed))) for name, passed in package.calls]  # all by keyword


# ---- loading: the interface is checked, not a version number ---------------------------------------------


@pytest.mark.parametrize("fake", [fake_fa3, fake_fa4])
def test_the_fakes_have_the_interface_the_routes_call(fake: Any) -> None:
    package = next(p for p in backends.FLASH_PACKAGES.values() if p.module == fake().__name__)
    assert backends.interface_problem(fake(), package) is None


def test_an_interface_that_moved_is_named() -> None:
    module = fake_fa4()

    def renamed(q, k, v, out, dout, lse, softmax_scale=None, is_causal=False, softcap=0.0, window_size_left=None,
                window_size_right=None):
        raise AssertionError("never called")

    def needs_more(q, k, v, softmax_scale, causal, softcap, window_size_left, window_size_right, return_lse,
                   tile_mn):
        raise AssertionError("never called")

    module._flash_attn_bwd = renamed
    assert backends.interface_problem(module, backends.FLASH_ATTN_4) == (
        "its _flash_attn_bwd is not the one this route calls (it takes no causal)")
    module._flash_attn_fwd = needs_more
    assert backends.interface_problem(module, backends.FLASH_ATTN_4) == (
        "its _flash_attn_fwd is not the one this route calls (it requires tile_mn, which this route does not pass)")
    del module._flash_attn_fwd
    assert backends.interface_problem(module, backends.FLASH_ATTN_4) == (
        "flash_attn.cute.interface has no _flash_attn_fwd")


@pytest.fixture
def packages(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """A pretend CUDA machine whose cuDNN is too old for cuDNN's route, with the FlashAttention packages given in
    the dict (a module, an exception its import raises, or None: not installed)."""
    machine: dict[str, Any] = {"capability": (9, 0), "flash_attn_3": None, "flash_attn_4": None}
    real_import = backends.importlib.import_module

    def import_module(name: str) -> ModuleType:
        for backend, package in backends.FLASH_PACKAGES.items():
            if name == package.module:
                found = machine[backend]
                if found is None:  # FlashAttention-4's path misses below flash_attn where flash-attn 2 is installed
                    missing = "flash_attn.cute" if name.startswith("flash_attn.") else name.split(".")[0]
                    raise ModuleNotFoundError(f"No module named {missing!r}", name=missing)
                if isinstance(found, Exception):
                    raise found
                return found
        return real_import(name)

    monkeypatch.setattr(backends.importlib, "import_module", import_module)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: machine["capability"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(backends, "cudnn_unusable_reason", lambda device_type: "the loaded cuDNN is 9.1.0")
    monkeypatch.setattr(backends, "flash_attn_available", lambda: False)
    backends.load_flash_package.cache_clear()
    yield machine
    backends.load_flash_package.cache_clear()


@pytest.mark.parametrize(("installed", "capability", "picked"), [
    ((), (9, 0), "sdpa"),
    (("flash_attn_3",), (9, 0), "flash_attn_3"),
    (("flash_attn_4",), (9, 0), "flash_attn_4"),
    (("flash_attn_3", "flash_attn_4"), (9, 0), "flash_attn_3"),  # on Hopper its own build first
    (("flash_attn_3",), (8, 0), "sdpa"),  # the Hopper build's kernels run on sm80, but auto takes it on sm90 only
    (("flash_attn_3", "flash_attn_4"), (10, 0), "flash_attn_4"),
])
def test_auto_picks_an_installed_package_where_cudnn_is_not_usable(
    packages: dict[str, Any], installed: tuple[str, ...], capability: tuple[int, int], picked: str
) -> None:
    packages["capability"] = capability
    for backend in installed:
        packages[backend] = {"flash_attn_3": fake_fa3, "flash_attn_4": fake_fa4}[backend]()
    assert get_kernel("auto", CUDA, torch.bfloat16).name == picked
    assert get_kernel("auto", CUDA, torch.float32).name == "sdpa"  # they compute in half precision only


def test_each_route_is_refused_by_name_where_it_cannot_run(packages: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"attention_backend='flash_attn_3' but the FlashAttention-3 package"
                                         r" \(flash_attn_3\) is not installed; build it from flash-attention's"
                                         r" hopper/ directory"):
        get_kernel("flash_attn_3", CUDA, torch.bfloat16)
    with pytest.raises(ValueError, match=r"'flash_attn_4' but the FlashAttention-4 package \(flash-attn-4\) is not"
                                         r" installed; pip install 'lightning-fpdt\[flash4\]'"):
        get_kernel("flash_attn_4", CUDA, torch.bfloat16)
    backends.load_flash_package.cache_clear()
    packages["flash_attn_4"] = ImportError("libcuda.so.1: cannot open shared object file")
    with pytest.raises(ValueError, match=r"'flash_attn_4' but the FlashAttention-4 package is installed but does"
                                         r" not import \(ImportError: libcuda\.so\.1"):
        get_kernel("flash_attn_4", CUDA, torch.bfloat16)
    packages["flash_attn_4"], packages["flash_attn_3"] = fake_fa4(), fake_fa3()
    backends.load_flash_package.cache_clear()
    with pytest.raises(ValueError, match=r"'flash_attn_4' but FlashAttention-4 runs on CUDA devices, not cpu"):
        get_kernel("flash_attn_4", torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ValueError, match=r"'flash_attn_3' but it computes in float16/bfloat16, not torch\.float32"):
        get_kernel("flash_attn_3", CUDA, torch.float32)
    packages["capability"] = (10, 0)
    with pytest.raises(ValueError, match=r"'flash_attn_3' but the GPU is sm100, and FlashAttention-3 runs on"
                                         r" sm8x/sm9x"):
        get_kernel("flash_attn_3", CUDA, torch.bfloat16)
    assert isinstance(get_kernel("flash_attn_4", CUDA, torch.bfloat16), FlashAttn4Kernel)
    assert backends.route_description("flash_attn_4", "cuda", torch.bfloat16).startswith(
        "flash_attn_4 (FlashAttention-4 ")  # and the installed release, logged once at setup


def test_the_half_precision_rule_in_lightnings_terms(packages: dict[str, Any]) -> None:
    from lightning_fpdt.options import check_attention_backend

    packages["flash_attn_3"] = fake_fa3()
    check_attention_backend("flash_attn_3", "cuda", "bf16-mixed")
    with pytest.raises(ValueError, match=r"attention_backend='flash_attn_3' needs float16/bfloat16 attention inputs,"
                                         r" but precision='32-true'"):
        check_attention_backend("flash_attn_3", "cuda", "32-true")


def test_a_custom_ops_arguments_are_read_from_its_schema() -> None:
    """FlashAttention-3's functions are ``torch.library`` ops, whose Python signature says ``(*args, **kwargs)``."""
    arguments = backends._arguments(_fa3_backward)
    assert arguments is not None and list(arguments)[:6] == ["dout", "q", "k", "v", "out", "softmax_lse"]
    assert arguments["softmax_lse"] is False and arguments["is_causal"] is True  # required, has a default


def test_the_extra_and_the_backend_names_agree() -> None:
    from typing import get_args

    from lightning_fpdt.options import AttentionBackend

    assert get_args(AttentionBackend) == backends.BACKENDS
    assert set(backends.FLASH_PACKAGES) <= set(backends.HALF_ONLY_BACKENDS)


def test_auto_says_once_why_an_installed_package_is_not_used(packages: dict[str, Any],
                                                             caplog: pytest.LogCaptureFixture) -> None:
    module = fake_fa3()
    del module._flash_attn_backward  # a build whose interface moved
    packages["flash_attn_3"] = module
    backends._say_once.cache_clear()
    with caplog.at_level("INFO"):
        for _ in range(3):  # every attention call asks
            assert get_kernel("auto", CUDA, torch.bfloat16).name == "sdpa"
    said = [r.getMessage() for r in caplog.records if "FlashAttention-3" in r.getMessage()]
    assert said == ["FPDTStrategy: FlashAttention-3 is not used: FlashAttention-3 ? is installed, but"
                    " flash_attn_interface has no _flash_attn_backward."], said
    backends._say_once.cache_clear()


@pytest.mark.parametrize(("width", "softcap", "declined"), [
    (192, None, "head width 192: FlashAttention-4 on sm10x takes up to 128, or 256"),
    (256, 30.0, "FlashAttention-4 on sm10x caps no scores at head width 256"),
])
def test_flash_attn_4_hands_blackwell_the_blocks_it_takes(width: int, softcap: float | None, declined: str) -> None:
    """On sm100 FlashAttention-4's kernels take head widths up to 128 or of 256 without a cap: any other block runs
    on ``sdpa`` with the reason noted, or is refused by name without a fallback."""
    from lightning_fpdt.attention import routes
    from lightning_fpdt.attention.kernels import SdpaKernel

    calls: list[tuple[str, int, tuple[str, ...]]] = []
    q = torch.randn(1, 8, 2, width, dtype=torch.float64)
    with routes.tally() as counts:
        out, lse = FlashAttn4Kernel(fake_fa4(calls), fallback=SdpaKernel(), major=10).forward(q, q, q, True, 0.1,
                                                                                             softcap=softcap)
        FlashAttn4Kernel(fake_fa4(calls), major=10).forward(q[..., :128], q[..., :128], q[..., :128], True, 0.1)
    assert calls == [("_flash_attn_fwd", 0, tuple(sorted(backends.FLASH_ATTN_4.calls[0][1])))]  # the 128 only
    assert counts == {("math" if softcap else "sdpa: torch's cpu flash kernel", declined): 1, ("flash_attn_4", ""): 1}
    ref_out, ref_lse = MathKernel().forward(q, q, q, True, 0.1, None, softcap)
    assert rel_error(out, ref_out) <= 1e-12 and rel_error(lse, ref_lse) <= 1e-12
    with pytest.raises(ValueError, match=rf"attention_backend='flash_attn_4': {declined}; use attention_backend="):
        FlashAttn4Kernel(fake_fa4(), major=10).forward(q, q, q, True, 0.1, softcap=softcap)



def test_the_blocks_cudnn_declines_go_where_auto_would_go_without_it(packages: dict[str, Any],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A softcapped block (Gemma-2's) on a cuDNN run, with FlashAttention-3 installed: FlashAttention-3 computes it
    in one call, forward and backward, noted with cuDNN's reason; without a package it would go to ``math``."""
    from lightning_fpdt.attention import routes
    from lightning_fpdt.attention.kernels import CudnnKernel

    calls: list[tuple[str, int, tuple[str, ...]]] = []
    packages["flash_attn_3"] = fake_fa3(calls)
    monkeypatch.setattr(backends, "cudnn_unusable_reason", lambda device_type: None)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91501)
    kernel = get_kernel("auto", CUDA, torch.bfloat16)
    assert isinstance(kernel, CudnnKernel) and isinstance(kernel._fallback, FlashAttn3Kernel)
    assert backends.route_description("auto", "cuda", torch.bfloat16).endswith(
        "sm90; the blocks its op declines: flash_attn_3 (FlashAttention-3 ?, sm90))")
    g = torch.Generator().manual_seed(3)
    q, dout = (torch.randn(1, 12, 4, 16, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, 12, 2, 16, generator=g, dtype=torch.float64) for _ in range(2))
    with routes.tally() as counts:
        out, lse = kernel.forward(q, k, v, True, 0.25, softcap=20.0)
    grads = kernel.backward(dout, q, k, v, out, lse, True, 0.25, softcap=20.0)
    assert counts == {("flash_attn_3", "cuDNN's op cannot cap the scores (softcap)"): 1}
    assert [name for name, *_ in calls] == ["_flash_attn_forward", "_flash_attn_backward"]
    ref_out, ref_lse = MathKernel().forward(q, k, v, True, 0.25, None, 20.0)
    ref_grads = MathKernel().backward(dout, q, k, v, ref_out, ref_lse, True, 0.25, None, 20.0)
    assert rel_error(out, ref_out) <= 1e-12
    for a, b in zip(grads, ref_grads, strict=True):
        assert rel_error(a, b) <= 1e-5  # the float32 lse the package is handed


@pytest.mark.parametrize("route", ["flash_attn_3", "flash_attn_4", "cudnn+flash_attn_3"])
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (10, None), (10, 20.0)])
def test_the_chunked_pipeline_on_each_route_is_attention(route: str, window: int | None, softcap: float | None,
                                                         fresh_seed: int) -> None:
    """64 tokens in 8 chunks through the pipeline (offloaded store, online merge, per-block backward from the rows'
    final out and lse) on each package's fake, and on cuDNN's route handing its declined blocks to FlashAttention-3
    (here every block: CPU float64), against attention by the textbook formula: forward and every gradient."""
    from lightning_fpdt.attention.kernels import CudnnKernel
    from lightning_fpdt.attention.pipeline import PipelineOptions, run_pipeline
    from lightning_fpdt.attention.sources import TensorEnds

    kernel = {"flash_attn_3": lambda: FlashAttn3Kernel(fake_fa3()),
              "flash_attn_4": lambda: FlashAttn4Kernel(fake_fa4()),
              "cudnn+flash_attn_3": lambda: CudnnKernel(FlashAttn3Kernel(fake_fa3()))}[route]()
    seq, scale = 64, 0.3
    g = torch.Generator().manual_seed(fresh_seed)
    q, dout = (torch.randn(1, seq, 4, 16, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, seq, 2, 16, generator=g, dtype=torch.float64) for _ in range(2))
    opt = PipelineOptions.for_chunk_size(None, 8, causal=True, scale=scale, kernel=kernel, offload=True,
                                         window=window, softcap=softcap)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, _ = run_pipeline(TensorEnds(kv_heads=2), opt, *leaves)
    out.backward(dout)
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref, _ = flash_reference(*ref_leaves, scale, True, -1 if window is None else window - 1, -1, softcap or 0.0)
    ref.backward(dout)
    assert rel_error(out.detach(), ref.detach()) <= 1e-6  # the packages' float32 lse in the merge
    for a, b in zip(leaves, ref_leaves, strict=True):
        assert rel_error(a.grad, b.grad) <= 1e-5
