"""Reading a mixture-of-experts MLP for the memory model (no model imported).

transformers 5 stores a layer's experts as fused 3-D parameters (``gate_up_proj`` ``[experts, 2 x inter,
hidden]`` and ``down_proj`` ``[experts, hidden, inter]``, or transposed as gpt-oss stores them) beside a router
whose ``top_k`` says how many experts each token runs through. Every expert's weights count as parameters
(gradients and optimizer state follow them); each routed token keeps one expert MLP's intermediates per
expert it is routed to.
"""

from __future__ import annotations

from torch import nn


def read_experts(mlp: nn.Module, hidden: int, top_k: int | None = None) -> tuple[int, int, int] | None:
    """``(intermediate_size, mlp_projections, experts_per_token)`` of an MoE block with fused 3-D expert weights;
    ``None`` for any other MLP.

    ``top_k``: experts per token where no module of the block says (an int ``top_k`` or ``num_experts_per_tok``
    attribute, as most routers have; Gemma-4's router has none). Shared experts beside the routed ones (DeepSeek-V3,
    GLM-4.5-MoE: dense MLPs every token runs through) count as that many more experts per token, their intermediate
    width over the routed experts' rounded up."""
    widths = []
    for p in mlp.parameters():
        if p.dim() == 3 and hidden in p.shape[1:]:
            widths.append(p.shape[2] if p.shape[1] == hidden else p.shape[1])  # the non-hidden width
    found = next((k for m in mlp.modules() for name in ("top_k", "num_experts_per_tok")
                  if isinstance(k := getattr(m, name, None), int) and not isinstance(k, bool)), top_k)
    if not widths or found is None:
        return None
    inter = min(widths)  # down_proj's input; gate_up is twice as wide
    shared = sum(m.in_features for name, m in mlp.named_modules()  # LoRA's lora_B is no shared expert
                 if isinstance(m, nn.Linear) and m.out_features == hidden and ".lora_" not in f".{name}")
    return inter, max(1, sum(widths) // inter - 1), found + -(-shared // inter)
