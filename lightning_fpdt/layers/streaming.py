"""Decoder layers that stream: a layer's forward, its recomputation and its backward run chunk by chunk in
sequence order, so the device memory of a layer's work is one chunk's, not the local sequence's.

A *chunked layer* is a function ``run_chunk(x_c, lo, hi, stream)`` computing one chunk ``x[:, lo:hi]`` of a
decoder layer's input ``x`` ``[batch, s_local, hidden]``: its attention layer hands the chunk's q, k, v
(``[batch, hi - lo, heads, head_dim]``, this rank's tokens in the FPDT layout, RoPE applied) to
:meth:`~lightning_fpdt.layers.layer_stream.LayerStream.attend` and gets the chunk's output back, computed against the
keys and values of this chunk and every earlier one, which the stream keeps in its pipeline store (host memory with
offload). Everything else a layer computes must be per token (norms, projections, residual adds, MLPs, experts
routed per token): a chunk's output then depends on other chunks only through causal attention, and the streamed
layer is exact.
Which layers qualify is the caller's decision (:func:`lightning_fpdt.layers.block.FPDTBlock.forward`,
:mod:`lightning_fpdt.hf.streamed`); any other layer is recomputed whole (:mod:`lightning_fpdt.offload.recompute`).

Forward (no graph): for each chunk ``y_c = run_chunk(x_c)``, written into ``y``; the attention store is freed at
the end. The layer keeps its input, chunk by chunk, in the layer input store (host memory with
``offload_checkpoints``), or whole in the autograd graph without one.

Backward, two passes over the chunks in sequence order:

1. each chunk is recomputed with grad, its attention recomputed into a fresh store that keeps what FPDT's
   attention backward reads (q, out, lse, k, v); the attention output is a leaf, so ``dy_c`` runs back through
   the per-token work after attention only: the residual part of ``dx_c``, the parameters' gradients, and
   ``d out_c``, which goes head-sharded into the store (``"do"``);
2. FPDT's attention backward (:func:`~lightning_fpdt.attention.backward.pipeline_backward`); as chunk ``c``'s dq,
   dk and dv become final, the layer runs on ``x_c`` once more until its attention call, which stops it
   (:class:`~lightning_fpdt.layers.layer_stream.Captured`), and the per-token work before attention is differentiated:
   the rest of ``dx_c``.

Two more channels, for layers that need them (:mod:`lightning_fpdt.hf.streamed`): *per-token extra inputs*
``[batch, s_local, ...]`` with a gradient (Gemma-4's per-layer inputs), cut to the chunk and given to ``run_chunk``
after its stream, their gradients filled chunk by chunk; and *token sums*: ``run_chunk`` may return ``(y_c, s_c)``,
``s_c`` a small tensor that is a sum over the chunk's tokens (a router's probabilities for the auxiliary loss,
``[calls, experts]``), the call returning ``(y, sum of s_c)``; in backward, the sum's gradient goes to each chunk's
``s_c`` in pass 1.

What is sized by the local sequence during a layer's work: its input's gradient being made and its output's
gradient (two hidden vectors per token; the layer's input too when no layer input store keeps it), and nothing
else: the chunks' intermediates, q/k/v and attention outputs are one chunk's. The price: each chunk's work before
attention (norm and q/k/v projections) runs once more in backward.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_fpdt.attention.backward import pipeline_backward
from lightning_fpdt.attention.blocks import chunk_bounds
from lightning_fpdt.attention.pipeline import finish, whole_sinks_grad
from lightning_fpdt.layers.layer_stream import Captured, ChunkedLayer, LayerStream
from lightning_fpdt.offload.autocast_state import AutocastState
from lightning_fpdt.offload.chunk_store import ChunkStore
from lightning_fpdt.offload.recompute import INPUT_CHUNK_KIND, differentiate, previous_input
from lightning_fpdt.offload.weight_casts import original, weights_cast_once, with_casts
from lightning_fpdt.parallel.comm import sum_kv_replicas
from lightning_fpdt.profiling import named_range


@dataclass
class _Streamed:
    """One streamed call: the layer, its chunks, where its input is kept, its parameters."""

    run_chunk: ChunkedLayer
    module: nn.Module
    bounds: list[tuple[int, int]]
    local_chunk_size: int
    store: ChunkStore | None
    name: str
    keep_answers: bool = False
    sums: bool = False  # run_chunk returns (y_c, s_c), s_c summed over chunks

    def stream(self, x: Tensor) -> LayerStream:
        return LayerStream(x.shape[1], self.local_chunk_size, x.device)

    def params(self) -> list[Tensor]:
        return [original(p) for p in self.module.parameters() if p.requires_grad]

    def run(self, x_c: Tensor, c: int, stream: LayerStream, extras_c: Sequence[Tensor]) -> tuple[Tensor, Tensor | None]:
        """Chunk ``c``'s ``(y_c, s_c)`` (``s_c`` ``None`` without token sums)."""
        lo, hi = self.bounds[c]
        stream.lo = lo
        return split_token_sums(self.run_chunk(x_c, lo, hi, stream, *extras_c), self.sums, self.name)

    def forward(self, x: Tensor, extras: Sequence[Tensor] = (), keep_answers: bool = False
                ) -> tuple[Tensor, Tensor | None, ChunkStore | None]:
        """``y`` ``[batch, s_local, hidden]``, chunk by chunk, without a graph; the token sums (``None`` without);
        with ``keep_answers``, the store holding each chunk's attention output and lse for the recomputation
        (:mod:`lightning_fpdt.attention.kept_answers`)."""
        stream = self.stream(x)
        stream.keep_answers = keep_answers
        y: Tensor | None = None
        total: Tensor | None = None
        with torch.no_grad(), weights_cast_once(self.module, AutocastState.capture(x.device.type)):  # not per chunk
            for c, (lo, hi) in enumerate(self.bounds):
                with named_range(f"fpdt/{self.name}"):
                    y_c, s_c = self.run(x[:, lo:hi], c, stream, [e[:, lo:hi] for e in extras])
                if y is None:
                    y = y_c.new_empty(x.shape[0], x.shape[1], *y_c.shape[2:])
                y[:, lo:hi] = y_c
                if s_c is not None:
                    total = s_c if total is None else total.add_(s_c)
        stream.end_forward()
        assert y is not None
        return y, total, stream.store if keep_answers else None

    def backward(self, dy: Tensor, dsums: Tensor | None, chunk: Callable[[int], Tensor], extras: Sequence[Tensor],
                 x_shape: torch.Size, x_dtype: torch.dtype, want_dx: bool, autocast: AutocastState,
                 answers: ChunkStore | None = None) -> list[Tensor | None]:
        """``[dx, *extras' gradients, *parameter gradients]`` from the output gradient ``dy`` and the token sums'
        ``dsums`` (module docstring, passes 1 and 2); ``answers``: what the forward kept of its attention, answered
        from in pass 1 instead of attention's kernels."""
        params = self.params()  # read now (FSDP2 has swapped in the unsharded ones), before the casts are swapped in
        # once for both passes' chunks; autocast itself is restored around each chunk's work only (not the attention
        # backward between them)
        with weights_cast_once(self.module, autocast):
            return self._backward(dy, dsums, chunk, extras, x_shape, x_dtype, want_dx, autocast, answers, params)

    def _backward(self, dy: Tensor, dsums: Tensor | None, chunk: Callable[[int], Tensor], extras: Sequence[Tensor],
                  x_shape: torch.Size, x_dtype: torch.dtype, want_dx: bool, autocast: AutocastState,
                  answers: ChunkStore | None, params: list[Tensor]) -> list[Tensor | None]:
        casts = with_casts(params)
        d_params: list[Tensor | None] = [None] * len(params)
        dx = dy.new_empty(x_shape, dtype=x_dtype) if want_dx else None
        # filled chunk by chunk: written in pass 1, added to in pass 2
        d_extras = [torch.empty_like(e) if e.requires_grad else None for e in extras]
        stream = self.stream(dy)
        stream.mode = "recompute"
        stream.answers = answers

        def grads_of(outputs: Sequence[Tensor], grads: Sequence[Tensor], wrt: Sequence[Tensor]) -> list[Tensor | None]:
            return differentiate(list(zip(outputs, grads)), wrt, params, casts, d_params)

        def extras_of(c: int) -> list[Tensor]:
            lo, hi = self.bounds[c]
            return [e[:, lo:hi].detach().requires_grad_(e.requires_grad) for e in extras]

        def add_extras(c: int, grads: Sequence[Tensor | None], first: bool = False) -> None:
            lo, hi = self.bounds[c]
            for d, g in zip(d_extras, grads):
                if d is not None and first:
                    d[:, lo:hi] = g if g is not None else 0
                elif d is not None and g is not None:
                    d[:, lo:hi] += g

        # pass 1: recompute each chunk; its output gradient back through the work after attention
        for c, (lo, hi) in enumerate(self.bounds):
            x_c, e_c = chunk(c).detach().requires_grad_(want_dx), extras_of(c)
            with torch.enable_grad(), autocast.restore(), named_range(f"fpdt/{self.name}_backward"):
                y_c, s_c = self.run(x_c, c, stream, e_c)
                out_c = stream.out
                assert out_c is not None, "streamed layer: the chunk's attention never ran"
                outputs, grads = [y_c], [dy[:, lo:hi]]
                if s_c is not None and dsums is not None:
                    outputs.append(s_c)
                    grads.append(dsums)
                d_x, d_out, *d_e = grads_of(outputs, grads, [x_c, out_c, *e_c])
            if dx is not None:
                dx[:, lo:hi] = d_x if d_x is not None else 0
            add_extras(c, d_e, first=True)
            stream.out = None
            stream.put_dout(c, d_out if d_out is not None else torch.zeros_like(out_c))
        stream.end_forward()
        opt, store = stream.opt, stream.store
        assert opt is not None and store is not None and stream.q_dtype is not None

        # pass 2: the attention backward; each chunk's work before attention as its dq, dk, dv become final
        stream.mode = "capture"
        starts = {lo: c for c, (lo, _) in enumerate(self.bounds)}
        waiting: dict[int, dict[str, Tensor]] = {}

        def arrive(lo: int, **grads: Tensor) -> None:
            c = starts[lo]
            got = waiting.setdefault(c, {})
            got.update(grads)
            if len(got) < 3:
                return
            del waiting[c]
            x_c, e_c = chunk(c).detach().requires_grad_(want_dx), extras_of(c)
            with torch.enable_grad(), autocast.restore(), named_range(f"fpdt/{self.name}_backward"):
                try:
                    self.run(x_c, c, stream, e_c)
                except Captured as captured:
                    q, k, v = captured.q, captured.k, captured.v
                else:
                    raise RuntimeError("streamed layer: the layer never called its attention")
                dk, dv = sum_kv_replicas(got["dk"], k.shape[2]), sum_kv_replicas(got["dv"], v.shape[2])
                d_x, *d_e = grads_of([q, k, v], [got["dq"].to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)], [x_c, *e_c])
            if dx is not None and d_x is not None:
                dx[:, self.bounds[c][0]:self.bounds[c][1]] += d_x
            add_extras(c, d_e)

        sink = _Arrivals(arrive)
        try:
            dsinks = pipeline_backward(None, stream.q_dtype, opt, store, sink, stream.local_sinks, s_local=dy.shape[1])
        finally:
            finish(store, opt)
        if dsinks is not None and stream.sinks is not None:  # the sinks' gradient: this rank's heads
            index = next((n for n, p in enumerate(params) if p is stream.sinks), None)
            if index is None:
                raise RuntimeError(f"streamed layer {self.name}: its attention sinks are not one of its parameters, so"
                                   " their gradient has nowhere to go")
            whole = whole_sinks_grad(dsinks, stream.sinks.shape, opt.group)
            before = d_params[index]
            d_params[index] = whole if before is None else before.add_(whole.to(before.dtype))
        return [dx, *d_extras, *(None if d is None else d.to(p.dtype) for d, p in zip(d_params, params))]


def split_token_sums(out: Any, sums: bool, name: str) -> tuple[Tensor, Tensor | None]:
    """A chunk's ``run_chunk`` result as ``(y_c, s_c)``: ``(out, None)`` without token sums, else ``out`` itself,
    checked to be that pair."""
    if not sums:
        return out, None
    if not isinstance(out, tuple) or len(out) != 2:
        raise RuntimeError(f"streamed layer {name}: run_chunk must return (y_c, token sums), got {type(out)}")
    return out


class _Arrivals:
    """The pipeline backward's sink of a streamed layer: each final gradient chunk to ``arrive``."""

    def __init__(self, arrive: Callable[..., None]) -> None:
        self.arrive = arrive

    def q(self, lo: int, hi: int, dq: Tensor) -> None:
        self.arrive(lo, dq=dq)

    def kv(self, lo: int, hi: int, dk: Tensor, dv: Tensor) -> None:
        self.arrive(lo, dk=dk, dv=dv)

    def result(self) -> tuple[Tensor | None, ...]:
        return ()


class _StreamedLayer(torch.autograd.Function):
    """``(x, *extras) -> y`` (``(y, sums)`` with token sums) of a :class:`_Streamed` call, keeping only ``x`` (chunk
    by chunk in its store, when it has one) and the extras."""

    @staticmethod
    def forward(ctx: Any, call: _Streamed, n_extras: int, x: Tensor, *tensors: Tensor) -> Any:
        extras = tensors[:n_extras]
        y, sums, ctx.answers = call.forward(x, extras, call.keep_answers)
        # no backward will come if the graph is dropped: give the answers back then
        ctx.release_answers = None if ctx.answers is None else weakref.finalize(ctx, ctx.answers.close_later)
        ctx.call, ctx.x_shape, ctx.x_dtype, ctx.n_extras = call, x.shape, x.dtype, n_extras
        ctx.autocast = AutocastState.capture(x.device.type)
        store = call.store
        if store is None:
            ctx.save_for_backward(*extras, x)
            ctx.keys = None
        else:
            ctx.save_for_backward(*extras)
            # chunk 0 numbered last: the backward before this one prefetches it (recompute.previous_input)
            ctx.keys = [store.new_key(INPUT_CHUNK_KIND) for _ in call.bounds][::-1]
            for key, (lo, hi) in zip(ctx.keys, call.bounds):
                store.put(key, x[:, lo:hi].detach())
            # no backward will come if the graph is dropped: give the chunks back then
            ctx.release = weakref.finalize(ctx, _delete_later, store, list(ctx.keys))
        return y if sums is None else (y, sums)

    @staticmethod
    def backward(ctx: Any, dy: Tensor, dsums: Tensor | None = None) -> tuple[Tensor | None, ...]:
        call: _Streamed = ctx.call
        store, keys = call.store, ctx.keys
        saved = ctx.saved_tensors
        extras = saved[:ctx.n_extras]
        if keys is None:
            x = saved[-1]

            def chunk(c: int) -> Tensor:
                lo, hi = call.bounds[c]
                return x[:, lo:hi]
        else:
            assert store is not None
            uses = {c: 2 for c in range(len(keys))}  # each chunk is read in both passes

            def chunk(c: int) -> Tensor:
                # the next chunk's copy runs during this one's work; after pass 1's last, pass 2 starts at chunk 0;
                # after pass 2's last, the backward that runs next starts with its first input
                following = keys[c + 1] if c + 1 < len(keys) else keys[0] if uses[c] == 2 else previous_input(
                    store, keys[-1])
                if following is not None and following in store:
                    store.prefetch(following)
                x_c = store.get(keys[c])
                uses[c] -= 1
                if uses[c] == 0:
                    store.delete(keys[c])
                else:
                    store.evict(keys[c])
                return x_c

        if ctx.release_answers is not None:
            ctx.release_answers.detach()  # the backward's pipeline store now: closed when its pass 2 ends
        try:
            grads = call.backward(dy, dsums, chunk, extras, ctx.x_shape, ctx.x_dtype, ctx.needs_input_grad[2],
                                  ctx.autocast, ctx.answers)
        except BaseException:
            if ctx.answers is not None:  # the backward closes them as its pass 2 ends: not reached
                ctx.answers.close()
            raise
        ctx.answers = None
        if keys is not None:
            ctx.release.detach()
        return (None, None, *grads)


def _delete_later(store: ChunkStore, keys: list[tuple[str, int]]) -> None:
    for key in keys:
        store.delete_later(key)


def streamed_layer_call(run_chunk: ChunkedLayer, module: nn.Module, x: Tensor, local_chunk_size: int,
                        store: ChunkStore | None = None, name: str = "decoder_layer", keep_answers: bool = False,
                        extras: Sequence[Tensor] = (), sums: bool = False) -> Any:
    """``y`` ``[batch, s_local, hidden]`` of the layer ``run_chunk`` computes chunk by chunk (module docstring) on
    ``x`` ``[batch, s_local, hidden]``, in local chunks of ``local_chunk_size`` tokens (:func:`stream_chunk_size`).
    ``module`` owns every parameter ``run_chunk`` uses (their gradients come back once per backward, summed over
    chunks); ``store``: where the input's chunks wait for backward (``None``: the autograd graph). Where the attention's
    chunks live is its pipeline options' business. ``keep_answers``: attention runs once per step, its recomputation
    answered from what the forward kept (:mod:`lightning_fpdt.attention.kept_answers`). ``extras``: per-token inputs
    ``[batch, s_local, ...]``, each chunk's given to ``run_chunk`` after its stream; ``sums``: ``run_chunk`` returns
    ``(y_c, s_c)`` and the call ``(y, sum of s_c)``. Without a backward to follow, the layer streams and keeps
    nothing."""
    call = _Streamed(run_chunk, module, chunk_bounds(x.shape[1], local_chunk_size), local_chunk_size, store, name,
                     keep_answers, sums)
    for e in extras:
        if tuple(e.shape[:2]) != tuple(x.shape[:2]):
            raise ValueError(f"streamed layer {name}: an extra input {tuple(e.shape)} is not per token of the layer's"
                             f" input {tuple(x.shape)}")
    params = call.params()
    if not torch.is_grad_enabled() or not (x.requires_grad or params or any(e.requires_grad for e in extras)):
        y, total, _ = call.forward(x, extras)
        return (y, total) if sums else y
    return _StreamedLayer.apply(call, len(extras), x, *extras, *params)


__all__ = ["streamed_layer_call"]
