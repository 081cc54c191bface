"""FPDT sequence layout: label shift, padding, position ids and the strided chunk permutation.

Pure functions on tensors; nothing here communicates.

Notation: ``S`` global sequence length, ``P`` sequence-parallel size, ``C`` chunk size in global
tokens. The sequence is cut into chunks of ``C`` tokens (the last may be shorter); chunk ``i`` is
cut into ``P`` equal sub-chunks and rank ``r`` holds sub-chunk ``r`` of every chunk, in chunk
order. After the all-to-all that gathers the sequence and scatters heads, local chunk ``i`` is
therefore global chunk ``i``, contiguous (FPDT, Yao et al. 2024, section 3.2). With ``C = None``
(no chunking) there is one chunk and the layout is the contiguous split of plain Ulysses.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

IGNORE_INDEX = -100

DEFAULT_SEQUENCE_KEYS = (
    "input_ids", "labels", "shift_labels", "position_ids", "attention_mask", "loss_mask", "answer_mask",
)
# padding value per sequence key; other keys are padded with 0
_PAD_VALUES = {"shift_labels": IGNORE_INDEX, "labels": IGNORE_INDEX}


def chunk_lengths(seq_len: int, chunk_size: int | None) -> list[int]:
    """Global lengths of the chunks of a sequence: ``chunk_size`` each, the last one shorter.

    Args:
        seq_len: global sequence length ``S``.
        chunk_size: global tokens per chunk ``C``; ``None`` means one chunk of ``S`` tokens.
    """
    if seq_len <= 0:
        raise ValueError(f"The sequence length must be positive, got {seq_len}.")
    if chunk_size is None or chunk_size >= seq_len:
        return [seq_len]
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive number of tokens, got {chunk_size}.")
    full, rest = divmod(seq_len, chunk_size)
    return [chunk_size] * full + ([rest] if rest else [])


def padded_length(seq_len: int, sp_size: int, chunk_size: int | None = None) -> int:
    """Smallest length ``>= seq_len`` that the layout accepts: every chunk divides by ``sp_size``.

    Chunks are ``chunk_size`` long (a multiple of ``sp_size``) except the last, so only the total
    needs to be a multiple of ``sp_size``: no whole chunk of padding is ever added.
    """
    validate_chunk_size(chunk_size, sp_size)
    return -(-seq_len // sp_size) * sp_size


def validate_chunk_size(chunk_size: int | None, sp_size: int) -> None:
    """Raise if ``chunk_size`` cannot be cut into ``sp_size`` equal sub-chunks."""
    if chunk_size is None:
        return
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}.")
    if chunk_size % sp_size != 0:
        lower = max(sp_size, chunk_size // sp_size * sp_size)
        raise ValueError(
            f"chunk_size={chunk_size} is not divisible by sequence_parallel_size={sp_size}: each chunk is"
            f" split into {sp_size} equal sub-chunks, one per rank. Use a multiple of {sp_size},"
            f" e.g. {lower} or {lower + sp_size}."
        )


def fpdt_permutation(seq_len: int, sp_size: int, chunk_size: int | None = None) -> Tensor:
    """Global token indices in layout order: rank 0's shard first, then rank 1's, ...

    ``x[:, perm]`` reorders a sequence so that ``x[:, perm].chunk(sp_size, dim=1)[r]`` is rank
    ``r``'s shard. ``seq_len`` must be a multiple of ``sp_size`` (see :func:`padded_length`).

    Returns:
        A ``[seq_len]`` int64 tensor.
    """
    validate_chunk_size(chunk_size, sp_size)
    if seq_len % sp_size != 0:
        raise ValueError(
            f"The sequence length {seq_len} is not divisible by sequence_parallel_size={sp_size}; pad it"
            f" to {padded_length(seq_len, sp_size)} first (FPDTStrategy does this for you)."
        )
    per_rank: list[list[Tensor]] = [[] for _ in range(sp_size)]
    start = 0
    for length in chunk_lengths(seq_len, chunk_size):
        sub = length // sp_size
        for r in range(sp_size):
            per_rank[r].append(torch.arange(start + r * sub, start + (r + 1) * sub))
        start += length
    return torch.cat([idx for rank in per_rank for idx in rank])


def inverse_permutation(perm: Tensor) -> Tensor:
    """The permutation ``inv`` with ``x[:, perm][:, inv] == x``."""
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def shard_indices(seq_len: int, sp_size: int, sp_rank: int, chunk_size: int | None = None) -> Tensor:
    """Global token indices held by ``sp_rank``, in local order. ``[seq_len // sp_size]`` int64."""
    if not 0 <= sp_rank < sp_size:
        raise ValueError(f"sp_rank={sp_rank} is outside [0, {sp_size}).")
    return fpdt_permutation(seq_len, sp_size, chunk_size).view(sp_size, -1)[sp_rank]


def shard_sequence(x: Tensor, sp_size: int, sp_rank: int, chunk_size: int | None = None, dim: int = 1) -> Tensor:
    """This rank's shard of a full-sequence tensor along ``dim`` (default: ``[batch, seq, ...]``)."""
    idx = shard_indices(x.shape[dim], sp_size, sp_rank, chunk_size).to(x.device)
    return x.index_select(dim, idx)


def unshard_sequence(shards: Sequence[Tensor], chunk_size: int | None = None, dim: int = 1) -> Tensor:
    """Inverse of :func:`shard_sequence`: the full sequence from every rank's shard, in rank order."""
    sp_size = len(shards)
    laid_out = torch.cat(list(shards), dim=dim)
    inv = inverse_permutation(fpdt_permutation(laid_out.shape[dim], sp_size, chunk_size)).to(laid_out.device)
    return laid_out.index_select(dim, inv)


# ---- documents -------------------------------------------------------------------------------------


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
            raise ValueError(f"position_ids must be [batch, seq], got shape {tuple(position_ids.shape)}.")
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
        raise ValueError(
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
        raise ValueError(
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


def shift_labels(labels: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Hugging Face labels (``labels[t]`` is token ``t``) to pre-shifted ones (target of token ``t``).

    ``[batch, seq]`` in, ``[batch, seq]`` out; the last position gets ``ignore_index``. This must
    happen on the whole sequence, before sharding: after sharding the next token may live on
    another rank.
    """
    shifted = torch.full_like(labels, ignore_index)
    shifted[:, :-1] = labels[:, 1:]
    return shifted


def mask_targets(
    shift_labels: Tensor, documents: PackedDocuments | None, loss_mask: Tensor | None, attention_mask: Tensor | None
) -> Tensor:
    """Pre-shifted targets with ``IGNORE_INDEX`` wherever the target token (``t + 1``) is not trained on:
    it starts another document (the last token of a document never predicts the next one), it is
    padding (``attention_mask`` 0), or ``loss_mask`` is 0 there (``loss_mask`` marks target tokens, like
    Hugging Face's ``labels``)."""
    drop = torch.zeros_like(shift_labels, dtype=torch.bool)
    if documents is not None:
        drop |= documents.document_starts(shift_labels.device)
    for mask in (loss_mask, attention_mask):
        if mask is not None:
            drop |= mask.reshape(drop.shape) == 0
    if not bool(drop.any()):
        return shift_labels
    dropped_target = torch.zeros_like(drop)
    dropped_target[:, :-1] = drop[:, 1:]
    return shift_labels.masked_fill(dropped_target, IGNORE_INDEX)


def pad_sequence(x: Tensor, length: int, value: float | int, dim: int = 1) -> Tensor:
    """Pad ``x`` at the end of ``dim`` to ``length`` with ``value``."""
    missing = length - x.shape[dim]
    if missing < 0:
        raise ValueError(f"Cannot pad a sequence of length {x.shape[dim]} down to {length}.")
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x, x.new_full(shape, value)], dim=dim)


def default_position_ids(batch_size: int, seq_len: int, device: torch.device | None = None) -> Tensor:
    """``[batch, seq]`` global positions ``0 .. seq-1``."""
    return torch.arange(seq_len, device=device).unsqueeze(0).expand(batch_size, seq_len)


def _check_sequence_keys(batch: Mapping[str, Any], sequence_keys: Sequence[str], b: int, s: int, owner: str) -> None:
    """Refuse a per-token key whose leading dims are not ``[b, s]`` like ``input_ids``', and a ``loss_mask``
    (one entry per target token) that is not exactly ``[b, s]``. ``attention_mask``: see :func:`find_documents`."""
    for key in dict.fromkeys((*sequence_keys, "loss_mask")):
        x = batch.get(key)
        exact = key == "loss_mask"
        if x is None or key == "attention_mask" or isinstance(x, Tensor) and x.shape[:2 + exact] == (b, s):
            continue
        shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        expected = f"[{b}, {s}]" if exact else f"[{b}, {s}, ...]"
        fix = ("it marks each target token to train on (1) or ignore (0): give it the length and padding of"
               " 'input_ids'" if exact else "remove it from `sequence_keys` if it is not per token")
        raise ValueError(f"{owner}: sequence key {key!r} has shape {shape}, expected {expected} like 'input_ids';"
                         f" {fix}.")


def shard_batch(
    batch: Mapping[str, Any] | Any,
    sp_size: int,
    sp_rank: int,
    chunk_size: int | None = None,
    sequence_keys: Sequence[str] = DEFAULT_SEQUENCE_KEYS,
    pad_token_id: int = 0,
    owner: str = "shard_batch",
) -> dict[str, Any]:
    """This rank's part of a dict batch of whole sequences.

    Steps, in this order: derive ``labels`` from ``input_ids`` if absent; shift them into
    ``shift_labels`` on the *whole* sequence (the next token may live on another rank); add global
    ``position_ids``; find the documents (:func:`find_documents`) and drop the targets that cross a
    document boundary, are padding or are masked by ``loss_mask`` (:func:`mask_targets`); pad every
    sequence key to a multiple of ``sp_size`` (labels with ``IGNORE_INDEX``, ``input_ids`` with
    ``pad_token_id``, others with 0); apply the FPDT layout and keep rank ``sp_rank``'s shard. Keys not
    in ``sequence_keys`` pass through untouched. ``documents`` is added: the batch's
    :class:`PackedDocuments` over the padded length, or ``None`` for plain sequences.

    A batch that is not a mapping is returned as it is when ``sp_size == 1``.

    Raises:
        TypeError: a batch that is not a mapping, with ``sp_size > 1`` (nothing says what to shard).
        ValueError: no ``input_ids``, ``input_ids`` not ``[batch, seq]``, a sequence shorter than
            ``sp_size``, a sequence key whose leading dims differ from ``input_ids``', or a ``loss_mask``
            that is not ``[batch, seq]``.
    """
    if not isinstance(batch, Mapping):
        if sp_size == 1:
            return batch  # nothing to shard: the module gets it as it is
        raise TypeError(
            f"{owner}: sequence_parallel_size={sp_size} needs dict batches with 'input_ids' [batch, seq]"
            f" to shard; got a {type(batch).__name__}."
        )
    if "input_ids" not in batch:
        raise ValueError(
            f"{owner}: the batch has no 'input_ids'; its keys are {sorted(batch)}. Return a dict with"
            " 'input_ids' [batch, seq] (and optionally 'labels', 'position_ids') from your dataset."
        )
    out = dict(batch)
    ids = out["input_ids"]
    if not isinstance(ids, Tensor) or ids.dim() != 2:
        shape = tuple(ids.shape) if isinstance(ids, Tensor) else type(ids).__name__
        raise ValueError(f"{owner}: 'input_ids' must be a [batch, seq] tensor, got {shape}.")
    b, s = ids.shape
    if s < sp_size:
        smaller = f" (at most {s})" if s > 0 else ""
        raise ValueError(
            f"{owner}: the sequence length {s} is shorter than sequence_parallel_size={sp_size}: every rank of"
            f" the sequence-parallel group needs at least one token of each sample. Use samples of at least"
            f" {sp_size} tokens (pad or drop shorter ones), or a smaller sequence_parallel_size{smaller}."
        )
    _check_sequence_keys(out, sequence_keys, b, s, owner)  # before any key is read: no raw reshape errors
    if "shift_labels" not in out:
        labels = out.pop("labels", None)
        out["shift_labels"] = shift_labels(ids if labels is None else labels, IGNORE_INDEX)
    if "position_ids" not in out:
        out["position_ids"] = default_position_ids(b, s, device=ids.device)
    documents = find_documents(out["position_ids"], out.get("attention_mask"), owner)
    out["shift_labels"] = mask_targets(out["shift_labels"], documents, out.get("loss_mask"), out.get("attention_mask"))
    length = padded_length(s, sp_size, chunk_size)
    out["documents"] = None if documents is None else documents.padded(length)
    for key in sequence_keys:
        x = out.get(key)
        if x is None:
            continue
        pad = pad_token_id if key == "input_ids" else _PAD_VALUES.get(key, 0)
        x = pad_sequence(x, length, pad)
        out[key] = shard_sequence(x, sp_size, sp_rank, chunk_size) if sp_size > 1 else x
    return out
