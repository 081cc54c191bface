"""The FPDT attention pipeline: per-chunk all-to-all, online softmax, chunked backward.

Inputs are this rank's shards in the FPDT layout (``lightning_fpdt.layout``): ``[batch, s_local,
heads, head_dim]`` with ``s_local = S / P``, local chunk ``i`` being sub-chunk ``rank`` of global
chunk ``i``. One all-to-all per chunk turns local chunk ``i`` into global chunk ``i`` with
``heads / P`` heads (docs/how-fpdt-works.md, sections 1 to 4).

Forward, for each query chunk ``i``: all-to-all ``q_i, k_i, v_i``; attend ``q_i`` to ``k_j, v_j``
for ``j <= i`` (causal; all ``j`` otherwise), the diagonal block first while it is on the device,
then ``j = 0, 1, ...`` with ``j + 1`` prefetched while ``j`` is computed; merge with
:func:`update_out_and_lse`; all-to-all the output chunk back.

Backward: outer loop over key/value chunks ``j``, inner loop over query chunks ``i`` (``i >= j``
when causal) with the next query-side set (q, out, lse, dout, dq) prefetched. After outer step
``j``, dk_j and dv_j (and for causal attention dq_j) are final and go back through the inverse
all-to-all, so nothing of the size of the whole sequence with ``heads / P`` heads is ever
materialised beyond the saved chunks, which live in a :class:`ChunkStore` (host memory when
offloaded).

Where the local chunks come from and where their gradients go is not this module's business: a
:class:`ChunkSource` hands out local q/k/v chunks and a :class:`ChunkSink` takes the final gradient
chunks. ``lightning_fpdt.attention.sources`` has the two pairs: slices of whole q/k/v tensors
(``fpdt_attention``) and q/k/v projected chunk by chunk from a block's input (``FPDTAttention``).
:class:`PipelineFunction` is the one autograd Function over any pair (:class:`PipelineEnds`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_fpdt.attention.kernels import AttentionKernel, accumulate_dtype
from lightning_fpdt.attention.merge import update_out_and_lse
from lightning_fpdt.comm import group_size, head_to_seq, seq_to_head
from lightning_fpdt.layout import chunk_lengths, validate_chunk_size
from lightning_fpdt.offload import ChunkStore, OffloadStats
from lightning_fpdt.profiling import record

KV_KINDS = {"k": "kv", "v": "kv"}
QUERY_KINDS = {"q": "query", "o": "query", "lse": "query", "do": "query", "dq": "query"}
_QUERY_SET = ("q", "o", "lse", "do", "dq")


@dataclass(frozen=True)
class PipelineOptions:
    """How one FPDT attention call runs. ``local_chunk_size`` is ``chunk_size / P`` (or ``None``)."""

    group: ProcessGroup | None
    local_chunk_size: int | None
    causal: bool
    scale: float
    kernel: AttentionKernel
    offload: bool = False
    copy_delay: float = 0.0
    stats_sink: list[OffloadStats] | None = None

    @classmethod
    def for_chunk_size(cls, group: ProcessGroup | None, chunk_size: int | None, **options: Any) -> PipelineOptions:
        """Options for a global ``chunk_size`` (validated against the group's size, then cut per rank)."""
        p = group_size(group)
        validate_chunk_size(chunk_size, p)
        return cls(group=group, local_chunk_size=None if chunk_size is None else chunk_size // p, **options)


class ChunkSource(Protocol):
    """Where the forward gets this rank's local chunks ``lo:hi`` of q, k and v (layout order).

    Attributes:
        q_shape: the whole local q, ``[batch, s_local, n_heads, head_dim]``.
        dtype: the dtype of the q chunks; may be known only once the first chunk is made (autocast).
    """

    q_shape: torch.Size
    dtype: torch.dtype | None

    def q(self, lo: int, hi: int) -> Tensor:
        """``[batch, hi - lo, n_heads, head_dim]``."""
        ...

    def kv(self, lo: int, hi: int) -> tuple[Tensor, Tensor]:
        """k and v ``[batch, hi - lo, kv_heads, head_dim]``, ``kv_heads`` already replicated to a multiple of P."""
        ...


class ChunkSink(Protocol):
    """Where the backward puts each local gradient chunk once it is final, and what it makes of them."""

    def q(self, lo: int, hi: int, dq: Tensor) -> None:
        """``dq`` ``[batch, hi - lo, n_heads, head_dim]``: final."""
        ...

    def kv(self, lo: int, hi: int, dk: Tensor, dv: Tensor) -> None:
        """``dk``, ``dv`` ``[batch, hi - lo, kv_heads, head_dim]``: final."""
        ...

    def result(self) -> tuple[Tensor | None, ...]:
        """The gradients of the pipeline's inputs (see :class:`PipelineEnds`), once every chunk is in."""
        ...


class PipelineEnds(Protocol):
    """Both ends of a pipeline over the tensor ``inputs`` given to :class:`PipelineFunction`.

    Holds no tensors itself: the autograd context keeps it until backward, and a reference to a
    whole q or k there would keep its storage alive.
    """

    def source(self, *inputs: Tensor) -> ChunkSource:
        """The forward's chunk source over ``inputs``."""
        ...

    def saved(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        """The inputs :meth:`sink` needs in backward (kept with ``ctx.save_for_backward``)."""
        ...

    def sink(self, dout: Tensor, dtype: torch.dtype, *saved: Tensor) -> ChunkSink:
        """The backward's sink; its ``result()`` is one gradient (or ``None``) per input, in order.

        ``dout`` ``[batch, s_local, n_heads, head_dim]``; ``dtype`` that of the source's q chunks.
        """
        ...


def chunk_bounds(s_local: int, local_chunk_size: int | None) -> list[tuple[int, int]]:
    """``(lo, hi)`` of each local chunk: the chunk lengths of the local shard with ``C / P`` per chunk."""
    bounds, start = [], 0
    for length in chunk_lengths(s_local, local_chunk_size):
        bounds.append((start, start + length))
        start += length
    return bounds


def _key_order(i: int, n: int, causal: bool) -> list[int]:
    """Key chunks query chunk ``i`` attends to: the diagonal first (it is on the device), then in order."""
    others = [j for j in range(i if causal else n) if j != i]
    return [i, *others]


def pipeline_forward(
    source: ChunkSource, opt: PipelineOptions, store: ChunkStore, save_for_backward: bool = True
) -> tuple[Tensor, Tensor]:
    """Attention output ``[b, s_local, h, d]`` and lse ``[b, h/P, S]`` (head-sharded, layout order).

    With ``save_for_backward`` the query-side chunks (q, out, lse) stay in ``store`` for
    :func:`pipeline_backward`; without it only k/v pass through the store, for this forward's own use.
    """
    b, s_local, h, d = source.q_shape  # s_local = S // P; h = all query heads
    bounds = chunk_bounds(s_local, opt.local_chunk_size)
    n = len(bounds)
    out: Tensor | None = None  # [b, s_local, h, d]: chunks are written in as they finish
    lses: list[Tensor] = []

    def gather_kv(j: int, keep: bool) -> None:
        k_c, v_c = source.kv(*bounds[j])
        with record("fpdt/all_to_all"):
            store.put(("k", j), seq_to_head(k_c, opt.group), keep_on_device=keep)  # [b, C_j, h_kv/P, d]
            store.put(("v", j), seq_to_head(v_c, opt.group), keep_on_device=keep)

    if not opt.causal:  # every query chunk needs every key chunk: gather them all first
        for j in range(n):
            gather_kv(j, keep=j == 0)
    for i, (lo, hi) in enumerate(bounds):
        q_c = source.q(lo, hi)
        with record("fpdt/all_to_all"):
            q_i = seq_to_head(q_c, opt.group)  # [b, C_i, h/P, d], global chunk i
        del q_c
        if opt.causal:
            gather_kv(i, keep=True)
        out_i = lse_i = None
        order = _key_order(i, n, opt.causal)
        for pos, j in enumerate(order):
            if pos + 1 < len(order):  # issue the next copy before computing this block
                store.prefetch(("k", order[pos + 1]))
                store.prefetch(("v", order[pos + 1]))
            k_j, v_j = store.get(("k", j)), store.get(("v", j))
            with record("fpdt/attention_chunk"):
                block_out, block_lse = opt.kernel.forward(q_i, k_j, v_j, opt.causal and i == j, opt.scale)
                out_i, lse_i = update_out_and_lse(out_i, lse_i, block_out, block_lse)
            store.evict(("k", j))
            store.evict(("v", j))
        assert out_i is not None and lse_i is not None
        out_i = out_i.to(source.dtype)
        with record("fpdt/all_to_all"):
            out_c = head_to_seq(out_i, opt.group)  # [b, C_i / P, h, d]
        if out is None:
            out = out_c.new_empty(b, s_local, h, d)
        out[:, lo:hi] = out_c
        lses.append(lse_i)
        if save_for_backward:
            store.put(("q", i), q_i)
            store.put(("o", i), out_i)
            store.put(("lse", i), lse_i)
    assert out is not None
    return out, lses[0] if n == 1 else torch.cat(lses, dim=2)  # lse [b, h/P, S]


def pipeline_backward(
    dout: Tensor, q_dtype: torch.dtype, opt: PipelineOptions, store: ChunkStore, sink: ChunkSink
) -> None:
    """Gradients of q, k, v from ``dout`` ``[b, s_local, h, d]`` and the chunks :func:`pipeline_forward`
    left in ``store``, handed to ``sink`` chunk by chunk as they become final."""
    s_local = dout.shape[1]
    bounds = chunk_bounds(s_local, opt.local_chunk_size)
    n = len(bounds)
    acc = accumulate_dtype(q_dtype)

    def query_chunks(j: int) -> list[int]:
        return list(range(j, n)) if opt.causal else list(range(n))

    def send_back(x: Tensor) -> Tensor:
        with record("fpdt/all_to_all"):
            return head_to_seq(x, opt.group)

    for j in range(n):
        store.prefetch(("k", j))
        store.prefetch(("v", j))
        k_j, v_j = store.get(("k", j)), store.get(("v", j))
        dk_j = dv_j = None
        rows = query_chunks(j)
        for pos, i in enumerate(rows):
            if j == 0:  # first visit of query chunk i: bring its dout over, start its dq
                lo, hi = bounds[i]
                with record("fpdt/all_to_all"):
                    store.put(("do", i), seq_to_head(dout[:, lo:hi], opt.group))
            if pos + 1 < len(rows):  # prefetch the next query-side set while this one computes
                for kind in _QUERY_SET:
                    if (kind, rows[pos + 1]) in store:
                        store.prefetch((kind, rows[pos + 1]))
            if j + 1 < n and pos + 1 == len(rows):  # and the next k/v during the last row
                store.prefetch(("k", j + 1))
                store.prefetch(("v", j + 1))
            q_i, o_i, lse_i, do_i = (store.get((kind, i)) for kind in ("q", "o", "lse", "do"))
            with record("fpdt/attention_chunk_backward"):
                dq, dk, dv = opt.kernel.backward(do_i, q_i, k_j, v_j, o_i, lse_i, opt.causal and i == j, opt.scale)
            if ("dq", i) not in store:
                dq_i = dq.to(acc)
            elif store.offload:
                dq_i = store.get(("dq", i)) + dq  # not in place: the old one may still be copying to host
            else:
                dq_i = store.get(("dq", i)).add_(dq)
            # the first contribution is the kernel's own fresh tensor: accumulate into it
            dk_j = dk.to(acc) if dk_j is None else dk_j.add_(dk)
            dv_j = dv.to(acc) if dv_j is None else dv_j.add_(dv)
            store.delete(("dq", i))  # the accumulator is replaced by dq_i (or sent home)
            final = (opt.causal and i == j) or (not opt.causal and j == n - 1)
            if final:  # dq_i has every contribution: send it home and drop the query-side set
                sink.q(*bounds[i], send_back(dq_i.to(q_dtype)))
                for kind in _QUERY_SET:
                    store.delete((kind, i))
            else:
                store.put(("dq", i), dq_i)
                for kind in ("q", "o", "lse", "do"):
                    store.evict((kind, i))
        assert dk_j is not None and dv_j is not None
        store.delete(("k", j))
        store.delete(("v", j))
        sink.kv(*bounds[j], send_back(dk_j.to(q_dtype)), send_back(dv_j.to(q_dtype)))


class PipelineFunction(torch.autograd.Function):
    """``(*inputs) -> (out, lse)``: the pipeline from ``ends.source(*inputs)``; backward through ``ends.sink``.

    ``out`` ``[b, s_local, h, d]``; ``lse`` ``[b, h/P, S]`` (head-sharded, not differentiable).
    """

    @staticmethod
    def forward(
        ctx: Any, ends: PipelineEnds, opt: PipelineOptions, needs_backward: bool, *inputs: Tensor
    ) -> tuple[Tensor, Tensor]:
        store = new_store(inputs[0].device, opt)
        source = ends.source(*inputs)
        out, lse = pipeline_forward(source, opt, store, save_for_backward=needs_backward)
        if not needs_backward:  # inference: nothing to keep
            finish(store, opt)
        ctx.ends, ctx.opt, ctx.store, ctx.q_dtype = ends, opt, store, source.dtype
        ctx.save_for_backward(*ends.saved(*inputs))
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: Tensor, _dlse: Tensor | None) -> tuple[Tensor | None, ...]:
        sink = ctx.ends.sink(dout, ctx.q_dtype, *ctx.saved_tensors)
        try:
            pipeline_backward(dout.contiguous(), ctx.q_dtype, ctx.opt, ctx.store, sink)
        finally:
            finish(ctx.store, ctx.opt)
        return None, None, None, *sink.result()


def run_pipeline(ends: PipelineEnds, opt: PipelineOptions, *inputs: Tensor) -> tuple[Tensor, Tensor]:
    """:class:`PipelineFunction` over ``inputs``; it saves chunks for backward only if one can follow."""
    needs_backward = torch.is_grad_enabled() and any(x.requires_grad for x in inputs)
    return PipelineFunction.apply(ends, opt, needs_backward, *inputs)


def new_store(device: torch.device, opt: PipelineOptions) -> ChunkStore:
    return ChunkStore(device, offload=opt.offload, groups={**KV_KINDS, **QUERY_KINDS}, copy_delay=opt.copy_delay)


def finish(store: ChunkStore, opt: PipelineOptions) -> None:
    """Release everything the store holds and report its figures."""
    store.close()
    if opt.stats_sink is not None:
        opt.stats_sink.append(store.stats)
