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
"""

from __future__ import annotations

import importlib.util
from typing import Protocol

import torch
from torch import Tensor

BACKENDS = ("auto", "math", "sdpa", "flash_attn")


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


class SdpaKernel:
    """torch's fused attention through the aten ops that return the log-sum-exp.

    CPU: ``_scaled_dot_product_flash_attention_for_cpu`` (any float dtype). CUDA: the flash op for
    float16/bfloat16 and the memory-efficient op otherwise (float64 falls back to ``math``).
    """

    name = "sdpa"

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        _check_shapes(q, k, v, causal)
        h = q.shape[2]
        # aten wants [b, h, s, d]
        qt, kt, vt = (x.transpose(1, 2) for x in (q, _repeat_kv(k, h), _repeat_kv(v, h)))
        if q.device.type == "cpu":
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                qt, kt, vt, 0.0, causal, attn_mask=None, scale=scale
            )
        elif q.dtype in (torch.float16, torch.bfloat16):
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention(qt, kt, vt, 0.0, causal, False, scale=scale)[:2]
        elif q.dtype == torch.float32:
            out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
                qt, kt, vt, None, True, 0.0, causal, scale=scale
            )[:2]
            lse = lse[..., : q.shape[1]]  # the efficient kernel pads lse's sequence dim to a multiple of 32
        else:
            return MathKernel().forward(q, k, v, causal, scale)
        return out.transpose(1, 2), lse

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        _check_shapes(q, k, v, causal)
        h, g = q.shape[2], k.shape[2]
        qt, kt, vt, ot, dot = (
            x.transpose(1, 2) for x in (q, _repeat_kv(k, h), _repeat_kv(v, h), out, dout.to(q.dtype))
        )
        lse = lse.to(accumulate_dtype(q.dtype)).contiguous()
        if q.device.type == "cpu":
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dot.contiguous(), qt, kt, vt, ot, lse, 0.0, causal, attn_mask=None, scale=scale
            )
        elif q.dtype in (torch.float16, torch.bfloat16):
            empty = torch.empty(0, dtype=torch.int64, device=q.device)
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                dot.contiguous(), qt, kt, vt, ot, lse, empty, empty, q.shape[1], k.shape[1], 0.0, causal,
                empty, empty, scale=scale,
            )
        elif q.dtype == torch.float32:
            empty = torch.empty(0, dtype=torch.int64, device=q.device)
            dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
                dot.contiguous(), qt, kt, vt, torch.empty(0, device=q.device), ot, lse, empty, empty, 0.0,
                [True, True, True, False], causal, scale=scale,
            )
        else:
            return MathKernel().backward(dout, q, k, v, out, lse, causal, scale)
        dq, dk, dv = (x.transpose(1, 2) for x in (dq, dk, dv))
        return dq, _sum_kv_grad(dk, g), _sum_kv_grad(dv, g)


class FlashAttnKernel:
    """The flash-attn package (CUDA, float16/bfloat16); supports GQA natively."""

    name = "flash_attn"

    def __init__(self) -> None:
        from flash_attn import flash_attn_interface  # noqa: F401  (raises a clear ImportError)

        self._fa = flash_attn_interface

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        _check_shapes(q, k, v, causal)
        out, lse, _, _ = self._fa._flash_attn_forward(
            q, k, v, 0.0, scale, causal=causal, window_size_left=-1, window_size_right=-1,
            softcap=0.0, alibi_slopes=None, return_softmax=False,
        )
        return out, lse

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        _check_shapes(q, k, v, causal)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        self._fa._flash_attn_backward(
            dout.to(q.dtype).contiguous(), q, k, v, out, lse.float(), dq, dk, dv, 0.0, scale, causal,
            -1, -1, 0.0, None, False,
        )
        return dq, dk, dv


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def get_kernel(backend: str, device: torch.device, dtype: torch.dtype) -> AttentionKernel:
    """Resolve a backend name (``auto`` included) to a kernel for this device and dtype.

    ``auto``: ``flash_attn`` on CUDA with half precision when the package imports; ``sdpa`` on CPU
    and on CUDA for float16/bfloat16/float32; ``math`` for float64 on CUDA.

    Raises:
        ValueError: unknown backend name, or one that cannot run on this device or dtype.
    """
    if backend not in BACKENDS:
        raise ValueError(f"attention_backend={backend!r} is not one of {BACKENDS}.")
    half = dtype in (torch.float16, torch.bfloat16)
    if backend == "auto":
        if device.type == "cuda" and half and flash_attn_available():
            backend = "flash_attn"
        elif device.type == "cuda" and dtype == torch.float64:
            backend = "math"
        else:
            backend = "sdpa"
    if backend == "math":
        return MathKernel()
    if backend == "sdpa":
        return SdpaKernel()
    if device.type != "cuda" or not half:
        raise ValueError(
            f"attention_backend='flash_attn' needs a CUDA device and float16/bfloat16 inputs, got {device.type}"
            f" and {dtype}. Use attention_backend='sdpa' or 'auto'."
        )
    if not flash_attn_available():
        raise ValueError(
            "attention_backend='flash_attn' but the flash-attn package is not installed; install the"
            " 'flash' extra (pip install 'lightning-fpdt[flash]') or use attention_backend='sdpa'."
        )
    return FlashAttnKernel()
