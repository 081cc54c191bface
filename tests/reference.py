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
