"""Block rules: what each (query chunk, key chunk) block of FPDT attention computes.

Causality, packed documents, a sliding window and chunked (local) attention decide, per block, one of three
things, here and nowhere else (every backend obeys the answer):

- **skip**: no query of the block sees any of its keys (above the causal diagonal, wholly before every
  query's window, no shared document or attention chunk). The pipeline drops the block from its schedule
  before anything is issued: no prefetch, copy or kernel, in forward and backward.
- **full**: every query sees every key: one plain kernel call on the whole block.
- **cut**: a causal diagonal, a window edge, a document or attention-chunk boundary runs through the block. It becomes
  rectangles (:class:`Rect`), one per shared document, each trimmed to the rows that see at least one
  key and the keys some row sees, with at most a causal diagonal and a window edge left inside. The
  kernels apply those two (``lightning_fpdt.attention.kernels``): ``math`` with a mask, ``flash_attn``
  with its ``window_size``, and ``sdpa`` on the rectangle's unmasked pieces (:func:`unmasked_pieces`).

Why pieces: torch's fused CPU kernel computes every pair of a masked call, masked or not, and adds the
mask on top, so a window edge left as a mask costs the whole rectangle (a 1024-token diagonal block with a
window of 512 took twice its unmasked time). Cut along the window's edge into row bands of the window's
height, a rectangle becomes whole rectangles and triangles: a triangle on the causal diagonal is a causal
call, and one on the window's lower edge (row ``a`` sees keys ``b >= a``) is a causal call on reversed rows
and keys. Bands of the window's height give the fewest and largest calls: per band, one triangle of each
kind and nothing in between; a shorter band adds a whole rectangle between its triangles.

Chunked attention (Llama-4's ``attention_chunk_size`` ``A``, not the pipeline's ``chunk_size``): a query sees only
the keys of its own attention chunk, ``A`` tokens counted from its document's start (``masking_utils.chunked_overlay``:
``k // A == q // A``, with causality). Within an attention chunk that is plain causal attention, so attention chunks
are documents: each document is cut every ``A`` tokens (:meth:`BlockRules.segmentation`) and the document rules
apply, giving whole rectangles and causal squares only, no new mask for any kernel; with a window, its band inside.

Softcapping and attention sinks change the scores and the merge, not this schedule.

Positions are global token offsets of the padded sequence (chunk ``i`` covers ``ranges[i]``): after the
all-to-all, local chunk ``i`` is global chunk ``i`` on every rank, so every rank plans the same blocks. With a
ring, a rank's part of a chunk is two pieces (:func:`lightning_fpdt.parallel.layout.ring_pieces`): a block of two such
parts is planned piece by piece (:func:`part_rects`), rows and keys numbered along each part.
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass
from typing import Literal

from lightning_fpdt.errors import FPDTError, is_positive_int
from lightning_fpdt.parallel.layout import chunk_lengths
from lightning_fpdt.parallel.packed_documents import PackedDocuments, Segment

BlockKind = Literal["skip", "full", "cut"]
Range = tuple[int, int]  # global token range [start, end) of a chunk
Part = tuple[Range, ...]  # a rank's part of a chunk under a ring: its pieces, in the order the rank holds them


def window_start(query: int, window: int) -> int:
    """The first key position a query at position ``query`` sees under a sliding window of ``window`` tokens.

    As transformers 5 counts it (``masking_utils.sliding_window_overlay``: ``kv_idx > q_idx - sliding_window``,
    combined with causality in ``sliding_window_causal_mask_function``): keys ``query - window + 1 .. query``,
    ``window`` tokens with the query itself. Packed sequences: transformers measures both indices as
    positions inside the document (``remap_positions_for_packed_sequence``) and adds a same-document mask;
    inside one document global and in-document distances are equal, so the band in global offsets is the same.
    """
    return query - window + 1


@dataclass(frozen=True)
class Rect(Segment):
    """One kernel call of a cut block: a document's :class:`~lightning_fpdt.parallel.packed_documents.Segment` (rows
    ``q_lo:q_hi`` of the query chunk attend to keys ``k_lo:k_hi`` of the key chunk, for the samples ``batch``;
    ``causal``: a square on the diagonal, local key ``b`` seen by local row ``a`` only if ``b <= a``) with a
    window edge: ``lower``, only keys with ``b - a >= lower`` are seen (``None``: no edge). Every row sees at
    least one key.
    """

    lower: int | None = None


@dataclass(frozen=True)
class BlockRules:
    """The rules of one attention call: ``causal``, a sliding ``window`` (tokens a query sees, itself
    included; ``None``: unbounded), packed ``documents`` (``None``: one document per sample) and chunked
    attention, ``attention_chunk_size`` tokens per attention chunk from each document's start (Llama-4's
    config field; not the pipeline's ``chunk_size``; ``None``: off).

    Raises:
        ValueError: a window or attention chunk below 1, or either without causality.
    """

    causal: bool
    window: int | None = None
    documents: PackedDocuments | None = None
    attention_chunk_size: int | None = None

    def __post_init__(self) -> None:
        if self.window is not None and self.window < 1:
            raise FPDTError(f"fpdt_attention: window={self.window}; a sliding window holds at least 1 token"
                            " (the query itself). Use None for no window.")
        if self.window is not None and not self.causal:
            raise FPDTError(f"fpdt_attention: window={self.window} with causal=False; sliding windows are"
                            " supported for causal attention only (as transformers' sliding_window_causal"
                            " masks). Use causal=True or window=None.")
        size = self.attention_chunk_size
        if size is not None and not is_positive_int(size):
            raise FPDTError(f"fpdt_attention: attention_chunk_size={size!r}; an attention chunk holds at least 1"
                            " token (a query sees the keys of its own chunk, itself included): give a positive int"
                            " (Llama-4's config.attention_chunk_size), or None for no chunked attention.")
        if size is not None and not self.causal:
            raise FPDTError(f"fpdt_attention: attention_chunk_size={size} with causal=False; chunked attention is"
                            " supported for causal attention only (as transformers' chunked_causal masks). Use"
                            " causal=True or attention_chunk_size=None.")

    def segmentation(self, lo: int, hi: int) -> PackedDocuments | None:
        """The documents as the block rules see them around tokens ``lo:hi``: ``documents``, each cut every
        ``attention_chunk_size`` tokens from its start when chunked (only the cuts in ``lo:hi`` and the one
        before ``lo``, which is all a block of these tokens needs)."""
        size = self.attention_chunk_size
        if size is None:
            return self.documents
        length = hi if self.documents is None else self.documents.length
        cut = []
        for starts in ((0,),) if self.documents is None else self.documents.starts:
            ends, cuts = (*starts[1:], length), []
            for d in range(max(bisect.bisect_right(starts, lo) - 1, 0), len(starts)):
                if starts[d] >= hi:
                    break
                first = starts[d] + max(0, lo - starts[d]) // size * size  # the attention chunk holding lo
                cuts.extend(range(first, min(ends[d], hi), size))
            cut.append(tuple(cuts))
        return PackedDocuments(tuple(cut), length)

    def _skips(self, q: Range, k: Range) -> bool:
        """The cheap tests: above the diagonal, before the first query's window."""
        (q0, q1), (k0, k1) = q, k
        if self.causal and k0 >= q1:
            return True
        # the first query's window starts earliest: a key before it is before every query's window
        return self.window is not None and k1 <= window_start(q0, self.window)

    def rects(self, q: Range, k: Range) -> list[Rect] | None:
        """The rectangles of block (queries ``q``, keys ``k``; equal or disjoint ranges): ``[]`` to skip it,
        ``None`` when it is full (one call on the whole block)."""
        if self._skips(q, k):
            return []
        (q0, q1), (k0, k1) = q, k
        documents = self.segmentation(min(q0, k0), max(q1, k1))
        if documents is not None and not documents.shares_document(q, k):  # no shared document or attention chunk
            return []
        diagonal = self.causal and q == k
        window_cuts = self.window is not None and k0 < window_start(q1 - 1, self.window)
        if documents is None:
            if not diagonal and not window_cuts:
                return None
            pieces = [Rect(slice(None), 0, q1 - q0, 0, k1 - k0, diagonal)]
        else:
            pieces = [Rect(s.batch, s.q_lo, s.q_hi, s.k_lo, s.k_hi, s.causal)
                      for s in documents.segments(q, k, diagonal)]
            # whole: one document holds the block in every sample (one piece for all, or one per sample)
            block = (0, q1 - q0, 0, k1 - k0, False)
            whole = all((r.q_lo, r.q_hi, r.k_lo, r.k_hi, r.causal) == block for r in pieces) and (
                pieces[0].batch == slice(None) or len(pieces) == len(documents.starts))
            if whole and not window_cuts:
                return None
        if self.window is None:
            return pieces
        banded = (self._band(r, q0 + r.q_lo - (k0 + r.k_lo)) for r in pieces)
        return [r for r in banded if r is not None]

    def _band(self, r: Rect, offset: int) -> Rect | None:
        """``r`` with the window's edge, trimmed to the rows that see a key and the keys a row sees (``None``
        when no row sees any); ``offset`` is the global position of its first row minus that of its first key."""
        assert self.window is not None
        n_q, n_k = r.q_hi - r.q_lo, r.k_hi - r.k_lo
        # local key b is seen by local row a iff k0 + b >= window_start(q0 + a), i.e. b - a >= lower
        lower = window_start(offset, self.window)
        rows = min(n_q, n_k - lower)  # row a sees a key iff a + lower <= n_k - 1 (a causal square: every row)
        if rows <= 0:
            return None
        first_key = max(0, lower)  # the first row's first key; no row sees an earlier one
        lower -= first_key
        if rows - 1 + lower <= 0:  # even the last row sees the first key: no edge inside
            lower = None
        return Rect(r.batch, r.q_lo, r.q_lo + rows, r.k_lo + first_key, r.k_hi, r.causal, lower)

    def kind(self, q: Range, k: Range) -> BlockKind:
        """``"skip"``, ``"full"`` or ``"cut"`` for block (queries ``q``, keys ``k``): :meth:`rects`, named."""
        rects = self.rects(q, k)
        return "full" if rects is None else "cut" if rects else "skip"


def chunk_bounds(s_local: int, local_chunk_size: int | None) -> list[tuple[int, int]]:
    """``(lo, hi)`` of each local chunk: the chunk lengths of the local shard with ``C / P`` per chunk."""
    bounds, start = [], 0
    for length in chunk_lengths(s_local, local_chunk_size):
        bounds.append((start, start + length))
        start += length
    return bounds


def global_ranges(bounds: list[tuple[int, int]], p: int) -> list[Range]:
    """Global token ranges of the chunks: local chunk ``(lo, hi)`` is global chunk ``(lo * P, hi * P)``."""
    return [(lo * p, hi * p) for lo, hi in bounds]


def plan_blocks(rules: BlockRules, ranges: list[Range]) -> dict[tuple[int, int], list[Rect] | None]:
    """The blocks ``(i, j)`` (query chunk ``i``, key chunk ``j``) that are not skipped, each with its
    rectangles (``None``: full). Forward and backward both schedule from this, so a skipped block is
    absent from both."""
    plan = {}
    for i, q in enumerate(ranges):
        for j, k in enumerate(ranges):
            rects = rules.rects(q, k)
            if rects is None or rects:
                plan[(i, j)] = rects
    return plan


def part_rects(rules: BlockRules, q: Part, k: Part) -> list[Rect] | None:
    """:meth:`BlockRules.rects` of the block (query pieces ``q``, key pieces ``k``; each pair equal or disjoint),
    rows and keys numbered along the concatenated pieces: ``[]`` to skip it, ``None`` when every pair is full."""
    if len(q) == 1 and len(k) == 1:
        return rules.rects(q[0], k[0])
    rects, full, q_at = [], True, 0
    for q_range in q:
        k_at = 0
        for k_range in k:
            found = rules.rects(q_range, k_range)
            n_q, n_k = q_range[1] - q_range[0], k_range[1] - k_range[0]
            if found is None:
                rects.append(Rect(slice(None), q_at, q_at + n_q, k_at, k_at + n_k, False))
            else:
                full = False
                rects += [dataclasses.replace(r, q_lo=r.q_lo + q_at, q_hi=r.q_hi + q_at, k_lo=r.k_lo + k_at,
                                              k_hi=r.k_hi + k_at) for r in found]
            k_at += n_k
        q_at += n_q
    return None if full else rects


# A causal diagonal with a window shorter than this many tokens keeps its mask: one masked call on the square
# is cheaper than two kernel calls per band of a few rows (measured on CPU: ~50 us per call and piece).
MIN_BAND = 32


def unmasked_pieces(r: Rect, band: int | None = None, min_band: int = MIN_BAND) -> list[Rect]:
    """``r`` cut along its window edge into rectangles a kernel computes without a mask: whole ones
    (``causal=False``, ``lower=None``), causal squares (``causal=True``, ``lower=None``) and squares on the
    window's lower edge (``causal=False``, ``lower=0``: row ``a`` sees keys ``b >= a``, a causal kernel on
    reversed rows and keys). Together they cover exactly the pairs ``r`` sees, each once; each piece's rows
    see at least one of its keys; pieces of one row band share rows, so their results are merged.

    Args:
        r: a rectangle of :meth:`BlockRules.rects`; one without an edge, or a square on the edge of at most
            ``band`` rows, is returned as it is.
        band: the most rows per band (``None``: the window's height, the fewest calls); a kernel whose large
            calls run slower per pair asks for shorter bands (``SdpaKernel.edge_band``).
        min_band: a causal square whose window (``1 - r.lower`` tokens) is shorter is returned whole, mask
            and all (see :data:`MIN_BAND`).
    """
    n_q, n_k, lower = r.q_hi - r.q_lo, r.k_hi - r.k_lo, r.lower
    if lower is None or (lower == 0 and not r.causal and n_q == n_k and n_q <= (band or n_q)):
        return [r]

    def piece(a0: int, a1: int, b0: int, b1: int, causal: bool = False, edge: int | None = None) -> list[Rect]:
        """Rows ``a0:a1`` and keys ``b0:b1`` of ``r`` (local), or nothing when empty."""
        if a1 <= a0 or b1 <= b0:
            return []
        return [Rect(r.batch, r.q_lo + a0, r.q_lo + a1, r.k_lo + b0, r.k_lo + b1, causal, edge)]

    if not r.causal:
        # row a sees keys a + lower .. n_k - 1: rows before -lower see every key; then per band, a triangle on
        # the edge and the keys right of it, which every row of the band sees (rects() trimmed r to rows that
        # see one, so the triangle ends inside r)
        head = min(n_q, max(0, -lower))
        pieces = piece(0, head, 0, n_k)
        for a0 in range(head, n_q, band or n_q):
            a1 = min(a0 + (band or n_q), n_q)
            pieces += piece(a0, a1, a0 + lower, a1 + lower, edge=0) + piece(a0, a1, a1 + lower, n_k)
        return pieces
    window = 1 - lower  # a causal square with an edge: row a sees keys a - window + 1 .. a
    if window < min_band:
        return [r]
    height = min(window, band or window)
    # bands of `height` rows from row 0 and again from row `window`, so that no band straddles the first row
    # whose window leaves key 0 behind: before it, keys 0 .. a0 - 1 are seen by the whole band, from it on,
    # keys a0 + lower .. a1 - 2 + lower are the edge's triangle (the band's last row sees none of them); then
    # keys every row sees (none when a band is a whole window), then the diagonal's triangle
    pieces = []
    for a0 in [*range(0, min(window, n_q), height), *range(window, n_q, height)]:
        a1 = min(a0 + height, window if a0 < window else n_q, n_q)
        if a0 >= window:
            pieces += piece(a0, a1 - 1, a0 + lower, a1 - 1 + lower, edge=0)
        pieces += piece(a0, a1, max(0, a1 - 1 + lower), a0) + piece(a0, a1, a0, a1, causal=True)
    return pieces
