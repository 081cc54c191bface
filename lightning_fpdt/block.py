"""``FPDTBlock``: a pre-norm transformer block whose attention runs through the FPDT pipeline.

The block is a plain ``nn.Module`` that works in one process. ``FPDTStrategy`` binds it to the
sequence-parallel group and configuration from outside (:meth:`FPDTBlock.bind`); models never
look for process groups themselves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from lightning_fpdt.attention import fpdt_attention
from lightning_fpdt.attention.kernels import get_kernel
from lightning_fpdt.attention.pipeline import (
    ChunkSink,
    ChunkSource,
    PipelineOptions,
    pipeline_backward,
    pipeline_forward,
    finish,
    new_store,
)
from lightning_fpdt.comm import check_heads, expand_kv_heads, group_size
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

    def _cos_sin(self, position_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = position_ids.float().unsqueeze(-1) * self.inv_freq.float()  # [b, s, d/2]
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(2)  # [b, s, 1, d]
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)

    def forward(self, x: Tensor, position_ids: Tensor) -> Tensor:
        """``x`` ``[batch, seq, heads, head_dim]``, ``position_ids`` ``[batch, seq]`` (global positions)."""
        cos, sin = self._cos_sin(position_ids, x.dtype)
        return x * cos + rotate_half(x) * sin

    def transpose(self, dy: Tensor, position_ids: Tensor) -> Tensor:
        """The adjoint of :meth:`forward` (it is linear in ``x``): the gradient with respect to ``x``.

        ``rotate_half`` maps ``[x1, x2]`` to ``[-x2, x1]``; its adjoint maps ``[y1, y2]`` to ``[y2, -y1]``.
        """
        cos, sin = self._cos_sin(position_ids, dy.dtype)
        y1, y2 = (dy * sin).chunk(2, dim=-1)
        return dy * cos + torch.cat((y2, -y1), dim=-1)


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
        """``x`` ``[batch, s_local, hidden]`` (this rank's shard), ``position_ids`` ``[batch, s_local]``.

        With chunking the q/k/v projections and RoPE run chunk by chunk inside the pipeline, so no
        ``[s_local, heads, head_dim]`` q, k or v exists at once, forward or backward.
        """
        b, s_local, _ = x.shape  # s_local = S // sp
        ctx = self.context
        self.record = BlockRecord(
            seq_len_local=s_local, chunks=1 if ctx.chunk_size is None else -(-s_local * ctx.size // ctx.chunk_size)
        )
        if ctx.chunk_size is not None:
            out = projected_fpdt_attention(self, x, position_ids)
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
            return _CheckpointedBlock.apply(x, position_ids, self, *params)
        return self.block_forward(x, position_ids)


class _ProjectionSource(ChunkSource):
    """Local q/k/v chunks computed on demand from the block's input: ``x[:, lo:hi]`` -> projections -> RoPE."""

    def __init__(self, attn: FPDTAttention, x: Tensor, position_ids: Tensor) -> None:
        b, s_local, _ = x.shape
        self.attn, self.x, self.position_ids = attn, x, position_ids
        self.q_shape = torch.Size((b, s_local, attn.n_heads, attn.head_dim))
        self.dtype: torch.dtype | None = None  # the projections' output dtype (autocast may change it)

    def _project(self, proj: nn.Linear, n_heads: int, lo: int, hi: int, rope: bool) -> Tensor:
        a = self.attn
        y = F.linear(self.x[:, lo:hi], proj.weight, proj.bias).view(self.x.shape[0], hi - lo, n_heads, a.head_dim)
        self.dtype = y.dtype
        return a.rope(y, self.position_ids[:, lo:hi]) if rope and a.rope is not None else y

    def q(self, lo: int, hi: int) -> Tensor:
        return self._project(self.attn.q_proj, self.attn.n_heads, lo, hi, rope=True)

    def kv(self, lo: int, hi: int) -> tuple[Tensor, Tensor]:
        a, p = self.attn, self.attn.context.size
        k = self._project(a.k_proj, a.n_kv_heads, lo, hi, rope=True)
        v = self._project(a.v_proj, a.n_kv_heads, lo, hi, rope=False)
        return expand_kv_heads(k, p), expand_kv_heads(v, p)


class _ProjectionSink(ChunkSink):
    """Backward of the per-chunk projections, run as each chunk's q/k/v gradients become final.

    Projections and RoPE are linear in their input, so no recomputation is needed: for a chunk,
    ``dW += dY^T x_c``, ``db += sum(dY)``, ``dx_c += dY W``, with ``dY`` the RoPE-transposed gradient.
    """

    def __init__(self, attn: FPDTAttention, x: Tensor, position_ids: Tensor, autocast: AutocastState) -> None:
        self.attn, self.x, self.position_ids, self.autocast = attn, x, position_ids, autocast
        acc = torch.promote_types(x.dtype, torch.float32)
        self.dx = torch.zeros(x.shape, dtype=acc, device=x.device)
        self.grads: dict[str, Tensor] = {}

    def _linear_backward(self, name: str, proj: nn.Linear, dy: Tensor, lo: int, hi: int) -> None:
        b, n = dy.shape[:2]
        dy2 = dy.reshape(b * n, -1)  # [tokens of the chunk, out_features]
        x2 = self.x[:, lo:hi].reshape(b * n, -1)
        with self.autocast.restore():  # under autocast the matmuls cast as they did in forward
            if not self.autocast.enabled:
                dy2 = dy2.to(x2.dtype)
            dw = dy2.t() @ x2
            dx = dy2 @ proj.weight
        self.dx[:, lo:hi] += dx.view(b, n, -1)
        acc = self.dx.dtype
        self.grads[f"{name}.weight"] = self.grads.get(f"{name}.weight", 0) + dw.to(acc)
        if proj.bias is not None:
            self.grads[f"{name}.bias"] = self.grads.get(f"{name}.bias", 0) + dy2.sum(0).to(acc)

    def _rope_t(self, dy: Tensor, lo: int, hi: int) -> Tensor:
        rope = self.attn.rope
        return dy if rope is None else rope.transpose(dy, self.position_ids[:, lo:hi])

    def q(self, lo: int, hi: int, dq: Tensor) -> None:
        self._linear_backward("q_proj", self.attn.q_proj, self._rope_t(dq, lo, hi), lo, hi)

    def kv(self, lo: int, hi: int, dk: Tensor, dv: Tensor) -> None:
        g = self.attn.n_kv_heads
        if dk.shape[2] != g:  # KV heads were replicated for the all-to-all: sum the replicas
            b, n, p, d = dk.shape
            dk, dv = dk.view(b, n, g, p // g, d).sum(3), dv.view(b, n, g, p // g, d).sum(3)
        self._linear_backward("k_proj", self.attn.k_proj, self._rope_t(dk, lo, hi), lo, hi)
        self._linear_backward("v_proj", self.attn.v_proj, dv, lo, hi)


def _projection_params(attn: FPDTAttention) -> list[tuple[str, nn.Parameter]]:
    return [(f"{name}.{kind}", getattr(getattr(attn, name), kind)) for name in ("q_proj", "k_proj", "v_proj")
            for kind in ("weight", "bias") if getattr(getattr(attn, name), kind) is not None]


class _ProjectedAttentionFunction(torch.autograd.Function):
    """``x -> attention output`` (before ``o_proj``) with the q/k/v projections done per chunk."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, position_ids: Tensor, attn: FPDTAttention, opt: PipelineOptions,
                needs_backward: bool, *params: Tensor) -> Tensor:
        store = new_store(x.device, opt)
        source = _ProjectionSource(attn, x, position_ids)
        out, _ = pipeline_forward(source, opt, store)
        if not needs_backward:
            finish(store, opt)
        ctx.attn, ctx.opt, ctx.store, ctx.out_dtype = attn, opt, store, source.dtype
        ctx.autocast = AutocastState.capture(x.device.type)
        ctx.save_for_backward(x, position_ids)
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Any, ...]:
        x, position_ids = ctx.saved_tensors
        sink = _ProjectionSink(ctx.attn, x, position_ids, ctx.autocast)
        try:
            pipeline_backward(dout.contiguous(), ctx.out_dtype, ctx.opt, ctx.store, sink)
        finally:
            finish(ctx.store, ctx.opt)
        grads = [sink.grads[name].to(p.dtype) for name, p in _projection_params(ctx.attn)]
        return (sink.dx.to(x.dtype), None, None, None, None, *grads)


def projected_fpdt_attention(attn: FPDTAttention, x: Tensor, position_ids: Tensor) -> Tensor:
    """``attn``'s q/k/v projection, RoPE and FPDT attention in one pipeline, chunk by chunk.

    Returns the attention output ``[batch, s_local, n_heads, head_dim]`` (before ``o_proj``).
    """
    ctx = attn.context
    kernel = get_kernel(ctx.attention_backend, x.device, _compute_dtype(attn, x))
    opt = PipelineOptions.for_chunk_size(
        ctx.group, ctx.chunk_size, causal=attn.causal, scale=1.0 / math.sqrt(attn.head_dim), kernel=kernel,
        offload=ctx.offload, stats_sink=attn.record.sink,
    )
    params = [param for _, param in _projection_params(attn)]
    needs_backward = torch.is_grad_enabled() and (x.requires_grad or any(q.requires_grad for q in params))
    return _ProjectedAttentionFunction.apply(x, position_ids, attn, opt, needs_backward, *params)


def _compute_dtype(attn: FPDTAttention, x: Tensor) -> torch.dtype:
    if x.device.type in ("cpu", "cuda") and torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return torch.promote_types(x.dtype, attn.q_proj.weight.dtype)


def fpdt_blocks(module: nn.Module) -> list[tuple[str, FPDTBlock]]:
    """``(name, block)`` of every :class:`FPDTBlock` in ``module``, in module order (= forward order
    for a stack of layers)."""
    return [(name, m) for name, m in module.named_modules() if isinstance(m, FPDTBlock)]


def new_checkpoint_store(device: torch.device, copy_delay: float = 0.0) -> ChunkStore:
    """A store that keeps checkpointed block inputs in host memory (key ``("ckpt", layer_index)``)."""
    return ChunkStore(device, offload=True, groups={"ckpt": "checkpoint"}, copy_delay=copy_delay)


class _CheckpointedBlock(torch.autograd.Function):
    """Activation checkpointing of one block: only its input is kept (optionally on the host).

    The block's parameters are explicit inputs and their gradients are returned, so each is
    produced once per backward (DDP's reducer and FSDP hooks see one gradient per parameter).
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, position_ids: Tensor, block: FPDTBlock, *params: Tensor) -> Tensor:
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
        return (dx, None, None, *grads)
