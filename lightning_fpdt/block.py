"""``FPDTBlock``: a pre-norm transformer block whose attention runs through the FPDT pipeline.

The block is a plain ``nn.Module`` that works in one process. ``FPDTStrategy`` binds it to the
sequence-parallel group and configuration from outside (:meth:`FPDTBlock.bind`); models never
look for process groups themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from lightning_fpdt.attention import fpdt_attention
from lightning_fpdt.comm import check_heads, group_size
from lightning_fpdt.offload import OffloadStats


@dataclass
class SequenceParallelContext:
    """What the strategy binds to every FPDT block.

    Attributes:
        group: the sequence-parallel process group; ``None`` means one process.
        chunk_size: global tokens per attention chunk; ``None`` is plain Ulysses (one chunk).
        attention_backend: ``"auto"``, ``"math"``, ``"sdpa"`` or ``"flash_attn"``.
        offload: keep the attention chunks saved for backward in host memory.
    """

    group: ProcessGroup | None = None
    chunk_size: int | None = None
    attention_backend: str = "auto"
    offload: bool = False

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

    def __init__(self, head_dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: Tensor, position_ids: Tensor) -> Tensor:
        """``x`` ``[batch, seq, heads, head_dim]``, ``position_ids`` ``[batch, seq]`` (global positions)."""
        freqs = position_ids.float().unsqueeze(-1) * self.inv_freq.float()  # [b, s, d/2]
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(2)  # [b, s, 1, d]
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
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

    def bind(self, context: SequenceParallelContext) -> None:
        """Attach the sequence-parallel group and options (called by ``FPDTStrategy``)."""
        self.attention.bind(context)

    @property
    def record(self) -> BlockRecord:
        return self.attention.record

    def forward(self, x: Tensor, position_ids: Tensor) -> Tensor:
        x = x + self.attention(self.attention_norm(x), position_ids)
        return x + self.mlp(self.mlp_norm(x))
