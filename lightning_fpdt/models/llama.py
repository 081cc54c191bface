"""The Llama family: a Llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) built from FPDT blocks,
its LightningModule :class:`LlamaLM`, and what the project knows of ``transformers``' Llama: the weight-name table
(:func:`llama_weights`), the config mapping both ways and the :data:`FAMILY` record that conversion, reading a
pretrained directory and export look up.

The model is a plain ``nn.Module``: it works in one process, and under ``FPDTStrategy`` its blocks
are bound to the sequence-parallel group from outside. It never shifts labels: the loss takes
pre-shifted labels (``shift_labels[t]`` is the target of token ``t``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_fpdt.errors import FPDTError, Unsupported
from lightning_fpdt.layers.block import FPDTAttention, FPDTBlock
from lightning_fpdt.layers.rope import RopeScaling, RotaryEmbedding, rope_frequencies, rope_theta_of
from lightning_fpdt.models.bundled import BundledLM
from lightning_fpdt.models.family import Family, Weight
from lightning_fpdt.models.init import init_weights
from lightning_fpdt.offload.tiling import TiledMLP
from lightning_fpdt.parallel.layout import default_position_ids
from lightning_fpdt.parallel.packed_documents import PackedDocuments


@dataclass
class LlamaConfig:
    """Llama hyper-parameters, with Hugging Face's field names (the defaults are Llama-3-8B's).

    Attributes:
        vocab_size: tokens in the vocabulary.
        hidden_size: model width.
        intermediate_size: SwiGLU inner width.
        num_hidden_layers: transformer blocks.
        num_attention_heads: query heads.
        num_key_value_heads: key/value heads (GQA); ``None`` means ``num_attention_heads``.
        rope_theta: RoPE base.
        rope_scaling: a scaled RoPE schedule for context extension (linear, Llama 3 or YaRN; a
            :class:`~lightning_fpdt.layers.rope.RopeScaling` or its fields as a dict, transformers' ``rope_parameters``
            names); ``None``: unscaled.
        max_position_embeddings: the context the model is meant for (Hugging Face's field; carried to and from
            ``transformers``, where YaRN reads it when ``factor`` is unset; the own model has no length limit).
        rms_norm_eps: RMSNorm epsilon.
        tie_word_embeddings: share the input embedding with the output projection.
        attention_bias: biases on the q/k/v/o projections.
        mlp_bias: biases on the MLP projections.
        initializer_std: std of the linear and embedding weights; ``None`` means
            ``1 / sqrt(fan_in)`` per layer (and 1 for embeddings; a tied embedding, which is the output layer too:
            ``1 / sqrt(hidden_size)``).
        mlp_tiles: sequence tiles of the MLP (``None``: from the sequence and hidden sizes; 1: off).
            The loss's tiles are the LightningModule's (``LlamaLM(loss_tiles=...)``), not the model's.
        norm_compute_dtype: dtype RMSNorm computes in; ``None`` means float32 or wider (float64
            models stay float64). Hugging Face's Llama always uses float32 (set by
            :func:`lightning_fpdt.models.convert.llama_from_hf`).
    """

    vocab_size: int = 128256
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 8
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    initializer_std: float | None = None
    mlp_tiles: int | None = None
    norm_compute_dtype: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):  # from a YAML or a checkpoint's hyper-parameters
            self.rope_scaling = RopeScaling(**self.rope_scaling)
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise FPDTError(f"LlamaConfig.{name} must be positive, got {getattr(self, name)}.")
        if self.hidden_size % self.num_attention_heads != 0:
            raise FPDTError(
                f"LlamaConfig: hidden_size={self.hidden_size} is not divisible by"
                f" num_attention_heads={self.num_attention_heads}."
            )
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise FPDTError(
                f"LlamaConfig: num_attention_heads={self.num_attention_heads} is not a multiple of"
                f" num_key_value_heads={self.num_key_value_heads}."
            )
        if self.norm_compute_dtype not in (None, "float32", "float64"):
            raise FPDTError(
                "LlamaConfig.norm_compute_dtype must be None, 'float32' or 'float64', got"
                f" {self.norm_compute_dtype!r}."
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def tiny(cls, **overrides: Any) -> LlamaConfig:
        """A ~125K-parameter model for CPU tests and the quick start."""
        base = dict(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0)
        return cls(**{**base, **overrides})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class RMSNorm(nn.Module):
    """``weight * x / rms(x)``, computed in ``compute_dtype`` (default: float32 or wider)."""

    def __init__(self, dim: int, eps: float = 1e-6, compute_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps, self.compute_dtype = eps, compute_dtype
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        acc = self.compute_dtype or torch.promote_types(x.dtype, torch.float32)
        h = x.to(acc)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Llama(nn.Module):
    """Llama decoder (a :class:`~lightning_fpdt.models.causal_lm.DecoderModel`). ``forward(input_ids, position_ids)
    -> logits`` ``[batch, seq, vocab]``. Weights from and to ``transformers``: :mod:`lightning_fpdt.models.convert`."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = c = config
        norm_dtype = getattr(torch, c.norm_compute_dtype) if c.norm_compute_dtype else None
        inv_freq, attention_scaling = rope_frequencies(c.head_dim, c.rope_theta, c.rope_scaling)
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(
            FPDTBlock(
                attention=FPDTAttention(
                    c.hidden_size, c.num_attention_heads, c.num_key_value_heads, bias=c.attention_bias,
                    rope=RotaryEmbedding(c.head_dim, c.rope_theta, inv_freq, attention_scaling),
                ),
                mlp=TiledMLP(SwiGLU(c.hidden_size, c.intermediate_size, c.mlp_bias), c.mlp_tiles),
                attention_norm=RMSNorm(c.hidden_size, c.rms_norm_eps, norm_dtype),
                mlp_norm=RMSNorm(c.hidden_size, c.rms_norm_eps, norm_dtype),
            )
            for _ in range(c.num_hidden_layers)
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, norm_dtype)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        init_weights(self, c.initializer_std, tied=self.embed_tokens if c.tie_word_embeddings else None)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def compute_buffers(self) -> None:
        """Compute the buffers that are not weights (every layer's RoPE inverse frequencies) in place, on their
        device: after ``to_empty`` of a model built on the meta device (``LlamaLM(hf_checkpoint=...)``)."""
        c = self.config
        with torch.device("cpu"):  # computed as at construction, then copied to the buffers' device
            inv_freq, _ = rope_frequencies(c.head_dim, c.rope_theta, c.rope_scaling)
        with torch.no_grad():
            for layer in self.layers:
                layer.attention.rope.inv_freq.copy_(inv_freq)

    def hidden_states(
        self, input_ids: Tensor, position_ids: Tensor | None = None, documents: PackedDocuments | None = None,
        normed: bool = True,
    ) -> Tensor:
        """Final normed hidden states ``[batch, seq, hidden]`` (``seq`` is this rank's shard under SP)."""
        if position_ids is None:
            position_ids = default_position_ids(*input_ids.shape, device=input_ids.device)
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, position_ids, documents)
        return self.norm(x) if normed else x  # normed=False: the tiled loss applies final_norm

    def forward(
        self, input_ids: Tensor, position_ids: Tensor | None = None, documents: PackedDocuments | None = None
    ) -> Tensor:
        return self.lm_head(self.hidden_states(input_ids, position_ids, documents))

    @property
    def final_norm(self) -> nn.Module:
        """The norm ``hidden_states`` ends with (``normed=False`` leaves it to the tiled loss)."""
        return self.norm

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token at global length ``seq_len`` (6 x matmul parameters, plus attention
        ``QK^T`` and ``PV``, halved by causality, x3 for backward)."""
        c = self.config
        n_params = sum(p.numel() for n, p in self.named_parameters() if "embed_tokens" not in n)
        attention = 2 * c.num_hidden_layers * seq_len * c.hidden_size
        return 6 * n_params + 3 * attention


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


def llama_config_from_hf(config: Any, **overrides: Any) -> LlamaConfig:
    """The :class:`LlamaConfig` of a ``transformers`` ``LlamaConfig`` (what ``llama_from_hf`` and
    ``LlamaLM(hf_checkpoint=...)`` build).

    RMSNorm computes in float32, and the RoPE schedule (``rope_theta``, the scaling in ``rope_parameters``:
    linear, Llama 3 or YaRN) and ``max_position_embeddings`` are carried, so the frequencies equal
    transformers' bit for bit (:func:`lightning_fpdt.layers.rope.rope_frequencies`).

    Args:
        config: a ``transformers`` ``LlamaConfig``.
        **overrides: :class:`LlamaConfig` fields to set instead of the mapped ones (``mlp_tiles``, ...).

    Raises:
        NotImplementedError: a ``head_dim`` other than ``hidden_size / heads``, or a RoPE type other than
            default, linear, llama3 and yarn (:meth:`~lightning_fpdt.layers.rope.RopeScaling.from_hf`).
    """
    c = config
    mapped = dict(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, rope_theta=rope_theta_of(c), rope_scaling=RopeScaling.of_hf(c),
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        attention_bias=bool(getattr(c, "attention_bias", False)), mlp_bias=bool(getattr(c, "mlp_bias", False)),
        norm_compute_dtype="float32",  # transformers' LlamaRMSNorm always computes in float32
    )
    ours = LlamaConfig(**{**mapped, **overrides})
    if getattr(c, "head_dim", ours.head_dim) != ours.head_dim:
        raise Unsupported(f"llama_from_hf: head_dim={c.head_dim} != hidden_size / heads is not supported.")
    return ours


def llama_config_to_hf(c: LlamaConfig) -> dict[str, Any]:
    """The keyword arguments of the ``transformers`` ``LlamaConfig`` of ``c`` (its RoPE schedule as
    ``rope_parameters``)."""
    return dict(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=c.tie_word_embeddings, attention_bias=c.attention_bias, mlp_bias=c.mlp_bias,
        max_position_embeddings=c.max_position_embeddings,
        rope_parameters={"rope_type": "default", **(c.rope_scaling.to_hf() if c.rope_scaling else {}),
                         "rope_theta": c.rope_theta},
    )


FAMILY = Family(name="Llama", model_type="llama", hf_class="LlamaForCausalLM", model_class=Llama,
                config_class=LlamaConfig, config_from_hf=llama_config_from_hf, config_to_hf=llama_config_to_hf,
                weights=llama_weights, converter="llama_from_hf")


class LlamaLM(BundledLM):
    """Trains a :class:`Llama` (see :class:`~lightning_fpdt.models.causal_lm.CausalLM` for batches and options).

    From a Hugging Face checkpoint directory (``hf_checkpoint``: a ``LlamaForCausalLM`` saved with safetensors),
    the config is read from its ``config.json`` (:func:`llama_config_from_hf`,
    then ``config_overrides``), the model is built on the meta device and the weights are read where they are
    needed (:attr:`weights_pending`): whole in :meth:`configure_model` (on the strategy's device, in a ``*-true``
    precision's dtype), or, under ``FPDTStrategy(shard_parameters=True)``, each rank only the rows of its FSDP2
    shards (:meth:`load_sharded_weights`), so that no rank ever holds the whole model. The parameters are in
    torch's default dtype as ``LlamaLM(config)`` builds them (float32 master weights under ``*-mixed``); their
    values are :func:`~lightning_fpdt.models.convert.llama_from_hf`'s. Used without a Trainer, the first forward
    (or :meth:`load_weights`) reads them.

    Args:
        config: the model (a :class:`LlamaConfig` or its fields as a dict); defaults to :meth:`LlamaConfig.tiny`,
            or, with ``hf_checkpoint``, the checkpoint's own config (given with ``hf_checkpoint``: the config
            the checkpoint's weights are read into, as a checkpoint's saved hyper-parameters give it).
        hf_checkpoint: a local Hugging Face checkpoint directory (``config.json`` and ``model.safetensors`` or
            an index of safetensors files) to read the config and the weights from; needs ``transformers``.
        config_overrides: :class:`LlamaConfig` fields to set on the config, e.g. ``{"mlp_tiles": 4}`` or a
            ``rope_scaling`` for context extension; fields that change a weight's shape are refused.
        **kwargs: the options of :class:`CausalLM` (``loss_tiles``, optimizer and schedule).

    Raises:
        FileNotFoundError: ``hf_checkpoint`` is not a directory, or holds no safetensors files.
        TypeError: ``hf_checkpoint`` holds another model type than ``llama``.
        ValueError: ``config_overrides`` naming no field of :class:`LlamaConfig`; a checkpoint that lacks a
            tensor of the model or holds it in another shape (named).
    """

    family = FAMILY

    def __init__(self, config: LlamaConfig | dict[str, Any] | None = None, hf_checkpoint: str | None = None,
                 config_overrides: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(config, hf_checkpoint, config_overrides, **kwargs)
