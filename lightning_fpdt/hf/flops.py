"""Training FLOPs per token of a transformers causal LM, counted as the bundled models count theirs (read by
Lightning's throughput monitor for FLOP/s and MFU)."""

from __future__ import annotations

from torch import nn
from transformers import PreTrainedModel

from lightning_fpdt.hf.attention import attention_layers, layer_head_widths
from lightning_fpdt.hf.masks import attention_chunk_size
from lightning_fpdt.hf.recurrent import SequenceParallelRecurrence
from lightning_fpdt.hf.router_loss import TOP_K_FIELDS, config_number


def flops_per_token(model: PreTrainedModel, seq_len: int) -> float:
    """Training FLOPs per token of ``model`` at global sequence length ``seq_len`` (forward and backward, counted as
    ``LlamaLM`` counts them): 6 x the parameters each token multiplies through (every parameter but the
    input embeddings, the output embedding once even when tied, a routed expert's weights times
    ``num_experts_per_tok / num_experts``; 4 x for a frozen parameter, as LoRA's base weights: no weight gradient),
    plus 6 x ``heads x (qk_head_dim + v_head_dim)`` (the scores' and the output's matmuls; 12 x ``heads x head_dim``
    where the widths are equal) x the keys a query attends to per attention layer: ``seq_len / 2`` under causality,
    ``w - w^2 / (2 seq_len)`` in a layer with a sliding window ``w < seq_len`` (``layer_types``/``sliding_window``
    of the config), half the squared attention chunks per token in a chunked layer (attention chunks of
    ``a < seq_len`` tokens: ``a / 2`` where ``a`` divides it), plus each gated delta-net or Mamba-2 layer's core
    kernel (:meth:`~lightning_fpdt.hf.recurrent.SequenceParallelRecurrence.flops_per_token`: linear in the length,
    so a hybrid's MFU is not counted against attention it does not run)."""
    config = model.config.get_text_config()
    embeddings = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    scale = {}  # a routed expert's weights: only top_k of num_experts run per token
    top_k = config_number(config, TOP_K_FIELDS) or 1
    for m in model.modules():
        if type(m).__name__.endswith("Experts") and isinstance(getattr(m, "num_experts", None), int):
            scale.update({id(p): top_k / m.num_experts for p in m.parameters()})
    # a frozen parameter (LoRA's base weights) costs 4 of the 6: no weight gradient is computed for it
    active = sum(p.numel() * scale.get(id(p), 1) * (1 if p.requires_grad else 2 / 3) for p in model.parameters()
                 if id(p) not in embeddings)
    head = model.get_output_embeddings().weight
    tied = head.numel() * (1 if head.requires_grad else 2 / 3)
    active += tied if id(head) in embeddings else 0  # tied: the output embedding is still a matmul
    n_heads = config.num_attention_heads
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    layer_types = getattr(config, "layer_types", None) or []
    attended = 0.0  # per token: sum over attention layers of the keys a query sees x (q/k width + v width) / 2
    for _, layer in attention_layers(model):  # a hybrid's linear layers have no keys to attend to
        index = layer.layer_idx if isinstance(layer.layer_idx, int) else -1
        kind = layer_types[index] if 0 <= index < len(layer_types) else "sliding_attention"
        w = window if kind == "sliding_attention" and window else seq_len
        qk_width, v_width = layer_head_widths(layer, config)  # multi-head latent attention: v narrower than q and k
        chunk = attention_chunk_size(layer)  # chunked attention (Llama-4): each attention chunk a causal square
        if chunk is not None and chunk < seq_len:
            keys = ((seq_len // chunk) * chunk**2 + (seq_len % chunk) ** 2) / (2 * seq_len)
        else:
            keys = seq_len / 2 if w >= seq_len else w - w * w / (2 * seq_len)
        attended += keys * (qk_width + v_width) / 2
    recurrences = sum(f.flops_per_token() for m in model.modules()
                      if isinstance(f := m.__dict__.get("forward"), SequenceParallelRecurrence))
    return 6 * active + 12 * n_heads * attended + recurrences
