"""FPDT sequence layout: label shift, padding, position ids and the strided chunk permutation.

Pure functions on tensors; nothing here communicates. A batch's documents are
:mod:`lightning_fpdt.parallel.packed_documents`; a whole batch is prepared with
:func:`lightning_fpdt.parallel.batches.shard_batch`, which uses both.

Notation: ``S`` global sequence length, ``P`` sequence-parallel size, ``C`` chunk size in global
tokens. The sequence is cut into chunks of ``C`` tokens (the last may be shorter); chunk ``i`` is
cut into ``P`` equal sub-chunks and rank ``r`` holds sub-chunk ``r`` of every chunk, in chunk
order. After the all-to-all that gathers the sequence and scatters heads, local chunk ``i`` is
therefore global chunk ``i``, contiguous (FPDT, Yao et al. 2024, section 3.2). With ``C = None``
(no chunking) there is one chunk and the layout is the contiguous split of plain Ulysses.

With a ring (``P = U x R``: ``R`` Ulysses groups of ``U`` consecutive ranks, :mod:`lightning_fpdt.attention.ring`),
each chunk is cut into ``2R`` equal pieces and Ulysses group ``a`` holds pieces ``a`` and ``2R - 1 - a`` (the
zigzag): under causal attention every ring rank then has the same work in every chunk, where contiguous quarters
would give the last one ``2R - 1`` times the first one's diagonal work. Inside the group the ``U`` ranks hold the
group's tokens in equal sub-chunks, in order, so the group's all-to-all gathers its two pieces, in order. ``R = 1``
is the layout above. Every chunk then divides by ``lcm(P, 2R)`` (:func:`layout_multiple`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_fpdt.errors import FPDTError, is_positive_int

IGNORE_INDEX = -100  # the target id that trains nothing (torch's cross-entropy default, Hugging Face's labels)


def chunk_lengths(seq_len: int, chunk_size: int | None) -> list[int]:
    """Global lengths of the chunks of a sequence: ``chunk_size`` each, the last one shorter.

    Args:
        seq_len: global sequence length ``S``.
        chunk_size: global tokens per chunk ``C``; ``None`` means one chunk of ``S`` tokens.
    """
    if seq_len <= 0:
        raise FPDTError(f"The sequence length must be positive, got {seq_len}.")
    if chunk_size is None or chunk_size >= seq_len:
        return [seq_len]
    if chunk_size <= 0:
        raise FPDTError(f"chunk_size must be a positive number of tokens, got {chunk_size}.")
    full, rest = divmod(seq_len, chunk_size)
    return [chunk_size] * full + ([rest] if rest else [])


def layout_multiple(sp_size: int, ring_size: int = 1) -> int:
    """What every chunk's length divides by: ``sp_size`` sub-chunks, and with a ring ``2 x ring_size`` pieces."""
    return sp_size if ring_size == 1 else math.lcm(sp_size, 2 * ring_size)


def padded_length(seq_len: int, sp_size: int, chunk_size: int | None = None, ring_size: int = 1) -> int:
    """Smallest length ``>= seq_len`` that the layout accepts: every chunk divides by :func:`layout_multiple`.

    Chunks are ``chunk_size`` long (a multiple of it) except the last, so only the total needs to be a
    multiple of it: no whole chunk of padding is ever added.
    """
    validate_chunk_size(chunk_size, sp_size, ring_size)
    multiple = layout_multiple(sp_size, ring_size)
    return -(-seq_len // multiple) * multiple


def validate_chunk_size(chunk_size: int | None, sp_size: int, ring_size: int = 1) -> None:
    """Raise if ``chunk_size`` cannot be cut into ``sp_size`` equal sub-chunks (and, with a ring, ``2 x ring_size``
    equal pieces)."""
    if ring_size < 1 or sp_size % ring_size != 0:
        raise FPDTError(f"ring_size={ring_size} does not divide sequence_parallel_size={sp_size}: the group is"
                        f" ulysses x ring ranks. Use a ring_size that divides {sp_size}.")
    if chunk_size is None:
        return
    if not is_positive_int(chunk_size):
        raise FPDTError(f"chunk_size must be a positive int or None, got {chunk_size!r}.")
    multiple = layout_multiple(sp_size, ring_size)
    if chunk_size % multiple != 0:
        lower = max(multiple, chunk_size // multiple * multiple)
        if ring_size == 1:
            divisor = f"sequence_parallel_size={sp_size}"
            why = f"each chunk is split into {sp_size} equal sub-chunks, one per rank"
        else:
            divisor = f"{multiple} (sequence_parallel_size={sp_size}, ring_size={ring_size})"
            why = (f"each chunk is split into {sp_size} equal sub-chunks, one per rank, and {2 * ring_size} equal"
                   " pieces, two per ring rank")
        raise FPDTError(f"chunk_size={chunk_size} is not divisible by {divisor}: {why}. Use a multiple of {multiple},"
                        f" e.g. {lower} or {lower + multiple}.")


def ring_pieces(start: int, length: int, ring_size: int, ring_rank: int) -> tuple[tuple[int, int], ...]:
    """Global ranges ``[lo, hi)`` of the chunk ``start .. start + length`` that ring rank ``ring_rank`` holds, in
    order: the whole chunk without a ring, else pieces ``a`` and ``2R - 1 - a`` of ``2R`` (one range when they
    touch)."""
    if ring_size == 1:
        return ((start, start + length),)
    piece = length // (2 * ring_size)
    first = (start + ring_rank * piece, start + (ring_rank + 1) * piece)
    second = (start + (2 * ring_size - 1 - ring_rank) * piece, start + (2 * ring_size - ring_rank) * piece)
    return ((first[0], second[1]),) if first[1] == second[0] else (first, second)


def fpdt_permutation(seq_len: int, sp_size: int, chunk_size: int | None = None, ring_size: int = 1) -> Tensor:
    """Global token indices in layout order: rank 0's shard first, then rank 1's, ...

    ``x[:, perm]`` reorders a sequence so that ``x[:, perm].chunk(sp_size, dim=1)[r]`` is rank
    ``r``'s shard. ``seq_len`` must be a multiple of :func:`layout_multiple` (see :func:`padded_length`).

    Returns:
        A ``[seq_len]`` int64 tensor.
    """
    validate_chunk_size(chunk_size, sp_size, ring_size)
    if seq_len % layout_multiple(sp_size, ring_size) != 0:
        sizes = f"sequence_parallel_size={sp_size}" + (f" and 2 x ring_size={2 * ring_size}" if ring_size > 1 else "")
        raise FPDTError(
            f"The sequence length {seq_len} is not divisible by {sizes}; pad it to"
            f" {padded_length(seq_len, sp_size, ring_size=ring_size)} first (FPDTStrategy does this for you)."
        )
    per_rank: list[list[Tensor]] = [[] for _ in range(sp_size)]
    ulysses = sp_size // ring_size
    start = 0
    for length in chunk_lengths(seq_len, chunk_size):
        sub = length // sp_size
        for a in range(ring_size):  # ring rank a: Ulysses group a, ranks a * U .. a * U + U - 1
            held = torch.cat([torch.arange(lo, hi) for lo, hi in ring_pieces(start, length, ring_size, a)])
            for u in range(ulysses):
                per_rank[a * ulysses + u].append(held[u * sub:(u + 1) * sub])
        start += length
    return torch.cat([idx for rank in per_rank for idx in rank])


@functools.lru_cache(maxsize=256)  # every layer of a step asks the same: the same tensor, read only
def gathered_order(seq_len: int, sp_size: int, chunk_size: int | None, ring_size: int, start: int,
                   length: int) -> Tensor | None:
    """The order that sorts chunk ``start .. start + length`` as an all-to-all over all ``sp_size`` ranks gathers it
    (every rank's sub-chunk, in rank order) into sequence order; ``None`` when it is in order already (no ring).

    Returns:
        ``[length]`` int64 indices into the gathered chunk.
    """
    if ring_size == 1:
        return None
    first, sub = start // sp_size, length // sp_size  # the chunk's sub-chunk: the same local offset on every rank
    return torch.argsort(_held(seq_len, sp_size, chunk_size, ring_size)[:, first:first + sub].reshape(-1))


@functools.lru_cache(maxsize=8)
def _held(seq_len: int, sp_size: int, chunk_size: int | None, ring_size: int) -> Tensor:
    """``[P, seq_len / P]``: the global index of each rank's tokens (read only: cached for every chunk)."""
    return fpdt_permutation(seq_len, sp_size, chunk_size, ring_size).view(sp_size, -1)


def inverse_permutation(perm: Tensor) -> Tensor:
    """The permutation ``inv`` with ``x[:, perm][:, inv] == x``."""
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def shard_indices(seq_len: int, sp_size: int, sp_rank: int, chunk_size: int | None = None,
                  ring_size: int = 1) -> Tensor:
    """Global token indices held by ``sp_rank``, in local order. ``[seq_len // sp_size]`` int64."""
    if not 0 <= sp_rank < sp_size:
        raise FPDTError(f"sp_rank={sp_rank} is outside [0, {sp_size}).")
    return fpdt_permutation(seq_len, sp_size, chunk_size, ring_size).view(sp_size, -1)[sp_rank]


def local_token_indices(seq_len: int, sp_size: int, sp_rank: int, chunk_size: int | None, first: int, count: int,
                        ring_size: int = 1) -> Tensor:
    """``shard_indices(...)[first:first + count]``: the global indices of the rank's local tokens ``first .. first +
    count - 1`` (``[count]`` int64), made from the chunks that range meets alone (a streamed layer asks for one chunk's;
    no index of the whole sequence is built) unless the ring splits chunks (``ring_size`` > 1)."""
    if ring_size > 1:
        return shard_indices(seq_len, sp_size, sp_rank, chunk_size, ring_size)[first:first + count]
    pieces, local, start = [], 0, 0
    for length in chunk_lengths(seq_len, chunk_size):
        sub = length // sp_size  # this chunk's tokens on each rank: rank r holds start + r * sub ..
        lo, hi = max(first, local), min(first + count, local + sub)
        if lo < hi:
            pieces.append(torch.arange(lo, hi) + (start + sp_rank * sub - local))
        local, start = local + sub, start + length
        if local >= first + count:
            break
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def shard_sequence(x: Tensor, sp_size: int, sp_rank: int, chunk_size: int | None = None, dim: int = 1,
                   ring_size: int = 1) -> Tensor:
    """This rank's shard of a full-sequence tensor along ``dim`` (default: ``[batch, seq, ...]``)."""
    idx = shard_indices(x.shape[dim], sp_size, sp_rank, chunk_size, ring_size).to(x.device)
    return x.index_select(dim, idx)


def unshard_sequence(shards: Sequence[Tensor], chunk_size: int | None = None, dim: int = 1,
                     ring_size: int = 1) -> Tensor:
    """Inverse of :func:`shard_sequence`: the full sequence from every rank's shard, in rank order."""
    sp_size = len(shards)
    laid_out = torch.cat(list(shards), dim=dim)
    perm = fpdt_permutation(laid_out.shape[dim], sp_size, chunk_size, ring_size)
    return laid_out.index_select(dim, inverse_permutation(perm).to(laid_out.device))


def shift_labels(labels: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Hugging Face labels (``labels[t]`` is token ``t``) to pre-shifted ones (target of token ``t``).

    ``[batch, seq]`` in, ``[batch, seq]`` out; the last position gets ``ignore_index``. This must
    happen on the whole sequence, before sharding: after sharding the next token may live on
    another rank.
    """
    shifted = torch.full_like(labels, ignore_index)
    shifted[:, :-1] = labels[:, 1:]
    return shifted


def pad_sequence(x: Tensor, length: int, value: float | int, dim: int = 1) -> Tensor:
    """Pad ``x`` at the end of ``dim`` to ``length`` with ``value``."""
    missing = length - x.shape[dim]
    if missing < 0:
        raise FPDTError(f"Cannot pad a sequence of length {x.shape[dim]} down to {length}.")
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x, x.new_full(shape, value)], dim=dim)


def default_position_ids(batch_size: int, seq_len: int, device: torch.device | None = None) -> Tensor:
    """``[batch, seq]`` global positions ``0 .. seq-1``."""
    return torch.arange(seq_len, device=device).unsqueeze(0).expand(batch_size, seq_len)
