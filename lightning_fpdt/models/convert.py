"""Weight import from and export to Hugging Face ``transformers`` (an optional dependency: extra ``hf``)."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from lightning_fpdt.rope import RotaryEmbedding


def _transformers() -> Any:
    try:
        import transformers  # an optional extra: imported only when Hugging Face models are used
    except ImportError as err:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "Hugging Face import/export needs `transformers`: pip install 'lightning-fpdt[hf]'."
        ) from err
    return transformers


def _resolve(model: Any, expected: str) -> Any:
    """A ``transformers`` model instance from an instance or a local checkpoint directory."""
    transformers = _transformers()
    if isinstance(model, (str, os.PathLike)):
        if not os.path.isdir(model):
            raise FileNotFoundError(f"No Hugging Face checkpoint directory at {os.fspath(model)!r}.")
        model = transformers.AutoModelForCausalLM.from_pretrained(os.fspath(model), local_files_only=True)
    if type(model).__name__ != expected:
        raise TypeError(f"Expected a transformers {expected}, got {type(model).__name__}.")
    return model


def _copy(dst: nn.Parameter, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"Hugging Face weight {name}: shape {tuple(src.shape)} does not fit {tuple(dst.shape)}.")
    with torch.no_grad():
        dst.copy_(src.to(dst.dtype))


def _rope_theta(cfg: Any) -> float:
    theta = getattr(cfg, "rope_theta", None)
    if theta is None:  # transformers >= 5 keeps it in rope_parameters
        theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return float(theta)


def _llama_pairs(ours: Any) -> list[tuple[nn.Parameter, str]]:
    """(our parameter, its Hugging Face name) for every Llama weight: one table for import and export."""
    pairs = [(ours.embed_tokens.weight, "model.embed_tokens.weight"), (ours.norm.weight, "model.norm.weight")]
    for i, layer in enumerate(ours.layers):
        p = f"model.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            pairs += [(getattr(getattr(layer.attention, proj), kind), f"{p}self_attn.{proj}.{kind}")
                      for kind in ("weight", "bias") if getattr(getattr(layer.attention, proj), kind) is not None]
        for proj in ("gate_proj", "up_proj", "down_proj"):
            pairs += [(getattr(getattr(layer.mlp.mlp, proj), kind), f"{p}mlp.{proj}.{kind}")
                      for kind in ("weight", "bias") if getattr(getattr(layer.mlp.mlp, proj), kind) is not None]
        pairs += [(layer.attention_norm.weight, f"{p}input_layernorm.weight"),
                  (layer.mlp_norm.weight, f"{p}post_attention_layernorm.weight")]
    if not ours.config.tie_word_embeddings:
        pairs.append((ours.lm_head.weight, "lm_head.weight"))
    return pairs


def load_llama(cls: type, model: Any, overrides: dict[str, Any]) -> Any:
    from lightning_fpdt.models.llama import LlamaConfig  # llama imports this module: a cycle at import time

    hf = _resolve(model, "LlamaForCausalLM")
    c = hf.config
    config = LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, rope_theta=_rope_theta(c), rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        attention_bias=bool(getattr(c, "attention_bias", False)), mlp_bias=bool(getattr(c, "mlp_bias", False)),
        norm_compute_dtype="float32",  # transformers' LlamaRMSNorm always computes in float32
        **overrides,
    )
    if getattr(c, "head_dim", config.head_dim) != config.head_dim:
        raise NotImplementedError(f"Llama.from_hf: head_dim={c.head_dim} != hidden_size / heads is not supported.")
    ours = cls(config).to(next(hf.parameters()).dtype)
    src = dict(hf.named_parameters())
    for param, name in _llama_pairs(ours):
        _copy(param, src[name], name)
    rotary = hf.model.rotary_emb
    for layer in ours.layers:
        # the checkpoint's own frequencies: covers scaled schedules (Llama 3, linear, dynamic at init)
        layer.attention.rope = RotaryEmbedding(
            config.head_dim, config.rope_theta, rotary.inv_freq.detach().cpu(), float(rotary.attention_scaling)
        )
    return ours


def export_llama(ours: Any) -> Any:
    transformers = _transformers()
    c = ours.config
    hf_config = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=c.tie_word_embeddings, attention_bias=c.attention_bias, mlp_bias=c.mlp_bias,
        rope_theta=c.rope_theta,
    )
    if getattr(hf_config, "rope_parameters", None) is not None:
        hf_config.rope_parameters = {**hf_config.rope_parameters, "rope_theta": c.rope_theta}
    hf = transformers.LlamaForCausalLM(hf_config).to(next(ours.parameters()).dtype)
    dst = dict(hf.named_parameters())
    for param, name in _llama_pairs(ours):
        _copy(dst[name], param, name)
    return hf


def load_gpt2(cls: type, model: Any, overrides: dict[str, Any]) -> Any:
    from lightning_fpdt.models.gpt import GPTConfig  # gpt imports this module: a cycle at import time

    hf = _resolve(model, "GPT2LMHeadModel")
    c = hf.config
    if getattr(c, "activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise NotImplementedError(f"GPT.from_hf: activation_function={c.activation_function!r} is not supported.")
    if getattr(c, "scale_attn_by_inverse_layer_idx", False) or getattr(c, "reorder_and_upcast_attn", False):
        raise NotImplementedError(
            "GPT.from_hf: scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are not supported."
        )
    config = GPTConfig(
        vocab_size=c.vocab_size, n_positions=c.n_positions, n_embd=c.n_embd, n_layer=c.n_layer, n_head=c.n_head,
        n_inner=c.n_inner, layer_norm_epsilon=c.layer_norm_epsilon,
        tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", True)), **overrides,
    )
    ours = cls(config).to(next(hf.parameters()).dtype)
    src = dict(hf.named_parameters())
    n = config.n_embd
    _copy(ours.wte.weight, src["transformer.wte.weight"], "wte")
    _copy(ours.wpe.weight, src["transformer.wpe.weight"], "wpe")
    for i, layer in enumerate(ours.layers):
        p = f"transformer.h.{i}."
        w, b = src[f"{p}attn.c_attn.weight"], src[f"{p}attn.c_attn.bias"]  # Conv1D: weight is [in, out]
        for j, proj in enumerate(("q_proj", "k_proj", "v_proj")):
            _copy(getattr(layer.attention, proj).weight, w[:, j * n:(j + 1) * n].T, proj)
            _copy(getattr(layer.attention, proj).bias, b[j * n:(j + 1) * n], proj)
        _copy(layer.attention.o_proj.weight, src[f"{p}attn.c_proj.weight"].T, "attn.c_proj")
        _copy(layer.attention.o_proj.bias, src[f"{p}attn.c_proj.bias"], "attn.c_proj")
        _copy(layer.mlp.mlp.c_fc.weight, src[f"{p}mlp.c_fc.weight"].T, "mlp.c_fc")
        _copy(layer.mlp.mlp.c_fc.bias, src[f"{p}mlp.c_fc.bias"], "mlp.c_fc")
        _copy(layer.mlp.mlp.c_proj.weight, src[f"{p}mlp.c_proj.weight"].T, "mlp.c_proj")
        _copy(layer.mlp.mlp.c_proj.bias, src[f"{p}mlp.c_proj.bias"], "mlp.c_proj")
        for ours_norm, theirs in ((layer.attention_norm, "ln_1"), (layer.mlp_norm, "ln_2")):
            _copy(ours_norm.weight, src[f"{p}{theirs}.weight"], theirs)
            _copy(ours_norm.bias, src[f"{p}{theirs}.bias"], theirs)
    _copy(ours.ln_f.weight, src["transformer.ln_f.weight"], "ln_f")
    _copy(ours.ln_f.bias, src["transformer.ln_f.bias"], "ln_f")
    if not config.tie_word_embeddings:
        _copy(ours.lm_head.weight, src["lm_head.weight"], "lm_head")
    return ours


def export_gpt2(ours: Any) -> Any:
    transformers = _transformers()
    c = ours.config
    if ours.wpe is None:
        raise NotImplementedError(
            "GPT.to_hf: rotary positions have no GPT-2 counterpart; use position_embedding='learned'."
        )
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=c.vocab_size, n_positions=c.n_positions, n_embd=c.n_embd, n_layer=c.n_layer, n_head=c.n_head,
        n_inner=c.n_inner, layer_norm_epsilon=c.layer_norm_epsilon, tie_word_embeddings=c.tie_word_embeddings,
    )).to(next(ours.parameters()).dtype)
    dst = dict(hf.named_parameters())
    _copy(dst["transformer.wte.weight"], ours.wte.weight, "wte")
    _copy(dst["transformer.wpe.weight"], ours.wpe.weight, "wpe")
    for i, layer in enumerate(ours.layers):
        p = f"transformer.h.{i}."
        a = layer.attention
        _copy(dst[f"{p}attn.c_attn.weight"], torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).T, "c_attn")
        _copy(dst[f"{p}attn.c_attn.bias"], torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]), "c_attn")
        _copy(dst[f"{p}attn.c_proj.weight"], a.o_proj.weight.T, "attn.c_proj")
        _copy(dst[f"{p}attn.c_proj.bias"], a.o_proj.bias, "attn.c_proj")
        _copy(dst[f"{p}mlp.c_fc.weight"], layer.mlp.mlp.c_fc.weight.T, "mlp.c_fc")
        _copy(dst[f"{p}mlp.c_fc.bias"], layer.mlp.mlp.c_fc.bias, "mlp.c_fc")
        _copy(dst[f"{p}mlp.c_proj.weight"], layer.mlp.mlp.c_proj.weight.T, "mlp.c_proj")
        _copy(dst[f"{p}mlp.c_proj.bias"], layer.mlp.mlp.c_proj.bias, "mlp.c_proj")
        for ours_norm, theirs in ((layer.attention_norm, "ln_1"), (layer.mlp_norm, "ln_2")):
            _copy(dst[f"{p}{theirs}.weight"], ours_norm.weight, theirs)
            _copy(dst[f"{p}{theirs}.bias"], ours_norm.bias, theirs)
    _copy(dst["transformer.ln_f.weight"], ours.ln_f.weight, "ln_f")
    _copy(dst["transformer.ln_f.bias"], ours.ln_f.bias, "ln_f")
    if not c.tie_word_embeddings:
        _copy(dst["lm_head.weight"], ours.lm_head.weight, "lm_head")
    return hf
