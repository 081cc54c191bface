"""Attention by plain torch matrix products in the accumulation dtype: the reference every other kernel is tested
against (``math``), and the kernel of the blocks no fused op computes (a softcap, float64 on CUDA), which ``sdpa``
runs in bands of query rows so that a block's scores never exist whole.

``q`` ``[batch, seq_q, heads, head_dim]``, ``k`` ``[batch, seq_k, kv_heads, head_dim]``, ``v`` ``[batch, seq_k,
kv_heads, v_head_dim]``; ``out`` ``[batch, seq_q, heads, v_head_dim]``, ``lse`` ``[batch, heads, seq_q]`` in the
accumulation dtype (:mod:`lightning_fpdt.attention.kernels` states the interface).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_fpdt.attention import routes
from lightning_fpdt.attention.fused_ops import check_shapes, repeat_kv, sum_kv_grad, visible_keys

# scores held at once by a banded block, ``batch * heads * rows * keys``: 2**24 is 64 MiB in float32 per
# intermediate (the scores, P, dP and dS of the backward), where a whole 64K-token block of 16 heads is 256 GiB
MATH_BAND_SCORES = 1 << 24


def band_rows(batch: int, heads: int, keys: int) -> int:
    """Query rows a band of a block with ``keys`` keys at ``heads`` heads (``batch`` samples) holds, so that its scores
    stay within :data:`MATH_BAND_SCORES` (at least one row); the memory model counts bands by the same rule."""
    return max(1, MATH_BAND_SCORES // max(1, batch * heads * keys))


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of softmax statistics and accumulators: float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


class MathKernel:
    """Plain torch attention in the accumulation dtype. The reference every other path is tested against."""

    name = "math"
    edge_band = None  # the reference: masks exactly what the block rules say

    @staticmethod
    def _scores(
        q: Tensor, k: Tensor, causal: bool, scale: float, lower: int | None, softcap: float | None, first_row: int = 0
    ) -> tuple[Tensor, Tensor | None]:
        """Masked scores ``[b, h, s_q, s_k]`` and, when capped, ``tanh(scaled / cap)`` (for the backward); ``q``'s
        rows are the block's rows from ``first_row`` on."""
        acc = accumulate_dtype(q.dtype)
        s = torch.einsum("bqhd,bkhd->bhqk", q.to(acc), repeat_kv(k, q.shape[2]).to(acc)) * scale
        capped = None
        if softcap is not None:  # scaled first, then capped (transformers Gemma-2's eager attention)
            capped = torch.tanh(s / softcap)
            s = capped * softcap
        seen = visible_keys(q.shape[1], k.shape[1], causal, lower, q.device, first_row)
        if seen is not None:
            s = s.masked_fill(~seen, float("-inf"))
        return s, capped

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, lower: int | None = None,
        softcap: float | None = None,
    ) -> tuple[Tensor, Tensor]:
        check_shapes(q, k, v, causal)
        routes.note(self.name)
        return self._forward(q, k, v, causal, scale, lower, softcap)

    def _forward(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, lower: int | None, softcap: float | None,
        first_row: int = 0,
    ) -> tuple[Tensor, Tensor]:
        s, _ = self._scores(q, k, causal, scale, lower, softcap, first_row)
        lse = torch.logsumexp(s, dim=-1)  # [b, h, s_q]
        p = torch.exp(s - lse.unsqueeze(-1))
        out = torch.einsum("bhqk,bkhd->bqhd", p, repeat_kv(v, q.shape[2]).to(p.dtype))
        return out.to(q.dtype), lse

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float,
        lower: int | None = None, softcap: float | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        check_shapes(q, k, v, causal)
        return self._backward(dout, q, k, v, out, lse, causal, scale, lower, softcap)

    def _backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float,
        lower: int | None, softcap: float | None, first_row: int = 0,
    ) -> tuple[Tensor, Tensor, Tensor]:
        acc = accumulate_dtype(q.dtype)
        h, g = q.shape[2], k.shape[2]
        dout_, v_ = dout.to(acc), repeat_kv(v, h).to(acc)
        # 1. P = exp(S - lse), with the row's final lse: the block's share of the full softmax.
        s, capped = self._scores(q, k, causal, scale, lower, softcap, first_row)
        p = torch.exp(s - lse.to(acc).unsqueeze(-1))
        # 2. dV = P^T dO
        dv = torch.einsum("bhqk,bqhd->bkhd", p, dout_)
        # 3. dP = dO V^T
        dp = torch.einsum("bqhd,bkhd->bhqk", dout_, v_)
        # 4. dS = P * (dP - D), D = rowsum(dO * O) with the row's final output
        delta = (dout_ * out.to(acc)).sum(-1).transpose(1, 2)  # [b, h, s_q]
        ds = p * (dp - delta.unsqueeze(-1)) * scale
        if capped is not None:  # through the cap: d(cap * tanh(x / cap)) / dx = 1 - tanh^2
            ds = ds * (1 - capped.square())
        # 5. dQ = dS K, dK = dS^T Q
        dq = torch.einsum("bhqk,bkhd->bqhd", ds, repeat_kv(k, h).to(acc))
        dk = torch.einsum("bhqk,bqhd->bkhd", ds, q.to(acc))
        return dq, sum_kv_grad(dk, g), sum_kv_grad(dv, g)

    # ---- in bands of query rows: the block's rows are independent given their final out and lse ----------------

    @staticmethod
    def _bands(q: Tensor, k: Tensor, causal: bool) -> list[tuple[int, int, int]]:
        """``(first row, end row, keys seen)`` per band: rows such that a band's scores hold at most
        :data:`MATH_BAND_SCORES`; a causal band sees no key past its last row."""
        b, s_q, h = q.shape[:3]
        rows = band_rows(b, h, k.shape[1])
        return [(a0, min(a0 + rows, s_q), min(a0 + rows, s_q) if causal else k.shape[1]) for a0 in range(0, s_q, rows)]

    def forward_in_bands(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, lower: int | None, softcap: float | None,
    ) -> tuple[Tensor, Tensor]:
        """:meth:`forward`, computed band by band (:meth:`_bands`): the same rows, at most ``MATH_BAND_SCORES``
        scores at once."""
        bands = self._bands(q, k, causal)
        if len(bands) <= 1:
            return self._forward(q, k, v, causal, scale, lower, softcap)
        k, v = self._expanded(q, k, v)
        pieces = [self._forward(q[:, a0:a1], k[:, :keys], v[:, :keys], causal, scale, lower, softcap, a0)
                  for a0, a1, keys in bands]
        return torch.cat([o for o, _ in pieces], dim=1), torch.cat([l_ for _, l_ in pieces], dim=2)

    def backward_in_bands(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float,
        lower: int | None, softcap: float | None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`backward`, band by band: each band's dq, and dk/dv summed over the bands."""
        bands = self._bands(q, k, causal)
        if len(bands) <= 1:
            return self._backward(dout, q, k, v, out, lse, causal, scale, lower, softcap)
        g = k.shape[2]
        k, v = self._expanded(q, k, v)  # dk and dv at q's heads below, summed to k's at the end
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        dqs = []
        for a0, a1, keys in bands:
            dq_band, dk_band, dv_band = self._backward(
                dout[:, a0:a1], q[:, a0:a1], k[:, :keys], v[:, :keys], out[:, a0:a1], lse[:, :, a0:a1], causal, scale,
                lower, softcap, a0,
            )
            dqs.append(dq_band)
            dk[:, :keys] += dk_band
            dv[:, :keys] += dv_band
        return torch.cat(dqs, dim=1), sum_kv_grad(dk, g), sum_kv_grad(dv, g)

    @staticmethod
    def _expanded(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """k and v at q's head count in the accumulation dtype, made once for all the bands (each band's
        ``_scores`` would otherwise repeat the whole block's keys for its few rows)."""
        acc = accumulate_dtype(q.dtype)
        return repeat_kv(k, q.shape[2]).to(acc), repeat_kv(v, q.shape[2]).to(acc)
