"""What each decoder layer of a transformers model is, as the strategy shards it and the memory model reads it
(:class:`~lightning_fpdt.parallel.binding.DecoderLayer`): found from its modules, whatever the family names them."""

from __future__ import annotations

from torch import nn
from transformers import PreTrainedModel

from lightning_fpdt.hf.attention import head_widths, is_attention_layer, layer_head_widths
from lightning_fpdt.hf.feed_forward import feed_forward
from lightning_fpdt.hf.layers import decoder_modules
from lightning_fpdt.hf.recurrent_memory import mixer_memory
from lightning_fpdt.hf.router_loss import TOP_K_FIELDS, config_number
from lightning_fpdt.hf.streamed import layer_refusal
from lightning_fpdt.memory.experts import read_experts
from lightning_fpdt.parallel.binding import DecoderLayer


def describe_layers(model: PreTrainedModel, heads: tuple[int, int], mlp_tiled: bool) -> list[DecoderLayer]:
    """The :class:`~lightning_fpdt.parallel.binding.DecoderLayer` of each decoder layer of ``model``, whose attention
    layers have ``heads = (n_heads, n_kv_heads)``: its norms, token mixers besides attention (as the memory model
    counts them), head widths, feed-forward (``mlp_tiled``: run in tiles) and routed experts."""
    config = model.config.get_text_config()
    n_heads, n_kv_heads = heads
    layers = []
    for name, layer in decoder_modules(model):
        norms = tuple(m for m in layer.children() if "norm" in type(m).__name__.lower())
        mixers = tuple(memory for m in layer.modules() if (memory := mixer_memory(m)) is not None)
        attention = next((m for m in layer.modules() if is_attention_layer(m)), None)
        # per layer (Gemma-4's full layers are wider); multi-head latent attention: v narrower than q and k
        head_dim, v_head_dim = head_widths(config) if attention is None else layer_head_widths(attention, config)
        mlp, top_k = feed_forward(layer), config_number(config, TOP_K_FIELDS)
        # routed experts outside the feed-forward: Granite's block_sparse_moe (its only one), Gemma-4's beside it
        beside = next((c for c in layer.children() if c is not mlp and not isinstance(c, nn.ModuleList)
                       and read_experts(c, config.hidden_size, top_k) is not None
                       and not any(is_attention_layer(m) for m in c.modules())), None)
        mlp, beside = (beside, None) if mlp is None else (mlp, beside)
        # the cap the attention module hands the attention function (Gemma-2 passes softcap=attn_logit_softcapping)
        softcap = None if attention is None else getattr(attention, "attn_logit_softcapping", None)
        layers.append(DecoderLayer(
            name=f"model.{name}", module=layer, hidden_size=config.hidden_size, n_heads=n_heads,
            n_kv_heads=n_kv_heads, head_dim=head_dim, v_head_dim=v_head_dim, mlp=mlp, experts=beside,
            experts_per_token=top_k,
            mlp_tiled=mlp_tiled, norms=norms, chunked_projections=False,
            attention=attention is not None, mixers=mixers, stream_refusal=layer_refusal(layer),
            attention_softcap=softcap,
        ))
    return layers
