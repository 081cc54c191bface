"""Weights from and to Hugging Face ``transformers`` (an optional dependency: extra ``hf``).

This module sits above the model files: it imports :mod:`~lightning_fpdt.models.llama` and
:mod:`~lightning_fpdt.models.gpt`, never the reverse. Each family has one weight-name table, a list of
:class:`Weight` rows (our parameter, its ``transformers`` name, how the two tensors are laid out), read in
both directions, so an import and an export cannot disagree.

Public entry points: :func:`llama_from_hf`, :func:`gpt_from_hf` and :func:`to_hf`; the config mappings
:func:`llama_config_from_hf` and :func:`gpt_config_from_hf` are shared with ``LlamaLM(hf_checkpoint=...)`` and
``GPTLM(hf_checkpoint=...)`` (:mod:`~lightning_fpdt.models.hf_checkpoint`), which read the same tables from a
checkpoint directory, row range by row range.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from lightning_fpdt.models.gpt import GPT, GPTConfig
from lightning_fpdt.models.llama import Llama, LlamaConfig
from lightning_fpdt.rope import RopeScaling


class Weight(NamedTuple):
    """One row of a weight-name table.

    Attributes:
        ours: our parameter.
        name: the ``transformers`` parameter it corresponds to.
        transposed: the ``transformers`` tensor is ``[in, out]`` (GPT-2's ``Conv1D``), ours ``[out, in]``.
        rows: the rows of the (transposed) ``transformers`` tensor that are ours (a fused q/k/v projection);
            ``None``: all of it.
    """

    ours: nn.Parameter
    name: str
    transposed: bool = False
    rows: slice | None = None

    def theirs(self, tensor: Tensor) -> Tensor:
        """The view of ``transformers``' ``tensor`` that holds our parameter (writes go through to it)."""
        view = tensor.T if self.transposed else tensor
        return view if self.rows is None else view[self.rows]


def llama_weights(ours: Llama) -> list[Weight]:
    """Llama's weight-name table (``LlamaForCausalLM``)."""
    table = [Weight(ours.embed_tokens.weight, "model.embed_tokens.weight"),
             Weight(ours.norm.weight, "model.norm.weight")]
    for i, layer in enumerate(ours.layers):
        p = f"model.layers.{i}."
        attention = ("q_proj", "k_proj", "v_proj", "o_proj")
        projections = [(f"self_attn.{n}", getattr(layer.attention, n)) for n in attention]
        projections += [(f"mlp.{n}", getattr(layer.mlp.mlp, n)) for n in ("gate_proj", "up_proj", "down_proj")]
        for name, linear in projections:
            table += [Weight(param, f"{p}{name}.{kind}") for kind, param in linear.named_parameters()]
        table += [Weight(layer.attention_norm.weight, f"{p}input_layernorm.weight"),
                  Weight(layer.mlp_norm.weight, f"{p}post_attention_layernorm.weight")]
    if not ours.config.tie_word_embeddings:
        table.append(Weight(ours.lm_head.weight, "lm_head.weight"))
    return table


def gpt2_weights(ours: GPT) -> list[Weight]:
    """GPT-2's weight-name table (``GPT2LMHeadModel``): its ``Conv1D`` weights are ``[in, out]`` and its
    q, k and v are one fused ``c_attn`` projection, whose thirds are ours."""
    n = ours.config.n_embd
    table = [Weight(ours.wte.weight, "transformer.wte.weight")]
    if ours.wpe is not None:
        table.append(Weight(ours.wpe.weight, "transformer.wpe.weight"))
    for i, layer in enumerate(ours.layers):
        p = f"transformer.h.{i}."
        a, mlp = layer.attention, layer.mlp.mlp
        for j, proj in enumerate((a.q_proj, a.k_proj, a.v_proj)):
            third = slice(j * n, (j + 1) * n)
            table += [Weight(proj.weight, f"{p}attn.c_attn.weight", transposed=True, rows=third),
                      Weight(proj.bias, f"{p}attn.c_attn.bias", rows=third)]
        for ours_linear, theirs in ((a.o_proj, "attn.c_proj"), (mlp.c_fc, "mlp.c_fc"), (mlp.c_proj, "mlp.c_proj")):
            table += [Weight(ours_linear.weight, f"{p}{theirs}.weight", transposed=True),
                      Weight(ours_linear.bias, f"{p}{theirs}.bias")]
        for ours_norm, theirs in ((layer.attention_norm, "ln_1"), (layer.mlp_norm, "ln_2")):
            table += [Weight(ours_norm.weight, f"{p}{theirs}.weight"), Weight(ours_norm.bias, f"{p}{theirs}.bias")]
    table += [Weight(ours.ln_f.weight, "transformer.ln_f.weight"), Weight(ours.ln_f.bias, "transformer.ln_f.bias")]
    if not ours.config.tie_word_embeddings:
        table.append(Weight(ours.lm_head.weight, "lm_head.weight"))
    return table


def llama_config_from_hf(config: Any, **overrides: Any) -> LlamaConfig:
    """The :class:`LlamaConfig` of a ``transformers`` ``LlamaConfig`` (what :func:`llama_from_hf` and
    ``LlamaLM(hf_checkpoint=...)`` build).

    RMSNorm computes in float32, and the RoPE schedule (``rope_theta``, the scaling in ``rope_parameters``:
    linear, Llama 3 or YaRN) and ``max_position_embeddings`` are carried, so the frequencies equal
    transformers' bit for bit (:func:`lightning_fpdt.rope.rope_frequencies`).

    Args:
        config: a ``transformers`` ``LlamaConfig``.
        **overrides: :class:`LlamaConfig` fields to set instead of the mapped ones (``mlp_tiles``, ...).

    Raises:
        NotImplementedError: a ``head_dim`` other than ``hidden_size / heads``, or a RoPE type other than
            default, linear, llama3 and yarn (:meth:`~lightning_fpdt.rope.RopeScaling.from_hf`).
    """
    c = config
    mapped = dict(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, rope_theta=_rope_theta(c), rope_scaling=_rope_scaling(c),
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        attention_bias=bool(getattr(c, "attention_bias", False)), mlp_bias=bool(getattr(c, "mlp_bias", False)),
        norm_compute_dtype="float32",  # transformers' LlamaRMSNorm always computes in float32
    )
    ours = LlamaConfig(**{**mapped, **overrides})
    if getattr(c, "head_dim", ours.head_dim) != ours.head_dim:
        raise NotImplementedError(f"llama_from_hf: head_dim={c.head_dim} != hidden_size / heads is not supported.")
    return ours


def gpt_config_from_hf(config: Any, **overrides: Any) -> GPTConfig:
    """The :class:`GPTConfig` of a ``transformers`` ``GPT2Config`` (what :func:`gpt_from_hf` and
    ``GPTLM(hf_checkpoint=...)`` build).

    Args:
        config: a ``transformers`` ``GPT2Config``.
        **overrides: :class:`GPTConfig` fields to set instead of the mapped ones (``mlp_tiles``, ...).

    Raises:
        NotImplementedError: an activation other than tanh-GELU, or per-layer attention scaling.
    """
    c = config
    if getattr(c, "activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise NotImplementedError(f"gpt_from_hf: activation_function={c.activation_function!r} is not supported.")
    if getattr(c, "scale_attn_by_inverse_layer_idx", False) or getattr(c, "reorder_and_upcast_attn", False):
        raise NotImplementedError(
            "gpt_from_hf: scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are not supported."
        )
    mapped = dict(
        vocab_size=c.vocab_size, n_positions=c.n_positions, n_embd=c.n_embd, n_layer=c.n_layer, n_head=c.n_head,
        n_inner=c.n_inner, layer_norm_epsilon=c.layer_norm_epsilon,
        tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", True)),
    )
    return GPTConfig(**{**mapped, **overrides})


def llama_from_hf(model: Any, **overrides: Any) -> Llama:
    """A :class:`Llama` with the weights of a ``transformers`` ``LlamaForCausalLM``, in its dtype (the config:
    :func:`llama_config_from_hf`).

    RMSNorm computes in float32, and the RoPE schedule (``rope_theta``, the scaling in ``rope_parameters``:
    linear, Llama 3 or YaRN) and ``max_position_embeddings`` are carried into :class:`LlamaConfig`, whose
    frequencies equal transformers' bit for bit (:func:`lightning_fpdt.rope.rope_frequencies`). To read a
    checkpoint directory where its weights are needed (each rank only its shards), use
    ``LlamaLM(hf_checkpoint=...)`` instead: this loads the whole transformers model first.

    Args:
        model: a ``LlamaForCausalLM``, or the path of a local checkpoint directory (no downloads).
        **overrides: :class:`LlamaConfig` fields to set instead of the mapped ones (``mlp_tiles``, ...).

    Raises:
        FileNotFoundError: no directory at the path.
        TypeError: another model class.
        NotImplementedError: a ``head_dim`` other than ``hidden_size / heads``, or a RoPE type other than
            default, linear, llama3 and yarn (:meth:`~lightning_fpdt.rope.RopeScaling.from_hf`).
    """
    hf = _resolve(model, "LlamaForCausalLM")
    ours = Llama(llama_config_from_hf(hf.config, **overrides)).to(next(hf.parameters()).dtype)
    _load(ours, llama_weights(ours), hf)
    return ours


def gpt_from_hf(model: Any, **overrides: Any) -> GPT:
    """A :class:`GPT` with the weights of a ``transformers`` ``GPT2LMHeadModel``, in its dtype (the config:
    :func:`gpt_config_from_hf`). ``GPTLM(hf_checkpoint=...)`` reads a checkpoint directory where its weights
    are needed instead.

    Args:
        model: a ``GPT2LMHeadModel``, or the path of a local checkpoint directory (no downloads).
        **overrides: :class:`GPTConfig` fields to set instead of the mapped ones (``mlp_tiles``, ...).

    Raises:
        FileNotFoundError: no directory at the path.
        TypeError: another model class.
        NotImplementedError: an activation other than tanh-GELU, or per-layer attention scaling.
    """
    hf = _resolve(model, "GPT2LMHeadModel")
    ours = GPT(gpt_config_from_hf(hf.config, **overrides)).to(next(hf.parameters()).dtype)
    _load(ours, gpt2_weights(ours), hf)
    return ours


def to_hf(model: Llama | GPT) -> Any:
    """A ``transformers`` model with the weights of ``model``: ``LlamaForCausalLM`` for a :class:`Llama`,
    ``GPT2LMHeadModel`` for a :class:`GPT` (learned positions only).

    Raises:
        NotImplementedError: a :class:`GPT` with rotary positions (GPT-2 has no counterpart).
        TypeError: another model class.
    """
    transformers = _transformers()
    if isinstance(model, Llama):
        c = model.config
        hf_config = transformers.LlamaConfig(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
            num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_key_value_heads, rms_norm_eps=c.rms_norm_eps,
            tie_word_embeddings=c.tie_word_embeddings, attention_bias=c.attention_bias, mlp_bias=c.mlp_bias,
            max_position_embeddings=c.max_position_embeddings,
            rope_parameters={"rope_type": "default", **(c.rope_scaling.to_hf() if c.rope_scaling else {}),
                             "rope_theta": c.rope_theta},
        )
        hf, table = transformers.LlamaForCausalLM(hf_config), llama_weights(model)
    elif isinstance(model, GPT):
        c = model.config
        if model.wpe is None:
            raise NotImplementedError(
                "to_hf: a GPT with rotary positions has no GPT-2 counterpart; use position_embedding='learned'."
            )
        hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=c.vocab_size, n_positions=c.n_positions, n_embd=c.n_embd, n_layer=c.n_layer, n_head=c.n_head,
            n_inner=c.n_inner, layer_norm_epsilon=c.layer_norm_epsilon, tie_word_embeddings=c.tie_word_embeddings,
        ))
        table = gpt2_weights(model)
    else:
        raise TypeError(f"to_hf: expected a lightning_fpdt Llama or GPT, got {type(model).__name__}.")
    hf = hf.to(next(model.parameters()).dtype)
    dst = dict(hf.named_parameters())
    for w in table:
        _copy(w.theirs(dst[w.name]), w.ours, w.name)
    return hf


def _load(ours: nn.Module, table: list[Weight], hf: Any) -> None:
    covered = {id(w.ours) for w in table}
    missing = [name for name, p in ours.named_parameters() if id(p) not in covered]
    if missing:  # a table that forgets a parameter would leave it at its random initialisation
        raise RuntimeError(f"The weight table of {type(ours).__name__} misses {missing}.")
    src = dict(hf.named_parameters())
    for w in table:
        _copy(w.ours, w.theirs(src[w.name]), w.name)


def _transformers() -> Any:
    try:
        import transformers  # an optional dependency (extra "hf"): imported only when converting
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


def _copy(dst: Tensor, src: Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"Hugging Face weight {name}: shape {tuple(src.shape)} does not fit {tuple(dst.shape)}.")
    with torch.no_grad():
        dst.copy_(src.to(dst.dtype))


def _rope_scaling(cfg: Any) -> RopeScaling | None:
    parameters = dict(getattr(cfg, "rope_parameters", None) or {})
    if parameters.get("rope_type") == "yarn" and parameters.get("factor") is None:  # transformers' fallback
        parameters["factor"] = cfg.max_position_embeddings / parameters["original_max_position_embeddings"]
    return RopeScaling.from_hf(parameters)


def _rope_theta(cfg: Any) -> float:
    theta = getattr(cfg, "rope_theta", None)
    if theta is None:  # transformers >= 5 keeps it in rope_parameters
        theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return float(theta)
