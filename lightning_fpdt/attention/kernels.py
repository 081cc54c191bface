"""Attention kernels behind one interface, each returning the log-sum-exp the FPDT merge needs.

Every backend implements::

    forward(q, k, v, causal, scale) -> (out, lse)
    backward(dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv)

with ``q`` ``[batch, seq_q, heads, head_dim]``, ``k``/``v`` ``[batch, seq_k, kv_heads, head_dim]``
(``heads`` a multiple of ``kv_heads``), ``out`` like ``q``, ``lse`` ``[batch, heads, seq_q]`` in
float32 (float64 for float64 inputs). ``causal`` is only used on diagonal blocks, where
``seq_q == seq_k``. ``backward`` takes the *final* ``out`` and ``lse`` of the whole row (after the
online merge over all key blocks), which is what makes per-block backward exact.

Backends: ``math`` (pure torch, any dtype: the reference), ``sdpa`` (torch's fused kernels through
the aten ops that return the log-sum-exp), ``flash_attn`` (the flash-attn package, CUDA).

Each fused CUDA backward op gets what its forward op returned, as torch's autograd formula passes it
(``derivatives.yaml``); tests/test_cuda_calls.py checks every call on meta tensors.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

# the backend rules (names, flash-attn's availability, what runs where) live in lightning_fpdt.backends, which
# configuration reads without loading a kernel; the names tests and callers know here are re-exported (`as`)
from lightning_fpdt.backends import BACKENDS as BACKENDS
from lightning_fpdt.backends import FLASH_ATTN_FIX, HALF_DTYPES, load_flash_attn, resolve_backend
from lightning_fpdt.backends import FLASH_ATTN_REQUIREMENT as FLASH_ATTN_REQUIREMENT
from lightning_fpdt.backends import FLASH_ATTN_VERSIONS as FLASH_ATTN_VERSIONS
from lightning_fpdt.backends import flash_attn_available as flash_attn_available
from lightning_fpdt.backends import flash_attn_unavailable_reason as flash_attn_unavailable_reason


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of softmax statistics and accumulators: float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _check_shapes(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(
            f"Attention expects q [batch, seq, heads, head_dim] and k, v of equal shape; got"
            f" q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}."
        )
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"{q.shape[2]} query heads are not a multiple of {k.shape[2]} key/value heads.")
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"A causal block must be square; got seq_q={q.shape[1]}, seq_k={k.shape[1]}.")


def _repeat_kv(x: Tensor, n_heads: int) -> Tensor:
    """``[b, s, g, d] -> [b, s, n_heads, d]``: query head ``i`` uses KV head ``i // (n_heads / g)``."""
    g = x.shape[2]
    return x if g == n_heads else x.repeat_interleave(n_heads // g, dim=2)


def _sum_kv_grad(dx: Tensor, kv_heads: int) -> Tensor:
    """Inverse of :func:`_repeat_kv` for gradients: sum over the query heads sharing a KV head."""
    b, s, h, d = dx.shape
    return dx if h == kv_heads else dx.view(b, s, kv_heads, h // kv_heads, d).sum(dim=3)


def _last_dim_contiguous(x: Tensor) -> Tensor:
    """The fused CUDA kernels take any strides except in the head dim."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _dense_head_dim(x: Tensor) -> Tensor:
    """Last dim contiguous and padded with zeros to a multiple of 8, as the flash kernels require.

    Zero columns change no score (the scale is always passed explicitly), give zero output columns and
    zero gradient columns; callers slice them off.
    """
    x = _last_dim_contiguous(x)
    d = x.shape[-1]
    return x if d % 8 == 0 else F.pad(x, (0, 8 - d % 8))


class AttentionKernel(Protocol):
    name: str

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]: ...

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]: ...


class MathKernel:
    """Plain torch attention in the accumulation dtype. The reference every other path is tested against."""

    name = "math"

    @staticmethod
    def _scores(q: Tensor, k: Tensor, causal: bool, scale: float) -> Tensor:
        acc = accumulate_dtype(q.dtype)
        # [b, h, s_q, s_k]
        s = torch.einsum("bqhd,bkhd->bhqk", q.to(acc), _repeat_kv(k, q.shape[2]).to(acc)) * scale
        if causal:
            mask = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device).triu(1)
            s = s.masked_fill(mask, float("-inf"))
        return s

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        _check_shapes(q, k, v, causal)
        s = self._scores(q, k, causal, scale)
        lse = torch.logsumexp(s, dim=-1)  # [b, h, s_q]
        p = torch.exp(s - lse.unsqueeze(-1))
        out = torch.einsum("bhqk,bkhd->bqhd", p, _repeat_kv(v, q.shape[2]).to(p.dtype))
        return out.to(q.dtype), lse

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        _check_shapes(q, k, v, causal)
        acc = accumulate_dtype(q.dtype)
        h, g = q.shape[2], k.shape[2]
        dout_, v_ = dout.to(acc), _repeat_kv(v, h).to(acc)
        # 1. P = exp(S - lse), with the row's final lse: the block's share of the full softmax.
        p = torch.exp(self._scores(q, k, causal, scale) - lse.to(acc).unsqueeze(-1))
        # 2. dV = P^T dO
        dv = torch.einsum("bhqk,bqhd->bkhd", p, dout_)
        # 3. dP = dO V^T
        dp = torch.einsum("bqhd,bkhd->bhqk", dout_, v_)
        # 4. dS = P * (dP - D), D = rowsum(dO * O) with the row's final output
        delta = (dout_ * out.to(acc)).sum(-1).transpose(1, 2)  # [b, h, s_q]
        ds = p * (dp - delta.unsqueeze(-1)) * scale
        # 5. dQ = dS K, dK = dS^T Q
        dq = torch.einsum("bhqk,bkhd->bqhd", ds, _repeat_kv(k, h).to(acc))
        dk = torch.einsum("bhqk,bqhd->bkhd", ds, q.to(acc))
        return dq, _sum_kv_grad(dk, g), _sum_kv_grad(dv, g)


def _efficient_lse_len(s_q: int) -> int:
    """Length of the lse the memory-efficient CUDA op returns for ``s_q`` queries (torch's meta function).

    The CUDA kernel pads it to a multiple of 32 and writes +inf in the padding, so that its backward can
    read whole 32-row tiles without bound checks; ROCm's kernel returns exactly ``s_q``.
    """
    return s_q if torch.version.hip else -(-s_q // 32) * 32


def _unused_rng_state(flash_op: bool, device: torch.device) -> tuple[Tensor, Tensor]:
    """The philox seed/offset pair a forward without dropout returns: its dtypes and shapes, unread contents.

    The CUDA backward reads them only when ``dropout_p > 0`` (flash: ``if (is_dropout) params.rng_state =
    ...``; efficient: ``if (use_dropout)``), but they must be defined tensors, as the forward's are: ROCm's
    backward takes their data pointer unconditionally.
    """
    if flash_op and not torch.version.hip:  # the flash op returns (rng_state uint64[2], unused uint64[])
        return torch.empty(2, dtype=torch.uint64, device=device), torch.empty((), dtype=torch.uint64, device=device)
    return torch.empty((), dtype=torch.int64, device=device), torch.empty((), dtype=torch.int64, device=device)


class SdpaKernel:
    """torch's fused attention through the aten ops that return the log-sum-exp.

    CPU: ``_scaled_dot_product_flash_attention_for_cpu`` (any float dtype). Any other device (CUDA, and
    meta, whose shape functions mirror CUDA's): the flash op for float16/bfloat16, with k/v at their own
    head count (it supports GQA, as torch's sdpa with ``enable_gqa`` relies on), and the memory-efficient
    op for float32, which needs equal head counts; float64 falls back to ``math``.
    """

    name = "sdpa"

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        _check_shapes(q, k, v, causal)
        if q.device.type == "cpu":
            h = q.shape[2]
            # aten wants [b, h, s, d]
            qt, kt, vt = (x.transpose(1, 2) for x in (q, _repeat_kv(k, h), _repeat_kv(v, h)))
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                qt, kt, vt, 0.0, causal, attn_mask=None, scale=scale
            )
            return out.transpose(1, 2), lse
        if q.dtype in HALF_DTYPES:
            return _flash_op_forward(q, k, v, causal, scale)
        if q.dtype == torch.float32:
            return _efficient_op_forward(q, k, v, causal, scale)
        return MathKernel().forward(q, k, v, causal, scale)

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        _check_shapes(q, k, v, causal)
        if q.device.type == "cpu":
            h, g = q.shape[2], k.shape[2]
            qt, kt, vt, ot, dot = (
                x.transpose(1, 2) for x in (q, _repeat_kv(k, h), _repeat_kv(v, h), out, dout.to(q.dtype))
            )
            lse = lse.to(accumulate_dtype(q.dtype)).contiguous()
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dot.contiguous(), qt, kt, vt, ot, lse, 0.0, causal, attn_mask=None, scale=scale
            )
            dq, dk, dv = (x.transpose(1, 2) for x in (dq, dk, dv))
            return dq, _sum_kv_grad(dk, g), _sum_kv_grad(dv, g)
        if q.dtype in HALF_DTYPES:
            return _flash_op_backward(dout, q, k, v, out, lse, causal, scale)
        if q.dtype == torch.float32:
            return _efficient_op_backward(dout, q, k, v, out, lse, causal, scale)
        return MathKernel().backward(dout, q, k, v, out, lse, causal, scale)


def _flash_op_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    d = q.shape[-1]
    qt, kt, vt = (_dense_head_dim(x).transpose(1, 2) for x in (q, k, v))  # [b, heads or kv_heads, s, d8]
    # -> (output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused, debug_attn_mask)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(qt, kt, vt, 0.0, causal, False, scale=scale)[:2]
    return out.transpose(1, 2)[..., :d], lse  # lse [b, h, s_q] float32


def _flash_op_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    d = q.shape[-1]
    dot, qt, kt, vt, ot = (_dense_head_dim(x.to(q.dtype)).transpose(1, 2) for x in (dout, q, k, v, out))
    rng_state, unused = _unused_rng_state(True, q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dot, qt, kt, vt, ot, lse.to(torch.float32).contiguous(),
        None, None,  # cum_seq_q/k: the dense forward returns them undefined; defined ones select the varlen kernel
        q.shape[1], k.shape[1],  # max_q/max_k: the dense forward returns the two sequence lengths
        0.0, causal, rng_state, unused, scale=scale,
    )
    return dq.transpose(1, 2)[..., :d], dk.transpose(1, 2)[..., :d], dv.transpose(1, 2)[..., :d]


def _efficient_op_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    s_q, h = q.shape[1], q.shape[2]
    # [b, h, s, d] with equal head counts
    qt, kt, vt = (_last_dim_contiguous(x).transpose(1, 2) for x in (q, _repeat_kv(k, h), _repeat_kv(v, h)))
    # -> (output, log_sumexp, philox_seed, philox_offset)
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        qt, kt, vt, None, True, 0.0, causal, scale=scale
    )[:2]
    if lse.shape[-1] != _efficient_lse_len(s_q):
        raise RuntimeError(
            f"SdpaKernel: the memory-efficient op returned an lse of length {lse.shape[-1]} for {s_q} queries,"
            f" not the {_efficient_lse_len(s_q)} its backward is fed; this torch build changed the layout."
        )
    return out.transpose(1, 2), lse[..., :s_q]


def _efficient_op_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    s_q, h, g = q.shape[1], q.shape[2], k.shape[2]
    qt, kt, vt, dot = (
        _last_dim_contiguous(x).transpose(1, 2) for x in (q, _repeat_kv(k, h), _repeat_kv(v, h), dout.to(q.dtype))
    )
    # The kernel is given only out's batch and head strides and assumes the rest of the forward's output
    # layout, [b, s, h, d] contiguous.
    ot = out.to(q.dtype).contiguous().transpose(1, 2)
    # The merged lse [b, h, s_q] re-padded to the forward's layout. The kernel reads whole 32-row tiles
    # without bound checks; +inf, what the forward writes there, makes P = exp(S - lse) = 0 on those rows.
    lse_padded = F.pad(lse.to(torch.float32), (0, _efficient_lse_len(s_q) - s_q), value=math.inf)
    philox_seed, philox_offset = _unused_rng_state(False, q.device)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dot, qt, kt, vt,
        None,  # attn_bias: the forward had none; a defined one is read as a BMHK bias
        ot, lse_padded, philox_seed, philox_offset, 0.0, [True, True, True, False], causal, scale=scale,
    )
    dq, dk, dv = (x.transpose(1, 2) for x in (dq, dk, dv))
    return dq, _sum_kv_grad(dk, g), _sum_kv_grad(dv, g)


class FlashAttnKernel:
    """The flash-attn package (CUDA, float16/bfloat16, ``FLASH_ATTN_REQUIREMENT``); supports GQA natively.

    Args:
        interface: the ``flash_attn.flash_attn_interface`` module; imported (and its version checked) when omitted.

    Raises:
        ValueError: flash-attn does not import or its version is outside ``FLASH_ATTN_VERSIONS``.
    """

    name = "flash_attn"

    def __init__(self, interface: ModuleType | None = None) -> None:
        if interface is None:
            interface, problem = load_flash_attn()
            if interface is None:
                raise ValueError(f"attention_backend='flash_attn' but {problem};{FLASH_ATTN_FIX}")
        self._fa = interface

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        _check_shapes(q, k, v, causal)
        d = q.shape[-1]
        q8, k8, v8 = (_dense_head_dim(x) for x in (q, k, v))  # k/v keep their kv_heads
        # flash-attn 2.7-2.8 -> (out, softmax_lse, S_dmask, rng_state)
        out, lse, _, _ = self._fa._flash_attn_forward(
            q8, k8, v8, 0.0, scale, causal=causal, window_size_left=-1, window_size_right=-1,
            softcap=0.0, alibi_slopes=None, return_softmax=False,
        )
        return out[..., :d], lse

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        _check_shapes(q, k, v, causal)
        d = q.shape[-1]
        do8, q8, k8, v8, o8 = (_dense_head_dim(x.to(q.dtype)) for x in (dout, q, k, v, out))
        dq, dk, dv = torch.empty_like(q8), torch.empty_like(k8), torch.empty_like(v8)
        # fills dq, dk, dv; rng_state (unread without dropout) left at its default None
        self._fa._flash_attn_backward(
            do8, q8, k8, v8, o8, lse.to(torch.float32).contiguous(), dq, dk, dv, 0.0, scale, causal,
            -1, -1, 0.0, None, False,
        )
        return dq[..., :d], dk[..., :d], dv[..., :d]


def get_kernel(backend: str, device: torch.device, dtype: torch.dtype) -> AttentionKernel:
    """The kernel :func:`resolve_backend` picks for this device and dtype.

    Raises:
        ValueError: unknown backend name, or one that cannot run on this device or dtype.
    """
    name = resolve_backend(backend, device.type, dtype)
    if name == "math":
        return MathKernel()
    if name == "sdpa":
        return SdpaKernel()
    return FlashAttnKernel()
