"""The ring inside the sequence-parallel group: which key/value parts each rank needs, and their point-to-point moves.

The group of ``P = U x R`` ranks is ``R`` Ulysses groups of ``U`` consecutive ranks; the ``R`` ranks with the same
place in their Ulysses groups form a ring (``lightning_fpdt.parallel.mesh``). Per chunk, the all-to-all inside the
Ulysses group gives each rank ``heads / U`` heads of its ring rank's part of the chunk (two of the chunk's ``2R``
pieces: :func:`lightning_fpdt.parallel.layout.ring_pieces`). Its queries attend to every part of every chunk the
rules let them see: its own part, and its ring peers' parts, which arrive point to point.

Each key/value part travels once, to the peers that need it, when its chunk is gathered, and joins the receiving
rank's :class:`~lightning_fpdt.offload.chunk_store.ChunkStore` (host memory when offloaded) like a part of its own: no
part is sent twice, whatever the number of query chunks that read it, so the bytes moved are those of a ring pass
(``R - 1`` parts per part at most) and device memory stays a chunk's. The parts of chunk ``i`` arrive while the
earlier chunks' blocks are computed. In backward each rank sums the key/value gradients of a peer's part over its
own queries and sends the sum home, where the owner adds it to its own before the part's gradients leave.

A part is sent only to the peers whose queries see some of it (causality, documents, a window, attention chunks:
:class:`~lightning_fpdt.attention.blocks.BlockRules`), and a block a rank's queries do not see is not computed.
Every rank plans every rank's blocks from the same global positions (:class:`RingPlan`), so senders and receivers
agree without a message. Key part ``m = j * R + b`` is ring rank ``b``'s part of chunk ``j``; with ``R = 1`` it is
chunk ``j`` and the plan is the pipeline's plain one.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_fpdt.attention.blocks import BlockRules, Part, Range, Rect, part_rects
from lightning_fpdt.parallel.comm import group_rank, group_size
from lightning_fpdt.parallel.layout import ring_pieces


@dataclass(frozen=True)
class RingPlan:
    """The blocks of one attention call on ring rank ``rank`` of ``size``, over chunks with global ``ranges``.

    Attributes:
        parts: ``parts[i][b]``, ring rank ``b``'s pieces of chunk ``i``.
        blocks: ``(i, m)`` -> rectangles (``None``: full) of the blocks this rank computes: its queries of chunk
            ``i`` against key part ``m``; skipped blocks are absent.
        sends: ``sends[j]``, the peers that need this rank's part of chunk ``j``.
        receives: ``receives[j]``, the peers whose part of chunk ``j`` this rank needs.
        causal: whether the rules are causal (the candidates counted).
    """

    size: int
    rank: int
    causal: bool
    parts: tuple[tuple[Part, ...], ...]
    blocks: dict[tuple[int, int], list[Rect] | None]
    sends: tuple[tuple[int, ...], ...]
    receives: tuple[tuple[int, ...], ...]

    @property
    def chunks(self) -> int:
        return len(self.parts)

    def own(self, j: int) -> int:
        """This rank's key part of chunk ``j``."""
        return j * self.size + self.rank

    def key_parts(self, i: int, causal: bool) -> list[int]:
        """The key parts query chunk ``i`` attends to, in the order it computes them: its own part of chunk ``i``
        first (on the device from the all-to-all), then the parts of the chunks before (in the store), then its
        peers' parts of chunk ``i`` (arriving meanwhile); all chunks' parts without causality. Skipped ones left out."""
        earlier = range(i) if causal else (j for j in range(self.chunks) if j != i)
        order = [self.own(i), *(j * self.size + b for j in earlier for b in range(self.size)),
                 *(i * self.size + b for b in range(self.size) if b != self.rank)]
        return [m for m in order if (i, m) in self.blocks]

    def query_chunks(self, m: int, causal: bool) -> list[int]:
        """The query chunks that attend to key part ``m``, in order."""
        first = m // self.size if causal else 0
        return [i for i in range(first, self.chunks) if (i, m) in self.blocks]

    @property
    def candidates(self) -> int:
        """Blocks before skipping (causal: key chunks up to the query chunk), as ``OffloadStats`` counts them."""
        n = self.chunks
        return self.size * n * (n + 1) // 2 if self.causal else self.size * n * n


@functools.lru_cache(maxsize=64)
def ring_plan(rules: BlockRules, ranges: tuple[Range, ...], size: int, rank: int) -> RingPlan:
    """The :class:`RingPlan` of ring rank ``rank`` of ``size`` over the chunks at global ``ranges`` (the same for
    every layer of a step: cached)."""
    parts = tuple(tuple(ring_pieces(lo, hi - lo, size, b) for b in range(size)) for lo, hi in ranges)
    n = len(ranges)

    # only causality: every block off the diagonal chunk is full (planning 64 chunks on a ring of 8 then takes
    # milliseconds, not the second of asking the rules about each of its 133,120 blocks)
    plain = rules.window is None and rules.documents is None and rules.attention_chunk_size is None

    def blocks_of(c: int) -> dict[tuple[int, int], list[Rect] | None]:
        found = {}
        for i in range(n):
            for j in range(i + 1 if rules.causal else n):
                for b in range(size):
                    rects = None if plain and j != i else part_rects(rules, parts[i][c], parts[j][b])
                    if rects is None or rects:
                        found[(i, j * size + b)] = rects
        return found

    everyone = [blocks_of(c) for c in range(size)]
    needed = [{m for _, m in blocks} for blocks in everyone]  # the key parts each ring rank reads
    sends = tuple(tuple(c for c in range(size) if c != rank and j * size + rank in needed[c]) for j in range(n))
    receives = tuple(tuple(b for b in range(size) if b != rank and j * size + b in needed[rank]) for j in range(n))
    return RingPlan(size, rank, rules.causal, parts, everyone[rank], sends, receives)


class PendingParts:
    """One batch of point-to-point part moves in flight (:func:`exchange_parts`); :meth:`wait` once."""

    def __init__(self, works: list[dist.Work], received: dict[int, Tensor], sent: list[Tensor]) -> None:
        self._works, self._received, self._sent = works, received, sent

    def wait(self) -> dict[int, Tensor]:
        """The received buffers by ring rank of the sender, once every send and receive of the batch is done."""
        for work in self._works:
            work.wait()
        self._works, self._sent = [], []  # send buffers live until here
        return self._received


def exchange_parts(group: ProcessGroup | None, sends: dict[int, Tensor], receives: dict[int, torch.Size],
                   dtype: torch.dtype, device: torch.device) -> PendingParts:
    """Start one batch of moves in the ring ``group``: ``sends`` (ring rank -> a tensor for it) and ``receives`` (ring
    rank -> the shape of what it sends here). Every pair's send and receive are in the same batch on both ranks (one
    NCCL group: no order between the peers' sends can deadlock)."""
    if not sends and not receives:
        return PendingParts([], {}, [])
    received = {b: torch.empty(shape, dtype=dtype, device=device) for b, shape in receives.items()}
    ops = [dist.P2POp(dist.isend, x.contiguous(), dist.get_global_rank(group, c), group) for c, x in sends.items()]
    ops += [dist.P2POp(dist.irecv, buf, dist.get_global_rank(group, b), group) for b, buf in received.items()]
    works = dist.batch_isend_irecv(ops)
    return PendingParts(works, received, [op.tensor for op in ops])


def ring_size_rank(group: ProcessGroup | None) -> tuple[int, int]:
    """``(R, ring rank)`` of ``group`` (``None``: no ring, ``(1, 0)``)."""
    return group_size(group), group_rank(group)


def pack(*tensors: Tensor) -> Tensor:
    """One flat buffer of ``tensors`` (k and v, or their gradients): one message per peer."""
    return torch.cat([t.reshape(-1) for t in tensors])


def unpack(flat: Tensor, *shapes: torch.Size) -> list[Tensor]:
    """The tensors of :func:`pack`, by their shapes."""
    out, at = [], 0
    for shape in shapes:
        count = int(torch.Size(shape).numel())
        out.append(flat[at:at + count].view(shape))
        at += count
    return out
