"""Attention kernels behind one interface, each returning the log-sum-exp the FPDT merge needs.

Every backend implements::

    forward(q, k, v, causal, scale, lower=None, softcap=None) -> (out, lse)
    backward(dout, q, k, v, out, lse, causal, scale, lower=None, softcap=None) -> (dq, dk, dv)

with ``q`` ``[batch, seq_q, heads, head_dim]``, ``k`` ``[batch, seq_k, kv_heads, head_dim]`` and ``v``
``[batch, seq_k, kv_heads, v_head_dim]`` (``heads`` a multiple of ``kv_heads``; ``v_head_dim`` any width:
multi-head latent attention's v is narrower than q and k), ``out`` ``[batch, seq_q, heads, v_head_dim]``,
``lse`` ``[batch, heads, seq_q]`` in
float32 (float64 for float64 inputs). ``causal`` is only used on diagonal blocks, where
``seq_q == seq_k``. ``backward`` takes the *final* ``out`` and ``lse`` of the whole row (after the
online merge over all key blocks, attention sinks included), which is what makes per-block backward exact.

``lower`` is a sliding window's edge inside the block (``lightning_fpdt.attention.blocks``): row ``a``
sees key ``b`` only if ``b - a >= lower``; every row must see at least one key. ``softcap`` is Gemma-2's
attention-logit cap, ``cap * tanh(s / cap)`` on the scaled scores ``s`` before the softmax. ``math``
computes both; ``sdpa`` is handed a cut rectangle in unmasked pieces (``edge_band``: its fused ops compute
every pair of a masked call) and runs a softcapped block on ``math`` (its fused ops cannot cap), in bands of
query rows that bound its scores (``math_kernel.MATH_BAND_SCORES``); ``flash_attn`` passes ``window_size`` and
``softcap``. ``math`` computes a v of another width directly; the fused ops take one head width, so ``sdpa`` and
``flash_attn`` pad q, k and v with zero columns to a common one (``fused_ops.common_head_dim``: exact, the zero
columns add nothing to a score and the output's and gradients' padded columns are sliced off).

Backends: ``math`` (pure torch, any dtype: the reference, :mod:`lightning_fpdt.attention.math_kernel`), ``sdpa``
(torch's fused kernels through the aten ops that return the log-sum-exp), ``cudnn`` (cuDNN's fused attention
through torch's aten op, on Hopper and newer, for the blocks it computes exactly; every other block on an installed
FlashAttention package or as ``sdpa`` runs it), ``flash_attn``, ``flash_attn_3`` and ``flash_attn_4`` (the
FlashAttention packages 2, 3 and 4, CUDA, when installed: :mod:`lightning_fpdt.attention.flash_kernels`).

The fused CUDA ops, GQA's key/value heads as each op takes them and the edge's mask are in ``fused_ops``.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from lightning_fpdt.attention import routes
from lightning_fpdt.attention.flash_kernels import Fallback, FlashAttn3Kernel, FlashAttn4Kernel
from lightning_fpdt.attention.flash_kernels import FlashAttnKernel as FlashAttnKernel
from lightning_fpdt.attention.flash_kernels import flash_window as flash_window
from lightning_fpdt.attention.fused_ops import (
    CUDNN_MAX_HEAD_DIM,
    check_shapes,
    common_head_dim,
    cudnn_op_backward,
    cudnn_op_forward,
    cudnn_op_takes,
    dense_head_dim,
    edge_bias,
    efficient_bias,
    efficient_op_backward,
    efficient_op_forward,
    flash_op_backward,
    flash_op_forward,
    repeat_kv,
    sum_kv_grad,
)
from lightning_fpdt.attention.math_kernel import MathKernel as MathKernel
from lightning_fpdt.attention.math_kernel import accumulate_dtype as accumulate_dtype

# the backend rules (names, flash-attn's availability, what runs where) live in lightning_fpdt.backends, which
# configuration reads without loading a kernel; the names tests and callers know here are re-exported (`as`)
from lightning_fpdt.backends import BACKENDS as BACKENDS
from lightning_fpdt.backends import FLASH_ATTN_REQUIREMENT as FLASH_ATTN_REQUIREMENT
from lightning_fpdt.backends import FLASH_ATTN_VERSIONS as FLASH_ATTN_VERSIONS
from lightning_fpdt.backends import HALF_DTYPES, flash_route, resolve_backend
from lightning_fpdt.backends import flash_attn_available as flash_attn_available
from lightning_fpdt.backends import flash_attn_unavailable_reason as flash_attn_unavailable_reason
from lightning_fpdt.errors import FPDTError


def check_softcap(softcap: float | None) -> None:
    """Raises ``ValueError`` for an attention-logit cap that is not a positive number (``None``: no cap)."""
    if softcap is not None and not softcap > 0:
        raise FPDTError(f"fpdt_attention: softcap={softcap}; the attention-logit cap must be positive (Gemma-2"
                        " uses 50.0). Use None for no cap.")


class AttentionKernel(Protocol):
    name: str
    # rows per band when cut rectangles reach the kernel as blocks.unmasked_pieces (None: the kernel takes
    # the window edge itself, as a mask or flash-attn's window_size)
    edge_band: int | None

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, lower: int | None = None,
        softcap: float | None = None,
    ) -> tuple[Tensor, Tensor]: ...

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float,
        lower: int | None = None, softcap: float | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]: ...


class SdpaKernel:
    """torch's fused attention through the aten ops that return the log-sum-exp.

    CPU: ``_scaled_dot_product_flash_attention_for_cpu`` (any float dtype). Any other device (CUDA, and
    meta, whose shape functions mirror CUDA's): the flash op for float16/bfloat16, with k/v at their own
    head count (it supports GQA, as torch's sdpa with ``enable_gqa`` relies on), and the memory-efficient
    op for float32, which needs equal head counts; float64 falls back to ``math``.

    A window's edge (``lower``) reaches it cut into pieces (``blocks.unmasked_pieces``): whole rectangles,
    causal squares, and squares on the edge (``lower=0``, row ``a`` sees keys ``b >= a``), which run as causal
    calls on reversed rows and keys, since these ops compute every pair of a masked call. Any other edge (a
    window shorter than ``blocks.MIN_BAND``, a direct call) is an additive mask: to the CPU op, and on CUDA
    to the memory-efficient op (the flash op takes none) for every dtype it runs. A softcapped block runs
    on ``math``, in bands of query rows (:meth:`~lightning_fpdt.attention.math_kernel.MathKernel.forward_in_bands`):
    none of these ops can cap the scores.
    """

    name = "sdpa"
    # torch's CPU op tiles 256 query rows from 768 rows on (64 below), and those tiles ran 2-4x slower per pair
    # (1024 rows: 9-12 ns forward, 36-42 ns backward; 512 rows: 4.4 and 11.6), and a causal call saves only
    # whole 512-key tiles. One training step over causal's (fpdt_attention, 2 heads of 64, one thread, the
    # shared 2-core machine), bands of the window's height / 512 / 256 rows: 8K tokens, window 512, chunks of
    # 1024: 0.35 / 0.35 / 0.29; 16K, 1024, 2048: 0.26 / 0.23 / 0.23. On CUDA a shorter band only adds calls,
    # and any band beats the mask, which costs the whole rectangle.
    edge_band = 256
    # torch's CPU op computes a causal call's diagonal in whole tiles (256 rows x 512 keys from 768 rows on, 64 x 512
    # below), a third to a half of the pairs it computes there masked. A causal square's backward in column bands of
    # 128 keys (cpu_op_backward) took 0.68 / 0.79 / 0.88 / 0.96x the one call's time at 512 / 1024 / 2048 / 4096
    # rows, and 1.02x at 8192 (4 heads of 64, float32, one thread; bands of 256: 0.75-0.99x, 1.00x at 8192); the
    # pipeline's diagonal blocks are such squares. bfloat16's op ran 1.2-1.8x slower in bands; the forward's bands
    # would need merging, which ate most of the gain (1024 rows: 8.2 against 8.4 ms).
    causal_band = 128
    banded_rows = 4096  # causal squares of more rows run as one call

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, lower: int | None = None,
        softcap: float | None = None,
    ) -> tuple[Tensor, Tensor]:
        check_shapes(q, k, v, causal)
        return self.forward_declined(q, k, v, causal, scale, lower, softcap)

    def forward_declined(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, lower: int | None, softcap: float | None,
        declined: str = "",
    ) -> tuple[Tensor, Tensor]:
        """The forward as ``sdpa`` runs it, noting its route (:mod:`routes`) with why the block is not on the op it
        would take, or (``declined``) why the run's own route did not take it (cuDNN's op, FlashAttention-4)."""
        if softcap is not None or (q.device.type != "cpu" and q.dtype not in (*HALF_DTYPES, torch.float32)):
            own = "softcap" if softcap is not None else f"{q.dtype} on {q.device.type}"
            routes.note("math", declined or own)
            return MathKernel().forward_in_bands(q, k, v, causal, scale, lower, softcap)
        if _edge_triangle(q, k, causal, lower):  # reversed, keys b >= a become b <= a: a causal call, no mask
            out, lse = self.forward(q.flip(1), k.flip(1), v.flip(1), True, scale)  # a subclass's op may take it
            return out.flip(1), lse.flip(-1)
        masked = "a window's edge as a mask" if lower is not None else ""
        if q.device.type == "cpu":
            routes.note("sdpa: torch's cpu flash kernel", declined or masked)
            h, width = q.shape[2], common_head_dim(q, v, multiple=1)
            # aten wants [b, h, s, d], q, k and v of one width (it refuses "Q/K/V should have the same head size")
            qt, kt, vt = (dense_head_dim(x, width).transpose(1, 2) for x in (q, repeat_kv(k, h), repeat_kv(v, h)))
            mask = None if lower is None else edge_bias(q.shape[1], k.shape[1], lower, q.dtype, q.device)
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                qt, kt, vt, 0.0, causal, attn_mask=mask, scale=scale
            )
            return out.transpose(1, 2)[..., :v.shape[-1]], lse
        if q.dtype in HALF_DTYPES and lower is None:
            routes.note("sdpa: FlashAttention-2 op", declined)
            return flash_op_forward(q, k, v, causal, scale)
        routes.note("sdpa: memory-efficient op", declined or masked)
        return efficient_op_forward(q, k, v, causal, scale, efficient_bias(q, k, lower))

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float,
        lower: int | None = None, softcap: float | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        check_shapes(q, k, v, causal)
        if softcap is not None or (q.device.type != "cpu" and q.dtype not in (*HALF_DTYPES, torch.float32)):
            return MathKernel().backward_in_bands(dout, q, k, v, out, lse, causal, scale, lower, softcap)
        if _edge_triangle(q, k, causal, lower):
            dq, dk, dv = self.backward(*(x.flip(1) for x in (dout, q, k, v, out)), lse.flip(-1), True, scale)
            return dq.flip(1), dk.flip(1), dv.flip(1)
        if q.device.type == "cpu":
            h, g, width = q.shape[2], k.shape[2], common_head_dim(q, v, multiple=1)
            qt, kt, vt, ot, dot = (dense_head_dim(x, width).transpose(1, 2)
                                   for x in (q, repeat_kv(k, h), repeat_kv(v, h), out, dout.to(q.dtype)))
            # the op reads dout and lse by their strides, as it reads q, k, v and out (dense_head_dim made each row
            # of head_dim dense): copying both for every block was 72 copies of an 8-chunk step
            lse = lse.to(accumulate_dtype(q.dtype))
            mask = None if lower is None else edge_bias(q.shape[1], k.shape[1], lower, q.dtype, q.device)
            rows = q.shape[1]
            banded = causal and mask is None and q.dtype in CPU_BANDED_DTYPES
            banded = banded and self.causal_band < rows <= self.banded_rows
            dq, dk, dv = cpu_op_backward(dot, qt, kt, vt, ot, lse, causal, mask, scale,
                                         self.causal_band if banded else None)
            d, dv_width = q.shape[-1], v.shape[-1]
            dq, dk, dv = (x.transpose(1, 2)[..., :n] for x, n in ((dq, d), (dk, d), (dv, dv_width)))
            return dq, sum_kv_grad(dk, g), sum_kv_grad(dv, g)
        if q.dtype in HALF_DTYPES and lower is None:
            return flash_op_backward(dout, q, k, v, out, lse, causal, scale)
        return efficient_op_backward(dout, q, k, v, out, lse, causal, scale, efficient_bias(q, k, lower))


class CudnnKernel(SdpaKernel):
    """cuDNN's fused attention (``aten._scaled_dot_product_cudnn_attention`` and its backward, with the log-sum-exp),
    on the blocks it computes exactly: whole and causal rectangles in float16/bfloat16 of one padded head width of
    at most 128. A window's edge reaches it in the unmasked pieces ``sdpa`` cuts (``edge_band``); a softcapped block,
    another dtype or a wider head runs on ``fallback`` (``get_kernel`` gives the FlashAttention package ``auto``
    would take without cuDNN, :func:`~lightning_fpdt.backends.flash_route`) or, without one, as :class:`SdpaKernel`
    runs it, block by block, noted with the reason (:mod:`routes`). Picked by ``auto`` on Hopper
    and newer where the loaded cuDNN works (:func:`lightning_fpdt.backends.cudnn_unusable_reason`)."""

    name = "cudnn"

    def __init__(self, fallback: Fallback | None = None) -> None:
        self._fallback = fallback  # None: as sdpa runs them

    @staticmethod
    def _declines(q: Tensor, v: Tensor, lower: int | None, softcap: float | None) -> str:
        """Why cuDNN's op does not take this block (``""``: it does)."""
        if softcap is not None:
            return "cuDNN's op cannot cap the scores (softcap)"
        if lower is not None:
            return "cuDNN's op takes no window edge"
        if q.device.type == "cpu" or q.dtype not in HALF_DTYPES:
            return f"cuDNN's op takes float16/bfloat16 on CUDA, not {q.dtype} on {q.device.type}"
        if not cudnn_op_takes(q, v):
            return f"head width {common_head_dim(q, v)} is over cuDNN's {CUDNN_MAX_HEAD_DIM}"
        return ""

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, lower: int | None = None,
        softcap: float | None = None,
    ) -> tuple[Tensor, Tensor]:
        check_shapes(q, k, v, causal)
        declined = self._declines(q, v, lower, softcap)
        if declined:
            return self._declined_to(q, k, causal, lower, softcap).forward_declined(q, k, v, causal, scale, lower,
                                                                                    softcap, declined)
        routes.note(self.name)
        return cudnn_op_forward(q, k, v, causal, scale)

    def _declined_to(
        self, q: Tensor, k: Tensor, causal: bool, lower: int | None, softcap: float | None
    ) -> Fallback:
        """Where a declined block goes, forward and backward alike: a square on a window's edge to ``sdpa``'s path,
        which reverses it into a causal call this op takes; any other to the fallback, if any."""
        if self._fallback is None or (softcap is None and _edge_triangle(q, k, causal, lower)):
            return super()
        return self._fallback

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float,
        lower: int | None = None, softcap: float | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        if self._declines(q, v, lower, softcap):
            return self._declined_to(q, k, causal, lower, softcap).backward(dout, q, k, v, out, lse, causal, scale,
                                                                            lower, softcap)
        check_shapes(q, k, v, causal)
        return cudnn_op_backward(dout, q, k, v, out, lse, causal, scale)


CPU_BANDED_DTYPES = (torch.float32, torch.float64)  # the dtypes whose CPU backward gains from bands


def cpu_op_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, mask: Tensor | None,
    scale: float, band: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """torch's CPU op's backward on ``[b, h, s, d]`` tensors (k and v at q's head count): ``(dq, dk, dv)``.

    ``band``: a causal square's backward in column bands of ``band`` keys, two calls each: the band's causal square on
    the diagonal, and the whole rectangle of every row below it. Together they cover each pair the square sees once
    (key ``c`` of a band is seen by its square's rows from ``c`` on and by every row below the square); each call
    reads its rows' final ``out`` and ``lse``, so the gradients are the calls' sums. Each band's dk and dv are final
    after its two calls; dq's rows are summed over the bands.
    """
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    if band is None:
        return op(dout, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale)

    def call(rows: slice, keys: slice, square: bool) -> tuple[Tensor, Tensor, Tensor]:
        return op(dout[:, :, rows], q[:, :, rows], k[:, :, keys], v[:, :, keys], out[:, :, rows], lse[:, :, rows], 0.0,
                  square, scale=scale)

    n = q.shape[2]
    # [b, s, h, d] underneath, as the caller hands them on (transposed back): contiguous there, as the op's are
    dq, dk, dv = (torch.empty(x.shape[0], x.shape[2], x.shape[1], x.shape[3], dtype=x.dtype, device=x.device)
                  .transpose(1, 2) for x in (q, k, v))
    for b0 in range(0, n, band):
        keys, below = slice(b0, b0 + band), slice(b0 + band, n)
        first = b0 == 0  # the first band's calls are the first to reach every row of dq
        g_q, g_k, g_v = call(keys, keys, True)
        if first:
            dq[:, :, keys] = g_q
        else:
            dq[:, :, keys] += g_q
        if b0 + band >= n:  # no row below the last band
            dk[:, :, keys], dv[:, :, keys] = g_k, g_v
            break
        r_q, r_k, r_v = call(below, keys, False)
        if first:
            dq[:, :, below] = r_q
        else:
            dq[:, :, below] += r_q
        torch.add(g_k, r_k, out=dk[:, :, keys])
        torch.add(g_v, r_v, out=dv[:, :, keys])
    return dq, dk, dv


def _edge_triangle(q: Tensor, k: Tensor, causal: bool, lower: int | None) -> bool:
    """Whether the block is a square on a window's lower edge: row ``a`` sees exactly the keys ``b >= a``."""
    return lower == 0 and not causal and q.shape[1] == k.shape[1]


def get_kernel(backend: str, device: torch.device, dtype: torch.dtype) -> AttentionKernel:
    """The kernel :func:`resolve_backend` picks for this device and dtype.

    Raises:
        ValueError: unknown backend name, or one that cannot run on this device or dtype.
    """
    name = resolve_backend(backend, device.type, dtype)
    if name == "math":
        return MathKernel()
    if name == "cudnn":  # the blocks cuDNN's op declines go where auto would go without it: a package, or sdpa
        fallback = flash_route(device.type)
        return CudnnKernel(None if fallback == "sdpa" else _kernel(fallback))
    return _kernel(name)


def _kernel(name: str) -> AttentionKernel:
    if name == "sdpa":
        return SdpaKernel()
    if name == "flash_attn_3":
        return FlashAttn3Kernel()
    if name == "flash_attn_4":
        return FlashAttn4Kernel(fallback=SdpaKernel())
    return FlashAttnKernel()
