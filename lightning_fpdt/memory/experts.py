"""Reading a mixture-of-experts MLP for the memory model (no model imported).

transformers 5 stores a layer's experts as fused 3-D parameters (``gate_up_proj`` ``[experts, 2 x inter,
hidden]`` and ``down_proj`` ``[experts, hidden, inter]``, or transposed as gpt-oss stores them) beside a router
whose ``top_k`` says how many experts each token runs through. Every expert's weights count as parameters
(gradients and optimizer state follow them); each routed token keeps one expert MLP's intermediates per
expert it is routed to.
"""

from __future__ import annotations

from torch import nn


def read_experts(mlp: nn.Module, hidden: int) -> tuple[int, int, int] | None:
    """``(intermediate_size, mlp_projections, experts_per_token)`` of an MoE ``mlp`` with fused 3-D expert
    weights and a router with an int ``top_k``; ``None`` for any other MLP."""
    widths = []
    for p in mlp.parameters():
        if p.dim() == 3 and hidden in p.shape[1:]:
            widths.append(p.shape[2] if p.shape[1] == hidden else p.shape[1])  # the non-hidden width
    top_k = next((m.top_k for m in mlp.modules() if isinstance(getattr(m, "top_k", None), int)), None)
    if not widths or top_k is None:
        return None
    inter = min(widths)  # down_proj's input; gate_up is twice as wide
    return inter, max(1, sum(widths) // inter - 1), top_k
