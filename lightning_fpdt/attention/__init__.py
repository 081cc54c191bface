"""FPDT attention: sequence-parallel, chunked, exact."""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_fpdt.attention.blocks import BlockRules, chunk_bounds
from lightning_fpdt.attention.kernels import BACKENDS, check_softcap, get_kernel
from lightning_fpdt.attention.merge import update_out_and_lse
from lightning_fpdt.attention.pipeline import PipelineOptions, run_pipeline
from lightning_fpdt.attention.sources import TensorEnds, check_qkv_shapes
from lightning_fpdt.attention.ulysses import ulysses_attention
from lightning_fpdt.errors import FPDTError
from lightning_fpdt.offload.stats import OffloadStats
from lightning_fpdt.parallel.comm import check_heads, expand_kv_heads, group_size, head_to_seq
from lightning_fpdt.parallel.layout import validate_chunk_size
from lightning_fpdt.parallel.packed_documents import PackedDocuments

__all__ = ["BACKENDS", "attention_options", "fpdt_attention", "get_kernel", "update_out_and_lse"]


def fpdt_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group: ProcessGroup | None = None,
    chunk_size: int | None = None,
    causal: bool = True,
    backend: str = "auto",
    scale: float | None = None,
    offload: bool = False,
    return_lse: bool = False,
    stats_sink: list[OffloadStats] | None = None,
    documents: PackedDocuments | None = None,
    window: int | None = None,
    attention_chunk_size: int | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    ring_group: ProcessGroup | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Sequence-parallel attention over this rank's shards in the FPDT layout.

    Args:
        q: ``[batch, S/P, n_heads, head_dim]``, this rank's shard (``lightning_fpdt.parallel.layout``).
        k: ``[batch, S/P, n_kv_heads, head_dim]``; ``n_kv_heads`` may be smaller than ``P``.
        v: ``[batch, S/P, n_kv_heads, v_head_dim]``; ``v_head_dim`` may differ from ``head_dim`` (multi-head
            latent attention: DeepSeek-V2/V3, MiniCPM3).
        group: the sequence-parallel process group (``P`` ranks); ``None`` means one process. With a
            ``ring_group``, the Ulysses group (``U`` consecutive ranks) whose all-to-alls scatter the heads.
        chunk_size: global tokens per chunk (a multiple of ``P``); ``None`` runs plain Ulysses,
            one chunk. The shards must be laid out for this same chunk size (and ring size).
        causal: causal (decoder) or full (bidirectional) attention.
        backend: ``"auto"``, ``"math"``, ``"sdpa"``, ``"cudnn"``, ``"flash_attn"``, ``"flash_attn_3"`` or
            ``"flash_attn_4"``.
        scale: softmax scale; default ``1 / sqrt(head_dim)``.
        offload: keep the chunks saved for backward in host memory, prefetching the next one.
        return_lse: also return the log-sum-exp ``[batch, S/P, n_heads]`` (not differentiable).
        stats_sink: a list the call appends its :class:`OffloadStats` to once its work is done.
        documents: packed documents (global offsets of the padded sequence, the same on every rank:
            :func:`lightning_fpdt.parallel.packed_documents.find_documents`); each token attends only within its
            document, and blocks that share no document are skipped. ``None``: one document per sample.
        window: sliding-window attention (causal only): a query at global position ``i`` sees keys
            ``i - window + 1 .. i``, as transformers counts ``sliding_window``; within packed documents the
            same band inside each document. Blocks wholly outside every query's window are skipped (no
            prefetch, copy or kernel); ``None``: no window.
        attention_chunk_size: chunked (local) attention, causal only (Llama-4's ``attention_chunk_size``; not
            ``chunk_size``, the pipeline's): a query at global position ``i`` sees keys ``k <= i`` with ``k // A ==
            i // A`` (``A`` the attention chunk size), positions counted from its document's start within packed
            documents. Blocks no query's attention chunk reaches are skipped; ``None``: off.
        softcap: attention-logit softcapping (Gemma-2): scores ``s`` (scaled) become ``softcap * tanh(s /
            softcap)`` before the softmax. ``sdpa`` runs softcapped blocks on ``math``; ``None``: no cap.
        sinks: attention sinks (gpt-oss): one learnt logit per query head ``[n_heads]``, the same on every
            rank, joining each query's softmax denominator once (not scaled). Differentiable: each rank's
            gradient holds its heads after the all-to-all (zeros elsewhere), summed over the group it is the
            gradient. The returned lse includes it. ``None``: no sinks.
        ring_group: the ring (``R`` ranks, one per Ulysses group, ``P = U x R``): key/value parts move between
            its ranks point to point (:mod:`lightning_fpdt.attention.ring`), and the heads need only divide
            over ``U``. The shards must be laid out with ``ring_size=R``
            (:func:`lightning_fpdt.parallel.layout.shard_sequence`). ``None``: no ring.

    Returns:
        The output shard ``[batch, S/P, n_heads, v_head_dim]`` (and the lse if asked), differentiable
        with respect to ``q``, ``k``, ``v`` (and ``sinks``).

    Raises:
        ValueError: head counts that cannot be sharded over ``P``, a ``chunk_size`` not divisible by
            ``P``, mismatched shapes, an unavailable backend, a window or attention chunk size below 1 or
            without causality, a softcap that is not positive, or sinks that are not ``[n_heads]``.
    """
    check_qkv_shapes(q, k, v)
    u, ring = group_size(group), group_size(ring_group)
    p = u * ring
    check_heads(q.shape[2], k.shape[2], u)
    validate_chunk_size(chunk_size, p, ring)
    # raises for a window or attention chunk it cannot apply, here on every rank before any collective
    BlockRules(causal, window, attention_chunk_size=attention_chunk_size)
    check_softcap(softcap)
    if sinks is not None and tuple(sinks.shape) != (q.shape[2],):
        raise FPDTError(f"fpdt_attention: sinks has shape {tuple(sinks.shape)}; it takes one logit per query head,"
                        f" [n_heads] = [{q.shape[2]}] (all heads, the same on every rank).")
    # KV heads fewer than ranks: replicate before the all-to-all (autograd sums the replicas' grads).
    k, v = expand_kv_heads(k, u), expand_kv_heads(v, u)
    opt = attention_options(q, group=group, chunk_size=chunk_size, causal=causal, backend=backend, scale=scale,
                            offload=offload, stats_sink=stats_sink, documents=documents, window=window,
                            attention_chunk_size=attention_chunk_size, softcap=softcap, ring_group=ring_group)
    opt.check_documents(q.shape[1], "fpdt_attention")
    rules = (documents, window, attention_chunk_size, sinks)  # any of them: the pipeline, which applies them
    if chunk_size is None and not offload and not return_lse and ring == 1 and all(x is None for x in rules):
        return ulysses_attention(q, k, v, group, opt.kernel, causal, opt.scale, softcap)
    out, lse = run_pipeline(TensorEnds(kv_heads=k.shape[2], head_dim=q.shape[3]), opt, q, k, v, sinks=sinks)
    if not return_lse:
        return out
    # lse [b, h/P, S] head-sharded -> [b, S/P, h] sequence-sharded (per chunk, in layout order)
    lse_local = _lse_to_seq(lse, q.shape[1], opt)
    return out, lse_local


def attention_options(
    q: Tensor, *, group: ProcessGroup | None = None, chunk_size: int | None = None, causal: bool = True,
    backend: str = "auto", scale: float | None = None, offload: bool = False,
    stats_sink: list[OffloadStats] | None = None, documents: PackedDocuments | None = None,
    window: int | None = None, attention_chunk_size: int | None = None, softcap: float | None = None,
    ring_group: ProcessGroup | None = None,
) -> PipelineOptions:
    """The :class:`PipelineOptions` of :func:`fpdt_attention`'s arguments (the kernel for ``q``'s device and dtype,
    the scale ``1 / sqrt(head_dim)`` by default): for a caller that feeds the pipeline itself (a streamed layer)."""
    return PipelineOptions.for_chunk_size(
        group, chunk_size, causal=causal, scale=1.0 / math.sqrt(q.shape[-1]) if scale is None else scale,
        kernel=get_kernel(backend, q.device, q.dtype), offload=offload, stats_sink=stats_sink, documents=documents,
        window=window, attention_chunk_size=attention_chunk_size, softcap=softcap, ring_group=ring_group,
    )


def _lse_to_seq(lse: Tensor, s_local: int, opt: PipelineOptions) -> Tensor:
    parts, start = [], 0
    u = group_size(opt.group)
    for lo, hi in chunk_bounds(s_local, opt.local_chunk_size):
        length = (hi - lo) * u  # the ring rank's part of the chunk
        chunk = lse[:, :, start : start + length].transpose(1, 2).unsqueeze(-1).contiguous()  # [b, C/R, h/U, 1]
        parts.append(head_to_seq(chunk, opt.group).squeeze(-1))  # [b, C/P, h]
        start += length
    return torch.cat(parts, dim=1)
