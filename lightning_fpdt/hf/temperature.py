"""Llama-4's attention temperature tuning, at the positions each token really has under FPDT.

Llama-4's NoPE layers (``attn_temperature_tuning``, ``use_rope=False``) scale their queries by ``log1p(floor((pos
+ 1) / floor_scale)) * attn_scale + 1`` (https://huggingface.co/papers/2501.19399), computed in float32 with ``pos =
arange(hidden_states.shape[1])`` (``modeling_llama4.Llama4TextAttention.forward``): the LOCAL length. Under sequence
sharding that is this rank's token count, in layout order, not the tokens' positions; within packed documents the
position of a document run alone counts from its start; a streamed layer (:mod:`lightning_fpdt.hf.streamed`) runs
one chunk at a time, so ``pos`` counts from the chunk's first token there. The attention function gets the already
scaled queries, so :func:`tuned_queries` multiplies them by the ratio of the right scale to the one applied:
``q * s_local`` becomes ``q * s_local * (s_true / s_local)``, ``q * s_true`` up to one rounding (the ratio in
float32 or wider), and its gradient flows through both factors to exactly ``s_true`` times the incoming one.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_fpdt.parallel.binding import SequenceParallelContext
from lightning_fpdt.parallel.comm import group_rank
from lightning_fpdt.parallel.packed_documents import PackedDocuments, token_positions


def tunes_temperature(module: nn.Module) -> bool:
    """Whether ``module`` scales its queries by position as Llama-4's NoPE layers do."""
    tuned = bool(getattr(module, "attn_temperature_tuning", False)) and not getattr(module, "use_rope", True)
    return tuned and hasattr(module, "floor_scale") and hasattr(module, "attn_scale")


def _scales(module: nn.Module, positions: Tensor) -> Tensor:
    """The layer's scale at ``positions``, as transformers computes it (float32)."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0


def tuned_queries(module: nn.Module, query: Tensor, context: SequenceParallelContext,
                  documents: PackedDocuments | None, first: int = 0, s_local: int | None = None) -> Tensor:
    """``query`` ``[batch, heads, n, head_dim]`` of a temperature-tuned layer rescaled from the scale of the
    positions ``0..n-1`` the layer applied to that of its tokens' positions in their documents; unchanged where the
    two agree. The ``n`` tokens are this rank's ``first .. first + n - 1`` of ``s_local`` (default: all of them; a
    streamed layer's chunk otherwise)."""
    n = query.shape[2]
    s_local = n if s_local is None else s_local
    local = _scales(module, torch.arange(n, device=query.device))
    positions = token_positions(s_local, context.size, group_rank(context.group), context.chunk_size, documents,
                                query.device, context.ring_size, first, n)
    true = _scales(module, positions)
    if torch.equal(true, local.expand_as(true)):
        return query
    wide = torch.promote_types(query.dtype, torch.float32)
    ratio = (true.to(wide) / local.to(wide))[:, None, :, None]  # [batch or 1, 1, n, 1]
    return (query.to(wide) * ratio).to(query.dtype)
