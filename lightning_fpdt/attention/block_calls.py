"""A block's kernel calls: one on the whole of a full block, one per rectangle of a cut block.

:mod:`lightning_fpdt.attention.blocks` decides what each (query chunk, key chunk) block computes: nothing
(skipped before this module is reached), the whole block, or rectangles (:class:`~.blocks.Rect`), one per
document the two chunks share, each with at most a causal diagonal and a sliding window's edge inside.
Attention inside a rectangle is the backend's ordinary kernel on slices of q, k and v, so every backend
(``math``, ``sdpa`` on CPU and CUDA, ``flash_attn``) and GQA are covered without a dense mask, and the
cost of packed documents is the sum over documents of their squared lengths, not ``S**2``.

A kernel with an ``edge_band`` (``sdpa``) gets a rectangle with a window edge as its unmasked pieces
(:func:`~.blocks.unmasked_pieces`): one call per piece, and the pieces of a row band merged with
:func:`~.merge.update_out_and_lse` in forward; in backward each piece's gradients are summed, as each
rectangle's are (every piece sees its own keys, with the rows' final ``out`` and ``lse``).

Rows of the block that no rectangle covers (no shared document, or every key outside their window) get
``out = 0`` and ``lse = -inf``; the online merge gives them weight ``exp(-inf) = 0``. Every token sees at
least itself, so a row's final ``lse`` is always finite.

Where documents come from: :func:`lightning_fpdt.parallel.packed_documents.find_documents`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_fpdt.attention.blocks import Rect, unmasked_pieces
from lightning_fpdt.attention.kernels import AttentionKernel, accumulate_dtype
from lightning_fpdt.attention.merge import update_out_and_lse


def _whole(rect: Rect, q: Tensor, k: Tensor) -> bool:
    """Whether ``rect`` is the whole block: the kernel then runs on q, k, v as they are, with no scatter."""
    return rect.batch == slice(None) and (rect.q_lo, rect.q_hi, rect.k_lo, rect.k_hi) == (0, q.shape[1], 0, k.shape[1])


def _rows_shared(rects: list[Rect]) -> bool:
    """Whether two rectangles cover a row of the same sample (they then merge; documents' never do)."""
    active: list[Rect] = []  # a sweep over rows: the rectangles still open at the current one's first row
    for r in sorted(rects, key=lambda r: r.q_lo):
        active = [o for o in active if o.q_hi > r.q_lo]
        if any(o.batch == r.batch or slice(None) in (o.batch, r.batch) for o in active):
            return True
        active.append(r)
    return False


def kernel_calls(kernel: AttentionKernel, rects: list[Rect]) -> list[list[Rect]]:
    """The calls ``kernel`` makes for each rectangle: the rectangle itself, or its unmasked pieces in bands of
    ``kernel.edge_band`` rows (``None``: the kernel takes the edge; read only for a rectangle with an edge)."""
    return [[r] if r.lower is None or kernel.edge_band is None else unmasked_pieces(r, kernel.edge_band)
            for r in rects]


def block_forward(
    kernel: AttentionKernel, q: Tensor, k: Tensor, v: Tensor, rects: list[Rect] | None, scale: float,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """``kernel.forward`` on a block (``rects`` ``None``: full), or on each of its rectangles (or their pieces).

    ``q`` ``[batch, C_q, heads, head_dim]``, ``k`` ``[batch, C_k, kv_heads, head_dim]``, ``v`` ``[batch, C_k,
    kv_heads, v_head_dim]``; returns ``out`` ``[batch, C_q, heads, v_head_dim]`` (in the accumulation dtype where
    pieces were merged) and ``lse`` ``[batch, heads, C_q]`` (``-inf`` on rows no rectangle covers).
    """
    if rects is None:
        return kernel.forward(q, k, v, False, scale, None, softcap)
    calls = kernel_calls(kernel, rects)
    if len(calls) == 1 and len(calls[0]) == 1 and _whole(calls[0][0], q, k):
        return kernel.forward(q, k, v, calls[0][0].causal, scale, calls[0][0].lower, softcap)
    b, c_q, h, _ = q.shape
    acc = accumulate_dtype(q.dtype)
    shared = _rows_shared(rects)  # a ring's two key pieces: rectangles of one row range
    merged = shared or any(len(pieces) > 1 for pieces in calls)
    out = torch.zeros(b, c_q, h, v.shape[-1], dtype=acc if merged else q.dtype, device=q.device)
    lse = torch.full((b, h, c_q), float("-inf"), dtype=acc, device=q.device)
    for pieces in calls:
        for r in pieces:
            rows, cols = slice(r.q_lo, r.q_hi), slice(r.k_lo, r.k_hi)
            o, l_ = kernel.forward(q[r.batch, rows], k[r.batch, cols], v[r.batch, cols], r.causal, scale, r.lower,
                                   softcap)
            if shared or len(pieces) > 1:  # rows seen before: from out = 0, lse = -inf the first is exact
                o, l_ = update_out_and_lse(out[r.batch, rows], lse[r.batch, :, rows], o, l_)
            out[r.batch, rows] = o
            lse[r.batch, :, rows] = l_
    return out, lse


def block_backward(
    kernel: AttentionKernel, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    rects: list[Rect] | None, scale: float, softcap: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``kernel.backward`` on a block, or on each of its rectangles or their pieces (``out`` and ``lse`` are
    the rows' final ones, as for the whole block); gradients in the accumulation dtype."""
    if rects is None:
        return kernel.backward(dout, q, k, v, out, lse, False, scale, None, softcap)
    calls = [r for pieces in kernel_calls(kernel, rects) for r in pieces]
    if len(calls) == 1 and _whole(calls[0], q, k):
        return kernel.backward(dout, q, k, v, out, lse, calls[0].causal, scale, calls[0].lower, softcap)
    acc = accumulate_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    for r in calls:
        rows, cols = slice(r.q_lo, r.q_hi), slice(r.k_lo, r.k_hi)
        g_q, g_k, g_v = kernel.backward(
            dout[r.batch, rows], q[r.batch, rows], k[r.batch, cols], v[r.batch, cols],
            out[r.batch, rows], lse[r.batch, :, rows], r.causal, scale, r.lower, softcap,
        )
        dq[r.batch, rows] += g_q
        dk[r.batch, cols] += g_k
        dv[r.batch, cols] += g_v
    return dq, dk, dv
