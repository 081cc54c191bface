"""Gated delta-net (Kimi delta attention too), Mamba-2 and Mamba-1 layers and MiniMax's lightning attention
sequence-parallel and exact under the FPDT layout.

Such a layer is position-wise projections, gates and norms around a sequence-mixing core, and transformers' families
call that core as module-level kernels: a causal depthwise convolution (``causal_conv1d_fn``), then a gated delta rule
(``torch_chunk_gated_delta_rule``: Qwen3.5, Qwen3-Next, OLMo-hybrid; ``chunk_kimi_delta_attention``, its gate per key
channel: Kimi Linear), a Mamba-2 selective scan (``mamba2_chunk_scan``: Nemotron-H, Granite-4.0-H, Bamba, Falcon-H1,
Zamba2) or a Mamba-1 one (``mamba_selective_scan``: Jamba, :mod:`lightning_fpdt.hf.selective_scan`), directly or
through the family's cache-handling wrappers, as plain functions or ``kernels`` modules
(:mod:`lightning_fpdt.hf.kernel_binding`: how each release binds them); MiniMax writes its lightning attention in the
layer's forward (:mod:`lightning_fpdt.hf.lightning_attention` gives that layer a core of its own).
:func:`~lightning_fpdt.hf.mixer_install.install_recurrences` gives each such module its class's own forward with these
kernels rebound to sequence-parallel versions (:class:`SequenceParallelRecurrence`), so the family's projections,
gates and norms run as written and only the kernels change:

- the convolution runs on this rank's tokens, each sub-chunk with the ``K - 1`` inputs before it carried from the
  rank that holds them (:func:`lightning_fpdt.hf.short_conv.causal_conv`, as for LFM2's short convolutions);
- the delta rule and the scan run the FPDT way, chunk by chunk: an all-to-all turns this rank's sub-chunk of every
  head into the whole chunk of ``heads / P`` heads, the family's own kernel runs on it from the recurrent state the
  chunk before left (its ``initial_state`` / ``initial_states`` argument), and the reverse all-to-all brings the
  output back. The state (``[batch, heads / P, ...]``) is all that crosses chunks; no tensor of the whole
  sequence exists.
- packed documents: the kernel runs per piece of a chunk between document starts, its state restarting at each
  start (and the convolution's history with it), as each document alone computes it.

Why the all-to-all and not the state handed from rank to rank: a delta rule's transition over a rank's tokens is a
``d_k x d_k`` matrix per head that no kernel returns, so a state passed along would make the ranks run one after
another; with the all-to-all every rank works on its heads at once, at the communication cost attention already
pays. Head counts the group does not divide: a delta rule's key heads are replicated where each rank's value heads
read one key head (as attention's KV heads), Mamba-2's ``B``/``C`` groups likewise (each chunk's ``B`` and ``C`` are
gathered whole, and each rank keeps the groups its heads read); anything else is refused with the numbers. Under a
ring (its zigzag layout) the all-to-all runs over the whole group and the gathered chunk is sorted into sequence
order for the kernel (:func:`lightning_fpdt.parallel.layout.gathered_order`), its output put back after.

On CUDA the family's kernels are whatever transformers bound (flash-linear-attention, mamba-ssm, causal-conv1d); the
fused Mamba-2 training kernel (``mamba2_split_conv1d_scan_combined``), which would convolve and scan this rank's
tokens alone, is kept out, so the family takes its unfused path through the two kernels above.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from transformers.activations import ACT2FN

from lightning_fpdt.errors import Unsupported
from lightning_fpdt.hf.attention import FPDT_KEYWORDS, delivered_keywords
from lightning_fpdt.hf.kernel_binding import reached_kernels, rebind
from lightning_fpdt.hf.lightning_attention import is_lightning_attention, lightning_forward
from lightning_fpdt.hf.recurrent_heads import (
    DELTA_RULE,
    KDA,
    LIGHTNING,
    SCAN,
    SELECTIVE_SCAN,
    check_module_heads,
    delta_rule_split,
    kernel_flops_per_token,
    refuse_split,
    scan_split,
)
from lightning_fpdt.hf.selective_scan import selective_scan
from lightning_fpdt.hf.short_conv import causal_conv, causal_conv_chunk
from lightning_fpdt.layers.carried import MixerStream
from lightning_fpdt.layers.layer_stream import active_stream
from lightning_fpdt.offload.chunk_store import ChunkStore
from lightning_fpdt.offload.recompute import INPUT_KIND, recomputed_call
from lightning_fpdt.parallel.binding import SequenceParallelContext
from lightning_fpdt.parallel.comm import HeadToSeq, SeqToHead, all_gather_autograd, expand_kv_heads, group_rank
from lightning_fpdt.parallel.layout import chunk_lengths, gathered_order, inverse_permutation
from lightning_fpdt.parallel.packed_documents import PackedDocuments

CONV = "causal_conv1d_fn"
FUSED_SCAN = "mamba2_split_conv1d_scan_combined"
_NOT_FOR_THE_KERNEL = (*FPDT_KEYWORDS, "cu_seqlens", "seq_idx")  # ours, or packed-input forms the pieces replace
_ONE_PROCESS = SequenceParallelContext()

Kernel = Callable[[list[Tensor], list[Tensor], Tensor | None], tuple[Tensor, Tensor]]
"""One kernel call on one piece: ``(inputs, parameters, state or None) -> (output, final state)``."""


def recurrence_core(module: nn.Module) -> str | None:
    """``DELTA_RULE``, ``KDA``, ``SCAN`` or ``SELECTIVE_SCAN`` when ``module``'s class forward reaches that kernel and
    the convolution kernel (:func:`~lightning_fpdt.hf.kernel_binding.reached_kernels`: in its code or the family
    functions it calls, the kernels known by their own names however the release binds them); ``LIGHTNING`` for
    MiniMax's lightning attention (its core written in its forward); else ``None``."""
    if is_lightning_attention(module):
        return LIGHTNING
    forward = getattr(type(module), "forward", None)
    if forward is None or not hasattr(inspect.unwrap(forward), "__code__"):
        return None
    names = reached_kernels(forward)
    if CONV not in names:
        return None
    return next((core for core in (DELTA_RULE, KDA, SCAN, SELECTIVE_SCAN) if core in names), None)


class SequenceParallelRecurrence:
    """The ``forward`` of one gated delta-net or Mamba-2 module instance under FPDT (see the module docstring).

    Reads the ``fpdt_context`` and ``documents`` keywords its decoder layer passes on, or that are delivered on the
    module (:func:`~lightning_fpdt.hf.attention.delivered_to`); ``None``: one process, one chunk, one document per
    sample. While :attr:`position_wise` is set (the token-mixing probe) its kernels run on every position alone.
    """

    fpdt_keywords = True  # hf/attention.keyword_receivers delivers the FPDT keywords on this module

    def __init__(self, module: nn.Module, core: str) -> None:
        self.module, self.core = module, core
        self.position_wise = False
        function = inspect.unwrap(type(module).forward)
        self._family = function.__globals__  # the family's namespace: its kernels, read at each call
        self._bound_as = reached_kernels(function)  # each kernel's name in that namespace
        cores = {DELTA_RULE: self._delta_rule, KDA: partial(self._delta_rule, fpdt_core=KDA), SCAN: self._scan,
                 SELECTIVE_SCAN: self._selective_scan}
        self._forward = partial(lightning_forward, self) if core == LIGHTNING else rebind(  # no kernel to rebind there
            function, {CONV: self._conv, FUSED_SCAN: _no_fused_kernel, core: cores[core]})
        self._context: SequenceParallelContext = _ONE_PROCESS
        self._documents: PackedDocuments | None = None

    def __reduce__(self) -> tuple[type, tuple[nn.Module, str]]:
        # made again from the module (a copy's forward binds the copy) rather than copying the rebound function and
        # the family's namespace, which cannot be pickled (spawned ranks, deepcopy)
        return SequenceParallelRecurrence, (self.module, self.core)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        delivered = delivered_keywords(self.module)
        context = kwargs.get("fpdt_context") or delivered.get("fpdt_context")
        documents = kwargs.get("documents") if kwargs.get("fpdt_context") is not None else delivered.get("documents")
        kwargs = {k: v for k, v in kwargs.items() if k not in FPDT_KEYWORDS}
        self._context, self._documents = context or _ONE_PROCESS, documents
        try:
            return self._forward(self.module, *args, **kwargs)
        finally:
            self._context, self._documents = _ONE_PROCESS, None

    # ---- the kernels, as the family calls them ------------------------------------------------------------

    def _conv(self, hidden_states: Tensor, weight: Tensor, bias: Tensor | None = None, activation: str | None = None,
              **kwargs: Any) -> Tensor:
        """``causal_conv1d_fn``: ``[b, channels, s_local]`` in and out, ``weight`` ``[channels, K]``."""
        x = hidden_states.transpose(1, 2).to(weight.dtype)  # [b, s_local, channels]
        stream = self._stream()
        if self.position_wise:  # the last tap only: each position reads itself
            y = x * weight[:, -1]
        elif stream is not None:  # one chunk of a streamed layer: the tail before it carried
            y = causal_conv_chunk(x, weight, self._context, self._documents, stream,
                                  MixerStream.key(self.module, "conv"))
        else:
            y = causal_conv(x, weight, self._context, self._documents)
        if bias is not None:
            y = y + bias
        if activation is not None:
            y = ACT2FN[activation](y)
        return y.to(hidden_states.dtype).transpose(1, 2)

    def _delta_rule(self, query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor,
                    initial_state: Tensor | None = None, output_final_state: bool = False, *,
                    fpdt_core: str = DELTA_RULE, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        """``torch_chunk_gated_delta_rule`` (``g`` ``[b, s_local, n_v]``) and ``chunk_kimi_delta_attention`` (``g``,
        the decay per key channel, ``[b, s_local, n_v, d_k]``, split by head with the rest): ``query``/``key``
        ``[b, s_local, n_k, d_k]``, ``value`` ``[b, s_local, n_v, d_v]``, ``beta`` ``[b, s_local, n_v]`` in;
        ``([b, s_local, n_v, d_v], None)``."""
        kernel = self._family[self._bound_as[fpdt_core]]
        options = {k: v for k, v in kwargs.items() if k not in _NOT_FOR_THE_KERNEL}
        if self._plain():
            return kernel(query, key, value, g=g, beta=beta, initial_state=initial_state,
                          output_final_state=output_final_state, **options)
        self._refuse_cached(initial_state is not None or output_final_state)
        if self.position_wise:
            out, _ = kernel(*_each_position(query, key, value), g=_each_position(g)[0], beta=_each_position(beta)[0],
                            **options)
            return out.reshape(*value.shape[:2], *out.shape[2:]), None
        p = self._context.size
        n_k, n_v = key.shape[2], value.shape[2]
        refuse_split(self._where(), delta_rule_split(n_k, n_v, p))
        query, key = expand_kv_heads(query, p), expand_kv_heads(key, p)  # n_k < P: replicated
        per_channel = g.dim() == 4

        def run(pieces: list[Tensor], params: list[Tensor], state: Tensor | None) -> tuple[Tensor, Tensor]:
            q, k, v, gate, b = pieces
            return kernel(q, k, v, g=gate if per_channel else gate[..., 0], beta=b[..., 0], initial_state=state,
                          output_final_state=True, **options)

        gates = g if per_channel else g.unsqueeze(-1)
        return self._chunk_by_chunk(run, [query, key, value, gates, beta.unsqueeze(-1)], [], []), None

    def _scan(self, hidden_states: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int,
              D: Tensor | None = None, dt_bias: Tensor | None = None, initial_states: Tensor | None = None,
              dt_softplus: bool = False, dt_limit: tuple[float, float] = (0.0, float("inf")),
              return_final_states: bool = False, **kwargs: Any) -> Any:
        """``mamba2_chunk_scan``: ``hidden_states`` ``[b, s_local, heads, head_dim]``, ``dt`` ``[b, s_local, heads]``,
        ``A`` ``[heads]``, ``B``/``C`` ``[b, s_local, groups, state]`` in; ``[b, s_local, heads, head_dim]`` out."""
        kernel = self._family[self._bound_as[SCAN]]
        options = dict(chunk_size=chunk_size, dt_softplus=dt_softplus, dt_limit=dt_limit,
                       **{k: v for k, v in kwargs.items() if k not in _NOT_FOR_THE_KERNEL})
        if self._plain():
            return kernel(hidden_states, dt, A, B, C, D=D, dt_bias=dt_bias, initial_states=initial_states,
                          return_final_states=return_final_states, **options)
        self._refuse_cached(initial_states is not None or return_final_states)
        if self.position_wise:
            out = kernel(*_each_position(hidden_states, dt), A, *_each_position(B, C), D=D, dt_bias=dt_bias,
                         **options)
            return out.reshape(hidden_states.shape)
        p, rank = self._context.size, group_rank(self._context.group)
        heads, groups = hidden_states.shape[2], B.shape[2]
        refuse_split(self._where(), scan_split(heads, groups, p))
        local = slice(rank * heads // p, (rank + 1) * heads // p)
        first_group = local.start // (heads // groups)
        kept = slice(first_group, first_group + max(groups // p, 1))  # the groups this rank's heads read
        # this rank's heads' A, D and dt_bias: inputs of every chunk (their gradients come back through it)
        params = [t[local] for t in (A, D, dt_bias) if t is not None]
        has_d, has_bias = D is not None, dt_bias is not None

        def run(pieces: list[Tensor], params: list[Tensor], state: Tensor | None) -> tuple[Tensor, Tensor]:
            x, step, b, c = pieces
            a, rest = params[0], list(params[1:])
            d = rest.pop(0) if has_d else None
            bias = rest.pop(0) if has_bias else None
            return kernel(x, step[..., 0], a, b[:, :, kept], c[:, :, kept], D=d, dt_bias=bias, initial_states=state,
                          return_final_states=True, **options)

        return self._chunk_by_chunk(run, [hidden_states, dt.unsqueeze(-1)], [B, C], params)

    def _selective_scan(self, *args: Any, **kwargs: Any) -> Any:
        """``mamba_selective_scan`` (Mamba-1: Jamba): :func:`~lightning_fpdt.hf.selective_scan.selective_scan`."""
        kernel = self._family[self._bound_as[SELECTIVE_SCAN]]
        return selective_scan(self, kernel, _NOT_FOR_THE_KERNEL, *args, **kwargs)

    # ---- chunk by chunk, piece by piece ------------------------------------------------------------------

    def _chunk_by_chunk(self, run: Kernel, by_head: list[Tensor], whole: list[Tensor], params: list[Tensor]) -> Tensor:
        """``run`` over the sequence chunk by chunk: ``by_head`` tensors ``[b, s_local, heads, ...]`` all-to-all'd
        to the whole chunk of this rank's heads, ``whole`` ones ``[b, s_local, ...]`` gathered whole, both in sequence
        order, ``params`` given to every chunk, the outputs all-to-all'd back: ``[b, s_local, heads, ...]``. Each chunk
        is a :func:`~lightning_fpdt.offload.recompute.recomputed_call` keeping only its inputs and starting states (not
        the kernel's ``c x c`` matrices of every head): a checkpointed layer's recomputation holds one chunk's at a
        time."""
        stream = self._stream()
        if stream is not None:
            return self._one_chunk(run, by_head, whole, params, stream)
        ctx = self._context
        group, p, s = ctx.group, ctx.size, by_head[0].shape[1] * ctx.size
        states: list[Tensor] = []  # per group of samples (PackedDocuments.pieces), after the chunk before
        # with offload, each chunk's inputs wait for backward in host memory (as attention's chunks do)
        store = ChunkStore(by_head[0].device, offload=True, groups={INPUT_KIND: "recurrence"}) if ctx.offload else None
        outputs, lo = [], 0
        for length in chunk_lengths(s, ctx.chunk_size):
            part = slice(lo // p, (lo + length) // p)  # this rank's sub-chunk of the chunk
            inputs = [SeqToHead.apply(t[:, part].contiguous(), group) for t in by_head]
            inputs += [t[:, part] if p == 1 else all_gather_autograd(t[:, part], 1, group) for t in whole]
            order = gathered_order(s, p, ctx.chunk_size, ctx.ring_size, lo, length)  # a ring's zigzag: sort it
            inputs = inputs if order is None else [t[:, order.to(t.device)] for t in inputs]
            if store is None:
                compute = partial(_chunk, run, lo, lo + length, self._documents, params, len(inputs))
                out, *states = recomputed_call(compute, *inputs, *states, params=params, name="recurrence")
            else:  # one tensor of the chunk's inputs into the store, offloaded; its backward prefetches the one before
                shapes = [t.shape for t in inputs]
                packed = torch.cat([t.reshape(*t.shape[:2], -1) for t in inputs], dim=-1)
                compute = partial(_chunk, run, lo, lo + length, self._documents, params, shapes)
                out, *states = recomputed_call(compute, packed, *states, params=params, store=store,
                                               name="recurrence")
            out = out if order is None else out[:, inverse_permutation(order).to(out.device)]  # back in gathered order
            outputs.append(HeadToSeq.apply(out.contiguous(), group))
            lo += length
        return torch.cat(outputs, dim=1)

    def _one_chunk(self, run: Kernel, by_head: list[Tensor], whole: list[Tensor], params: list[Tensor],
                   stream: MixerStream) -> Tensor:
        """:meth:`_chunk_by_chunk` for one chunk of a streamed layer (:mod:`lightning_fpdt.layers.carried`): the
        inputs are this rank's sub-chunk of global chunk ``stream.chunk``, the states it starts from carried in and
        those after it carried out; no recomputed call (the streamed layer recomputes the chunk)."""
        ctx = self._context
        group, p, s = ctx.group, ctx.size, stream.s_local * ctx.size
        lo = stream.lo * p  # local chunk c is global chunk c: its start, every earlier chunk being full
        length = by_head[0].shape[1] * p
        inputs = [SeqToHead.apply(t.contiguous(), group) for t in by_head]
        inputs += [t if p == 1 else all_gather_autograd(t, 1, group) for t in whole]
        order = gathered_order(s, p, ctx.chunk_size, ctx.ring_size, lo, length)  # a ring's zigzag: sort it
        inputs = inputs if order is None else [t[:, order.to(t.device)] for t in inputs]
        keys = [MixerStream.key(self.module, f"state{g}") for g in range(len(self._groups(lo, lo + length)))]
        states = [state for key in keys if (state := stream.carried(key)) is not None]
        out, finals = run_pieces(run, lo, lo + length, self._documents, inputs, params, states)
        for key, final in zip(keys, finals):
            stream.carry(key, final)
        out = out if order is None else out[:, inverse_permutation(order).to(out.device)]
        return HeadToSeq.apply(out.contiguous(), group)

    def _groups(self, lo: int, hi: int) -> list[Any]:
        return [None] if self._documents is None else self._documents.pieces(lo, hi)

    def _stream(self) -> MixerStream | None:
        """The carry of the streamed chunk this module runs in, or ``None`` (its layer runs whole)."""
        stream = active_stream(self.module)
        return stream if isinstance(stream, MixerStream) else None

    # ---- helpers ----------------------------------------------------------------------------------------

    def check_heads(self, sp_size: int) -> None:
        """Refuse, before any step, head counts ``sp_size`` ranks cannot split
        (:func:`~lightning_fpdt.hf.recurrent_heads.check_module_heads`)."""
        check_module_heads(self.core, self.module, sp_size, self._where())

    def _plain(self) -> bool:
        """One process, one chunk, one document per sample, not probed: the family's kernel as it is."""
        c = self._context
        return c.size == 1 and c.chunk_size is None and self._documents is None and not self.position_wise

    def _refuse_cached(self, cached: bool) -> None:
        if cached:
            raise Unsupported(
                f"HFCausalLM: {self._where()} was called with a recurrent state to start from or to return (a"
                " generation cache) under chunks or sequence parallelism; training passes neither (use_cache=False).")

    def flops_per_token(self) -> float:
        """Training FLOPs per token of the core kernel
        (:func:`~lightning_fpdt.hf.recurrent_heads.kernel_flops_per_token`)."""
        return kernel_flops_per_token(self.core, self.module)

    def _where(self) -> str:
        return f"{type(self.module).__name__} (layer {getattr(self.module, 'layer_idx', '?')})"


def run_pieces(run: Kernel, lo: int, hi: int, documents: PackedDocuments | None, inputs: list[Tensor],
               params: list[Tensor], states: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
    """``run`` on the global tokens ``lo:hi`` (``inputs`` ``[b, hi - lo, ...]``), cut at document starts: each group
    of samples from its state ``states[g]`` (none: the chunk starts the sequence), carried from piece to piece and
    restarting at a document start; ``(output [b, hi - lo, ...], each group's state after the chunk)``."""
    groups = documents.pieces(lo, hi) if documents is not None else [(slice(None), [(lo, hi, lo == 0)])]
    rows, finals = [], []
    for g, (samples, pieces) in enumerate(groups):
        state, outputs = (states[g] if states else None), []
        for a, c, starts_document in pieces:
            out, state = run([t[samples, a - lo:c - lo] for t in inputs], params, None if starts_document else state)
            outputs.append(out)
        rows.append(torch.cat(outputs, dim=1))
        finals.append(state)
    return torch.cat(rows, dim=0), finals


def _chunk(run: Kernel, lo: int, hi: int, documents: PackedDocuments | None, params: list[Tensor],
           layout: int | list[torch.Size], *tensors: Tensor) -> tuple[Tensor, ...]:
    """One chunk for :func:`~lightning_fpdt.offload.recompute.recomputed_call`: ``tensors`` are its inputs, then the
    states it starts from (``layout``: the number of inputs, or their shapes when they come packed into the first
    tensor, ``[b, L, sum of widths]``, as a store keeps one); ``(output, *states after)``."""
    if isinstance(layout, int):
        inputs, states = list(tensors[:layout]), list(tensors[layout:])
    else:
        widths = [math.prod(shape[2:]) for shape in layout]
        inputs = [t.reshape(shape) for t, shape in zip(tensors[0].split(widths, dim=-1), layout)]
        states = list(tensors[1:])
    out, finals = run_pieces(run, lo, hi, documents, inputs, params, states)
    return (out, *finals)


def _no_fused_kernel(*args: Any, **kwargs: Any) -> None:
    """Stands in for ``mamba2_split_conv1d_scan_combined``: ``None`` sends the family to its unfused path."""
    return None


def _each_position(*tensors: Tensor) -> tuple[Tensor, ...]:
    """``[b, s, ...] -> [b * s, 1, ...]``: every position its own sequence."""
    return tuple(t.reshape(t.shape[0] * t.shape[1], 1, *t.shape[2:]) for t in tensors)
