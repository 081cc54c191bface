"""Where each group lies: data parallel outermost, then the ring, then Ulysses (innermost, on the fast links).

A world of ``D x P`` processes, global rank ``g = d * P + a * U + u`` (``P = U x R``):

- ``d``: the data-parallel coordinate (ranks with different samples);
- the sequence-parallel group ``d``: ranks ``d * P .. d * P + P - 1``, which share one sample;
- the Ulysses group ``(d, a)``: ``U`` consecutive ranks, whose all-to-alls scatter the heads. Consecutive global
  ranks are one node's devices under Lightning's launchers (``node_rank * devices + local_rank``), so a Ulysses
  group of at most a node's devices, starting at a multiple of its size, sits on one node;
- the ring ``(d, u)``: the ``R`` ranks ``d * P + u + U * a``, one per Ulysses group, which move key/value parts
  point to point (``lightning_fpdt.attention.ring``): across nodes when ``P`` spans several.

``ring_size="auto"`` picks the largest Ulysses degree that divides ``P`` and the devices of one node (so that every
Ulysses group sits on one node) and fits the heads of every attention layer
(:func:`~lightning_fpdt.parallel.comm.heads_fit`); the ring is the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_fpdt.errors import PREFIX, FPDTError
from lightning_fpdt.parallel.comm import heads_fit


def resolve_ring_size(ring_size: int | Literal["auto"], sp: int, devices_per_node: int,
                      heads: Sequence[tuple[int, int]] = ()) -> int:
    """The ring size of a sequence-parallel group of ``sp`` ranks: ``ring_size`` as given, or with ``"auto"`` the
    one whose Ulysses degree is the largest that divides ``sp`` and ``devices_per_node`` and fits every
    ``(n_heads, n_kv_heads)`` of ``heads`` (none known yet: any).

    Raises:
        ValueError: a ring size that does not divide ``sp``.
    """
    if ring_size != "auto":
        if sp % ring_size != 0:
            divisors = [r for r in range(1, sp + 1) if sp % r == 0]
            raise FPDTError(f"{PREFIX}ring_size={ring_size} does not divide sequence_parallel_size={sp} (the group is"
                            f" ulysses x ring ranks); use one of {divisors}, or ring_size='auto'.")
        return ring_size
    for u in range(min(sp, max(1, devices_per_node)), 0, -1):  # u = 1 always qualifies
        if sp % u == 0 and devices_per_node % u == 0 and all(heads_fit(h, kv, u) for h, kv in heads):
            return sp // u
    return sp


@dataclass(frozen=True)
class SequenceParallelGroups:
    """This rank's Ulysses group and ring (``None`` where ``ring == 1``: the sequence-parallel group is the Ulysses
    group) of a world of ``data_parallel x ulysses x ring`` ranks."""

    data_parallel: int
    ulysses: int
    ring: int
    ulysses_group: ProcessGroup | None = None
    ring_group: ProcessGroup | None = None

    @classmethod
    def create(cls, data_parallel: int, sp: int, ring: int) -> SequenceParallelGroups:
        """Make every Ulysses group and ring of the world (a collective: every rank calls it, in the same order)."""
        if ring == 1:
            return cls(data_parallel, sp, 1)
        u, rank = sp // ring, dist.get_rank()
        mine: dict[str, ProcessGroup | None] = {}
        for d in range(data_parallel):
            for a in range(ring):
                ranks = [d * sp + a * u + x for x in range(u)]
                group = dist.new_group(ranks)
                if rank in ranks:
                    mine["ulysses"] = group
            for x in range(u):
                ranks = [d * sp + x + u * a for a in range(ring)]
                group = dist.new_group(ranks)
                if rank in ranks:
                    mine["ring"] = group
        return cls(data_parallel, u, ring, mine["ulysses"], mine["ring"])


def build_mesh(device_type: str, data_parallel: int, sp: int, ring: int) -> tuple[DeviceMesh, SequenceParallelGroups]:
    """The world's ``(data_parallel, sequence_parallel)`` device mesh and this rank's Ulysses group and ring (a
    collective: every rank calls it)."""
    mesh = init_device_mesh(device_type, (data_parallel, sp), mesh_dim_names=("data_parallel", "sequence_parallel"))
    return mesh, SequenceParallelGroups.create(data_parallel, sp, ring)


def placement(groups: SequenceParallelGroups, devices_per_node: int) -> str:
    """Where the groups lie, in words, for the strategy's log line (nodes hold consecutive ranks,
    ``devices_per_node`` each)."""
    dp, u, ring = groups.data_parallel, groups.ulysses, groups.ring
    sp = u * ring

    def nodes(ranks: range) -> int:
        return len({r // devices_per_node for r in ranks})

    ulysses_nodes = max(nodes(range(d * sp + a * u, d * sp + (a + 1) * u)) for d in range(dp) for a in range(ring))
    ulysses_where = "inside a node" if ulysses_nodes == 1 else f"across up to {ulysses_nodes} nodes"
    if ring == 1:
        return f"sequence_parallel={sp} as ulysses={u} ({ulysses_where}); data_parallel={dp}"
    ring_nodes = max(nodes(range(d * sp + x, (d + 1) * sp, u)) for d in range(dp) for x in range(u))
    ring_where = f"across {ring_nodes} nodes" if ring_nodes > 1 else "inside a node"
    return (f"sequence_parallel={sp} as ulysses={u} (consecutive ranks, {ulysses_where}) x ring={ring}"
            f" (ranks {u} apart, {ring_where}); data_parallel={dp} outermost")
