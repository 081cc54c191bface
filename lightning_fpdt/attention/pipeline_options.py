"""How one FPDT attention call runs (:class:`PipelineOptions`), read by the pipeline's forward and backward."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch.distributed import ProcessGroup

from lightning_fpdt.attention.blocks import BlockRules, chunk_bounds, global_ranges
from lightning_fpdt.attention.kernels import AttentionKernel, check_softcap
from lightning_fpdt.attention.ring import RingPlan, ring_plan, ring_size_rank
from lightning_fpdt.errors import FPDTError
from lightning_fpdt.offload.stats import OffloadStats
from lightning_fpdt.parallel.comm import group_size
from lightning_fpdt.parallel.layout import validate_chunk_size
from lightning_fpdt.parallel.packed_documents import PackedDocuments


@dataclass(frozen=True)
class PipelineOptions:
    """How one FPDT attention call runs. ``local_chunk_size`` is ``chunk_size / P`` (or ``None``).

    ``overlap_comm``: asynchronous all-to-alls overlapping the attention (module docstring); ``False``
    runs each to completion where it is issued (same results bit for bit; for comparisons).
    ``window``: a sliding window (tokens a query sees, itself included); ``attention_chunk_size``: chunked
    attention (:class:`~lightning_fpdt.attention.blocks.BlockRules`); ``softcap``: the attention-logit
    cap (``cap * tanh(s / cap)``); each ``None`` when off. ``group`` is the Ulysses group the all-to-alls run in;
    ``ring_group`` the ring peers key/value parts move between (``lightning_fpdt.attention.ring``; ``None``: no
    ring, ``group`` is the whole sequence-parallel group).

    Raises:
        ValueError: a window or attention chunk below 1 or without causality, a softcap that is not positive.
    """

    group: ProcessGroup | None
    local_chunk_size: int | None
    causal: bool
    scale: float
    kernel: AttentionKernel
    offload: bool = False
    stats_sink: list[OffloadStats] | None = None
    overlap_comm: bool = True
    documents: PackedDocuments | None = None
    window: int | None = None
    softcap: float | None = None
    attention_chunk_size: int | None = None
    ring_group: ProcessGroup | None = None

    def __post_init__(self) -> None:
        self.rules  # noqa: B018 (validates the window against causality now, not at the first block)
        check_softcap(self.softcap)

    @property
    def rules(self) -> BlockRules:
        """What each block computes (``lightning_fpdt.attention.blocks``)."""
        return BlockRules(self.causal, self.window, self.documents, self.attention_chunk_size)

    @property
    def sp_size(self) -> int:
        """Ranks of the sequence-parallel group: Ulysses x ring."""
        return group_size(self.group) * group_size(self.ring_group)

    def check_documents(self, s_local: int, owner: str) -> None:
        """Raises ``ValueError`` unless the documents (if any) cover the ``s_local x P`` tokens of the shards."""
        if self.documents is not None and self.documents.length != s_local * self.sp_size:
            raise FPDTError(
                f"{owner}: documents cover {self.documents.length} tokens, but the shards hold {s_local} x"
                f" {self.sp_size} = {s_local * self.sp_size}; build them for the padded sequence of this batch."
            )

    @classmethod
    def for_chunk_size(cls, group: ProcessGroup | None, chunk_size: int | None, **options: Any) -> PipelineOptions:
        """Options for a global ``chunk_size`` (validated against the group's size, then cut per rank)."""
        ring = group_size(options.get("ring_group"))
        p = group_size(group) * ring
        validate_chunk_size(chunk_size, p, ring)
        return cls(group=group, local_chunk_size=None if chunk_size is None else chunk_size // p, **options)

    def plan(self, s_local: int) -> tuple[list[tuple[int, int]], RingPlan]:
        """The local chunk bounds of ``s_local`` tokens and this rank's :class:`RingPlan` of their blocks."""
        bounds = chunk_bounds(s_local, self.local_chunk_size)
        ring, rank = ring_size_rank(self.ring_group)
        return bounds, ring_plan(self.rules, tuple(global_ranges(bounds, self.sp_size)), ring, rank)
