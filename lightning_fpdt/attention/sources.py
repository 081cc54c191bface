"""The two ends the FPDT pipeline runs between (the ``ChunkSource`` / ``ChunkSink`` protocols of ``ends.py``).

- Whole tensors (:class:`TensorEnds`, for ``fpdt_attention``): the source slices q, k, v
  ``[batch, s_local, heads, head_dim]`` (v's head width may differ: :func:`check_qkv_shapes`); the sink writes
  dq, dk, dv into whole tensors.
- Projections (:class:`ProjectionEnds`, for any :class:`ProjectedAttention` such as ``FPDTAttention``):
  the source computes the q/k/v projections and RoPE of one chunk of the block's input ``x``
  ``[batch, s_local, hidden]`` when the pipeline asks for it; the sink runs their backward chunk by chunk
  and returns ``dx`` and the projection weights' gradients. No ``[s_local, heads, head_dim]`` q, k or v exists at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_fpdt.errors import FPDTError
from lightning_fpdt.offload.autocast_state import AutocastState
from lightning_fpdt.offload.weight_casts import original
from lightning_fpdt.parallel.binding import SequenceParallelContext
from lightning_fpdt.parallel.comm import expand_kv_heads, sum_kv_replicas


class Rotary(Protocol):
    """A rotary position embedding applied per chunk (``lightning_fpdt.layers.rope.RotaryEmbedding``)."""

    def __call__(self, x: Tensor, position_ids: Tensor) -> Tensor:
        """``x`` ``[batch, n, heads, head_dim]`` rotated by ``position_ids`` ``[batch, n]``."""
        ...

    def transpose(self, dy: Tensor, position_ids: Tensor) -> Tensor:
        """The adjoint of the rotation, for the backward."""
        ...


class ProjectedAttention(Protocol):
    """What the projection ends read of an attention layer (``lightning_fpdt.layers.block.FPDTAttention``): its
    q/k/v projections, head counts, rotary embedding and bound context (for the group size)."""

    q_proj: nn.Linear
    k_proj: nn.Linear
    v_proj: nn.Linear
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope: Rotary | None
    context: SequenceParallelContext


def check_qkv_shapes(q: Tensor, k: Tensor, v: Tensor) -> None:
    """Raises ``ValueError`` unless q ``[b, s_local, h, d]``, k ``[b, s_local, kv_heads, d]`` and v ``[b, s_local,
    kv_heads, d_v]`` fit together: q and k of one head width (their dot products are the scores), v of any
    (multi-head latent attention's is narrower), one batch and length, k and v one head count."""
    problem = None
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        problem = "each must have 4 dims"
    elif not q.shape[:2] == k.shape[:2] == v.shape[:2]:
        problem = "batch and local length (dims 0, 1) must agree"
    elif k.shape[2] != v.shape[2]:
        problem = "k and v must have one head count (dim 2)"
    elif q.shape[3] != k.shape[3]:
        problem = ("q and k must have one head width (dim 3: their dot products are the scores; only v's may"
                   " differ): project them to one width (multi-head latent attention concatenates the rotary part to"
                   " both)")
    if problem is not None:
        raise FPDTError(
            "fpdt_attention expects q [batch, seq_local, n_heads, head_dim], k [batch, seq_local, n_kv_heads,"
            f" head_dim] and v [batch, seq_local, n_kv_heads, v_head_dim]; got q {tuple(q.shape)}, k"
            f" {tuple(k.shape)}, v {tuple(v.shape)}: {problem}."
        )


class TensorChunkSource:
    """Local chunks as slices of whole q ``[b, s_local, h, d]``, k ``[b, s_local, kv_heads, d]`` and v
    ``[b, s_local, kv_heads, d_v]``."""

    def __init__(self, q: Tensor, k: Tensor, v: Tensor) -> None:
        self._q, self._k, self._v = q, k, v
        self.q_shape, self.dtype = q.shape, q.dtype

    def q(self, lo: int, hi: int) -> Tensor:
        return self._q[:, lo:hi]

    def kv(self, lo: int, hi: int) -> tuple[Tensor, Tensor]:
        return self._k[:, lo:hi], self._v[:, lo:hi]


class TensorChunkSink:
    """Final gradient chunks written into whole preallocated dq ``[b, s_local, h, d]``, dk ``[b, s_local,
    kv_heads, d]`` and dv ``[b, s_local, kv_heads, d_v]`` (``d_v``: dout's width; ``d``: ``head_dim``, or
    ``d_v`` when ``None``)."""

    def __init__(self, dout: Tensor, kv_heads: int, dtype: torch.dtype, head_dim: int | None = None) -> None:
        b, s_local, h, d_v = dout.shape
        d = d_v if head_dim is None else head_dim
        self.dq = torch.empty(b, s_local, h, d, dtype=dtype, device=dout.device)
        self.dk = torch.empty(b, s_local, kv_heads, d, dtype=dtype, device=dout.device)
        self.dv = torch.empty(b, s_local, kv_heads, d_v, dtype=dtype, device=dout.device)

    def q(self, lo: int, hi: int, dq: Tensor) -> None:
        self.dq[:, lo:hi] = dq

    def kv(self, lo: int, hi: int, dk: Tensor, dv: Tensor) -> None:
        self.dk[:, lo:hi] = dk
        self.dv[:, lo:hi] = dv

    def result(self) -> tuple[Tensor, Tensor, Tensor]:
        return self.dq, self.dk, self.dv


@dataclass(frozen=True)
class TensorEnds:
    """Pipeline inputs ``(q, k, v)``; gradients ``(dq, dk, dv)``. ``kv_heads``: k's head count; ``head_dim``: q's
    and k's head width (``None``: v's, the output's)."""

    kv_heads: int
    head_dim: int | None = None
    weights: tuple[()] = ()

    def source(self, q: Tensor, k: Tensor, v: Tensor) -> TensorChunkSource:
        return TensorChunkSource(q, k, v)

    def saved(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, ...]:
        return ()  # the backward reads the chunks the forward put in the store, never the whole q/k/v

    def sink(self, dout: Tensor, dtype: torch.dtype) -> TensorChunkSink:
        return TensorChunkSink(dout, self.kv_heads, dtype, self.head_dim)


class ProjectionChunkSource:
    """Local q/k/v chunks computed on demand from the block's input: ``x[:, lo:hi]`` -> projections -> RoPE."""

    def __init__(self, attn: ProjectedAttention, x: Tensor, position_ids: Tensor) -> None:
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
        a, p = self.attn, self.attn.context.ulysses_size
        k = self._project(a.k_proj, a.n_kv_heads, lo, hi, rope=True)
        v = self._project(a.v_proj, a.n_kv_heads, lo, hi, rope=False)
        return expand_kv_heads(k, p), expand_kv_heads(v, p)


class ProjectionChunkSink:
    """Backward of the per-chunk projections, run as each chunk's q/k/v gradients become final.

    Projections and RoPE are linear in their input, so no recomputation is needed: for a chunk,
    ``dW += dY^T x_c``, ``db += sum(dY)``, ``dx_c += dY W``, with ``dY`` the RoPE-transposed gradient.
    """

    def __init__(self, attn: ProjectedAttention, x: Tensor, position_ids: Tensor, autocast: AutocastState) -> None:
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
            dx = dy2 @ proj.weight  # cast once for the whole backward (PipelineFunction.backward's scope)
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
        g = self.attn.n_kv_heads  # KV heads were replicated for the all-to-all: sum the replicas
        dk, dv = sum_kv_replicas(dk, g), sum_kv_replicas(dv, g)
        self._linear_backward("k_proj", self.attn.k_proj, self._rope_t(dk, lo, hi), lo, hi)
        self._linear_backward("v_proj", self.attn.v_proj, dv, lo, hi)

    def result(self) -> tuple[Tensor | None, ...]:
        """``(dx, None for position_ids, *parameter grads)`` in the order of :func:`projection_params`."""
        grads = [self.grads[name].to(p.dtype) for name, p in projection_params(self.attn)]
        return self.dx.to(self.x.dtype), None, *grads


def projection_params(attn: ProjectedAttention) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` of the q/k/v projections, in the order the pipeline takes them as inputs."""
    return [(f"{name}.{kind}", original(getattr(getattr(attn, name), kind))) for name in ("q_proj", "k_proj", "v_proj")
            for kind in ("weight", "bias") if getattr(getattr(attn, name), kind) is not None]


@dataclass(frozen=True)
class ProjectionEnds:
    """Pipeline inputs ``(x, position_ids, *projection_params(attn))``; gradients in the same order.

    ``autocast`` is the autocast state of the forward, restored for the projections' backward.
    """

    attn: ProjectedAttention
    autocast: AutocastState

    @property
    def weights(self) -> tuple[nn.Module, ...]:
        return self.attn.q_proj, self.attn.k_proj, self.attn.v_proj

    def source(self, x: Tensor, position_ids: Tensor, *params: Tensor) -> ProjectionChunkSource:
        return ProjectionChunkSource(self.attn, x, position_ids)

    def saved(self, x: Tensor, position_ids: Tensor, *params: Tensor) -> tuple[Tensor, ...]:
        return x, position_ids  # the weights are read from attn in backward: they are the same tensors

    def sink(self, dout: Tensor, dtype: torch.dtype, x: Tensor, position_ids: Tensor) -> ProjectionChunkSink:
        return ProjectionChunkSink(self.attn, x, position_ids, self.autocast)
