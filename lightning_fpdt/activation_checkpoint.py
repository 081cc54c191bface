"""Activation checkpointing of decoder layers (FPDT blocks, Hugging Face decoder layers), the checkpoint
optionally kept in host memory.

A checkpointed block keeps only its input for backward and recomputes itself there. With a
checkpoint store (``SequenceParallelContext.checkpoint_store``) the input goes into that
:class:`ChunkStore` (host memory when it offloads) instead of the autograd graph, and each block's
backward prefetches the input of the backward that runs next.

Every checkpointed forward takes a fresh key (:meth:`ChunkStore.new_key`), so any number of
forward passes may run before their backward (a second view of a batch, chosen/rejected pairs).
"Runs next" is the live checkpoint put just before this one: autograd runs ready nodes
latest-created first, so backward meets the checkpoints in reverse order of their forward, across
layers and across forward passes alike (for two passes over layers 0 and 1: ``b1 b0 a1 a0``). A
forward whose graph is dropped without a backward gives its checkpoint back when its autograd
context is freed.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from lightning_fpdt.autocast_state import AutocastState
from lightning_fpdt.binding import SequenceParallelContext
from lightning_fpdt.chunk_store import ChunkStore, Key
from lightning_fpdt.layout import PackedDocuments

CHECKPOINT_KIND = "ckpt"


class CheckpointedBlock(Protocol):
    """What :func:`checkpointed_forward` reads of a block (``lightning_fpdt.block.FPDTBlock``, an ``nn.Module``)."""

    context: SequenceParallelContext

    def block_forward(self, x: Tensor, position_ids: Tensor, documents: PackedDocuments | None = None) -> Tensor:
        """The block's computation, ``[batch, s_local, hidden] -> [batch, s_local, hidden]``."""
        ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """Every parameter ``block_forward`` uses."""
        ...


def new_checkpoint_store(device: torch.device, copy_delay: float = 0.0) -> ChunkStore:
    """A store that keeps checkpointed block inputs in host memory (keys from ``new_key("ckpt")``).

    Args:
        device: the compute device.
        copy_delay: seconds each copy sleeps on CPU (tests only).
    """
    return ChunkStore(device, offload=True, groups={CHECKPOINT_KIND: "checkpoint"}, copy_delay=copy_delay)


def checkpointed_forward(
    block: CheckpointedBlock, x: Tensor, position_ids: Tensor, documents: PackedDocuments | None = None
) -> Tensor:
    """``block.block_forward(x, position_ids, documents)`` keeping only ``x`` for backward, where the
    block's context says (its ``checkpoint_store``, or the autograd graph when that is ``None``).

    ``x`` ``[batch, s_local, hidden]``, ``position_ids`` ``[batch, s_local]``; returns like ``x``.
    """
    return checkpointed_call(block, lambda t: block.block_forward(t, position_ids, documents), x,
                             block.context.checkpoint_store)


def checkpointed_call(
    module: nn.Module, run: Callable[[Tensor], Tensor], x: Tensor, store: ChunkStore | None = None
) -> Tensor:
    """``run(x)`` keeping only ``x`` for backward (in ``store`` when given, else in the autograd graph) and
    recomputing ``run`` there.

    ``module`` owns every parameter ``run`` uses (their gradients are returned once per backward, as DDP's
    reducer and FSDP's hooks expect); anything else ``run`` reads (position ids, rotary tables, documents)
    must need no gradient and stay unchanged until backward. ``x`` ``[batch, s_local, hidden]``; ``run``
    returns one tensor.
    """
    params = [p for p in module.parameters() if p.requires_grad]
    return _Checkpointed.apply(x, module, run, store, *params)


def needs_backward(x: Tensor, module: nn.Module) -> bool:
    """Whether a backward can follow ``module`` applied to ``x`` (grad mode, and ``x`` or a parameter needs
    a gradient): only then is checkpointing worth its recomputation."""
    return torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in module.parameters()))


def _previous_checkpoint(store: ChunkStore, key: Key) -> Key | None:
    """The live checkpoint put most recently before ``key``: its backward runs next (module docstring)."""
    earlier = [k for k in store if k[0] == CHECKPOINT_KIND and k[1] < key[1]]
    return max(earlier, key=lambda k: k[1], default=None)


class _Checkpointed(torch.autograd.Function):
    """Activation checkpointing of one layer: only its input is kept (optionally in a host store).

    The layer's parameters are explicit inputs and their gradients are returned, so each is
    produced once per backward (DDP's reducer and FSDP hooks see one gradient per parameter).
    """

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, module: nn.Module, run: Callable[[Tensor], Tensor], store: ChunkStore | None,
        *params: Tensor,
    ) -> Tensor:
        with torch.no_grad():
            y = run(x)
        ctx.module, ctx.run, ctx.store = module, run, store
        ctx.autocast = AutocastState.capture(x.device.type)
        ctx.x_requires_grad = x.requires_grad
        if store is not None:
            ctx.key = store.new_key(CHECKPOINT_KIND)
            store.put(ctx.key, x.detach())
            # no backward will come if the graph is dropped: give the checkpoint back then
            ctx.release = weakref.finalize(ctx, store.delete_later, ctx.key)
        else:
            ctx.save_for_backward(x)
        return y

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Any, ...]:
        store = ctx.store
        if store is not None:
            x = store.get(ctx.key)
            previous = _previous_checkpoint(store, ctx.key)
            if previous is not None:  # its backward runs next: fetch its input while this layer recomputes
                store.prefetch(previous)
        else:
            (x,) = ctx.saved_tensors
        params = [p for p in ctx.module.parameters() if p.requires_grad]
        x = x.detach().requires_grad_(ctx.x_requires_grad)
        with torch.enable_grad(), ctx.autocast.restore():
            y = ctx.run(x)
            inputs = [x, *params] if ctx.x_requires_grad else params
            grads = list(torch.autograd.grad(y, inputs, dy, allow_unused=True))
        if store is not None:
            store.delete(ctx.key)
            ctx.release.detach()
        dx = grads.pop(0) if ctx.x_requires_grad else None
        return (dx, None, None, None, *grads)
