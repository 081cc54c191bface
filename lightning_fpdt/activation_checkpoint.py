"""Activation checkpointing of decoder layers (FPDT blocks, Hugging Face decoder layers), the checkpoint
optionally kept in host memory.

A checkpointed layer keeps only its input for backward and recomputes itself there
(:func:`lightning_fpdt.recompute.recomputed_call`). With a checkpoint store
(``SequenceParallelContext.checkpoint_store``) the input goes into that :class:`ChunkStore` (host memory
when it offloads) instead of the autograd graph, and each layer's backward prefetches the input of the
backward that runs next: the previous layer's, or the last layer's of an earlier forward pass
(:mod:`lightning_fpdt.recompute` says why that order holds).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

import torch
from torch import Tensor, nn

from lightning_fpdt.binding import SequenceParallelContext
from lightning_fpdt.chunk_store import ChunkStore
from lightning_fpdt.layout import PackedDocuments
from lightning_fpdt.recompute import INPUT_KIND, recomputed_call


class CheckpointedBlock(Protocol):
    """What :func:`checkpointed_forward` reads of a block (``lightning_fpdt.block.FPDTBlock``, an ``nn.Module``)."""

    context: SequenceParallelContext

    def block_forward(self, x: Tensor, position_ids: Tensor, documents: PackedDocuments | None = None) -> Tensor:
        """The block's computation, ``[batch, s_local, hidden] -> [batch, s_local, hidden]``."""
        ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """Every parameter ``block_forward`` uses."""
        ...


def new_checkpoint_store(device: torch.device) -> ChunkStore:
    """A store that keeps checkpointed layer inputs in host memory (their residency counted as the group
    ``"checkpoint"``), on the compute ``device``."""
    return ChunkStore(device, offload=True, groups={INPUT_KIND: "checkpoint"})


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
    return recomputed_call(run, x, params=module, store=store, name="checkpoint")
