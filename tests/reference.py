"""Plain single-process oracles the parallel paths are compared with."""

from __future__ import annotations

import torch
from torch import Tensor


def naive_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float | None = None) -> tuple[Tensor, Tensor]:
    """Softmax attention by the textbook formula, autograd-differentiable. ``[b, s, h, d]`` in;
    returns ``out`` ``[b, s, h, d]`` and ``lse`` ``[b, s, h]``."""
    h, g = q.shape[2], k.shape[2]
    k = k.repeat_interleave(h // g, dim=2)
    v = v.repeat_interleave(h // g, dim=2)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1), v)
    return out, lse.transpose(1, 2)


def rel_error(a: Tensor, b: Tensor) -> float:
    """``max|a - b| / max|b|``: one number that is small only if every element agrees."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def _flash_scores(
    q: Tensor, k: Tensor, scale: float, causal: bool, left: int, right: int, softcap: float
) -> tuple[Tensor, Tensor | None]:
    """Masked scores ``[b, heads, s_q, s_k]`` as flash-attn defines them, and ``tanh(scaled / softcap)`` if capped."""
    s_q, s_k, h = q.shape[1], k.shape[1], q.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(h // k.shape[2], dim=2)) * scale
    capped = None
    if softcap > 0:
        capped = torch.tanh(s / softcap)
        s = softcap * capped
    shift = torch.arange(s_k).view(1, -1) - torch.arange(s_q).view(-1, 1) - (s_k - s_q)  # key - row - offset
    seen = torch.ones(s_q, s_k, dtype=torch.bool)
    if left >= 0:
        seen &= shift >= -left
    if causal or right >= 0:
        seen &= shift <= (0 if causal else right)
    return s.masked_fill(~seen, float("-inf")), capped


def flash_reference(
    q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, left: int, right: int, softcap: float
) -> tuple[Tensor, Tensor]:
    """Attention as flash-attn's README defines it (FlashAttention-3 and -4 too), by the textbook formula,
    autograd-differentiable: windows aligned to the bottom-right corner (row ``i`` sees keys ``i + s_k - s_q - left
    .. i + s_k - s_q + right``, ``-1`` unbounded; ``causal`` is ``right = 0``), scores scaled, then
    ``softcap * tanh(s / softcap)`` (``0.0``: none). ``[b, s, heads, d]`` in; returns ``out`` and ``lse``
    ``[b, heads, s_q]``."""
    s, _ = _flash_scores(q, k, scale, causal, left, right, softcap)
    lse = torch.logsumexp(s, dim=-1)
    vv = v.repeat_interleave(q.shape[2] // v.shape[2], dim=2)
    return torch.einsum("bhqk,bkhd->bqhd", torch.exp(s - lse.unsqueeze(-1)), vv), lse


def flash_block_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float, causal: bool, left: int,
    right: int, softcap: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """A flash backward by the textbook formula, from the ``out`` and ``lse`` it is given (a block's share of rows
    whose final output and log-sum-exp cover other keys too): ``P = exp(S - lse)``, ``D = rowsum(dout * out)``,
    ``dS = P (dP - D)`` through the cap. Returns ``dq``, and ``dk``/``dv`` at k's head count."""
    h, g = q.shape[2], k.shape[2]
    s, capped = _flash_scores(q, k, scale, causal, left, right, softcap)
    p = torch.exp(s - lse.to(s.dtype).unsqueeze(-1))
    vv = v.repeat_interleave(h // g, dim=2)
    dv = torch.einsum("bhqk,bqhd->bkhd", p, dout)
    dp = torch.einsum("bqhd,bkhd->bhqk", dout, vv)
    delta = (dout * out.to(dout.dtype)).sum(-1).transpose(1, 2)  # [b, h, s_q]
    ds = p * (dp - delta.unsqueeze(-1))
    if capped is not None:
        ds = ds * (1 - capped.square())
    ds = ds * scale
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, k.repeat_interleave(h // g, dim=2))
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q)
    b, s_k = k.shape[:2]
    return dq, dk.view(b, s_k, g, h // g, -1).sum(3), dv.view(b, s_k, g, h // g, -1).sum(3)
