"""Activation checkpointing of decoder layers (FPDT blocks, Hugging Face decoder layers), each layer's input
optionally kept in host memory.

Words: a *recomputed layer* is a decoder layer under activation checkpointing; it keeps only its *layer
input* for backward and recomputes itself there (:func:`lightning_fpdt.offload.recompute.recomputed_call`). A
"checkpoint" elsewhere in the package is a training checkpoint (:mod:`lightning_fpdt.checkpoints.files`).
With a layer input store (``SequenceParallelContext.layer_input_store``) the input goes into that
:class:`ChunkStore` (host memory when it offloads) instead of the autograd graph, and each layer's backward
prefetches the input of the backward that runs next: the previous layer's, or the last layer's of an
earlier forward pass (:mod:`lightning_fpdt.offload.recompute` says why that order holds).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

import torch
from torch import Tensor, nn

from lightning_fpdt.attention.kept_answers import AnswerKeeper
from lightning_fpdt.offload.chunk_store import ChunkStore
from lightning_fpdt.offload.recompute import INPUT_CHUNK_KIND, INPUT_KIND, needs_backward, recomputed_call
from lightning_fpdt.parallel.binding import SequenceParallelContext
from lightning_fpdt.parallel.packed_documents import PackedDocuments


class RecomputedBlock(Protocol):
    """What :func:`recomputed_block_forward` reads of a block (``lightning_fpdt.layers.block.FPDTBlock``, an
    ``nn.Module``)."""

    context: SequenceParallelContext

    def block_forward(self, x: Tensor, position_ids: Tensor, documents: PackedDocuments | None = None) -> Tensor:
        """The block's computation, ``[batch, s_local, hidden] -> [batch, s_local, hidden]``."""
        ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """Every parameter ``block_forward`` uses."""
        ...


def new_layer_input_store(device: torch.device) -> ChunkStore:
    """A store that keeps the inputs of recomputed layers in host memory (their residency counted as the
    group ``"layer_input"``, whole or chunk by chunk: :mod:`lightning_fpdt.layers.streaming`), on the compute
    ``device``."""
    return ChunkStore(device, offload=True, groups={INPUT_KIND: "layer_input", INPUT_CHUNK_KIND: "layer_input"})


def recomputed_block_forward(
    block: RecomputedBlock, x: Tensor, position_ids: Tensor, documents: PackedDocuments | None = None
) -> Tensor:
    """``block.block_forward(x, position_ids, documents)`` keeping only ``x`` for backward, where the
    block's context says (its ``layer_input_store``, or the autograd graph when that is ``None``).

    ``x`` ``[batch, s_local, hidden]``, ``position_ids`` ``[batch, s_local]``; returns like ``x``.
    """
    return recomputed_layer_call(block, lambda t: block.block_forward(t, position_ids, documents), x,
                                 block.context.layer_input_store, keep_answers=block.context.keep_attention)


def recomputed_layer_call(
    module: nn.Module, run: Callable[..., Tensor], x: Tensor, store: ChunkStore | None = None, *extras: Tensor,
    keep_answers: bool = False,
) -> Tensor:
    """``run(x, *extras)`` keeping only ``x`` (in ``store`` when given, else in the autograd graph) and ``extras``
    (in the graph) for backward, and recomputing ``run`` there.

    ``module`` owns every parameter ``run`` uses (their gradients are returned once per backward, as DDP's
    reducer and FSDP's hooks expect); anything else ``run`` reads (position ids, rotary tables, documents)
    must need no gradient and stay unchanged until backward. ``x`` ``[batch, s_local, hidden]``; ``extras``:
    other inputs with a gradient (Gemma-4's per-layer input); ``run`` returns one tensor.

    ``keep_answers``: the forward keeps its attention's answers and the recomputation reads them instead of computing
    attention again (:mod:`lightning_fpdt.attention.kept_answers`).
    """
    if keep_answers and needs_backward((x, *extras), module):
        run = AnswerKeeper().wrap(run)
    return recomputed_call(run, x, *extras, params=module, store=store, name="decoder_layer")
