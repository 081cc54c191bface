"""The GPT-2 family: a GPT-2 style decoder (LayerNorm, GeLU MLP with bias, learned or rotary positions) on FPDT
blocks, its LightningModule :class:`GPTLM`, and what the project knows of ``transformers``' GPT-2: the weight-name
table (:func:`gpt2_weights`), the config mapping both ways and the :data:`FAMILY` record that conversion, reading a
pretrained directory and export look up.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from lightning_fpdt.errors import FPDTError, Unsupported
from lightning_fpdt.layers.block import FPDTAttention, FPDTBlock
from lightning_fpdt.layers.rope import RotaryEmbedding
from lightning_fpdt.models.bundled import BundledLM
from lightning_fpdt.models.family import Family, Weight
from lightning_fpdt.models.init import init_weights
from lightning_fpdt.offload.tiling import TiledMLP
from lightning_fpdt.parallel.layout import default_position_ids
from lightning_fpdt.parallel.packed_documents import PackedDocuments


@dataclass
class GPTConfig:
    """GPT-2 hyper-parameters with Hugging Face's field names (defaults: GPT-2 small).

    Attributes:
        vocab_size: tokens in the vocabulary.
        n_positions: learned position embeddings (the longest sequence with ``position_embedding="learned"``).
        n_embd: model width.
        n_layer: transformer blocks.
        n_head: attention heads.
        n_inner: MLP inner width; ``None`` means ``4 * n_embd``.
        layer_norm_epsilon: LayerNorm epsilon.
        tie_word_embeddings: share the token embedding with the output projection.
        position_embedding: ``"learned"`` (GPT-2) or ``"rotary"`` (no length limit: for long context).
        rope_theta: RoPE base when ``position_embedding="rotary"``.
        initializer_std: weight std; ``None`` means ``1 / sqrt(fan_in)`` (embeddings: 1; a tied embedding, which
            is the output layer too: ``1 / sqrt(n_embd)``).
        mlp_tiles: sequence tiles of the MLP (``None``: automatic; 1: off). The loss's tiles are the
            LightningModule's (``GPTLM(loss_tiles=...)``), not the model's.
    """

    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: int | None = None
    layer_norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = True
    position_embedding: Literal["learned", "rotary"] = "learned"
    rope_theta: float = 10000.0
    initializer_std: float | None = None
    mlp_tiles: int | None = None

    def __post_init__(self) -> None:
        if self.n_inner is None:
            self.n_inner = 4 * self.n_embd
        if self.n_embd % self.n_head != 0:
            raise FPDTError(f"GPTConfig: n_embd={self.n_embd} is not divisible by n_head={self.n_head}.")
        if self.position_embedding not in ("learned", "rotary"):
            raise FPDTError(
                f"GPTConfig.position_embedding must be 'learned' or 'rotary', got {self.position_embedding!r}."
            )

    @classmethod
    def tiny(cls, **overrides: Any) -> GPTConfig:
        base = dict(vocab_size=256, n_positions=2048, n_embd=64, n_layer=2, n_head=4)
        return cls(**{**base, **overrides})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class GeLUMLP(nn.Module):
    """``c_proj(gelu_tanh(c_fc(x)))`` with biases (GPT-2's MLP)."""

    def __init__(self, hidden_size: int, inner_size: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(hidden_size, inner_size)
        self.c_proj = nn.Linear(inner_size, hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(nn.functional.gelu(self.c_fc(x), approximate="tanh"))


class GPT(nn.Module):
    """GPT-2 style decoder (a :class:`~lightning_fpdt.models.causal_lm.DecoderModel`). ``forward(input_ids,
    position_ids) -> logits`` ``[batch, seq, vocab]``. Weights from and to ``transformers``:
    :mod:`lightning_fpdt.models.convert`."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = c = config
        head_dim = c.n_embd // c.n_head
        self.wte = nn.Embedding(c.vocab_size, c.n_embd)
        self.wpe = nn.Embedding(c.n_positions, c.n_embd) if c.position_embedding == "learned" else None
        self.layers = nn.ModuleList(
            FPDTBlock(
                attention=FPDTAttention(
                    c.n_embd, c.n_head, bias=True,
                    rope=RotaryEmbedding(head_dim, c.rope_theta) if c.position_embedding == "rotary" else None,
                ),
                mlp=TiledMLP(GeLUMLP(c.n_embd, c.n_inner or 4 * c.n_embd), c.mlp_tiles),
                attention_norm=nn.LayerNorm(c.n_embd, eps=c.layer_norm_epsilon),
                mlp_norm=nn.LayerNorm(c.n_embd, eps=c.layer_norm_epsilon),
            )
            for _ in range(c.n_layer)
        )
        self.ln_f = nn.LayerNorm(c.n_embd, eps=c.layer_norm_epsilon)
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        init_weights(self, c.initializer_std, tied=self.wte if c.tie_word_embeddings else None)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.wte.weight

    def compute_buffers(self) -> None:
        """Compute the buffers that are not weights (the rotary inverse frequencies, with
        ``position_embedding="rotary"``) in place, on their device: after ``to_empty`` of a model built on the
        meta device (``GPTLM(hf_checkpoint=...)``)."""
        c = self.config
        with torch.no_grad():
            for layer in self.layers:
                rope = layer.attention.rope
                if rope is not None:
                    with torch.device("cpu"):  # computed as at construction, then copied to the buffer's device
                        rope.inv_freq.copy_(RotaryEmbedding(c.n_embd // c.n_head, c.rope_theta).inv_freq)

    def hidden_states(
        self, input_ids: Tensor, position_ids: Tensor | None = None, documents: PackedDocuments | None = None,
        normed: bool = True,
    ) -> Tensor:
        """Final normed hidden states ``[batch, seq, n_embd]`` (``seq`` is this rank's shard under SP)."""
        if position_ids is None:
            position_ids = default_position_ids(*input_ids.shape, device=input_ids.device)
        x = self.wte(input_ids)
        if self.wpe is not None:
            # global positions (the strategy adds them before sharding), so learned positions shard too
            longest = int(position_ids.max()) + 1 if position_ids.numel() else 0
            if longest > self.config.n_positions:
                raise FPDTError(
                    f"GPT: position {longest - 1} is beyond n_positions={self.config.n_positions} learned"
                    " positions; shorten the sequence, raise n_positions, or use position_embedding='rotary'."
                )
            x = x + self.wpe(position_ids)
        for layer in self.layers:
            x = layer(x, position_ids, documents)
        return self.ln_f(x) if normed else x  # normed=False: the tiled loss applies final_norm

    def forward(
        self, input_ids: Tensor, position_ids: Tensor | None = None, documents: PackedDocuments | None = None
    ) -> Tensor:
        return self.lm_head(self.hidden_states(input_ids, position_ids, documents))

    @property
    def final_norm(self) -> nn.Module:
        """The norm ``hidden_states`` ends with (``normed=False`` leaves it to the tiled loss)."""
        return self.ln_f

    def flops_per_token(self, seq_len: int) -> float:
        c = self.config
        n_params = sum(p.numel() for n, p in self.named_parameters() if n.split(".")[0] not in ("wte", "wpe"))
        return 6 * n_params + 3 * 2 * c.n_layer * seq_len * c.n_embd


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


def gpt_config_from_hf(config: Any, **overrides: Any) -> GPTConfig:
    """The :class:`GPTConfig` of a ``transformers`` ``GPT2Config`` (what ``gpt_from_hf`` and
    ``GPTLM(hf_checkpoint=...)`` build).

    Args:
        config: a ``transformers`` ``GPT2Config``.
        **overrides: :class:`GPTConfig` fields to set instead of the mapped ones (``mlp_tiles``, ...).

    Raises:
        NotImplementedError: an activation other than tanh-GELU, or per-layer attention scaling.
    """
    c = config
    if getattr(c, "activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise Unsupported(f"gpt_from_hf: activation_function={c.activation_function!r} is not supported.")
    if getattr(c, "scale_attn_by_inverse_layer_idx", False) or getattr(c, "reorder_and_upcast_attn", False):
        raise Unsupported(
            "gpt_from_hf: scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are not supported."
        )
    mapped = dict(
        vocab_size=c.vocab_size, n_positions=c.n_positions, n_embd=c.n_embd, n_layer=c.n_layer, n_head=c.n_head,
        n_inner=c.n_inner, layer_norm_epsilon=c.layer_norm_epsilon,
        tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", True)),
    )
    return GPTConfig(**{**mapped, **overrides})


def gpt_config_to_hf(c: GPTConfig) -> dict[str, Any]:
    """The keyword arguments of the ``transformers`` ``GPT2Config`` of ``c``.

    Raises:
        NotImplementedError: rotary positions (GPT-2 has learned ones only).
    """
    if c.position_embedding != "learned":
        raise Unsupported(
            "to_hf: a GPT with rotary positions has no GPT-2 counterpart; use position_embedding='learned'."
        )
    # GPT-2's ids of <|endoftext|> only where its vocabulary holds them (GPT2Config's 50256 otherwise names no
    # token), and no dropout, as this GPT trains
    special = 50256 if c.vocab_size > 50256 else None
    return dict(vocab_size=c.vocab_size, n_positions=c.n_positions, n_embd=c.n_embd, n_layer=c.n_layer,
                n_head=c.n_head, n_inner=c.n_inner, layer_norm_epsilon=c.layer_norm_epsilon,
                tie_word_embeddings=c.tie_word_embeddings, bos_token_id=special, eos_token_id=special,
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


FAMILY = Family(name="GPT", model_type="gpt2", hf_class="GPT2LMHeadModel", model_class=GPT, config_class=GPTConfig,
                config_from_hf=gpt_config_from_hf, config_to_hf=gpt_config_to_hf, weights=gpt2_weights,
                converter="gpt_from_hf")


class GPTLM(BundledLM):
    """Trains a :class:`GPT` (same batches, options and precisions as ``LlamaLM``).

    From a Hugging Face checkpoint directory (``hf_checkpoint``: a ``GPT2LMHeadModel`` saved with safetensors),
    the config is read from its ``config.json`` (:func:`gpt_config_from_hf`, then
    ``config_overrides``), the model is built on the meta device and the weights are read where they are needed,
    whole or each rank only its FSDP2 shards, as ``LlamaLM(hf_checkpoint=...)`` reads them (GPT-2's transposed,
    fused ``c_attn``: a rank's rows of our q, k or v are a range of the stored tensor's columns, and only those
    are read).

    Args:
        config: the model (a :class:`GPTConfig` or its fields as a dict); defaults to :meth:`GPTConfig.tiny`, or,
            with ``hf_checkpoint``, the checkpoint's own config (given with it: the config its weights are read
            into).
        hf_checkpoint: a local Hugging Face checkpoint directory (``config.json`` and safetensors files) to read
            the config and the weights from; needs ``transformers``.
        config_overrides: :class:`GPTConfig` fields to set on the config, e.g. ``{"mlp_tiles": 4}``; fields that
            change a weight's shape are refused.
        **kwargs: the options of :class:`CausalLM` (``loss_tiles``, optimizer and schedule).

    Raises:
        FileNotFoundError: ``hf_checkpoint`` is not a directory, or holds no safetensors files.
        TypeError: ``hf_checkpoint`` holds another model type than ``gpt2``.
        ValueError: ``config_overrides`` naming no field of :class:`GPTConfig`; a checkpoint that lacks a tensor
            of the model or holds it in another shape (named).
    """

    family = FAMILY

    def __init__(self, config: GPTConfig | dict[str, Any] | None = None, hf_checkpoint: str | None = None,
                 config_overrides: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(config, hf_checkpoint, config_overrides, **kwargs)
