"""``FPDTAttention`` and ``FPDTBlock``: a pre-norm transformer block whose attention runs through the FPDT
pipeline.

The block is a plain ``nn.Module`` that works in one process. It implements the binding contract
(:class:`lightning_fpdt.parallel.binding.SequenceParallelAttention`) like any other sequence-parallel attention
layer: ``FPDTStrategy`` binds it to the sequence-parallel group and configuration from outside
(:func:`lightning_fpdt.parallel.binding.bind`); models never look for process groups themselves.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from lightning_fpdt.attention import fpdt_attention
from lightning_fpdt.attention.kernels import get_kernel
from lightning_fpdt.attention.pipeline import PipelineOptions, run_pipeline
from lightning_fpdt.attention.sources import ProjectionEnds, projection_params
from lightning_fpdt.layers.activation_checkpoint import recomputed_block_forward
from lightning_fpdt.layers.layer_stream import LayerStream, stream_chunk_size
from lightning_fpdt.layers.rope import RotaryEmbedding
from lightning_fpdt.layers.streaming import streamed_layer_call
from lightning_fpdt.offload.autocast_state import AutocastState
from lightning_fpdt.offload.recompute import needs_backward
from lightning_fpdt.offload.tiling import TiledMLP
from lightning_fpdt.parallel.binding import AttentionRecord, DecoderLayer, SequenceParallelContext
from lightning_fpdt.parallel.comm import check_heads
from lightning_fpdt.parallel.packed_documents import PackedDocuments


class FPDTAttention(nn.Module):
    """Multi-head / grouped-query self-attention on sequence shards.

    Args:
        hidden_size: model width.
        n_heads: query heads.
        n_kv_heads: key/value heads (GQA); defaults to ``n_heads``.
        head_dim: defaults to ``hidden_size // n_heads``.
        bias: biases on the q/k/v/o projections.
        rope: a :class:`RotaryEmbedding`, or ``None`` (positions handled elsewhere).
        causal: causal (decoder) attention.
    """

    def __init__(
        self,
        hidden_size: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        head_dim: int | None = None,
        bias: bool = False,
        rope: RotaryEmbedding | None = None,
        causal: bool = True,
    ) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads or n_heads
        self.head_dim = head_dim or hidden_size // n_heads
        self.causal = causal
        self.q_proj = nn.Linear(hidden_size, n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(n_heads * self.head_dim, hidden_size, bias=bias)
        self.rope = rope
        self.context = SequenceParallelContext()
        self.record = AttentionRecord()

    def bind(self, context: SequenceParallelContext) -> None:
        """Run under ``context`` from the next forward on (raises if the heads cannot be sharded over it)."""
        check_heads(self.n_heads, self.n_kv_heads, context.size, context.ring_size)
        self.context = context

    def forward(self, x: Tensor, position_ids: Tensor, documents: PackedDocuments | None = None) -> Tensor:
        """``x`` ``[batch, s_local, hidden]`` (this rank's shard), ``position_ids`` ``[batch, s_local]``,
        ``documents`` the packed documents of the batch (``None``: one per sample).

        With chunking (or documents) the q/k/v projections and RoPE run chunk by chunk inside the
        pipeline, so no ``[s_local, heads, head_dim]`` q, k or v exists at once, forward or backward.
        """
        b, s_local, _ = x.shape  # s_local = S // sp
        context = self.context
        self.record = AttentionRecord.for_call(s_local, context)
        if context.chunk_size is not None or documents is not None:
            out = projected_fpdt_attention(self, x, position_ids, documents)
            return self.o_proj(out.reshape(b, s_local, self.n_heads * self.head_dim))
        q = self.q_proj(x).view(b, s_local, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(b, s_local, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, s_local, self.n_kv_heads, self.head_dim)
        if self.rope is not None:
            q, k = self.rope(q, position_ids), self.rope(k, position_ids)
        out = fpdt_attention(
            q, k, v, group=context.attention_group, chunk_size=context.chunk_size, causal=self.causal,
            backend=context.attention_backend, offload=context.offload, stats_sink=self.record.sink,
            ring_group=context.ring_group,
        )
        return self.o_proj(out.reshape(b, s_local, self.n_heads * self.head_dim))


class FPDTBlock(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``.

    Implements :class:`lightning_fpdt.parallel.binding.SequenceParallelAttention` (one attention layer, one decoder
    layer).

    Args:
        attention: an :class:`FPDTAttention`.
        mlp: any module mapping ``[batch, seq, hidden]`` to the same shape.
        attention_norm: the norm before attention (RMSNorm, LayerNorm, ...).
        mlp_norm: the norm before the MLP.
    """

    def __init__(
        self, attention: FPDTAttention, mlp: nn.Module, attention_norm: nn.Module, mlp_norm: nn.Module
    ) -> None:
        super().__init__()
        self.attention_norm = attention_norm
        self.attention = attention
        self.mlp_norm = mlp_norm
        self.mlp = mlp
        self.layer_index = 0
        self.context = SequenceParallelContext()

    def bind(self, context: SequenceParallelContext, layer_index: int = 0) -> None:
        """Attach the sequence-parallel group and options.

        ``layer_index`` is the block's position in the model, for the reader of a record; the
        layer input prefetch follows the order the forward passes ran in
        (``lightning_fpdt.layers.activation_checkpoint``).
        """
        self.attention.bind(context)
        self.context, self.layer_index = context, layer_index

    @property
    def record(self) -> AttentionRecord:
        """What the block's attention did in its latest call."""
        return self.attention.record

    # ---- the SequenceParallelAttention protocol (lightning_fpdt.parallel.binding) ----------------------------

    def bind_sequence_parallel(self, context: SequenceParallelContext) -> None:
        """Run under ``context`` from the next forward on (what ``FPDTStrategy`` calls)."""
        self.bind(context, self.layer_index)

    def attention_heads(self) -> list[tuple[str, int, int]]:
        """``[("", n_heads, n_kv_heads)]``: the block is its one attention layer's name."""
        return [("", self.attention.n_heads, self.attention.n_kv_heads)]

    def decoder_layers(self) -> list[DecoderLayer]:
        """``[the block]``, with the sizes the memory model reads."""
        attn, mlp = self.attention, self.mlp
        tiled = isinstance(mlp, TiledMLP)
        return [DecoderLayer(
            name="", module=self, hidden_size=attn.q_proj.in_features, n_heads=attn.n_heads,
            n_kv_heads=attn.n_kv_heads, head_dim=attn.head_dim, mlp=mlp.mlp if tiled else mlp,
            mlp_tiled=tiled and mlp.num_tiles != 1, norms=(self.attention_norm, self.mlp_norm),
            stream_refusal=None if attn.causal else "its attention is not causal",
        )]

    def attention_records(self) -> list[AttentionRecord]:
        """``[the latest record of its attention]``."""
        return [self.record]

    # ---- forward ---------------------------------------------------------------------------------------

    def block_forward(self, x: Tensor, position_ids: Tensor, documents: PackedDocuments | None = None) -> Tensor:
        """The block itself: ``[batch, s_local, hidden] -> [batch, s_local, hidden]``."""
        x = x + self.attention(self.attention_norm(x), position_ids, documents)
        return x + self.mlp(self.mlp_norm(x))

    def forward(self, x: Tensor, position_ids: Tensor, documents: PackedDocuments | None = None) -> Tensor:
        """``x`` ``[batch, s_local, hidden]`` (this rank's shard), ``position_ids`` ``[batch, s_local]``,
        ``documents`` the batch's packed documents (``None``: one per sample).

        Chunked causal attention with activation checkpointing, or without a backward to follow: the block streams
        chunk by chunk (:mod:`lightning_fpdt.layers.streaming`). Otherwise checkpointed whole, or as written."""
        context = self.context
        backward = needs_backward(x, self)
        recompute = context.activation_checkpointing and backward
        chunk = stream_chunk_size(context, x.shape[1])
        if chunk is not None and self.attention.causal and (recompute or not backward):
            def run_chunk(x_c: Tensor, lo: int, hi: int, stream: LayerStream) -> Tensor:
                return self.chunk_forward(x_c, position_ids[:, lo:hi], stream, documents)

            return streamed_layer_call(run_chunk, self, x, chunk, context.layer_input_store,
                                       keep_answers=context.keep_attention)
        if recompute:
            return recomputed_block_forward(self, x, position_ids, documents)
        return self.block_forward(x, position_ids, documents)

    def _stream_options(self, q: Tensor, s_local: int, documents: PackedDocuments | None) -> PipelineOptions:
        """A streamed call's pipeline options, and a fresh record for its statistics (as each attention call has)."""
        self.attention.record = AttentionRecord.for_call(s_local, self.context)
        return pipeline_options(self.attention, q, documents)

    def chunk_forward(self, x: Tensor, position_ids: Tensor, stream: LayerStream,
                      documents: PackedDocuments | None = None) -> Tensor:
        """One chunk of the block, ``[batch, n, hidden] -> [batch, n, hidden]`` (``position_ids`` ``[batch, n]``, the
        chunk's), its attention answering from ``stream`` (:mod:`lightning_fpdt.layers.streaming`)."""
        attn = self.attention
        h = self.attention_norm(x)
        b, n, _ = h.shape
        q = attn.q_proj(h).view(b, n, attn.n_heads, attn.head_dim)
        k = attn.k_proj(h).view(b, n, attn.n_kv_heads, attn.head_dim)
        v = attn.v_proj(h).view(b, n, attn.n_kv_heads, attn.head_dim)
        if attn.rope is not None:
            q, k = attn.rope(q, position_ids), attn.rope(k, position_ids)
        out = stream.attend(q, k, v, lambda: self._stream_options(q, stream.s_local, documents))
        x = x + attn.o_proj(out.reshape(b, n, attn.n_heads * attn.head_dim))
        return x + self.mlp(self.mlp_norm(x))


def projected_fpdt_attention(
    attn: FPDTAttention, x: Tensor, position_ids: Tensor, documents: PackedDocuments | None = None
) -> Tensor:
    """``attn``'s q/k/v projection, RoPE and FPDT attention in one pipeline, chunk by chunk, each token
    attending within its document.

    Returns the attention output ``[batch, s_local, n_heads, head_dim]`` (before ``o_proj``).
    """
    opt = pipeline_options(attn, x, documents)
    params = [param for _, param in projection_params(attn)]
    ends = ProjectionEnds(attn, AutocastState.capture(x.device.type))
    out, _ = run_pipeline(ends, opt, x, position_ids, *params)
    return out


def pipeline_options(attn: FPDTAttention, x: Tensor, documents: PackedDocuments | None = None) -> PipelineOptions:
    """How ``attn``'s attention runs under its bound context (``x``: a tensor of its compute dtype's inputs); its
    offload statistics go to its current record."""
    context = attn.context
    kernel = get_kernel(context.attention_backend, x.device, _compute_dtype(attn, x))
    return PipelineOptions.for_chunk_size(
        context.attention_group, context.chunk_size, causal=attn.causal, scale=1.0 / math.sqrt(attn.head_dim),
        kernel=kernel, offload=context.offload, stats_sink=attn.record.sink, documents=documents,
        ring_group=context.ring_group,
    )


def _compute_dtype(attn: FPDTAttention, x: Tensor) -> torch.dtype:
    if x.device.type in ("cpu", "cuda") and torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return torch.promote_types(x.dtype, attn.q_proj.weight.dtype)


def fpdt_blocks(module: nn.Module) -> list[tuple[str, FPDTBlock]]:
    """``(name, block)`` of every :class:`FPDTBlock` in ``module``, in module order (= forward order
    for a stack of layers)."""
    return [(name, m) for name, m in module.named_modules() if isinstance(m, FPDTBlock)]
