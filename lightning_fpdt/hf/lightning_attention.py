"""MiniMax's lightning attention sequence-parallel and exact, chunk by chunk.

Lightning attention (MiniMax-Text-01) is a linear attention with a constant decay per head: each query reads every
earlier key, ``o_t = sum_{s <= t} exp(-slope (t - s)) (q_t . k_s) v_s``. transformers writes it inline in the
layer's forward, in blocks of ``block_size`` from the start of the sequence with the state ``S = sum k_s^T v_s``
(decayed) carried between blocks; no kernel function is there to rebind, so this module is the layer's core under
FPDT: the projections, activation, padding mask, norm, output gate and output projection as the family writes them,
and between them the core run the FPDT way by :class:`~lightning_fpdt.hf.recurrent.SequenceParallelRecurrence`: an
all-to-all turns this rank's sub-chunk of every head into the whole chunk of ``heads / P`` heads, the chunk is computed
from the state the chunk before left (within the chunk: the decayed scores; from the state: the queries decayed from
the chunk's start), the state goes on to the next chunk, and packed documents restart it. Every block split gives the
same sums; the float64 tests show it equal to the family's own to 1e-10.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lightning_fpdt.hf.recurrent_heads import channel_split, refuse_split
from lightning_fpdt.parallel.comm import group_rank

_PARTS = ("qkv_proj", "output_gate", "out_proj", "norm", "slope_rate", "num_attention_heads", "head_dim", "act_fn")


def is_lightning_class(cls: type) -> bool:
    """Whether ``cls`` is named as MiniMax's lightning attention."""
    return cls.__name__.endswith("LightningAttention")


def is_lightning_attention(module: nn.Module) -> bool:
    """A lightning-attention layer with the parts its forward reads (MiniMax's)."""
    return is_lightning_class(type(module)) and all(hasattr(module, name) for name in _PARTS)


def lightning_forward(recurrence: Any, module: nn.Module, hidden_states: Tensor, position_embeddings: Any = None,
                      attention_mask: Tensor | None = None, cache: Any = None, **kwargs: Any) -> tuple[Tensor, None]:
    """The layer's forward under ``recurrence`` (its context, chunk loop and checks): ``hidden_states``
    ``[b, s_local, hidden]`` in, ``([b, s_local, hidden], None)`` out (the family's returns the state second; its
    decoder layer discards it)."""
    if recurrence._plain():
        return type(module).forward(module, hidden_states, position_embeddings, attention_mask, cache, **kwargs)
    recurrence._refuse_cached(cache is not None)
    b, s, _ = hidden_states.shape
    h, d = module.num_attention_heads, module.head_dim
    mask_padding = recurrence._family["apply_mask_to_padding_states"]  # the family's own
    qkv = mask_padding(module.act_fn(module.qkv_proj(hidden_states)), attention_mask).reshape(b, s, h, 3 * d)
    query, key, value = torch.split(qkv, d, dim=3)
    if recurrence.position_wise:  # each query reads its own key only (decay 1 at distance 0)
        out = (query * key).sum(-1, keepdim=True) * value
    else:
        p, rank = recurrence._context.size, group_rank(recurrence._context.group)
        refuse_split(recurrence._where(), channel_split(h, p, "heads"))  # as at construction
        slope = module.slope_rate.reshape(h)[rank * h // p:(rank + 1) * h // p]

        def run(pieces: list[Tensor], params: list[Tensor], state: Tensor | None) -> tuple[Tensor, Tensor]:
            return decayed_chunk(*pieces, slope, state)

        out = recurrence._chunk_by_chunk(run, [query, key, value], [], [])
    out = module.norm(out.reshape(b, s, h * d))
    out = torch.sigmoid(module.output_gate(hidden_states)) * out
    return module.out_proj(out), None


def decayed_chunk(q: Tensor, k: Tensor, v: Tensor, slope: Tensor, state: Tensor | None) -> tuple[Tensor, Tensor]:
    """One piece of ``L`` tokens: ``q``, ``k``, ``v`` ``[b, L, heads, d]``, ``slope`` ``[heads]`` and the state the
    tokens before left (``[b, heads, d, d]``, decayed to the token before the piece; ``None``: none) in;
    ``(output [b, L, heads, d], the state after the piece)``."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads, L, d]
    steps = torch.arange(q.shape[2], device=q.device, dtype=q.dtype)
    rate = slope.to(q.dtype)[:, None, None]  # [heads, 1, 1]
    distance = steps[:, None] - steps[None, :]
    decay = torch.where(distance >= 0, torch.exp(-rate * distance.clamp_min(0)), torch.zeros((), dtype=q.dtype,
                                                                                             device=q.device))
    out = ((q @ k.transpose(-1, -2)) * decay) @ v
    if state is not None:  # the earlier tokens, decayed from the piece's start to each query
        out = out + (q * torch.exp(-rate * (steps[:, None] + 1))) @ state.to(q.dtype)
    kv = (k * torch.exp(-rate * (steps[-1] - steps)[:, None])).transpose(-1, -2) @ v
    final = kv if state is None else state.to(q.dtype) * torch.exp(-rate * q.shape[2]) + kv
    return out.transpose(1, 2), final
