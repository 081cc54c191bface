"""The attention drivers of the pipeline tests: one sharded ``fpdt_attention`` step on a rank, and the whole-sequence
results from every rank's (run the ranks with :func:`lightning_fpdt.testing.run_on_ranks`)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import Tensor

from lightning_fpdt.attention import fpdt_attention
from lightning_fpdt.parallel.layout import shard_sequence, unshard_sequence

ATTENTION_STEP = ("out", "lse", "dq", "dk", "dv")  # what sharded_attention_step returns, in order


def sharded_attention_step(
    rank: int, world: int, chunk: int | None, q: Tensor, k: Tensor, v: Tensor, dout: Tensor, **options: Any
) -> list[Tensor]:
    """One ``fpdt_attention`` forward and backward (``math`` kernel) on this rank's shard of whole ``q``, ``k``,
    ``v`` and ``dout`` ``[batch, seq, heads, head_dim]`` in the FPDT layout of ``chunk``; ``options`` go to
    ``fpdt_attention`` (``causal``, ``offload``, ``documents``, ...). Returns this rank's
    :data:`ATTENTION_STEP`, detached."""
    group = dist.group.WORLD if world > 1 else None
    shards = [shard_sequence(x, world, rank, chunk).requires_grad_() for x in (q, k, v)]
    out, lse = fpdt_attention(*shards, group=group, chunk_size=chunk, backend="math", return_lse=True, **options)
    out.backward(shard_sequence(dout, world, rank, chunk))
    return [t.detach() for t in (out, lse, *(x.grad for x in shards))]


def unsharded_attention_step(per_rank: list[list[Tensor]], chunk: int | None) -> list[Tensor]:
    """The whole-sequence :data:`ATTENTION_STEP` from every rank's :func:`sharded_attention_step`."""
    return [unshard_sequence([r[t] for r in per_rank], chunk) for t in range(len(ATTENTION_STEP))]
