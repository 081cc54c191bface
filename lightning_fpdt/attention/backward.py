"""The FPDT attention pipeline's backward pass: outer loop over key/value parts, inner over query chunks.

After the outer steps of key part ``m``, its dk and dv are final; for this rank's own part of chunk ``j`` they go
back through the inverse all-to-all (``lightning_fpdt.attention.pipeline``'s module docstring). With a ring
(``lightning_fpdt.attention.ring``) a rank first runs the steps of its peers' parts of chunk ``j`` (the parts it
received in forward), then sends each part's key/value gradient over its own queries home in one batch of
point-to-point moves, and runs its own part's steps while the peers' sums for its part arrive; they are added
before the part's gradients leave. Without a ring there are no peers' parts and no moves.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from lightning_fpdt.attention.block_calls import block_backward
from lightning_fpdt.attention.ends import ChunkSink
from lightning_fpdt.attention.kernels import accumulate_dtype
from lightning_fpdt.attention.merge import sink_grad
from lightning_fpdt.attention.pipeline_options import PipelineOptions
from lightning_fpdt.attention.ring import PendingParts, exchange_parts, pack, unpack
from lightning_fpdt.offload.chunk_store import ChunkStore
from lightning_fpdt.parallel.comm import Exchange, PendingAllToAll
from lightning_fpdt.profiling import named_range

QUERY_SET = ("q", "o", "lse", "do", "dq")


def pipeline_backward(
    dout: Tensor | None, q_dtype: torch.dtype, opt: PipelineOptions, store: ChunkStore, sink: ChunkSink,
    sinks: Tensor | None = None, s_local: int | None = None,
) -> Tensor | None:
    """Gradients of q, k, v from ``dout`` ``[b, s_local, h, d]`` and the chunks :func:`pipeline_forward`
    left in ``store``, handed to ``sink`` chunk by chunk as they become final. Returns the gradient of this
    rank's ``sinks`` ``[h/U]`` (accumulation dtype) when the forward had them, else ``None``.

    ``dout=None``: each chunk's ``dout`` is in ``store`` already, head-sharded under ``("do", i)`` (a streamed
    decoder layer puts it there as its per-token backward makes it: :mod:`lightning_fpdt.layers.streaming`), and
    ``s_local`` gives the local length.

    The steps ``(m, i)`` (outer key part, inner query chunk) run as one sequence; before each step's
    compute the next step's chunks are prefetched (its query set, and its k/v when the outer step
    changes), and ``dout``'s next all-to-all is issued. Final gradient chunks go home by all-to-alls
    that are waited for after the next step's compute.
    """
    s_local = dout.shape[1] if dout is not None else s_local
    assert s_local is not None, "pipeline_backward: without dout, s_local is needed"
    bounds, plan = opt.plan(s_local)
    n = len(bounds)
    acc = accumulate_dtype(q_dtype)
    exchange = Exchange(opt.group, overlap=opt.overlap_comm)
    # per chunk: the peers' parts first, this rank's own last (their gradients go home while it computes)
    outer = [m for j in range(n) for m in (*(j * plan.size + b for b in plan.receives[j]), plan.own(j))]
    steps = [(m, i) for m in outer for i in plan.query_chunks(m, opt.causal)]  # skipped blocks are not steps
    store.stats.count_blocks(len(steps), plan.candidates)
    dsinks = None if sinks is None else torch.zeros(sinks.shape, dtype=acc, device=sinks.device)
    # dout chunk i comes over at its first step; dq_i is final after its last one
    first_visit, last_visit = {}, {}
    for t, (_, i) in enumerate(steps):
        first_visit.setdefault(i, t)
        last_visit[i] = t
    dout_order = sorted(first_visit, key=first_visit.get)
    homebound: list[Callable[[], None]] = []  # gradient chunks in flight: hand them to the sink after a compute
    partials: dict[int, Tensor] = {}  # peer -> the packed dk, dv of its part of the current chunk, over these queries
    returning: PendingParts | None = None  # the peers' sums for this rank's part of the current chunk

    def prefetch(t: int) -> None:
        m, i = steps[t]
        if t == 0 or steps[t - 1][0] != m:
            store.prefetch(("k", m))
            store.prefetch(("v", m))
        for kind in QUERY_SET:
            if (kind, i) in store:
                store.prefetch((kind, i))

    def issue_dout(i: int | None) -> PendingAllToAll | None:
        if dout is None or i is None:  # no dout, or no chunk left: in the store already, or none to come
            return None
        lo, hi = bounds[i]
        return exchange.seq_to_head(dout[:, lo:hi], f"dout{i}")

    def deliver() -> None:
        with named_range("fpdt/all_to_all"):
            for hand_over in homebound:
                hand_over()
        homebound.clear()

    douts = iter(dout_order)  # first visits come in this order
    dout_ahead: PendingAllToAll | None = issue_dout(next(douts))
    prefetch(0)  # nothing to overlap the first step's copies with
    for t, (m, i) in enumerate(steps):
        nxt = steps[t + 1] if t + 1 < len(steps) else None
        j = m // plan.size
        if t == 0 or steps[t - 1][0] != m:  # first row of outer step m
            k_m, v_m = store.get(("k", m)), store.get(("v", m))
            dk_m = dv_m = None
            if m == plan.own(j):  # the peers' parts of chunk j are done: their gradients go home
                with named_range("fpdt/ring"):
                    returning = exchange_parts(opt.ring_group, partials, dict.fromkeys(
                        plan.sends[j], torch.Size([k_m.numel() + v_m.numel()])), acc, k_m.device)
                partials = {}
        if first_visit[i] == t and dout is not None:  # query chunk i's dout arrives, the next one's starts
            assert dout_ahead is not None
            with named_range("fpdt/all_to_all"):
                store.put(("do", i), dout_ahead.wait(), keep_on_device=True)
            dout_ahead = issue_dout(next(douts, None))
        if nxt is not None:
            prefetch(t + 1)
        q_i, o_i, lse_i, do_i = (store.get((kind, i)) for kind in ("q", "o", "lse", "do"))
        with named_range("fpdt/attention_chunk_backward"):
            if dsinks is not None and first_visit[i] == t:  # each row's sink gradient, once
                dsinks += sink_grad(do_i, o_i, lse_i, sinks)
            dq, dk, dv = block_backward(opt.kernel, do_i, q_i, k_m, v_m, o_i, lse_i, plan.blocks[(i, m)], opt.scale,
                                        opt.softcap)
        deliver()
        if ("dq", i) not in store:
            dq_i = dq.to(acc)
        elif store.offload:
            dq_i = store.get(("dq", i)) + dq  # not in place: the old one may still be copying to host
        else:
            dq_i = store.get(("dq", i)).add_(dq)
        # the first contribution is the kernel's own fresh tensor: accumulate into it
        dk_m = dk.to(acc) if dk_m is None else dk_m.add_(dk)
        dv_m = dv.to(acc) if dv_m is None else dv_m.add_(dv)
        store.delete(("dq", i))  # the accumulator is replaced by dq_i (or sent home)
        reused = nxt is not None and nxt[1] == i  # the next step reads this query chunk again
        if last_visit[i] == t:  # dq_i has every contribution
            sent_dq = exchange.head_to_seq(dq_i.to(q_dtype), f"dq{i}")
            homebound.append(lambda p=sent_dq, b=bounds[i]: sink.q(*b, p.wait()))
            for kind in QUERY_SET:
                store.delete((kind, i))
        else:
            store.put(("dq", i), dq_i, keep_on_device=reused)
            if not reused:
                for kind in ("q", "o", "lse", "do"):
                    store.evict((kind, i))
        if nxt is None or nxt[0] != m:  # dk_m, dv_m have every contribution of this rank's queries
            assert dk_m is not None and dv_m is not None
            store.delete(("k", m))
            store.delete(("v", m))
            if m != plan.own(j):  # a peer's part: its owner sums it with its own
                partials[m % plan.size] = pack(dk_m, dv_m)
                continue
            if returning is not None:
                with named_range("fpdt/ring"):
                    for flat in returning.wait().values():
                        g_k, g_v = unpack(flat, dk_m.shape, dv_m.shape)
                        dk_m.add_(g_k)
                        dv_m.add_(g_v)
                returning = None
            sent_kv = exchange.head_to_seq_many([dk_m.to(q_dtype), dv_m.to(q_dtype)], f"dkv{j}")
            homebound.append(lambda p=sent_kv, b=bounds[j]: sink.kv(*b, p[0].wait(), p[1].wait()))
    deliver()
    exchange.close()
    return dsinks
