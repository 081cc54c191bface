"""The contract between the FPDT pipeline and its two ends: where the forward gets this rank's local q/k/v
chunks (:class:`ChunkSource`), where the backward puts their final gradients (:class:`ChunkSink`), and the
pair as one object the autograd Function keeps (:class:`PipelineEnds`).

``lightning_fpdt.attention.sources`` implements two pairs; ``lightning_fpdt.attention.pipeline`` runs
between any pair.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor, nn


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
        """k ``[batch, hi - lo, kv_heads, head_dim]`` and v ``[batch, hi - lo, kv_heads, v_head_dim]`` (``v_head_dim``
        may differ), ``kv_heads`` already replicated to a multiple of P."""
        ...


class ChunkSink(Protocol):
    """Where the backward puts each local gradient chunk once it is final, and what it makes of them."""

    def q(self, lo: int, hi: int, dq: Tensor) -> None:
        """``dq`` ``[batch, hi - lo, n_heads, head_dim]``: final."""
        ...

    def kv(self, lo: int, hi: int, dk: Tensor, dv: Tensor) -> None:
        """``dk`` ``[batch, hi - lo, kv_heads, head_dim]``, ``dv`` ``[batch, hi - lo, kv_heads, v_head_dim]``: final."""
        ...

    def result(self) -> tuple[Tensor | None, ...]:
        """The gradients of the pipeline's inputs (see :class:`PipelineEnds`), once every chunk is in."""
        ...


class PipelineEnds(Protocol):
    """Both ends of a pipeline over the tensor ``inputs`` given to :class:`PipelineFunction`.

    Holds no tensors itself: the autograd context keeps it until backward, and a reference to a
    whole q or k there would keep its storage alive.
    """

    @property
    def weights(self) -> tuple[nn.Module, ...]:
        """The modules whose weights the source multiplies by (cast once per forward under mixed precision:
        :mod:`lightning_fpdt.offload.weight_casts`), or ``()``."""
        ...

    def source(self, *inputs: Tensor) -> ChunkSource:
        """The forward's chunk source over ``inputs``."""
        ...

    def saved(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        """The inputs :meth:`sink` needs in backward (kept with ``ctx.save_for_backward``)."""
        ...

    def sink(self, dout: Tensor, dtype: torch.dtype, *saved: Tensor) -> ChunkSink:
        """The backward's sink; its ``result()`` is one gradient (or ``None``) per input, in order.

        ``dout`` ``[batch, s_local, n_heads, v_head_dim]``; ``dtype`` that of the source's q chunks.
        """
        ...
