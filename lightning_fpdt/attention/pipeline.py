"""The FPDT attention pipeline: per-chunk all-to-all, online softmax, chunked backward.

Inputs are this rank's shards in the FPDT layout (``lightning_fpdt.parallel.layout``): ``[batch, s_local,
heads, head_dim]`` with ``s_local = S / P``, local chunk ``i`` being sub-chunk ``rank`` of global
chunk ``i``. One all-to-all per chunk turns local chunk ``i`` into global chunk ``i`` with
``heads / P`` heads (docs/how-fpdt-works.md, sections 1 to 4).

Forward, for each query chunk ``i``: all-to-all ``q_i, k_i, v_i``; attend ``q_i`` to ``k_j, v_j``
for ``j <= i`` (causal; all ``j`` otherwise), the diagonal block first while it is on the device,
then ``j = 0, 1, ...``; merge with :func:`update_out_and_lse` (then each head's sink logit, if any);
all-to-all the output chunk back. Which blocks run, and on what part of themselves, is decided by
:class:`~lightning_fpdt.attention.blocks.BlockRules` (causality, documents, a sliding window, attention
chunks): a skipped block is absent from both passes' schedules, so it gets no prefetch, copy or kernel.

Backward: outer loop over key/value chunks ``j``, inner loop over query chunks ``i`` (``i >= j``
when causal). After outer step ``j``, dk_j and dv_j (and for causal attention dq_j) are final and go
back through the inverse all-to-all, so nothing of the size of the whole sequence with ``heads / P``
heads is ever materialised beyond the saved chunks, which live in a :class:`ChunkStore` (host
memory when offloaded).

Overlap, both ways: each pass runs its blocks (forward) or steps (backward) as one sequence, and
before computing one it issues what the next needs, waiting for it only after the compute. Copies:
the next block's k/v (forward; across query chunks too) or the next step's query-side set (q, out,
lse, dout, dq) and, when the outer step changes, its k/v (backward), so every chunk after a pass's
first is prefetched one compute ahead. Communication (:class:`~lightning_fpdt.parallel.comm.Exchange`,
asynchronous all-to-alls): the next query chunk's q/k/v and the next ``dout`` chunk are issued before
the current compute; output and gradient chunks are sent when final and waited for after the next
compute. Every rank issues the same collectives in the same order, whatever it computes.

Where the local chunks come from and where their gradients go is not this module's business: a
:class:`ChunkSource` hands out local q/k/v chunks and a :class:`ChunkSink` takes the final gradient
chunks (``lightning_fpdt.attention.ends``). ``lightning_fpdt.attention.sources`` has the two pairs:
slices of whole q/k/v tensors (``fpdt_attention``) and q/k/v projected chunk by chunk from a block's
input (``FPDTAttention``).
:class:`PipelineFunction` is the one autograd Function over any pair (:class:`PipelineEnds`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_fpdt.attention.backward import pipeline_backward
from lightning_fpdt.attention.block_calls import block_forward
from lightning_fpdt.attention.ends import ChunkSource, PipelineEnds
from lightning_fpdt.attention.kept_answers import ANSWER_KINDS, active_keeper
from lightning_fpdt.attention.merge import merge_sink, update_out_and_lse
from lightning_fpdt.attention.pipeline_options import PipelineOptions
from lightning_fpdt.attention.ring import PendingParts, exchange_parts, pack, unpack
from lightning_fpdt.offload.autocast_state import AutocastState
from lightning_fpdt.offload.chunk_store import ChunkStore
from lightning_fpdt.offload.weight_casts import weights_cast_once
from lightning_fpdt.parallel.comm import Exchange, PendingAllToAll, group_rank, group_size
from lightning_fpdt.profiling import named_range

KV_KINDS = {"k": "kv", "v": "kv"}
QUERY_KINDS = {"q": "query", "o": "query", "lse": "query", "do": "query", "dq": "query"}


class ForwardPass:
    """One forward pass of the pipeline over ``s_local`` local tokens, one query chunk at a time: what both of
    its drivers share (:func:`pipeline_forward`, which looks one chunk ahead, and a streamed decoder layer's
    attention, which is handed each chunk's q/k/v as its layer computes them: :mod:`lightning_fpdt.layers.streaming`).

    For query chunk ``i``: :meth:`issue` its all-to-alls, :meth:`receive` them (its k/v join ``store``),
    :meth:`attend` (the blocks ``(i, m)`` in order, merged, sinks joined), :meth:`send` the output chunk back.
    Every rank issues the same collectives in the same order. ``save_for_backward``: the query side (q, out, lse)
    stays in ``store`` for :func:`pipeline_backward`.

    ``answers``: ``"keep"`` leaves each chunk's output and lse in ``store`` (a recomputed layer's first run:
    :mod:`lightning_fpdt.attention.kept_answers`); ``"recall"`` takes them from ``store``, where that run left them,
    instead of computing attention (its recomputation: no kernel runs; the all-to-alls and the k/v parts still do).
    """

    def __init__(self, opt: PipelineOptions, store: ChunkStore, s_local: int, save_for_backward: bool = True,
                 sinks: Tensor | None = None, keep_lse: bool = True, answers: str | None = None) -> None:
        self.opt, self.store, self.save, self.sinks, self.keep_lse = opt, store, save_for_backward, sinks, keep_lse
        self.answers = answers
        self.bounds, self.plan = opt.plan(s_local)
        self.exchange = Exchange(opt.group, overlap=opt.overlap_comm)
        # skipped blocks are dropped here: no prefetch, copy, move or kernel for them (the diagonal always stays)
        self.orders = [self.plan.key_parts(i, opt.causal) for i in range(len(self.bounds))]
        self.next_key = [m for order in self.orders for m in order][1:] + [None]  # the key part after each block
        if answers != "recall":
            store.stats.count_blocks(len(self.next_key), self.plan.candidates)
        self.lses: list[Tensor] = []
        self.moving: dict[int, tuple[PendingParts, tuple[torch.Size, ...]]] = {}  # chunk -> peers' parts coming
        self.block = 0  # index of the current block in the sequence of all blocks

    def issue(self, i: int, q: Tensor | None, k: Tensor | None = None, v: Tensor | None = None
              ) -> tuple[PendingAllToAll, ...]:
        """Start the all-to-alls of local chunk ``i``'s q (when given) and k/v (when given, KV heads replicated), as one
        collective."""
        xs = ([] if q is None else [q]) + ([k, v] if k is not None and v is not None else [])
        return self.exchange.seq_to_head_many(xs, f"{'q' if q is not None else ''}kv{i}")

    def store_kv(self, j: int, pending: tuple[PendingAllToAll, ...], keep: bool) -> None:
        """Chunk ``j``'s k/v part into the store, and on its way to the ring peers whose queries see it."""
        store, plan = self.store, self.plan
        with named_range("fpdt/all_to_all"):
            k_j, v_j = (p.wait() for p in pending)  # [b, C_j / R, h_kv/U, d]: this ring rank's part
        store.put(("k", plan.own(j)), k_j, keep_on_device=keep)
        store.put(("v", plan.own(j)), v_j, keep_on_device=keep)
        sends = dict.fromkeys(plan.sends[j], pack(k_j, v_j)) if plan.sends[j] else {}
        flat = torch.Size([k_j.numel() + v_j.numel()])  # a peer's part has this rank's shapes
        self.moving[j] = exchange_parts(self.opt.ring_group, sends, dict.fromkeys(plan.receives[j], flat), k_j.dtype,
                                        k_j.device), (k_j.shape, v_j.shape)

    def land(self, j: int, now: set[int]) -> None:
        """The peers' parts of chunk ``j`` into the store (``now``: the ones the next blocks read)."""
        if j not in self.moving:
            return
        pending, shapes = self.moving.pop(j)
        with named_range("fpdt/ring"):
            received = pending.wait()
        for peer, flat in received.items():
            m = j * self.plan.size + peer
            k_m, v_m = unpack(flat, *shapes)
            self.store.put(("k", m), k_m, keep_on_device=m in now)
            self.store.put(("v", m), v_m, keep_on_device=m in now)

    def receive(self, i: int, pending: tuple[PendingAllToAll, ...]) -> Tensor:
        """Query chunk ``i``'s q part ``[b, C_i / R, h/U, d]`` (causal: its k/v part goes into the store)."""
        with named_range("fpdt/all_to_all"):
            q_i = pending[0].wait()
        if self.opt.causal:
            self.store_kv(i, pending[1:], keep=True)
        return q_i

    def attend(self, i: int, q_i: Tensor, dtype: torch.dtype) -> Tensor:
        """Query chunk ``i``'s output ``[b, C_i / R, h/U, d_v]`` in ``dtype``, over every key block it sees."""
        if self.answers == "recall":
            return self.recall(i, q_i)
        store, plan, opt = self.store, self.plan, self.opt
        out_i = lse_i = None
        for m in self.orders[i]:
            if i in self.moving and m // plan.size == i and m != plan.own(i):  # a peer's part of this chunk, first read
                self.land(i, {x for x in self.orders[i] if x // plan.size == i})
            nxt = self.next_key[self.block]
            # issue the next block's copy before computing this one (a causal diagonal comes by all-to-all)
            if nxt is not None and nxt != m and ("k", nxt) in store:
                store.prefetch(("k", nxt))
                store.prefetch(("v", nxt))
            k_m, v_m = store.get(("k", m)), store.get(("v", m))
            with named_range("fpdt/attention_chunk"):
                block_out, block_lse = block_forward(opt.kernel, q_i, k_m, v_m, plan.blocks[(i, m)], opt.scale,
                                                     opt.softcap)
                out_i, lse_i = update_out_and_lse(out_i, lse_i, block_out, block_lse, in_place=True)
            if nxt != m:  # full attention's block (n-2, n-1) is followed by (n-1, n-1): keep it
                store.evict(("k", m))
                store.evict(("v", m))
            self.block += 1
        self.land(i, set())  # parts only later chunks read
        assert out_i is not None and lse_i is not None
        if self.sinks is not None:  # once per row, after every key block
            out_i, lse_i = merge_sink(out_i, lse_i, self.sinks)
        out_i = out_i.to(dtype)
        if self.save or self.answers == "keep":  # once per chunk: the backward's kernel calls read it once per block
            lse_i = lse_i.contiguous()
        if self.keep_lse:
            self.lses.append(lse_i)
        if self.save:
            store.put(("q", i), q_i)
        if self.save or self.answers == "keep":
            store.put(("o", i), out_i)
            store.put(("lse", i), lse_i)
        return out_i

    def recall(self, i: int, q_i: Tensor) -> Tensor:
        """Query chunk ``i``'s output as the layer's first run left it in the store (``answers="recall"``): no kernel.
        The chunk's k/v parts (own and the ring peers') join the store for the backward, as :meth:`attend` leaves
        them."""
        store = self.store
        self.land(i, set())
        for m in self.orders[i]:
            if m // self.plan.size == i:  # this chunk's parts arrived with it: off the device until backward
                store.evict(("k", m))
                store.evict(("v", m))
        self.block += len(self.orders[i])
        for kind in ("o", "lse") if self.keep_lse else ("o",):  # the next chunk's answer comes while this one is sent
            if (kind, i + 1) in store:
                store.prefetch((kind, i + 1))
        out_i = store.get(("o", i))
        store.evict(("o", i))
        if self.keep_lse:
            self.lses.append(store.get(("lse", i)))
            store.evict(("lse", i))
        if self.save:
            store.put(("q", i), q_i)
        return out_i

    def send(self, i: int, out_i: Tensor) -> PendingAllToAll:
        """Start sending query chunk ``i``'s output back: ``[b, C_i / P, h, d_v]`` once waited for."""
        return self.exchange.head_to_seq(out_i, f"out{i}")

    def close(self) -> Tensor | None:
        """End the pass; the lse ``[b, h/U, S/R]`` of every chunk (head-sharded, layout order), if kept."""
        self.exchange.close()
        if not self.keep_lse:
            return None
        return self.lses[0] if len(self.lses) == 1 else torch.cat(self.lses, dim=2)


def pipeline_forward(
    source: ChunkSource, opt: PipelineOptions, store: ChunkStore, save_for_backward: bool = True,
    sinks: Tensor | None = None, answers: str | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention output ``[b, s_local, h, d_v]`` (``d_v`` v's head width) and lse ``[b, h/P, S]`` (head-sharded,
    layout order; with the ``sinks`` ``[h/P]`` of this rank's heads joined to every row, when given).

    With ``save_for_backward`` the query-side chunks (q, out, lse) stay in ``store`` for
    :func:`pipeline_backward`; without it only k/v pass through the store, for this forward's own use.
    ``answers``: keep or recall the chunks' outputs and lse (:class:`ForwardPass`).

    Overlap: query chunk ``i + 1``'s all-to-alls are issued before chunk ``i``'s attention and waited
    for after it, and chunk ``i``'s output all-to-all is waited for after chunk ``i + 1``'s attention.
    The blocks ``(i, j)`` run as one sequence, and the key block after the current one is prefetched
    while the current one computes, also across query chunks.
    """
    b, s_local, h, d = source.q_shape  # s_local = S // P; h = all query heads
    fp = ForwardPass(opt, store, s_local, save_for_backward, sinks, answers=answers)
    bounds, n = fp.bounds, len(fp.bounds)
    out: Tensor | None = None  # [b, s_local, h, d]: chunks are written in as they arrive

    def issue_chunk(i: int) -> tuple[PendingAllToAll, ...]:
        # causal attention gathers each chunk's k/v with its q; full attention gathered them all first
        return fp.issue(i, source.q(*bounds[i]), *(source.kv(*bounds[i]) if opt.causal else ()))

    def place(sent: tuple[PendingAllToAll, int, int]) -> None:
        nonlocal out
        pending, lo, hi = sent
        with named_range("fpdt/all_to_all"):
            out_c = pending.wait()  # [b, C_i / P, h, d]
        if out is None:
            out = out_c.new_empty(b, s_local, h, out_c.shape[-1])  # v's width (multi-head latent attention: not q's)
        out[:, lo:hi] = out_c

    if not opt.causal:  # every query chunk needs every key chunk: gather them all first
        ahead = fp.issue(0, None, *source.kv(*bounds[0]))
        for j in range(n):
            current, ahead = ahead, fp.issue(j + 1, None, *source.kv(*bounds[j + 1])) if j + 1 < n else ()
            fp.store_kv(j, current, keep=j == 0)
            fp.land(j, set())
    ahead = issue_chunk(0)
    sent: tuple[PendingAllToAll, int, int] | None = None  # the previous output chunk, on its way back
    for i, (lo, hi) in enumerate(bounds):
        current, ahead = ahead, ()
        q_i = fp.receive(i, current)
        if i + 1 < n:
            ahead = issue_chunk(i + 1)  # runs during this chunk's attention
        out_i = fp.attend(i, q_i, source.dtype)
        if sent is not None:
            place(sent)
        sent = fp.send(i, out_i), lo, hi
    assert sent is not None
    place(sent)
    lse = fp.close()
    assert out is not None and lse is not None
    return out, lse  # lse [b, h/U, S/R]


class PipelineFunction(torch.autograd.Function):
    """``(sinks, *inputs) -> (out, lse)``: the pipeline from ``ends.source(*inputs)``; backward through
    ``ends.sink``.

    ``sinks``: ``None``, or each head's sink logit ``[n_heads]`` (all heads, the same on every rank). Its
    gradient on each rank holds the rank's heads (zeros elsewhere), over the whole sequence: summed over
    the sequence-parallel group, as every parameter's gradient is, it is the sinks' gradient.
    ``out`` ``[b, s_local, h, d]``; ``lse`` ``[b, h/P, S]`` (head-sharded, not differentiable).
    """

    @staticmethod
    def forward(
        ctx: Any, ends: PipelineEnds, opt: PipelineOptions, needs_backward: bool, sinks: Tensor | None,
        *inputs: Tensor,
    ) -> tuple[Tensor, Tensor]:
        keeper = active_keeper()  # a recomputed layer's: its first run keeps the answers, its second recalls them
        kept = keeper.replay() if keeper is not None and keeper.mode == "replay" else None
        if kept is not None and not needs_backward:  # this call's turn, but nothing to answer for
            kept.close()
            kept = None
        keep = keeper is not None and keeper.mode == "record" and not needs_backward
        store = kept if kept is not None else new_store(inputs[0].device, opt)
        source = ends.source(*inputs)
        local_sinks = rank_sinks(sinks, opt.group)
        ctx.autocast = AutocastState.capture(inputs[0].device.type)
        with weights_cast_once(ends.weights, ctx.autocast):  # the projections' weights, cast once, not once per chunk
            out, lse = pipeline_forward(source, opt, store, save_for_backward=needs_backward, sinks=local_sinks,
                                        answers="recall" if kept is not None else "keep" if keep else None)
        if keeper is not None and keeper.mode == "record":
            keeper.record(store if keep else None)
        if keep:
            answers_only(store)
        elif not needs_backward:  # inference: nothing to keep
            finish(store, opt)
        ctx.ends, ctx.opt, ctx.store, ctx.q_dtype = ends, opt, store, source.dtype
        ctx.sinks = local_sinks
        ctx.whole_sinks = None if sinks is None else (sinks.shape, sinks.dtype)
        ctx.save_for_backward(*ends.saved(*inputs))
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: Tensor, _dlse: Tensor | None) -> tuple[Tensor | None, ...]:
        sink = ctx.ends.sink(dout, ctx.q_dtype, *ctx.saved_tensors)
        try:  # the projections' weights cast once for every chunk's gradient, in the forward's compute dtype
            with weights_cast_once(ctx.ends.weights, ctx.autocast):
                dsinks = pipeline_backward(dout.contiguous(), ctx.q_dtype, ctx.opt, ctx.store, sink, ctx.sinks)
        finally:
            finish(ctx.store, ctx.opt)
        grad_sinks = None
        if dsinks is not None and ctx.needs_input_grad[3]:
            shape, dtype = ctx.whole_sinks
            grad_sinks = whole_sinks_grad(dsinks, shape, ctx.opt.group).to(dtype)
        return None, None, None, grad_sinks, *sink.result()


def _rank_heads(n_heads: int, group: ProcessGroup | None) -> slice:
    """This rank's heads after the all-to-all: rank ``r`` of ``P`` holds heads ``r * H/P`` up to
    ``(r + 1) * H/P`` (``lightning_fpdt.parallel.comm``)."""
    per_rank = n_heads // group_size(group)
    rank = group_rank(group)
    return slice(rank * per_rank, (rank + 1) * per_rank)


def rank_sinks(sinks: Tensor | None, group: ProcessGroup | None) -> Tensor | None:
    """This rank's heads (:func:`_rank_heads`) of the sink logits ``[n_heads]``, detached; ``None`` without sinks."""
    return None if sinks is None else sinks.detach()[_rank_heads(sinks.shape[0], group)]


def whole_sinks_grad(dsinks: Tensor, shape: torch.Size, group: ProcessGroup | None) -> Tensor:
    """The gradient of every head's sink logit ``shape = [n_heads]`` from this rank's ``dsinks`` ``[h/U]``: zeros on
    the other ranks' heads (summed over the group, as every parameter's gradient is, it is the sinks' gradient)."""
    whole = dsinks.new_zeros(shape)
    whole[_rank_heads(shape[0], group)] = dsinks
    return whole


def run_pipeline(
    ends: PipelineEnds, opt: PipelineOptions, *inputs: Tensor, sinks: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """:class:`PipelineFunction` over ``inputs`` (and attention ``sinks`` ``[n_heads]``, if any); it saves
    chunks for backward only if one can follow."""
    needs_backward = torch.is_grad_enabled() and any(x.requires_grad for x in (*inputs, sinks) if x is not None)
    return PipelineFunction.apply(ends, opt, needs_backward, sinks, *inputs)


def new_store(device: torch.device, opt: PipelineOptions) -> ChunkStore:
    return ChunkStore(device, offload=opt.offload, groups={**KV_KINDS, **QUERY_KINDS})


def answers_only(store: ChunkStore) -> None:
    """Drop everything but the chunks' outputs and lse (the k/v a forward pass leaves behind)."""
    for key in list(store):
        if key[0] not in ANSWER_KINDS:
            store.delete(key)


def finish(store: ChunkStore, opt: PipelineOptions) -> None:
    """Release everything the store holds and report its figures."""
    store.close()
    if opt.stats_sink is not None:
        opt.stats_sink.append(store.stats)
