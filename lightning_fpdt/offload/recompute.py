"""Recomputation in backward, written once: a call that keeps only its inputs and runs again in backward.

Everything that trades compute for memory goes through :func:`recomputed_call`: decoder layers under
activation checkpointing (:mod:`lightning_fpdt.layers.activation_checkpoint`, FPDT blocks and transformers layers
alike), the sequence-tiled MLP and the tiled loss (:func:`lightning_fpdt.offload.tiling.tiled_call`).

- Forward: ``fn`` runs without building a graph, tile by tile when ``tiles`` are given; only the inputs
  are kept, in the autograd graph or in a :class:`~lightning_fpdt.offload.chunk_store.ChunkStore` (host memory
  when it offloads).
- Backward: the inputs come back and ``fn`` runs again with grad, one tile at a time, under the autocast
  state captured at forward (``bf16-mixed`` recomputes in bf16 although backward runs outside autocast);
  its gradient flows to the inputs and the parameters. ``tile_grad`` replaces autograd through ``fn`` by a
  closed form where that saves memory (the loss: softmax minus one-hot, accumulated in place).
- Parameters are explicit inputs of one autograd Function and their gradients are returned from it,
  summed over tiles, so each parameter gets one gradient per backward (as DDP's reducer and FSDP's hooks
  expect), never one per tile or one from a nested backward.
- Random numbers are not replayed: what runs twice must draw none, or the recomputation's dropout masks
  differ from the forward's and the gradients belong to neither. ``HFCausalLM`` refuses dropout where it
  recomputes (:func:`lightning_fpdt.hf.layers.check_recomputable`).

An input kept in a store takes a fresh key (:meth:`ChunkStore.new_key`), so any number of forward passes
may run before their backward (a second view of a batch, chosen/rejected pairs), and each backward
prefetches the input of the backward that runs next: the live input put just before its own. Autograd runs
ready nodes latest-created first, so backward meets recomputed calls in reverse order of their forward,
across layers and forward passes alike (for two passes over layers 0 and 1: ``b1 b0 a1 a0``). A forward
whose graph is dropped without a backward gives its input back when its autograd context is freed.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_fpdt.errors import FPDTError
from lightning_fpdt.offload.autocast_state import AutocastState
from lightning_fpdt.offload.chunk_store import ChunkStore, Key
from lightning_fpdt.offload.weight_casts import original, weights_cast_once, with_casts
from lightning_fpdt.profiling import named_range

INPUT_KIND = "input"  # the key kind of recomputed inputs in a store
# a streamed layer's input chunks (lightning_fpdt.layers.streaming): chunk 0 numbered last
INPUT_CHUNK_KIND = "input_chunk"

Params = nn.Module | Sequence[Tensor]
"""What ``fn`` differentiates besides its inputs: a module (its parameters, read again in backward, where
FSDP2 has swapped in the unsharded ones) or tensors ``fn`` closes over."""

TileGrad = Callable[[Tensor, Sequence[Tensor], list[Tensor | None]], Sequence[Tensor | None]]
"""``tile_grad(grad, tile_inputs, param_grads) -> input_grads``: one tile's gradients in closed form.
``tile_inputs`` are the tile's inputs, detached, requiring grad where their gradient is wanted; it returns
those gradients (``None`` elsewhere) and adds the parameters' into ``param_grads`` (one entry per parameter
that requires grad, ``None`` until the first tile sets it; any dtype, cast to the parameter's at the end)."""


def needs_backward(inputs: Tensor | Sequence[Tensor], params: Params = ()) -> bool:
    """Whether a backward can follow a call on ``inputs`` using ``params`` (grad mode, and an input or a
    parameter needs a gradient): only then is keeping the inputs and recomputing worth it."""
    inputs = (inputs,) if isinstance(inputs, Tensor) else inputs
    return torch.is_grad_enabled() and (any(x.requires_grad for x in inputs) or bool(_grad_params(params)))


def recomputed_call(
    fn: Callable[..., Tensor | tuple[Tensor, ...]],
    *inputs: Tensor,
    params: Params = (),
    store: ChunkStore | None = None,
    tiles: Sequence[tuple[int, int]] | None = None,
    tile_grad: TileGrad | None = None,
    name: str = "recompute",
) -> Tensor:
    """``fn(*inputs)``, keeping only ``inputs`` for backward and running ``fn`` again there (module docstring).

    Args:
        fn: a function of the inputs (or of one tile of each); anything else it reads (position ids, rotary
            tables, documents) must need no gradient and stay unchanged until backward.
        inputs: tensors whose dimension 1 is the sequence when ``tiles`` are given.
        params: what ``fn`` differentiates besides ``inputs`` (see :data:`Params`).
        store: keep the first input here (host memory when it offloads) instead of in the autograd graph (the
            others, if any, stay in the graph: small ones, such as a recurrence's starting states).
        tiles: ``[lo, hi)`` ranges of dimension 1: ``fn`` runs on ``x[:, lo:hi]`` of every input, one tile at
            a time; tensor results are written at their tile of the output, 0-dimensional ones summed.
        tile_grad: a closed form for one tile's gradients instead of autograd through ``fn`` (see
            :data:`TileGrad`).
        name: the profiler range of each run, ``fpdt/<name>`` (``fpdt/<name>_backward`` when recomputed).

    Returns:
        ``fn``'s result: ``[batch, seq, ...]`` assembled from the tiles, or their sum; untiled, a tuple of tensors
        where ``fn`` returns one (a recurrence's output and the states it leaves: :mod:`lightning_fpdt.hf.recurrent`).

    Raises:
        ValueError: a ``store`` with tiles.
    """
    if store is not None and tiles is not None:
        raise FPDTError(f"recomputed_call: a store keeps an untiled input; got tiles={tiles!r}.")
    call = _Call(fn, params, store, None if tiles is None else list(tiles), tile_grad, name, len(inputs))
    if not needs_backward(inputs, params):  # nothing will come back for the inputs: keep nothing
        return call.run(inputs)
    return _Recomputed.apply(call, *inputs, *_grad_params(params))


def _grad_params(params: Params) -> list[Tensor]:
    """The parameters that need a gradient: the weights themselves inside a scope that swapped in their casts."""
    found = params.parameters() if isinstance(params, nn.Module) else params
    return [original(p) for p in found if p.requires_grad]


def add_param_grads(d_params: list[Tensor | None], params: Sequence[Tensor], found: Sequence[Tensor | None],
                    casts: Sequence[Tensor | None]) -> None:
    """Add one piece's gradients into ``d_params`` (one per parameter, ``None`` until the first): ``found`` holds the
    parameters' and then, in order, those of the casts :func:`~.weight_casts.with_casts` gave (``casts``), each added
    to its parameter's in float32 or wider."""
    from_casts = iter(found[len(params):])
    for n, (d, cast) in enumerate(zip(found, casts)):
        for part in (d, next(from_casts) if cast is not None else None):
            if part is None:
                continue
            if d_params[n] is None:
                d_params[n] = part.to(torch.promote_types(params[n].dtype, part.dtype))
            else:
                d_params[n].add_(part)  # type: ignore[union-attr]


def differentiate(pairs: Sequence[tuple[Tensor, Tensor | None]], wrt: Sequence[Tensor], params: Sequence[Tensor],
                  casts: Sequence[Tensor | None], d_params: list[Tensor | None]) -> list[Tensor | None]:
    """The gradients of ``wrt`` (``None`` for those that need none) from ``(output, its gradient)`` pairs, leaving out
    outputs without a gradient to give or that need none; the gradients of ``params`` and of their ``casts``
    (:func:`~.weight_casts.with_casts`) are added into ``d_params`` (:func:`add_param_grads`)."""
    pairs = [(o, g) for o, g in pairs if g is not None and o.requires_grad]
    needed = [t for t in wrt if t.requires_grad]
    targets = [*needed, *params, *(c for c in casts if c is not None)]
    found = torch.autograd.grad([o for o, _ in pairs], targets, [g for _, g in pairs],
                                allow_unused=True) if pairs else (None,) * len(targets)
    add_param_grads(d_params, params, found[len(needed):], casts)
    given = iter(found[: len(needed)])
    return [next(given) if t.requires_grad else None for t in wrt]


def previous_input(store: ChunkStore, key: Key) -> Key | None:
    """The live input numbered most recently before ``key``: its backward runs next (module docstring); for a
    streamed layer, its first chunk (numbered last of its chunks)."""
    earlier = [k for k in store if k[0] in (INPUT_KIND, INPUT_CHUNK_KIND) and k[1] < key[1]]
    return max(earlier, key=lambda k: k[1], default=None)


@dataclass
class _Call:
    """One recomputed call: what :class:`_Recomputed` runs in forward and again in backward."""

    fn: Callable[..., Tensor | tuple[Tensor, ...]]
    params: Params
    store: ChunkStore | None
    tiles: list[tuple[int, int]] | None
    tile_grad: TileGrad | None
    name: str
    num_inputs: int

    def pieces(self, inputs: Sequence[Tensor]) -> list[tuple[slice | None, list[Tensor]]]:
        """``(where in the output, the piece's inputs)`` for each tile, or once for the whole call."""
        if self.tiles is None:
            return [(None, list(inputs))]
        return [(slice(lo, hi), [x[:, lo:hi] for x in inputs]) for lo, hi in self.tiles]

    def run(self, inputs: Sequence[Tensor]) -> Tensor | tuple[Tensor, ...]:
        """``fn`` over every piece, assembled (the forward, and a call that needs no backward)."""
        # once for every tile, not once per tile
        with weights_cast_once(self.params, AutocastState.capture(inputs[0].device.type)):
            return self._run(inputs)

    def _run(self, inputs: Sequence[Tensor]) -> Tensor | tuple[Tensor, ...]:
        out: Tensor | None = None
        for where, piece in self.pieces(inputs):
            with named_range(f"fpdt/{self.name}"):
                y = self.fn(*piece)
            if where is None:
                return y
            if isinstance(y, tuple):
                raise TypeError(f"recomputed_call: {self.name} returns a tuple, which tiles cannot assemble.")
            if y.dim() == 0:
                out = y if out is None else out + y
                continue
            if out is None:
                out = y.new_empty(y.shape[0], inputs[0].shape[1], *y.shape[2:])
            out[:, where] = y
        assert out is not None, "tile_bounds never gives an empty list"
        return out

    def gradients(self, grad: Tensor | tuple[Tensor | None, ...], inputs: Sequence[Tensor], wanted: Sequence[bool],
                  scalar: bool, autocast: AutocastState) -> list[Tensor | None]:
        """The gradients of ``(*inputs, *params)``: each piece recomputed and differentiated in turn (``grad``: one
        per result of ``fn``, ``None`` for a result nothing used)."""
        params = _grad_params(self.params)
        whole = self.tiles is None
        d_inputs: list[Tensor | None] = [
            None if whole or not w else torch.empty_like(x) for x, w in zip(inputs, wanted)
        ]
        d_params: list[Tensor | None] = [None] * len(params)
        with autocast.restore(), weights_cast_once(self.params, autocast):
            return self._gradients(grad, inputs, wanted, scalar, params, d_inputs, d_params)

    def _gradients(self, grad: Tensor | tuple[Tensor | None, ...], inputs: Sequence[Tensor], wanted: Sequence[bool],
                   scalar: bool, params: list[Tensor], d_inputs: list[Tensor | None],
                   d_params: list[Tensor | None]) -> list[Tensor | None]:
        whole = self.tiles is None
        for where, piece in self.pieces(inputs):
            piece = [x.detach().requires_grad_(w) for x, w in zip(piece, wanted)]
            g = grad if scalar or where is None else grad[:, where]  # type: ignore[index]
            with named_range(f"fpdt/{self.name}_backward"):
                if self.tile_grad is not None:
                    found = list(self.tile_grad(g, piece, d_params))
                else:
                    found = self._autograd(g, piece, params, d_params)
            for i, d in enumerate(found):
                if not wanted[i]:
                    continue
                if whole:
                    d_inputs[i] = d
                elif d is None:
                    d_inputs[i][:, where] = 0  # type: ignore[index]
                else:
                    d_inputs[i][:, where] = d  # type: ignore[index]
        return [*d_inputs, *(None if d is None else d.to(p.dtype) for d, p in zip(d_params, params))]

    def _autograd(self, grad: Tensor | tuple[Tensor | None, ...], piece: list[Tensor], params: list[Tensor],
                  d_params: list[Tensor | None]) -> list[Tensor | None]:
        """``fn`` run again with grad on one piece; its parameters' gradients are added into ``d_params`` (a
        parameter whose cast the scope swapped in gets the cast's gradient too: :mod:`~.weight_casts`)."""
        with torch.enable_grad():
            y = self.fn(*piece)
            # the results something used (a recurrence's last states may have no gradient)
            pairs = list(zip(*((y, grad) if isinstance(y, tuple) else ((y,), (grad,)))))
            return differentiate(pairs, piece, params, with_casts(params), d_params)


class _Recomputed(torch.autograd.Function):
    """Runs a :class:`_Call`, keeping only its inputs; backward recomputes it piece by piece."""

    @staticmethod
    def forward(ctx: Any, call: _Call, *tensors: Tensor) -> Tensor | tuple[Tensor, ...]:
        inputs = tensors[: call.num_inputs]
        out = call.run(inputs)
        ctx.call, ctx.several = call, isinstance(out, tuple)
        ctx.scalar = not ctx.several and out.dim() == 0
        ctx.autocast = AutocastState.capture(inputs[0].device.type)
        ctx.wanted = [x.requires_grad for x in inputs]
        if call.store is not None:
            ctx.key = call.store.new_key(INPUT_KIND)
            call.store.put(ctx.key, inputs[0].detach())
            # no backward will come if the graph is dropped: give the input back then
            ctx.release = weakref.finalize(ctx, call.store.delete_later, ctx.key)
            ctx.save_for_backward(*inputs[1:])
        else:
            ctx.save_for_backward(*inputs)
        return out

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        grad = grads if ctx.several else grads[0]
        call, store = ctx.call, ctx.call.store
        if store is not None:
            inputs = [store.get(ctx.key), *ctx.saved_tensors]
            previous = previous_input(store, ctx.key)
            if previous is not None:  # its backward runs next: fetch its input while this call recomputes
                store.prefetch(previous)
        else:
            inputs = list(ctx.saved_tensors)
        grads = call.gradients(grad, inputs, ctx.wanted, ctx.scalar, ctx.autocast)
        if store is not None:
            store.delete(ctx.key)
            ctx.release.detach()
        return (None, *grads)
