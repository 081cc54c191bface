"""A GPT-2 style decoder (LayerNorm, GeLU MLP with bias, learned or rotary positions) on FPDT blocks."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from lightning_fpdt.block import FPDTAttention, FPDTBlock
from lightning_fpdt.layout import PackedDocuments, default_position_ids
from lightning_fpdt.models.init import init_weights
from lightning_fpdt.models.lm import CausalLM, config_and_options, with_overrides
from lightning_fpdt.rope import RotaryEmbedding
from lightning_fpdt.tiling import TiledMLP


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
        initializer_std: weight std; ``None`` means ``1 / sqrt(fan_in)`` (embeddings: 1).
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
            raise ValueError(f"GPTConfig: n_embd={self.n_embd} is not divisible by n_head={self.n_head}.")
        if self.position_embedding not in ("learned", "rotary"):
            raise ValueError(
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
    """GPT-2 style decoder (a :class:`~lightning_fpdt.models.lm.DecoderModel`). ``forward(input_ids,
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
        init_weights(self, c.initializer_std)
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
        self, input_ids: Tensor, position_ids: Tensor | None = None, documents: PackedDocuments | None = None
    ) -> Tensor:
        """Final normed hidden states ``[batch, seq, n_embd]`` (``seq`` is this rank's shard under SP)."""
        if position_ids is None:
            position_ids = default_position_ids(*input_ids.shape, device=input_ids.device)
        x = self.wte(input_ids)
        if self.wpe is not None:
            # global positions (the strategy adds them before sharding), so learned positions shard too
            longest = int(position_ids.max()) + 1 if position_ids.numel() else 0
            if longest > self.config.n_positions:
                raise ValueError(
                    f"GPT: position {longest - 1} is beyond n_positions={self.config.n_positions} learned"
                    " positions; shorten the sequence, raise n_positions, or use position_embedding='rotary'."
                )
            x = x + self.wpe(position_ids)
        for layer in self.layers:
            x = layer(x, position_ids, documents)
        return self.ln_f(x)

    def forward(
        self, input_ids: Tensor, position_ids: Tensor | None = None, documents: PackedDocuments | None = None
    ) -> Tensor:
        return self.lm_head(self.hidden_states(input_ids, position_ids, documents))

    def flops_per_token(self, seq_len: int) -> float:
        c = self.config
        n_params = sum(p.numel() for n, p in self.named_parameters() if n.split(".")[0] not in ("wte", "wpe"))
        return 6 * n_params + 3 * 2 * c.n_layer * seq_len * c.n_embd


class GPTLM(CausalLM):
    """Trains a :class:`GPT` (same batches, options and precisions as ``LlamaLM``).

    From a Hugging Face checkpoint directory (``hf_checkpoint``: a ``GPT2LMHeadModel`` saved with safetensors),
    the config is read from its ``config.json`` (:func:`~lightning_fpdt.models.convert.gpt_config_from_hf`, then
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

    def __init__(self, config: GPTConfig | dict[str, Any] | None = None, hf_checkpoint: str | None = None,
                 config_overrides: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if isinstance(config, dict):  # from a checkpoint's hyper-parameters
            config, kwargs = config_and_options(config, kwargs)
            config = GPTConfig(**config)
        super().__init__(**kwargs)
        if hf_checkpoint is not None:
            # optional dependency (transformers, safetensors), and an import cycle: hf_checkpoint imports this module
            from lightning_fpdt.models.hf_checkpoint import from_hf_checkpoint

            self.model, self._pending_weights = from_hf_checkpoint(GPT, hf_checkpoint, config, config_overrides,
                                                                   owner="GPTLM")
        else:
            self.model = GPT(with_overrides(config or GPTConfig.tiny(), config_overrides, "GPTLM"))
        self.config = self.model.config
        source = {} if hf_checkpoint is None else {"hf_checkpoint": str(hf_checkpoint)}
        # the config holds the overrides: a reload builds the same model (and reads no config.json)
        self.save_hyperparameters({"config": self.config.to_dict(), **source, **kwargs})
