"""Decoder layers whose token mixers carry state along the sequence (a gated delta-net, a Mamba-2 mixer, a short
convolution), streamed chunk by chunk: forward, recomputation and backward run one chunk of the layer at a time, so
the device memory of the layer's work is one chunk's, not the local sequence's.

Local chunk ``c`` of every rank is global chunk ``c`` (the FPDT layout), so when every rank runs its chunk ``c`` the
mixers' sequence-parallel kernels see the whole global chunk (:mod:`lightning_fpdt.hf.recurrent`,
:mod:`lightning_fpdt.hf.short_conv`). What crosses from chunk ``c`` to chunk ``c + 1`` is the *carry*: per mixer, its
recurrent state (per group of samples with the same documents) and its convolution's last ``K - 1`` inputs. A mixer
reads the carry entering the chunk from the :class:`MixerStream` installed on it and leaves the carry for the next
chunk there; packed documents restart both at each document start, as before.

Forward (no graph): for each chunk ``y_c, carry_{c+1} = layer(x_c, carry_c)``; each chunk's input and the carry
entering it are kept for backward (in the layer input store: host memory with ``offload_checkpoints``).

Backward, chunks in reverse order: chunk ``c`` is recomputed with grad from its input and its carry (leaves), and
``dy_c`` with ``d carry_{c+1}`` (from chunk ``c + 1``'s backward; zero for the last chunk) flow back to ``dx_c``,
``d carry_c`` and the parameters. Every rank runs the same chunks in the same order, so the collectives inside a
chunk's backward (the kernels' all-to-alls, the convolution tails' all-gather) meet.

With token sums (``sums``), ``run_chunk`` returns ``(y_c, s_c)``, ``s_c`` a sum over the chunk's tokens (a router's
probabilities for the auxiliary loss), and the call ``(y, sum of s_c)``; the sum's gradient goes to every chunk's
``s_c`` in backward (as :mod:`lightning_fpdt.layers.streaming` does).

What is sized by the local sequence during the layer's work: its output and its input's gradient, filled chunk by
chunk, and nothing else.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_fpdt.attention.blocks import chunk_bounds
from lightning_fpdt.layers.streaming import split_token_sums
from lightning_fpdt.offload.autocast_state import AutocastState
from lightning_fpdt.offload.chunk_store import ChunkStore, Key
from lightning_fpdt.offload.recompute import INPUT_CHUNK_KIND, differentiate, previous_input
from lightning_fpdt.offload.weight_casts import original, weights_cast_once, with_casts
from lightning_fpdt.profiling import named_range

CARRY_KIND = "carry"  # the key kind of a carried layer's chunk boundary states in a store

CarriedLayer = Callable[[Tensor, int, int, "MixerStream"], "Tensor | tuple[Tensor, Tensor]"]
"""``run_chunk(x_c, lo, hi, stream) -> y_c`` (``(y_c, s_c)`` with token sums): one chunk of a decoder layer, its
mixers reading and leaving their carry in ``stream``."""


class MixerStream:
    """The carry of one chunk of a streamed call: what the mixers read entering chunk :attr:`chunk` (local tokens
    :attr:`lo` .. :attr:`hi` of :attr:`s_local`) and what they leave for the next one. Keys are the mixers' own
    (:meth:`key`); a key not carried in is the start of the sequence."""

    def __init__(self, chunk: int, lo: int, hi: int, s_local: int, carried: dict[str, Tensor]) -> None:
        self.chunk, self.lo, self.hi, self.s_local = chunk, lo, hi, s_local
        self.carried_in = carried
        self.carried_out: dict[str, Tensor] = {}

    @staticmethod
    def key(module: nn.Module, what: str) -> str:
        """The carry key of ``what`` (``"conv"``, ``"state0"``, ...) of mixer ``module``: unique in the process
        while the module lives, the same in forward and backward."""
        return f"{id(module)}/{what}"

    def carried(self, key: str) -> Tensor | None:
        """What entered this chunk under ``key``; ``None`` at the start of the sequence."""
        return self.carried_in.get(key)

    def carry(self, key: str, value: Tensor) -> None:
        """Leave ``value`` for the next chunk under ``key``."""
        if key in self.carried_out:
            raise RuntimeError(f"streamed layer: chunk {self.chunk} carries {key!r} twice")
        self.carried_out[key] = value


@dataclass
class _Carried:
    """One carried call: the layer, its chunks, where its inputs and carries wait, its parameters."""

    run_chunk: CarriedLayer
    module: nn.Module
    bounds: list[tuple[int, int]]
    store: ChunkStore | None
    name: str
    sums: bool = False

    def params(self) -> list[Tensor]:
        return [original(p) for p in self.module.parameters() if p.requires_grad]

    def run(self, x_c: Tensor, lo: int, hi: int, stream: MixerStream) -> tuple[Tensor, Tensor | None]:
        return split_token_sums(self.run_chunk(x_c, lo, hi, stream), self.sums, self.name)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor | None, list[dict[str, Tensor]]]:
        """``y`` ``[batch, s_local, hidden]`` without a graph, the token sums (``None`` without), and the carry
        entering each chunk."""
        carry: dict[str, Tensor] = {}
        carries: list[dict[str, Tensor]] = []
        y: Tensor | None = None
        total: Tensor | None = None
        with torch.no_grad(), weights_cast_once(self.module, AutocastState.capture(x.device.type)):
            for c, (lo, hi) in enumerate(self.bounds):
                carries.append(carry)
                stream = MixerStream(c, lo, hi, x.shape[1], carry)
                with named_range(f"fpdt/{self.name}"):
                    y_c, s_c = self.run(x[:, lo:hi], lo, hi, stream)
                if y is None:
                    y = y_c.new_empty(x.shape[0], x.shape[1], *y_c.shape[2:])
                y[:, lo:hi] = y_c
                if s_c is not None:
                    total = s_c if total is None else total.add_(s_c)
                carry = stream.carried_out
        assert y is not None
        return y, total, carries

    def backward(self, dy: Tensor, dsums: Tensor | None, chunk: Callable[[int], tuple[Tensor, dict[str, Tensor]]],
                 x_shape: torch.Size, x_dtype: torch.dtype, want_dx: bool, autocast: AutocastState
                 ) -> list[Tensor | None]:
        """``[dx, *parameter gradients]``, the chunks in reverse order (module docstring)."""
        params = self.params()  # read now (FSDP2 has swapped in the unsharded ones), before the casts are swapped in
        with weights_cast_once(self.module, autocast):
            casts = with_casts(params)
            d_params: list[Tensor | None] = [None] * len(params)
            dx = dy.new_empty(x_shape, dtype=x_dtype) if want_dx else None
            d_carry: dict[str, Tensor] = {}  # the gradient of the carry leaving the chunk being differentiated
            for c in reversed(range(len(self.bounds))):
                lo, hi = self.bounds[c]
                x_c, carried = chunk(c)
                x_c = x_c.detach().requires_grad_(want_dx)
                leaves = {k: v.detach().requires_grad_(v.is_floating_point()) for k, v in carried.items()}
                stream = MixerStream(c, lo, hi, x_shape[1], leaves)
                with torch.enable_grad(), autocast.restore(), named_range(f"fpdt/{self.name}_backward"):
                    y_c, s_c = self.run(x_c, lo, hi, stream)
                # every output with a gradient gets one (zeros where the next chunk gave none), so every rank walks
                # the same graph and meets the same collectives
                pairs = [(y_c, dy[:, lo:hi])] + [(out, d_carry.get(k, torch.zeros_like(out)))
                                                  for k, out in stream.carried_out.items() if out.requires_grad]
                if s_c is not None and dsums is not None:
                    pairs.append((s_c, dsums))
                grads = differentiate(pairs, [x_c, *leaves.values()], params, casts, d_params)
                if dx is not None:
                    dx[:, lo:hi] = grads[0] if grads[0] is not None else 0
                d_carry = {k: g for k, g in zip(leaves, grads[1:]) if g is not None}
        return [dx, *(None if d is None else d.to(p.dtype) for d, p in zip(d_params, params))]


class _CarriedLayer(torch.autograd.Function):
    """``x -> y`` of a :class:`_Carried` call, keeping each chunk's input and entering carry (in its store, when it
    has one)."""

    @staticmethod
    def forward(ctx: Any, call: _Carried, x: Tensor, *params: Tensor) -> Any:
        y, sums, carries = call.forward(x)
        out = y if sums is None else (y, sums)
        ctx.call, ctx.x_shape, ctx.x_dtype = call, x.shape, x.dtype
        ctx.autocast = AutocastState.capture(x.device.type)
        store = call.store
        if store is None:
            ctx.save_for_backward(x)
            ctx.carries, ctx.keys = carries, None
            return out
        # chunk 0 numbered first: the backward runs the last chunk first, and the backward before this one
        # prefetches the input numbered last (recompute.previous_input)
        ctx.keys = [(store.new_key(INPUT_CHUNK_KIND), {k: store.new_key(CARRY_KIND) for k in carry})
                    for carry in carries]
        for (key, carry_keys), (lo, hi), carry in zip(ctx.keys, call.bounds, carries):
            store.put(key, x[:, lo:hi].detach())
            for k, held in carry_keys.items():
                store.put(held, carry[k].detach())
        ctx.carries = None
        # no backward will come if the graph is dropped: give the chunks back then
        ctx.release = weakref.finalize(ctx, _delete_later, store, _all_keys(ctx.keys))
        return out

    @staticmethod
    def backward(ctx: Any, dy: Tensor, dsums: Tensor | None = None) -> tuple[Tensor | None, ...]:
        call: _Carried = ctx.call
        store, keys = call.store, ctx.keys
        if keys is None:
            (x,) = ctx.saved_tensors
            carries = ctx.carries

            def chunk(c: int) -> tuple[Tensor, dict[str, Tensor]]:
                lo, hi = call.bounds[c]
                return x[:, lo:hi], carries[c]
        else:
            assert store is not None

            def chunk(c: int) -> tuple[Tensor, dict[str, Tensor]]:
                # the chunk before is read next; after chunk 0, the backward that runs next starts with its input
                following = [keys[c - 1][0], *keys[c - 1][1].values()] if c > 0 else [previous_input(store, keys[0][0])]
                for key in following:
                    if key is not None and key in store:
                        store.prefetch(key)
                key, carry_keys = keys[c]
                x_c = store.get(key)
                carried = {k: store.get(held) for k, held in carry_keys.items()}
                for held in (key, *carry_keys.values()):
                    store.delete(held)
                return x_c, carried

        grads = call.backward(dy, dsums, chunk, ctx.x_shape, ctx.x_dtype, ctx.needs_input_grad[1], ctx.autocast)
        ctx.carries = None
        if keys is not None:
            ctx.release.detach()
        return (None, *grads)


def _all_keys(keys: list[tuple[Key, dict[str, Key]]]) -> list[Key]:
    return [k for key, carry_keys in keys for k in (key, *carry_keys.values())]


def _delete_later(store: ChunkStore, keys: list[Key]) -> None:
    for key in keys:
        store.delete_later(key)


def carried_layer_call(run_chunk: CarriedLayer, module: nn.Module, x: Tensor, local_chunk_size: int,
                       store: ChunkStore | None = None, name: str = "decoder_layer", sums: bool = False) -> Any:
    """``y`` ``[batch, s_local, hidden]`` of the layer ``run_chunk`` computes chunk by chunk (module docstring) on
    ``x`` ``[batch, s_local, hidden]``, in local chunks of ``local_chunk_size`` tokens (the attention pipeline's:
    local chunk ``c`` is global chunk ``c``). ``module`` owns every parameter ``run_chunk`` uses; ``store``: where the
    input's chunks and the carries wait for backward (``None``: the autograd graph); ``sums``: ``run_chunk`` returns
    ``(y_c, s_c)`` and the call ``(y, sum of s_c)``. Without a backward to follow, the layer streams and keeps
    nothing."""
    call = _Carried(run_chunk, module, chunk_bounds(x.shape[1], local_chunk_size), store, name, sums)
    params = call.params()
    if not torch.is_grad_enabled() or not (x.requires_grad or params):
        y, total, _ = call.forward(x)
        return (y, total) if sums else y
    return _CarriedLayer.apply(call, x, *params)


__all__ = ["CARRY_KIND", "MixerStream", "carried_layer_call"]
