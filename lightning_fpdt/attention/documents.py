"""Attention within packed documents: a block's kernel call split into one call per shared document.

A packed sample holds several documents one after another; a token attends only to tokens of its own
document (causally, for a decoder). :class:`lightning_fpdt.layout.PackedDocuments` records where the
documents start in each sample, in *global* token offsets of the padded sequence (the order before the
FPDT permutation), so every rank can answer for any global chunk: after the all-to-all, local chunk
``i`` is global chunk ``i``, contiguous, whatever rank computes it.

Documents are contiguous ranges, so a (query chunk, key chunk) block either shares no document (it is
skipped: no copy, no kernel) or splits into rectangles, one per shared document. Each rectangle is
dense (a key chunk before the query chunk), or square and causal (the diagonal block). Attention
inside a rectangle is the backend's ordinary kernel on slices of q, k and v, so every backend
(``math``, ``sdpa`` on CPU and CUDA, ``flash_attn``) and GQA are covered without a dense mask, and the
cost is the sum over documents of their squared lengths, not ``S**2``. Rows of the block that share no
document with its keys get ``out = 0`` and ``lse = -inf``; the online merge gives them weight
``exp(-inf) = 0``. Every token sees at least itself, so a row's final ``lse`` is always finite.

Where documents come from: :func:`lightning_fpdt.layout.find_documents`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_fpdt.attention.kernels import AttentionKernel, accumulate_dtype
from lightning_fpdt.layout import Segment


def block_forward(
    kernel: AttentionKernel, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float,
    segments: list[Segment] | None,
) -> tuple[Tensor, Tensor]:
    """``kernel.forward`` on a block, or on each of its document rectangles.

    ``q`` ``[batch, C_q, heads, head_dim]``, ``k``/``v`` ``[batch, C_k, kv_heads, head_dim]``; returns
    ``out`` like ``q`` and ``lse`` ``[batch, heads, C_q]`` (``-inf`` on rows no rectangle covers).
    """
    if segments is None:
        return kernel.forward(q, k, v, causal, scale)
    b, c_q, h, _ = q.shape
    out = torch.zeros_like(q)
    lse = torch.full((b, h, c_q), float("-inf"), dtype=accumulate_dtype(q.dtype), device=q.device)
    for seg in segments:
        o, l_ = kernel.forward(q[seg.batch, seg.q_lo:seg.q_hi], k[seg.batch, seg.k_lo:seg.k_hi],
                               v[seg.batch, seg.k_lo:seg.k_hi], seg.causal, scale)
        out[seg.batch, seg.q_lo:seg.q_hi] = o
        lse[seg.batch, :, seg.q_lo:seg.q_hi] = l_
    return out, lse


def block_backward(
    kernel: AttentionKernel, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    causal: bool, scale: float, segments: list[Segment] | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``kernel.backward`` on a block, or on each of its document rectangles (``out`` and ``lse`` are
    the rows' final ones, as for the whole block); gradients in the accumulation dtype."""
    if segments is None:
        return kernel.backward(dout, q, k, v, out, lse, causal, scale)
    acc = accumulate_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    for seg in segments:
        rows, cols = slice(seg.q_lo, seg.q_hi), slice(seg.k_lo, seg.k_hi)
        g_q, g_k, g_v = kernel.backward(
            dout[seg.batch, rows], q[seg.batch, rows], k[seg.batch, cols], v[seg.batch, cols],
            out[seg.batch, rows], lse[seg.batch, :, rows], seg.causal, scale,
        )
        dq[seg.batch, rows] += g_q
        dk[seg.batch, cols] += g_k
        dv[seg.batch, cols] += g_v
    return dq, dk, dv
