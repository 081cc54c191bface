"""The attention side of a streamed decoder layer (:mod:`lightning_fpdt.layers.streaming`): the
:class:`LayerStream` an attention module answers from while its layer runs one chunk at a time (installed on the
module by :func:`streaming_into`, found by :func:`active_stream`), and the local chunk size a layer streams in
(:func:`stream_chunk_size`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from lightning_fpdt.attention.pipeline import ForwardPass, answers_only, finish, new_store, rank_sinks
from lightning_fpdt.attention.pipeline_options import PipelineOptions
from lightning_fpdt.offload.chunk_store import ChunkStore
from lightning_fpdt.parallel.binding import SequenceParallelContext
from lightning_fpdt.parallel.comm import Exchange, expand_kv_heads, group_size
from lightning_fpdt.profiling import named_range

_STREAM = "_fpdt_stream"  # an attention module's attribute while its decoder layer runs a streamed chunk

ChunkedLayer = Callable[..., "Tensor | tuple[Tensor, Tensor]"]
"""``run_chunk(x_c, lo, hi, stream, *extras_c) -> y_c`` (or ``(y_c, s_c)``, with token sums): one chunk of a decoder
layer (:mod:`lightning_fpdt.layers.streaming`)."""


class Captured(Exception):
    """Raised by :meth:`LayerStream.attend` in capture mode, carrying the chunk's q, k, v with their graph."""

    def __init__(self, q: Tensor, k: Tensor, v: Tensor) -> None:
        super().__init__("captured")
        self.q, self.k, self.v = q, k, v


class LayerStream:
    """The attention of one streamed call of a decoder layer, fed one chunk at a time.

    Modes: ``"forward"`` (attend, keep nothing), ``"recompute"`` (attend, keep the query side for the
    backward; the output is a leaf whose gradient the caller takes), ``"capture"`` (stop the layer at its
    attention call: :class:`Captured`).
    """

    def __init__(self, s_local: int, local_chunk_size: int, device: torch.device) -> None:
        self.s_local, self.local_chunk_size, self.device = s_local, local_chunk_size, device
        self.mode = "forward"
        self.opt: PipelineOptions | None = None
        self.store: ChunkStore | None = None
        self.passes: ForwardPass | None = None
        self.chunk = 0  # the next chunk attend computes
        self.lo = 0  # the first local token of the chunk the layer runs now (set by the layer's stream, every mode)
        self.q_dtype: torch.dtype | None = None
        self.sinks: Tensor | None = None  # the layer's sink logits [n_heads], if any
        self.local_sinks: Tensor | None = None  # this rank's heads of them
        self.out: Tensor | None = None  # recompute: the latest chunk's output, a leaf
        # attention once per step (lightning_fpdt.attention.kept_answers): the forward keeps each chunk's output and
        # lse in its store (keep_answers), left there for the recomputation, which answers from it (answers)
        self.keep_answers = False
        self.answers: ChunkStore | None = None

    def attend(self, q: Tensor, k: Tensor, v: Tensor, options: Callable[[], PipelineOptions],
               sinks: Tensor | None = None) -> Tensor:
        """This chunk's attention output ``[batch, n, heads, v_head_dim]`` from its q ``[batch, n, heads, head_dim]``,
        k and v ``[batch, n, kv_heads, *]`` (``n`` its local length). ``options()`` is called at the first chunk
        only: the layer's pipeline options (causal, with this stream's chunk size)."""
        if self.mode == "capture":
            raise Captured(q, k, v)
        with torch.no_grad():
            if self.passes is None:
                self._start(options(), sinks)
            passes, opt = self.passes, self.opt
            assert passes is not None and opt is not None
            i = self.chunk
            lo, hi = passes.bounds[i]
            if q.shape[1] != hi - lo:
                raise RuntimeError(f"streamed layer: chunk {i} has {q.shape[1]} tokens, its bounds {lo}:{hi} say"
                                   f" {hi - lo}")
            self.q_dtype = q.dtype
            u = group_size(opt.group)
            q_i = passes.receive(i, passes.issue(i, q, expand_kv_heads(k, u), expand_kv_heads(v, u)))
            pending = passes.send(i, passes.attend(i, q_i, q.dtype))
            with named_range("fpdt/all_to_all"):
                out = pending.wait()
            self.chunk += 1
        if self.mode == "recompute":
            self.out = out.requires_grad_()
        return out

    def _start(self, opt: PipelineOptions, sinks: Tensor | None) -> None:
        if not opt.causal or opt.local_chunk_size != self.local_chunk_size:
            raise RuntimeError(
                f"streamed layer: its attention runs with causal={opt.causal} and local chunks of"
                f" {opt.local_chunk_size} tokens; streaming needs causal attention in chunks of {self.local_chunk_size}"
            )
        opt.check_documents(self.s_local, "streamed layer")
        self.opt, self.sinks, self.local_sinks = opt, sinks, rank_sinks(sinks, opt.group)
        recall = self.answers is not None and self.mode == "recompute"
        self.store = self.answers if recall else new_store(self.device, opt)
        kept = "recall" if recall else "keep" if self.keep_answers and self.mode == "forward" else None
        self.passes = ForwardPass(opt, self.store, self.s_local, self.mode == "recompute", self.local_sinks,
                                  keep_lse=False, answers=kept)

    def put_dout(self, i: int, dout: Tensor) -> None:
        """Chunk ``i``'s output gradient ``[batch, n, heads, v_head_dim]``, head-sharded into the store."""
        assert self.opt is not None and self.store is not None
        exchange = Exchange(self.opt.group, overlap=False)
        with named_range("fpdt/all_to_all"):
            self.store.put(("do", i), exchange.seq_to_head(dout, f"dout{i}").wait())
        exchange.close()

    def end_forward(self) -> None:
        """Close the forward pass (its lse is not needed); a forward that keeps its answers leaves them in
        :attr:`store`, nothing else."""
        if self.passes is not None:
            self.passes.close()
        if self.mode == "forward" and self.store is not None and self.opt is not None:
            if self.keep_answers:
                answers_only(self.store)
                return
            finish(self.store, self.opt)
            self.store = None


def active_stream(module: nn.Module) -> LayerStream | None:
    """The stream attention module ``module`` answers from while its decoder layer streams (:func:`streaming_into`),
    else ``None``."""
    return module.__dict__.get(_STREAM)


@contextmanager
def streaming_into(modules: Sequence[nn.Module], stream: LayerStream) -> Iterator[None]:
    """Let each attention module of ``modules`` answer from ``stream`` (:func:`active_stream`) until the block ends."""
    for m in modules:
        m.__dict__[_STREAM] = stream
    try:
        yield
    finally:
        for m in modules:
            m.__dict__.pop(_STREAM, None)


def stream_chunk_size(context: SequenceParallelContext, s_local: int) -> int | None:
    """The local chunk size (the chunk size over the sequence-parallel degree) a layer of ``s_local`` tokens streams
    in under ``context``, or ``None``: streaming off (``context.streaming``), or nothing to gain (no chunking, or one
    chunk: the layer's work is then its whole local sequence anyway)."""
    if not context.streaming or context.chunk_size is None or context.chunk_size // context.size >= s_local:
        return None
    return context.chunk_size // context.size
