"""All-to-all between the sequence-sharded and the head-sharded layouts (DeepSpeed Ulysses).

Sequence-sharded: ``[batch, seq_local, heads, head_dim]`` on each of the ``P`` ranks, rank ``r``
holding the ``r``-th slice of a (chunk of the) sequence. Head-sharded: ``[batch, seq_local * P,
heads / P, head_dim]``, rank ``r`` holding heads ``r * heads / P ...`` of the whole (chunk of the)
sequence, in rank order along the sequence.

``seq_to_head`` / ``head_to_seq`` are plain (no autograd) and used inside the FPDT pipeline's own
autograd function. ``SeqToHead`` / ``HeadToSeq`` are their autograd versions (each one's backward is
the other), used by plain Ulysses attention.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup


def group_size(group: ProcessGroup | None) -> int:
    """Number of ranks in ``group``; ``None`` means one process."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def _all_to_all(x: Tensor, group: ProcessGroup) -> Tensor:
    """All-to-all along dim 0 (one equal block per rank) of a contiguous tensor."""
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def seq_to_head(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """``[b, s_local, h, d]`` sequence-sharded -> ``[b, s_local * P, h / P, d]`` head-sharded."""
    p = group_size(group)
    if p == 1:
        return x
    b, s_local, h, d = x.shape
    if h % p != 0:
        raise ValueError(f"seq_to_head: {h} heads cannot be split over {p} sequence-parallel ranks.")
    # [P (destination rank = head group), b, s_local, h/P, d]
    send = x.reshape(b, s_local, p, h // p, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = _all_to_all(send, group)  # [P (source rank = sequence slice), b, s_local, h/P, d]
    return recv.permute(1, 0, 2, 3, 4).reshape(b, p * s_local, h // p, d)


def head_to_seq(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """``[b, s_local * P, h_local, d]`` head-sharded -> ``[b, s_local, h_local * P, d]`` sequence-sharded."""
    p = group_size(group)
    if p == 1:
        return x
    b, s, h_local, d = x.shape
    if s % p != 0:
        raise ValueError(f"head_to_seq: sequence length {s} cannot be split over {p} ranks.")
    # [P (destination rank = sequence slice), b, s/P, h_local, d]
    send = x.reshape(b, p, s // p, h_local, d).transpose(0, 1).contiguous()
    recv = _all_to_all(send, group)  # [P (source rank = head group), b, s/P, h_local, d]
    return recv.permute(1, 2, 0, 3, 4).reshape(b, s // p, p * h_local, d)


class SeqToHead(torch.autograd.Function):
    """Autograd :func:`seq_to_head`; its gradient goes back through :func:`head_to_seq`."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup | None) -> Tensor:
        ctx.group = group
        return seq_to_head(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return head_to_seq(grad.contiguous(), ctx.group), None


class HeadToSeq(torch.autograd.Function):
    """Autograd :func:`head_to_seq`; its gradient goes back through :func:`seq_to_head`."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup | None) -> Tensor:
        ctx.group = group
        return head_to_seq(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return seq_to_head(grad.contiguous(), ctx.group), None


def check_heads(n_heads: int, n_kv_heads: int, sp_size: int) -> None:
    """Raise a ``ValueError`` naming the numbers if these head counts cannot be sharded over ``sp_size``.

    Query heads are split evenly over the ranks (Ulysses). Key/value heads are either split too
    (``n_kv_heads % sp_size == 0``) or replicated so that every rank gets the one KV head its
    query heads use (``sp_size % n_kv_heads == 0``).
    """
    if n_heads % n_kv_heads != 0:
        raise ValueError(f"n_heads={n_heads} is not a multiple of n_kv_heads={n_kv_heads}.")
    if n_heads % sp_size != 0:
        options = [p for p in range(1, n_heads + 1) if n_heads % p == 0]
        raise ValueError(
            f"n_heads={n_heads} is not divisible by sequence_parallel_size={sp_size}: Ulysses gives each"
            f" rank n_heads / sequence_parallel_size heads. Use a sequence_parallel_size in {options}."
        )
    if n_kv_heads % sp_size != 0 and sp_size % n_kv_heads != 0:
        raise ValueError(
            f"n_kv_heads={n_kv_heads} and sequence_parallel_size={sp_size}: KV heads must either divide"
            f" evenly over the ranks or be replicated evenly (sequence_parallel_size a multiple of"
            f" n_kv_heads). Use a sequence_parallel_size that divides or is a multiple of {n_kv_heads}."
        )


def expand_kv_heads(x: Tensor, sp_size: int) -> Tensor:
    """Replicate KV heads so they shard over ``sp_size`` ranks: ``[b, s, g, d] -> [b, s, P, d]``.

    Only when ``g < P``: rank ``r``'s query heads all use KV head ``r // (P / g)``, which is what
    ``repeat_interleave`` puts in slot ``r``. Autograd sums the replicas' gradients back.
    """
    g = x.shape[2]
    if g >= sp_size:
        return x
    return x.repeat_interleave(sp_size // g, dim=2)
