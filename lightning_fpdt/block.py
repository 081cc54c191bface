"""``FPDTBlock``: a pre-norm transformer block whose attention runs through the FPDT pipeline.

The block is a plain ``nn.Module`` that works in one process. ``FPDTStrategy`` binds it to the
sequence-parallel group and configuration from outside (:meth:`FPDTBlock.bind`); models never
look for process groups themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from lightning_fpdt.attention import fpdt_attention
from lightning_fpdt.comm import check_heads, group_size
from lightning_fpdt.autocast_state import AutocastState
from lightning_fpdt.offload import ChunkStore, OffloadStats


@dataclass
class SequenceParallelContext:
    """What the strategy binds to every FPDT block.

    Attributes:
        group: the sequence-parallel process group; ``None`` means one process.
        chunk_size: global tokens per attention chunk; ``None`` is plain Ulysses (one chunk).
        attention_backend: ``"auto"``, ``"math"``, ``"sdpa"`` or ``"flash_attn"``.
        offload: keep the attention chunks saved for backward in host memory.
        activation_checkpointing: keep only each block's input for backward and recompute the block.
        checkpoint_store: where checkpointed block inputs live; a store with ``offload=True`` keeps
            them in host memory and prefetches the previous block's input during backward.
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

    @property
    def stats(self) -> OffloadStats:
        total = OffloadStats()
        for s in self.sink:
            total.merge(s)
        return total


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding from *global* position ids (the Hugging Face half-split convention).

    Angles are computed in float32 like ``transformers`` does, then cast to the activations' dtype.
    """

    def __init__(
        self, head_dim: int, theta: float = 10000.0, inv_freq: Tensor | None = None, attention_scaling: float = 1.0
    ) -> None:
        super().__init__()
        self.head_dim, self.theta, self.attention_scaling = head_dim, theta, attention_scaling
        if inv_freq is None:  # the default schedule; scaled variants (e.g. Llama 3) come in as inv_freq
            inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        if inv_freq.shape != (head_dim // 2,):
            raise ValueError(f"RotaryEmbedding: inv_freq has shape {tuple(inv_freq.shape)}, expected ({head_dim // 2},).")
        self.register_buffer("inv_freq", inv_freq.float().clone(), persistent=False)

    def forward(self, x: Tensor, position_ids: Tensor) -> Tensor:
        """``x`` ``[batch, seq, heads, head_dim]``, ``position_ids`` ``[batch, seq]`` (global positions)."""
        freqs = position_ids.float().unsqueeze(-1) * self.inv_freq.float()  # [b, s, d/2]
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(2)  # [b, s, 1, d]
        cos = (emb.cos() * self.attention_scaling).to(x.dtype)
        sin = (emb.sin() * self.attention_scaling).to(x.dtype)
        return x * cos + rotate_half(x) * sin


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

    def forward(self, x: Tensor, position_ids: Tensor) -> Tensor:
        """``x`` ``[batch, s_local, hidden]`` (this rank's shard), ``position_ids`` ``[batch, s_local]``."""
        b, s_local, _ = x.shape  # s_local = S // sp
        q = self.q_proj(x).view(b, s_local, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(b, s_local, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, s_local, self.n_kv_heads, self.head_dim)
        if self.rope is not None:
            q, k = self.rope(q, position_ids), self.rope(k, position_ids)
        ctx = self.context
        self.record = BlockRecord(
            seq_len_local=s_local, chunks=1 if ctx.chunk_size is None else -(-s_local * ctx.size // ctx.chunk_size)
        )
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

    def __init__(self, attention: FPDTAttention, mlp: nn.Module, attention_norm: nn.Module, mlp_norm: nn.Module) -> None:
        super().__init__()
        self.attention_norm = attention_norm
        self.attention = attention
        self.mlp_norm = mlp_norm
        self.mlp = mlp
        self.layer_index = 0
        self.context = SequenceParallelContext()

    def bind(self, context: SequenceParallelContext, layer_index: int = 0) -> None:
        """Attach the sequence-parallel group and options (called by ``FPDTStrategy``).

        ``layer_index`` orders the blocks, so a block's backward can prefetch the checkpointed
        input of the block before it.
        """
        self.attention.bind(context)
        self.context, self.layer_index = context, layer_index

    @property
    def record(self) -> BlockRecord:
        return self.attention.record

    def block_forward(self, x: Tensor, position_ids: Tensor) -> Tensor:
        """The block itself: ``[batch, s_local, hidden] -> [batch, s_local, hidden]``."""
        x = x + self.attention(self.attention_norm(x), position_ids)
        return x + self.mlp(self.mlp_norm(x))

    def forward(self, x: Tensor, position_ids: Tensor) -> Tensor:
        if self.context.activation_checkpointing and torch.is_grad_enabled():
            params = [p for p in self.parameters() if p.requires_grad]
            return _CheckpointedBlock.apply(x, position_ids, self, len(params), *params)
        return self.block_forward(x, position_ids)


def new_checkpoint_store(device: torch.device, copy_delay: float = 0.0) -> ChunkStore:
    """A store that keeps checkpointed block inputs in host memory (key ``("ckpt", layer_index)``)."""
    return ChunkStore(device, offload=True, groups={"ckpt": "checkpoint"}, copy_delay=copy_delay)


class _CheckpointedBlock(torch.autograd.Function):
    """Activation checkpointing of one block: only its input is kept (optionally on the host).

    The block's parameters are explicit inputs and their gradients are returned, so each is
    produced once per backward (DDP's reducer and FSDP hooks see one gradient per parameter).
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, position_ids: Tensor, block: FPDTBlock, n_params: int, *params: Tensor) -> Tensor:
        with torch.no_grad():
            y = block.block_forward(x, position_ids)
        store = block.context.checkpoint_store
        ctx.block, ctx.store, ctx.key = block, store, ("ckpt", block.layer_index)
        ctx.autocast = AutocastState.capture(x.device.type)
        ctx.x_requires_grad = x.requires_grad
        if store is not None:
            store.put(ctx.key, x.detach())
            ctx.save_for_backward(position_ids)
        else:
            ctx.save_for_backward(position_ids, x)
        return y

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Any, ...]:
        block, store = ctx.block, ctx.store
        if store is not None:
            (position_ids,) = ctx.saved_tensors
            x = store.get(ctx.key)
            previous = ("ckpt", block.layer_index - 1)
            if previous in store.keys():  # the block before runs its backward next: fetch its input now
                store.prefetch(previous)
        else:
            position_ids, x = ctx.saved_tensors
        params = [p for p in block.parameters() if p.requires_grad]
        x = x.detach().requires_grad_(ctx.x_requires_grad)
        with torch.enable_grad(), ctx.autocast.restore():
            y = block.block_forward(x, position_ids)
            inputs = [x, *params] if ctx.x_requires_grad else params
            grads = list(torch.autograd.grad(y, inputs, dy, allow_unused=True))
        if store is not None:
            store.delete(ctx.key)
        dx = grads.pop(0) if ctx.x_requires_grad else None
        return (dx, None, None, None, *grads)
