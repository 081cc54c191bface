"""Packed documents: where each sample's documents start, and which parts of an attention block they share.

A sample may pack several documents (``position_ids`` restarting at 0) or end in padding (a 2-D
``attention_mask``); :func:`find_documents` reads both into :class:`PackedDocuments`, global token offsets
of the whole (padded) sequence. The attention pipeline asks it, per (query chunk, key chunk) block, whether
the block shares any document (else it is skipped) and which rectangles (:class:`Segment`) it computes.
Pure functions on tensors; nothing here communicates.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_fpdt.errors import FPDTError
from lightning_fpdt.parallel.layout import local_token_indices


@dataclass(frozen=True)
class Segment:
    """One document's share of an attention block: rows ``q_lo:q_hi`` attend to keys ``k_lo:k_hi``
    (offsets inside the block's query and key chunks), for the samples ``batch``."""

    batch: slice
    q_lo: int
    q_hi: int
    k_lo: int
    k_hi: int
    causal: bool


@dataclass(frozen=True)
class PackedDocuments:
    """Document starts per sample, as global token offsets of a padded sequence of ``length`` tokens.

    Attributes:
        starts: for each sample, the sorted offsets where its documents start (the first is 0).
        length: the global (padded) sequence length ``S``.
    """

    starts: tuple[tuple[int, ...], ...]
    length: int

    @classmethod
    def from_position_ids(cls, position_ids: Tensor) -> PackedDocuments | None:
        """Documents start where the global ``position_ids`` ``[batch, S]`` restart at 0 (and at 0);
        ``None`` when every sample is a single document (the plain path, with no segmentation)."""
        if position_ids.dim() != 2:
            raise FPDTError(f"position_ids must be [batch, seq], got shape {tuple(position_ids.shape)}.")
        restarts = position_ids[:, 1:] == 0
        if not bool(restarts.any()):
            return None
        starts = []
        for row in restarts.cpu():
            starts.append((0, *(int(t) + 1 for t in row.nonzero().flatten().tolist())))
        return cls(tuple(starts), position_ids.shape[1])

    def padded(self, length: int) -> PackedDocuments:
        """The same documents in a sequence padded to ``length``: the padding is one more document, so no
        real token attends to it, even without causality."""
        if length == self.length:
            return self
        return PackedDocuments(tuple((*s, self.length) for s in self.starts), length)

    def document_starts(self, device: torch.device | None = None) -> Tensor:
        """``[batch, S]`` bool: True where a document starts."""
        mask = torch.zeros(len(self.starts), self.length, dtype=torch.bool)
        for b, starts in enumerate(self.starts):
            mask[b, list(starts)] = True
        return mask.to(device)

    def pieces(self, lo: int, hi: int) -> list[tuple[slice, list[tuple[int, int, bool]]]]:
        """The global tokens ``lo:hi`` cut at document starts, per group of samples that share their documents:
        ``(samples, [(start, end, starts_a_document), ...])``, the pieces in order and covering ``lo:hi``. A
        recurrence runs piece by piece, its state restarting where ``starts_a_document``."""
        out = []
        for batch, starts in self._groups():
            cuts = [lo, *(s for s in starts if lo < s < hi), hi]
            out.append((batch, [(a, c, a in starts) for a, c in zip(cuts, cuts[1:])]))
        return out

    def _groups(self) -> list[tuple[slice, tuple[int, ...]]]:
        """Samples with the same documents, as one slice when all agree (one kernel call per document)."""
        if all(s == self.starts[0] for s in self.starts):
            return [(slice(None), self.starts[0])]
        return [(slice(b, b + 1), s) for b, s in enumerate(self.starts)]

    def segments(self, q_range: tuple[int, int], k_range: tuple[int, int], causal: bool) -> list[Segment]:
        """The rectangles of the block of global queries ``q_range`` and keys ``k_range`` (each
        ``(start, end)``); ``causal`` for the causal diagonal block (``q_range == k_range``)."""
        (q0, q1), (k0, k1) = q_range, k_range
        out: list[Segment] = []
        for batch, starts in self._groups():
            ends = (*starts[1:], self.length)
            # documents overlapping both ranges: from the one holding max(q0, k0) - ..., searched by start
            first = bisect.bisect_right(starts, max(q0, k0)) - 1
            for d in range(max(first, 0), len(starts)):
                s, e = starts[d], ends[d]
                if s >= min(q1, k1):
                    break
                qa, qb, ka, kb = max(s, q0), min(e, q1), max(s, k0), min(e, k1)
                if qa < qb and ka < kb:
                    out.append(Segment(batch, qa - q0, qb - q0, ka - k0, kb - k0, causal))
        return out

    def shares_document(self, q_range: tuple[int, int], k_range: tuple[int, int]) -> bool:
        """Whether any sample has a document with tokens in both ranges (else the block is skipped)."""
        (q0, q1), (k0, k1) = q_range, k_range
        lo, hi = max(q0, k0), min(q1, k1)
        if lo < hi:  # the ranges overlap: a token there shares its document with itself
            return True
        # disjoint ranges: the later range's first token must be in a document that began at or before
        # the earlier range's last token
        early_end, late_start = min(q1, k1), max(q0, k0)
        for starts in self.starts:
            doc_start = starts[bisect.bisect_right(starts, late_start) - 1]
            if doc_start < early_end:
                return True
        return False


def find_documents(
    position_ids: Tensor, attention_mask: Tensor | None, owner: str = "shard_batch"
) -> PackedDocuments | None:
    """The documents of a batch of whole sequences: starts where ``position_ids`` ``[batch, seq]`` restart
    at 0, and, with a right-padded 2-D ``attention_mask`` (1 = token, 0 = padding), the padding as one
    more document. ``None`` for plain sequences (one document each, no padding).

    Raises:
        ValueError: an ``attention_mask`` that is not ``[batch, seq]`` (4-D masks) or is not right-padded.
    """
    documents = PackedDocuments.from_position_ids(position_ids)
    if attention_mask is None:
        return documents
    if attention_mask.dim() != 2 or attention_mask.shape != position_ids.shape:
        raise FPDTError(
            f"{owner}: 'attention_mask' has shape {tuple(attention_mask.shape)}; only the Hugging Face 2-D padding"
            f" mask [batch, seq] = {list(position_ids.shape)} (1 = token, 0 = padding) is supported. For packed"
            " documents give position_ids that restart at 0 at each document; other masks (4-D, custom) cannot"
            " be honoured by the chunked pipeline: drop the key from the batch or from sequence_keys."
        )
    keep = attention_mask.bool()
    lengths = keep.sum(dim=1)
    right = torch.arange(keep.shape[1], device=keep.device).unsqueeze(0) < lengths.unsqueeze(1)
    if not torch.equal(keep, right):
        rows = (keep != right).any(dim=1).nonzero().flatten().tolist()
        raise FPDTError(
            f"{owner}: 'attention_mask' is not right-padded in sample(s) {rows[:8]} (padding before or between"
            " tokens). Pad on the right (tokenizer padding_side='right'), or pack the samples as documents with"
            " restarting position_ids instead of padding."
        )
    s = position_ids.shape[1]
    if bool((lengths == s).all()):
        return documents
    base = documents.starts if documents is not None else ((0,),) * len(lengths)
    starts = tuple(
        tuple(sorted({*(x for x in doc if x < n), *([n] if 0 < n < s else [])})) or (0,)
        for doc, n in zip(base, lengths.tolist())
    )
    return PackedDocuments(starts, s)


def token_positions(s_local: int, sp: int, rank: int, chunk_size: int | None,
                    documents: PackedDocuments | None, device: torch.device, ring_size: int = 1, first: int = 0,
                    count: int | None = None) -> Tensor:
    """``[batch or 1, count]``: the position of each of this rank's tokens ``first .. first + count - 1`` (default: all
    ``s_local``) in its document (global offsets in the FPDT layout of ``chunk_size`` and ``ring_size``, less the start
    of the document holding each)."""
    count = s_local - first if count is None else count
    offsets = local_token_indices(s_local * sp, sp, rank, chunk_size, first, count, ring_size).to(device)
    if documents is None:
        return offsets[None]
    rows = []
    for starts in documents.starts:
        starts_t = torch.tensor(starts, device=device)
        rows.append(offsets - starts_t[torch.searchsorted(starts_t, offsets, right=True) - 1])
    return torch.stack(rows)
