"""Short-convolution layers (LFM2's ``ShortConv``) sequence-parallel and exact under the FPDT layout.

A short convolution is ``out_proj(C * conv(B * x))`` with ``B, C, x = in_proj(h)`` and a causal depthwise
convolution of ``K`` taps (LFM2: 3) along the sequence. Token ``t``'s output reads tokens ``t - K + 1 .. t`` of
its document. Under the FPDT layout a rank holds sub-chunk ``(i, r)`` of every global chunk ``i`` (``C / P``
tokens each; :func:`lightning_fpdt.parallel.layout.fpdt_permutation`), so the ``K - 1`` tokens before a sub-chunk are
the tail of sub-chunk ``(i, r - 1)`` on rank ``r - 1``, or for ``r = 0`` the tail of ``(i - 1, P - 1)`` on the last
rank (and the sub-chunks before that too where sub-chunks are shorter than ``K - 1`` tokens: a short last chunk).
The convolution's tail is carried that way: one all-gather of every sub-chunk's last ``K - 1`` inputs of the
convolution (``[P, batch, chunks, K - 1, width]``, autograd-aware), then each sub-chunk convolved with its tail in
front, sub-chunk by sub-chunk. No whole-sequence tensor exists. Under a ring's zigzag layout a rank's tokens may
follow tokens of any rank: there each rank sends the rows other ranks' taps read, found from the layout once per
shape (:func:`_zigzag_causal_conv`). A lag reaching into an earlier document
(packed documents, padding) contributes nothing: the history restarts at every document start, as each document
alone computes it.

:func:`~lightning_fpdt.hf.mixer_install.install_short_convs` gives each such module this forward, after checking
on the module itself (one process, random input) that it computes what the module's own forward does; a module that
does not pass stays as it is, and the token-mixing guard refuses it beyond one rank.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_fpdt.errors import Unsupported
from lightning_fpdt.layers.carried import MixerStream
from lightning_fpdt.layers.layer_stream import active_stream
from lightning_fpdt.parallel.binding import SequenceParallelContext
from lightning_fpdt.parallel.comm import all_gather_autograd, group_rank, group_size
from lightning_fpdt.parallel.layout import chunk_lengths, fpdt_permutation
from lightning_fpdt.parallel.packed_documents import PackedDocuments, token_positions


def is_short_conv(module: nn.Module) -> bool:
    """Whether ``module`` has the parts of a short convolution: ``in_proj`` (width -> 3 x width), a depthwise
    causal ``conv`` (``Conv1d`` with ``groups == channels`` and ``K - 1`` padding) and ``out_proj``."""
    conv, inp, out = (getattr(module, n, None) for n in ("conv", "in_proj", "out_proj"))
    inp, out = (getattr(m, "base_layer", m) for m in (inp, out))  # a LoRA-adapted projection (lightning_fpdt.hf.lora)
    if not (isinstance(conv, nn.Conv1d) and isinstance(inp, nn.Linear) and isinstance(out, nn.Linear)):
        return False
    k = conv.kernel_size[0]
    return (conv.groups == conv.in_channels == conv.out_channels == inp.in_features == out.out_features
            and inp.out_features == 3 * inp.in_features and conv.padding[0] == k - 1 and conv.stride[0] == 1
            and conv.dilation[0] == 1)


class SequenceParallelShortConv:
    """A short-convolution module instance's ``forward`` under FPDT (see the module docstring).

    Reads the ``fpdt_context`` and ``documents`` keywords the decoder layer passes on (``None``: one process,
    one document per sample, one chunk). While :attr:`position_wise` is set (the token-mixing probe), it keeps
    only the convolution's last tap: a position-wise stand-in, as attention's stand-in sees its own key only.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.position_wise = False

    def __call__(self, hidden_states: Tensor, *args: Any, fpdt_context: SequenceParallelContext | None = None,
                 documents: PackedDocuments | None = None, **kwargs: Any) -> Tensor:
        m = self.module
        b, s_local, width = hidden_states.shape  # s_local = S // sp
        bcx = m.in_proj(hidden_states)  # [b, s_local, 3 width]
        gate_b, gate_c, x = bcx.chunk(3, dim=-1)
        u = gate_b * x  # the convolution's input, [b, s_local, width]
        weight = m.conv.weight[:, 0, :]  # [width, K]; tap K - 1 multiplies the token itself
        stream = active_stream(m)
        if self.position_wise:
            y = u * weight[:, -1]
        elif isinstance(stream, MixerStream):  # one chunk of a streamed layer (lightning_fpdt.layers.carried)
            y = causal_conv_chunk(u, weight, fpdt_context or SequenceParallelContext(), documents, stream,
                                  MixerStream.key(m, "conv"))
        else:
            y = causal_conv(u, weight, fpdt_context or SequenceParallelContext(), documents)
        if m.conv.bias is not None:
            y = y + m.conv.bias
        return m.out_proj(gate_c * y)


def causal_conv(u: Tensor, weight: Tensor, ctx: SequenceParallelContext, documents: PackedDocuments | None) -> Tensor:
    """The causal depthwise convolution of this rank's tokens ``u`` ``[b, s_local, width]`` (FPDT layout) with
    ``weight`` ``[width, K]`` (tap ``K - 1`` multiplies the token itself), its history restarting at each document
    start: ``[b, s_local, width]``.

    Each sub-chunk's last ``K - 1`` inputs (all of them, when it is shorter) are all-gathered; the ``K - 1`` tokens
    before a sub-chunk are then the tails of the sub-chunks before it in global order, nearest first, as many as it
    takes (one, unless sub-chunks are shorter than ``K - 1`` tokens: a short last chunk).
    """
    b, s_local, width = u.shape
    k1 = weight.shape[1] - 1  # the taps before the token itself
    p, rank = group_size(ctx.group), group_rank(ctx.group)
    if ctx.ring_size > 1:
        return _zigzag_causal_conv(u, weight, ctx, documents)
    lengths = [n // p for n in chunk_lengths(s_local * p, ctx.chunk_size)]  # every rank's sub-chunks, in order
    parts = u.split(lengths, dim=1)
    # each sub-chunk's tail, left-padded to K - 1 tokens: [b, chunks, K - 1, width]
    tails = torch.stack([F.pad(part[:, max(part.shape[1] - k1, 0):], (0, 0, k1 - min(part.shape[1], k1), 0))
                         for part in parts], dim=1)
    if p > 1:  # every rank's tails, [P, b, chunks, K - 1, width]
        gathered = all_gather_autograd(tails, 0, ctx.group)
        gathered = gathered.view(p, *tails.shape)
    else:
        gathered = tails.unsqueeze(0)
    windows = []
    for i, part in enumerate(parts):  # sub-chunk (i, rank)
        halo, need, chunk, owner = [], k1, i, rank - 1
        while need > 0:  # the sub-chunks before it, nearest first: (i, rank - 1), ..., (i - 1, P - 1), ...
            if owner < 0:
                chunk, owner = chunk - 1, p - 1
            if chunk < 0:  # the start of the sequence; the empty slice keeps the gather in this rank's graph even
                # when it reads no tail (rank 0, one chunk), so every rank runs its backward (a reduce-scatter)
                halo.insert(0, torch.cat([u.new_zeros(b, need, width), gathered[0][:, 0, :0]], dim=1))
                break
            take = min(lengths[chunk], k1, need)
            halo.insert(0, gathered[owner][:, chunk, k1 - take:])
            need, owner = need - take, owner - 1
        # window j ends at token j of the sub-chunk: [b, n, width, K]
        windows.append(torch.cat([*halo, part], dim=1).unfold(1, k1 + 1, 1))
    valid = _taps_in_document(token_positions(s_local, p, rank, ctx.chunk_size, documents, u.device), k1 + 1)
    return torch.einsum("bswk,wk->bsw", torch.cat(windows, dim=1) * valid.unsqueeze(2).to(u.dtype), weight)


def causal_conv_chunk(u: Tensor, weight: Tensor, ctx: SequenceParallelContext, documents: PackedDocuments | None,
                      stream: MixerStream, key: str) -> Tensor:
    """:func:`causal_conv` of one chunk of a streamed layer (:mod:`lightning_fpdt.layers.carried`): ``u`` ``[b, n,
    width]`` is this rank's sub-chunk of global chunk ``stream.chunk``; ``[b, n, width]`` out.

    The ``K - 1`` inputs before the chunk arrive carried under ``key`` (zeros at the start of the sequence); every
    rank's last ``K - 1`` inputs of the sub-chunk are all-gathered (autograd-aware). In global order the chunk is the
    carried inputs, then rank 0's sub-chunk, rank 1's, ...: a rank's ``K - 1`` inputs before its sub-chunk are the
    last ``K - 1`` of the carried ones and the tails of the ranks before it, and the last ``K - 1`` of all of them are
    carried out for the next chunk.
    """
    if ctx.ring_size > 1:
        raise Unsupported("a streamed layer's convolution under a ring (ring_size > 1): the zigzag layout's"
                                  " chunks are not in sequence order; such layers are recomputed whole")
    b, n, width = u.shape
    k1 = weight.shape[1] - 1  # the taps before the token itself
    p, rank = group_size(ctx.group), group_rank(ctx.group)
    held = min(n, k1)  # a sub-chunk shorter than K - 1 tokens is its whole tail
    tail = u[:, n - held:]
    tails = list(all_gather_autograd(tail, 0, ctx.group).split(b)) if p > 1 else [tail]  # each rank's [b, held, w]
    before = stream.carried(key)
    before = u.new_zeros(b, k1, width) if before is None else before.to(u.dtype)
    halo = torch.cat([before, *tails[:rank]], dim=1)[:, -k1:] if k1 else u.new_zeros(b, 0, width)
    stream.carry(key, torch.cat([before, *tails], dim=1)[:, -k1:] if k1 else before)
    windows = torch.cat([halo, u], dim=1).unfold(1, k1 + 1, 1)  # window j ends at token j: [b, n, width, K]
    positions = token_positions(stream.s_local, p, rank, ctx.chunk_size, documents, u.device, ctx.ring_size,
                                stream.lo, n)  # [b or 1, n], in each token's document
    valid = _taps_in_document(positions, k1 + 1)
    return torch.einsum("bswk,wk->bsw", windows * valid.unsqueeze(2).to(u.dtype), weight)


@functools.lru_cache(maxsize=16)
def _halo_plan(seq_len: int, p: int, chunk_size: int | None, ring: int, rank: int, k1: int) -> tuple[Tensor, ...]:
    """For the zigzag layout of a ring: the local rows every rank sends (``[P, M]``, padded with row 0), and where each
    of this rank's ``(token, tap)`` reads from (``[s_local, K]`` rows of ``cat(u, zero row, the P x M sent rows)``)."""
    held = fpdt_permutation(seq_len, p, chunk_size, ring).view(p, -1)  # [P, s_local] global index of each row
    s_local = held.shape[1]
    owner, row = torch.empty(seq_len, dtype=torch.long), torch.empty(seq_len, dtype=torch.long)
    owner[held.reshape(-1)] = torch.arange(p).repeat_interleave(s_local)
    row[held.reshape(-1)] = torch.arange(s_local).repeat(p)
    lags = torch.arange(k1, -1, -1)  # tap j reads lag K - 1 - j
    wanted = held.unsqueeze(-1) - lags  # [P, s_local, K] global positions each rank's taps read
    remote = (wanted >= 0) & (owner[wanted.clamp(min=0)] != torch.arange(p)[:, None, None])
    sent = [torch.unique(wanted[remote & (owner[wanted.clamp(min=0)] == q)]) for q in range(p)]  # what q sends
    most = max(1, max(len(x) for x in sent))
    rows = torch.zeros(p, most, dtype=torch.long)
    slot = torch.zeros(seq_len, dtype=torch.long)  # a sent position's row in the gathered block
    for q, positions in enumerate(sent):
        rows[q, :len(positions)] = row[positions]
        slot[positions] = s_local + 1 + q * most + torch.arange(len(positions))
    mine = wanted[rank]
    source = torch.where(mine < 0, s_local, torch.where(remote[rank], slot[mine.clamp(min=0)], row[mine.clamp(min=0)]))
    return rows, source


def _zigzag_causal_conv(u: Tensor, weight: Tensor, ctx: SequenceParallelContext,
                        documents: PackedDocuments | None) -> Tensor:
    """:func:`causal_conv` under a ring's zigzag layout, where a rank's tokens may follow tokens of any rank: every
    rank sends the rows other ranks' taps read (one all-gather, autograd-aware), and each tap reads its row of this
    rank's tokens, a zero row (before the sequence) or the gathered ones."""
    b, s_local, width = u.shape
    k1, p, rank = weight.shape[1] - 1, group_size(ctx.group), group_rank(ctx.group)
    rows, source = (t.to(u.device) for t in _halo_plan(s_local * p, p, ctx.chunk_size, ctx.ring_size, rank, k1))
    sent = u[:, rows[rank]]  # [b, M, width]
    gathered = all_gather_autograd(sent, 1, ctx.group)  # [b, P x M, width]
    table = torch.cat([u, u.new_zeros(b, 1, width), gathered], dim=1)
    windows = table[:, source]  # [b, s_local, K, width]
    valid = _taps_in_document(token_positions(s_local, p, rank, ctx.chunk_size, documents, u.device, ctx.ring_size),
                              k1 + 1)
    return torch.einsum("bskw,wk->bsw", windows * valid.unsqueeze(-1).to(u.dtype), weight)


def _taps_in_document(positions: Tensor, k: int) -> Tensor:
    """``[b or 1, n, K]`` bool: whether tap ``j`` (lag ``K - 1 - j``) of each token, at ``positions`` ``[b or 1, n]``
    in its document (:func:`~lightning_fpdt.parallel.packed_documents.token_positions`), lies in that document."""
    return positions.unsqueeze(-1) >= torch.arange(k - 1, -1, -1, device=positions.device)
