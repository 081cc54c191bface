"""Plain Ulysses attention: all-to-all, attention over the whole sequence, all-to-all back.

The baseline FPDT is measured against, and the path ``fpdt_attention(chunk_size=None)`` takes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_fpdt.attention.kernels import AttentionKernel
from lightning_fpdt.parallel.comm import HeadToSeq, SeqToHead
from lightning_fpdt.profiling import named_range


class KernelAttentionFunction(torch.autograd.Function):
    """One kernel call as an autograd function: ``(q, k, v) -> out`` ``[batch, seq, heads, head_dim]``, with
    the attention-logit ``softcap`` when given."""

    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, kernel: AttentionKernel, causal: bool, scale: float,
        softcap: float | None = None,
    ) -> Tensor:
        with named_range("fpdt/attention"):
            out, lse = kernel.forward(q, k, v, causal, scale, None, softcap)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kernel, ctx.causal, ctx.scale, ctx.softcap = kernel, causal, scale, softcap
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        with named_range("fpdt/attention_backward"):
            dq, dk, dv = ctx.kernel.backward(dout, q, k, v, out, lse, ctx.causal, ctx.scale, None, ctx.softcap)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def ulysses_attention(
    q: Tensor, k: Tensor, v: Tensor, group: ProcessGroup | None, kernel: AttentionKernel, causal: bool, scale: float,
    softcap: float | None = None,
) -> Tensor:
    """Sequence shards ``[b, S/P, h, d]`` in, output shard out; k/v heads already shardable over P. Sliding
    windows, attention chunks, documents and sinks take the pipeline (``fpdt_attention``), which plans their blocks."""
    with named_range("fpdt/all_to_all"):
        q, k, v = (SeqToHead.apply(x, group) for x in (q, k, v))  # [b, S, h/P, d]
    out = KernelAttentionFunction.apply(q, k, v, kernel, causal, scale, softcap)
    with named_range("fpdt/all_to_all"):
        return HeadToSeq.apply(out, group)  # [b, S/P, h, d]
