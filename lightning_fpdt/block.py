"""``FPDTBlock``: a pre-norm transformer block whose attention runs through the FPDT pipeline.

The block is a plain ``nn.Module`` that works in one process. ``FPDTStrategy`` binds it to the
sequence-parallel group and configuration from outside (:meth:`FPDTBlock.bind`); models never
look for process groups themselves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from lightning_fpdt.activation_checkpoint import checkpointed_forward, needs_backward, new_checkpoint_store
from lightning_fpdt.attention import fpdt_attention
from lightning_fpdt.attention.kernels import get_kernel
from lightning_fpdt.attention.pipeline import PipelineOptions, run_pipeline
from lightning_fpdt.attention.sources import ProjectionEnds, projection_params
from lightning_fpdt.autocast_state import AutocastState
from lightning_fpdt.chunk_store import ChunkStore, OffloadStats
from lightning_fpdt.comm import check_heads, group_size
from lightning_fpdt.layout import PackedDocuments
from lightning_fpdt.rope import RotaryEmbedding, rotate_half
from lightning_fpdt.tiling import TiledMLP

# re-exported: the strategy, the benchmarks and the models import these from here
__all__ = [
    "BlockRecord",
    "DecoderLayer",
    "SequenceParallelAttention",
    "attention_heads",
    "attention_records",
    "bind_blocks",
    "decoder_layers",
    "FPDTAttention",
    "FPDTBlock",
    "RotaryEmbedding",
    "SequenceParallelContext",
    "fpdt_blocks",
    "new_checkpoint_store",
    "projected_fpdt_attention",
    "rotate_half",
]


@dataclass
class SequenceParallelContext:
    """What the strategy binds to every FPDT block.

    Attributes:
        group: the sequence-parallel process group; ``None`` means one process.
        chunk_size: global tokens per attention chunk; ``None`` is plain Ulysses (one chunk).
        attention_backend: ``"auto"``, ``"math"``, ``"sdpa"`` or ``"flash_attn"``.
        offload: keep the attention chunks saved for backward in host memory.
        activation_checkpointing: keep only each block's input for backward and recompute the block.
        checkpoint_store: where checkpointed block inputs live (``None``: in the autograd graph); a
            store with ``offload=True`` keeps them in host memory, and each block's backward prefetches
            the input of the backward that runs next (``lightning_fpdt.activation_checkpoint``).
    """

    group: ProcessGroup | None = None
    chunk_size: int | None = None
    attention_backend: str = "auto"
    offload: bool = False
    activation_checkpointing: bool = False
    checkpoint_store: ChunkStore | None = None

    @property
    def size(self) -> int:
        return group_size(self.group)


@dataclass
class BlockRecord:
    """What a block's attention did in its last step, for callbacks (``FPDTMonitor``).

    ``sink`` receives the pipeline's :class:`OffloadStats` once its backward (or, without
    gradients, its forward) has finished, so read it after the step.
    """

    seq_len_local: int = 0
    chunks: int = 0
    sink: list[OffloadStats] = field(default_factory=list)

    @classmethod
    def for_call(cls, seq_len_local: int, context: SequenceParallelContext) -> BlockRecord:
        """A fresh record of one attention call over ``seq_len_local`` tokens of this rank under ``context``."""
        chunks = 1 if context.chunk_size is None else -(-seq_len_local * context.size // context.chunk_size)
        return cls(seq_len_local=seq_len_local, chunks=chunks)

    @property
    def stats(self) -> OffloadStats:
        total = OffloadStats()
        for s in self.sink:
            total.merge(s)
        return total


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
        self.record = BlockRecord()

    def bind(self, context: SequenceParallelContext) -> None:
        check_heads(self.n_heads, self.n_kv_heads, context.size)
        self.context = context

    def forward(self, x: Tensor, position_ids: Tensor, documents: PackedDocuments | None = None) -> Tensor:
        """``x`` ``[batch, s_local, hidden]`` (this rank's shard), ``position_ids`` ``[batch, s_local]``,
        ``documents`` the packed documents of the batch (``None``: one per sample).

        With chunking (or documents) the q/k/v projections and RoPE run chunk by chunk inside the
        pipeline, so no ``[s_local, heads, head_dim]`` q, k or v exists at once, forward or backward.
        """
        b, s_local, _ = x.shape  # s_local = S // sp
        ctx = self.context
        self.record = BlockRecord.for_call(s_local, ctx)
        if ctx.chunk_size is not None or documents is not None:
            out = projected_fpdt_attention(self, x, position_ids, documents)
            return self.o_proj(out.reshape(b, s_local, self.n_heads * self.head_dim))
        q = self.q_proj(x).view(b, s_local, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(b, s_local, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, s_local, self.n_kv_heads, self.head_dim)
        if self.rope is not None:
            q, k = self.rope(q, position_ids), self.rope(k, position_ids)
        out = fpdt_attention(
            q, k, v, group=ctx.group, chunk_size=ctx.chunk_size, causal=self.causal,
            backend=ctx.attention_backend, offload=ctx.offload, stats_sink=self.record.sink,
        )
        return self.o_proj(out.reshape(b, s_local, self.n_heads * self.head_dim))


class FPDTBlock(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``.

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
        """Attach the sequence-parallel group and options (called by ``FPDTStrategy``).

        ``layer_index`` is the block's position in the model, for the reader of a record; the
        checkpoint prefetch follows the order the forward passes ran in (``lightning_fpdt.activation_checkpoint``).
        """
        self.attention.bind(context)
        self.context, self.layer_index = context, layer_index

    @property
    def record(self) -> BlockRecord:
        return self.attention.record

    def block_forward(self, x: Tensor, position_ids: Tensor, documents: PackedDocuments | None = None) -> Tensor:
        """The block itself: ``[batch, s_local, hidden] -> [batch, s_local, hidden]``."""
        x = x + self.attention(self.attention_norm(x), position_ids, documents)
        return x + self.mlp(self.mlp_norm(x))

    def forward(self, x: Tensor, position_ids: Tensor, documents: PackedDocuments | None = None) -> Tensor:
        """``x`` ``[batch, s_local, hidden]`` (this rank's shard), ``position_ids`` ``[batch, s_local]``,
        ``documents`` the batch's packed documents (``None``: one per sample)."""
        if self.context.activation_checkpointing and needs_backward(x, self):
            return checkpointed_forward(self, x, position_ids, documents)
        return self.block_forward(x, position_ids, documents)


def projected_fpdt_attention(
    attn: FPDTAttention, x: Tensor, position_ids: Tensor, documents: PackedDocuments | None = None
) -> Tensor:
    """``attn``'s q/k/v projection, RoPE and FPDT attention in one pipeline, chunk by chunk, each token
    attending within its document.

    Returns the attention output ``[batch, s_local, n_heads, head_dim]`` (before ``o_proj``).
    """
    ctx = attn.context
    kernel = get_kernel(ctx.attention_backend, x.device, _compute_dtype(attn, x))
    opt = PipelineOptions.for_chunk_size(
        ctx.group, ctx.chunk_size, causal=attn.causal, scale=1.0 / math.sqrt(attn.head_dim), kernel=kernel,
        offload=ctx.offload, stats_sink=attn.record.sink, documents=documents,
    )
    params = [param for _, param in projection_params(attn)]
    ends = ProjectionEnds(attn, AutocastState.capture(x.device.type))
    out, _ = run_pipeline(ends, opt, x, position_ids, *params)
    return out


def _compute_dtype(attn: FPDTAttention, x: Tensor) -> torch.dtype:
    if x.device.type in ("cpu", "cuda") and torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return torch.promote_types(x.dtype, attn.q_proj.weight.dtype)


def fpdt_blocks(module: nn.Module) -> list[tuple[str, FPDTBlock]]:
    """``(name, block)`` of every :class:`FPDTBlock` in ``module``, in module order (= forward order
    for a stack of layers)."""
    return [(name, m) for name, m in module.named_modules() if isinstance(m, FPDTBlock)]


@dataclass(frozen=True)
class DecoderLayer:
    """One decoder layer as the strategy and the memory model see it: the unit of activation
    checkpointing and of FSDP2 sharding, and the sizes the memory model reads.

    Attributes:
        name: the layer's module name in the model.
        module: the layer (an :class:`FPDTBlock`, a Hugging Face decoder layer, ...).
        hidden_size: width of its input and output.
        n_heads: query heads of its attention.
        n_kv_heads: key/value heads.
        head_dim: per-head width of q, k and v.
        mlp: its MLP as written (inside any tiling); ``None`` if it has no MLP module.
        mlp_tiled: whether the MLP runs in recomputed sequence tiles.
        norms: its norm modules (LayerNorm keeps only its input for backward; RMSNorm also its output).
        chunked_projections: q/k/v are projected chunk by chunk inside the attention pipeline
            (``FPDTBlock``) rather than for the whole local sequence before it (Hugging Face layers).
    """

    name: str
    module: nn.Module
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    mlp: nn.Module | None
    mlp_tiled: bool
    norms: tuple[nn.Module, ...]
    chunked_projections: bool = True


@runtime_checkable
class SequenceParallelAttention(Protocol):
    """A module other than :class:`FPDTBlock` whose attention runs through the FPDT pipeline once bound
    (e.g. :class:`lightning_fpdt.models.HFCausalLM`, which routes a Hugging Face model's attention).
    The strategy binds it to the sequence-parallel context and checks its head counts like a block's,
    shards its decoder layers with FSDP2, and the memory model reads them."""

    def bind_sequence_parallel(self, context: SequenceParallelContext) -> None: ...

    def attention_heads(self) -> list[tuple[str, int, int]]:
        """``(layer name, n_heads, n_kv_heads)`` of every attention layer it routes."""
        ...

    def decoder_layers(self) -> list[DecoderLayer]:
        """Its decoder layers, in forward order."""
        ...

    def attention_records(self) -> list[BlockRecord]:
        """What each attention layer did in its latest call (for ``FPDTMonitor``)."""
        ...


def sequence_parallel_attention(module: nn.Module) -> list[tuple[str, SequenceParallelAttention]]:
    """``(name, module)`` of every :class:`SequenceParallelAttention` in ``module`` (itself included)."""
    return [(name, m) for name, m in module.named_modules()
            if isinstance(m, SequenceParallelAttention) and not isinstance(m, FPDTBlock)]


def decoder_layers(module: nn.Module) -> list[DecoderLayer]:
    """Every decoder layer of ``module``: its :class:`FPDTBlock` s and the layers of its
    :class:`SequenceParallelAttention` modules, in module order."""
    layers = []
    for name, block in fpdt_blocks(module):
        attn, mlp = block.attention, block.mlp
        tiled = isinstance(mlp, TiledMLP)
        layers.append(DecoderLayer(
            name=name, module=block, hidden_size=attn.q_proj.in_features, n_heads=attn.n_heads,
            n_kv_heads=attn.n_kv_heads, head_dim=attn.head_dim, mlp=mlp.mlp if tiled else mlp,
            mlp_tiled=tiled and mlp.num_tiles != 1, norms=(block.attention_norm, block.mlp_norm),
        ))
    for _, m in sequence_parallel_attention(module):
        layers += m.decoder_layers()
    return layers


def attention_records(module: nn.Module) -> list[BlockRecord]:
    """The latest :class:`BlockRecord` of every attention layer the strategy binds in ``module``."""
    records = [block.record for _, block in fpdt_blocks(module)]
    for _, m in sequence_parallel_attention(module):
        records += m.attention_records()
    return records


def attention_heads(module: nn.Module) -> list[tuple[str, int, int]]:
    """``(name, n_heads, n_kv_heads)`` of every attention layer the strategy binds in ``module``."""
    heads = [(name, b.attention.n_heads, b.attention.n_kv_heads) for name, b in fpdt_blocks(module)]
    for _, m in sequence_parallel_attention(module):
        heads += m.attention_heads()
    return heads


def bind_blocks(module: nn.Module, context: SequenceParallelContext) -> int:
    """Bind every :class:`FPDTBlock` of ``module`` to ``context`` (in module order, which is the forward
    order of a stack of layers), and every :class:`SequenceParallelAttention`; returns how many attention
    layers are bound."""
    blocks = fpdt_blocks(module)
    for index, (_, block) in enumerate(blocks):
        block.bind(context, layer_index=index)
    for _, m in sequence_parallel_attention(module):
        m.bind_sequence_parallel(context)
    return len(attention_heads(module))
