"""``HFCausalLM``: any Hugging Face causal LM, trained exactly under FPDT.

The transformers model stays a plain transformers model (its parameters keep their names under
``model.``). Two things change, for this model only:

- its attention runs through the FPDT pipeline (:mod:`lightning_fpdt.models.hf_attention`), bound to the
  sequence-parallel context by ``FPDTStrategy`` through :meth:`HFCausalLM.bind_sequence_parallel`;
- the loss is this project's: token-weighted across ranks on pre-shifted targets, from the base model's
  hidden states and the output embedding, never transformers' own loss (which shifts the labels of this
  rank's shard locally, crossing rank boundaries wrongly, and casts logits to float32);
- the memory stack (:mod:`lightning_fpdt.models.hf_layers`): the decoder MLPs run in sequence tiles, each
  decoder layer is checkpointed (its input optionally in host memory) when the strategy's
  ``activation_checkpointing`` says so, and ``shard_parameters`` shards each decoder layer (FSDP2) through
  :meth:`HFCausalLM.decoder_layers`. The loss runs in token tiles, so no full logits tensor exists
  (``loss_tiles=1`` turns the tiling off and keeps them).
"""

from __future__ import annotations

import copy
import importlib
import os
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from lightning_fpdt.binding import AttentionRecord, DecoderLayer, SequenceParallelContext
from lightning_fpdt.layout import IGNORE_INDEX
from lightning_fpdt.loss import cross_entropy_sum, tiled_cross_entropy_sum
from lightning_fpdt.models.hf_attention import LayerRecords, attention_layers, check_supported, delivered_to, install
from lightning_fpdt.models.hf_guards import check_context_arrived, find_head_transform
from lightning_fpdt.models.hf_layers import check_decoder_layers, check_recomputable, install_memory_stack
from lightning_fpdt.models.hf_layers import decoder_layers as hf_decoder_layers
from lightning_fpdt.models.hf_masks import check_mask_windows
from lightning_fpdt.models.hf_moe import check_experts, router_loss_for
from lightning_fpdt.models.hf_weights import (
    PretrainedWeights,
    SafetensorsCheckpoint,
    build_on_meta,
    checkpoint_dtype,
    unmatched,
)
from lightning_fpdt.models.lm import CausalLM
from lightning_fpdt.tiling import tiled_call


class HFCausalLM(CausalLM):
    """Trains a transformers causal LM (see :class:`~lightning_fpdt.models.lm.CausalLM` for batches and options).

    Args:
        model: a ``PreTrainedModel`` (used as is; its attention implementation is switched to FPDT's), a
            name or local path (``AutoModelForCausalLM.from_pretrained``), a ``PretrainedConfig``
            (``AutoModelForCausalLM.from_config``, random weights), or a config dict with ``model_type``.
        loss_tiles: token tiles of the loss (``None``: tiles of 1024 tokens), so no full
            ``[tokens, vocab]`` logits tensor exists; ``1``: off (full logits, kept for backward).
        mlp_tiles: sequence tiles of every decoder layer's MLP, each recomputed in backward (``None``: tiles
            of ``max(hidden, 1024)`` tokens; ``1``: off, the MLP's intermediates kept for backward).
        from_pretrained_kwargs: extra arguments of ``from_pretrained`` (e.g. ``{"dtype": "bfloat16"}``).
        config_overrides: config attributes set before the weights load (a name, path, config or config dict
            only), e.g. ``{"rope_parameters": {"rope_type": "yarn", "factor": 4.0}, "max_position_embeddings":
            32768}`` for context extension (:func:`apply_config_overrides`; docs/hf-models.md, "Context extension").
        **kwargs: the optimizer and schedule options of :class:`CausalLM`.

    Raises:
        NotImplementedError: the model uses a feature the FPDT pipeline does not compute (sliding-window
            attention, attention-logit softcapping, attention sinks, bidirectional layers, attention dropout),
            has experts whose routing or auxiliary loss cannot be reproduced
            (:func:`~lightning_fpdt.models.hf_moe.check_experts`), or has dropout in a tiled MLP; the message
            names the feature and the layer. Also a head whose forward transforms the logits in a way the loss
            cannot reproduce
            (:func:`~lightning_fpdt.models.hf_guards.find_head_transform`); when bound to more than one rank, a
            RoPE schedule that changes with the sequence length (:func:`check_static_rope`); and, at the first
            forward under a
            bound context, an attention layer that ran without it
            (:func:`~lightning_fpdt.models.hf_guards.check_context_arrived`).
        TypeError: ``model`` of another type.
        ValueError: ``mlp_tiles`` below 1; ``config_overrides`` with a built model, or naming an attribute the
            config does not have (:func:`apply_config_overrides`).
    """

    def __init__(
        self,
        model: PreTrainedModel | PretrainedConfig | str | dict[str, Any],
        loss_tiles: int | None = None,
        mlp_tiles: int | None = None,
        from_pretrained_kwargs: dict[str, Any] | None = None,
        config_overrides: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(loss_tiles=loss_tiles, **kwargs)
        if mlp_tiles is not None and (isinstance(mlp_tiles, bool) or not isinstance(mlp_tiles, int) or mlp_tiles < 1):
            raise ValueError(f"HFCausalLM: mlp_tiles must be a positive int or None (automatic), got {mlp_tiles!r}.")
        self.model, checkpoint = _build(model, from_pretrained_kwargs or {}, config_overrides or {})
        if checkpoint is not None:  # built on the meta device: read where needed (CausalLM.weights_pending)
            self._pending_weights = PretrainedWeights(self.model, checkpoint)
        layers = check_decoder_layers(self.model)  # first: the probes below run the layers
        # the mask probe runs the model (on the meta device where its forward allows, else once the weights are in)
        self._masks_probed = check_supported(self.model)
        check_experts(self.model, layers)
        self.head_transform = find_head_transform(self.model)  # what its forward does after the output embedding
        check_recomputable(self.model, mlp_tiled=mlp_tiles != 1, checkpointing=False)
        install(self.model)
        self.router_loss = router_loss_for(self.model)  # the auxiliary loss of a mixture of experts, or None
        install_memory_stack(self.model, mlp_tiles, self.router_loss)
        self.mlp_tiles = mlp_tiles
        self.context = SequenceParallelContext()
        self._bound = False  # whether a strategy bound self.context (hf_guards.check_context_arrived)
        self.records = LayerRecords()  # each attention layer's latest call
        saved = model if isinstance(model, str) else self.model.config.to_dict()  # a module is not a hyper-parameter
        # a saved config already holds the overrides (applying them twice would re-default the original context)
        overrides = {"config_overrides": config_overrides} if isinstance(model, str) and config_overrides else {}
        self.save_hyperparameters({"model": saved, "loss_tiles": loss_tiles, "mlp_tiles": mlp_tiles, **overrides,
                                   **kwargs})

    # ---- weights: read where they are needed (CausalLM's plumbing, lightning_fpdt.models.hf_weights) --------

    def _weights_loaded(self) -> None:
        """Probe the masks of a model whose forward could not be probed on the meta device at construction, now
        that its weights are in; when sharded, through the root's FSDP hooks (every layer's weights gathered
        once, in turn, then every module sharded again).

        Raises:
            NotImplementedError: the mask probe's refusal (:func:`~lightning_fpdt.models.hf_attention.check_supported`).
        """
        if self._masks_probed:
            return
        sharded = isinstance(self, FSDPModule)
        if sharded:  # through the root's hooks: FSDP2 initialises from its first forward
            register_fsdp_forward_method(self, "_check_mask_windows")
        try:
            self._check_mask_windows()
        finally:
            if sharded:  # every module sharded again (FSDP2 keeps the last layer gathered after a forward)
                for module in self.modules():
                    if isinstance(module, FSDPModule):
                        module.reshard()

    def _check_mask_windows(self) -> None:
        self._masks_probed = check_mask_windows(self.model, attention_layers(self.model))

    def check_model(self, model: nn.Module) -> bool:
        """A transformers model, not a :class:`~lightning_fpdt.models.lm.DecoderModel`: its contract is checked
        by :func:`_build` and the checks in ``__init__``; the documents reach its attention through
        :meth:`hidden_states`."""
        return True

    # ---- the SequenceParallelAttention protocol (lightning_fpdt.binding) ---------------------------------

    def bind_sequence_parallel(self, context: SequenceParallelContext) -> None:
        """Use ``context`` (group, chunk size, backend, offload, checkpointing) in every decoder layer's next
        forward.

        Raises:
            NotImplementedError: ``context.activation_checkpointing`` with dropout in a decoder layer; a
                ``dynamic`` or ``longrope`` RoPE schedule on a group of more than one rank (one process sees
                every position, so those train exactly there).
        """
        if context.size > 1:  # every rank binds the same config: every rank raises together
            check_static_rope(self.model.config)
        if context.activation_checkpointing:
            check_recomputable(self.model, mlp_tiled=self.mlp_tiles != 1, checkpointing=True)
        self.context, self._bound = context, True

    def attention_heads(self) -> list[tuple[str, int, int]]:
        """``(layer name, n_heads, n_kv_heads)`` of every attention layer, from the model's config."""
        n_heads, n_kv_heads = self._head_counts()
        return [(f"model.{name}", n_heads, n_kv_heads) for name, _ in attention_layers(self.model)]

    def _head_counts(self) -> tuple[int, int]:
        """``(n_heads, n_kv_heads)`` of every attention layer, from the model's config."""
        config = self.model.config.get_text_config()
        return config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads

    def attention_records(self) -> list[AttentionRecord]:
        """What each attention layer did in its latest call (chunks, offload statistics), in layer order."""
        return self.records.in_layer_order()

    def decoder_layers(self) -> list[DecoderLayer]:
        """The transformers decoder layers, as the strategy shards them and the memory model reads them."""
        config = self.model.config.get_text_config()
        n_heads, n_kv_heads = self._head_counts()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
        layers = []
        for name, layer in hf_decoder_layers(self.model):
            norms = tuple(m for m in layer.children() if "norm" in type(m).__name__.lower())
            layers.append(DecoderLayer(
                name=f"model.{name}", module=layer, hidden_size=config.hidden_size, n_heads=n_heads,
                n_kv_heads=n_kv_heads, head_dim=head_dim, mlp=getattr(layer, "mlp", None),
                mlp_tiled=self.mlp_tiles != 1, norms=norms, chunked_projections=False,
            ))
        return layers

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token at global sequence length ``seq_len`` (forward and backward, counted as
        ``LlamaLM`` counts them): 6 x the parameters each token multiplies through (every parameter but the
        input embeddings, the output embedding once even when tied, a routed expert's weights times
        ``num_experts_per_tok / num_experts``), plus 12 x ``heads x head_dim`` x the keys a query attends to per
        layer: ``seq_len / 2`` under causality, ``w - w^2 / (2 seq_len)`` in a layer with a sliding window
        ``w < seq_len`` (``layer_types``/``sliding_window`` of the config)."""
        config = self.model.config.get_text_config()
        embeddings = {id(p) for m in self.model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
        scale = {}  # a routed expert's weights: only num_experts_per_tok of num_experts run per token
        for m in self.model.modules():
            if type(m).__name__.endswith("Experts") and isinstance(getattr(m, "num_experts", None), int):
                scale.update({id(p): config.num_experts_per_tok / m.num_experts for p in m.parameters()})
        active = sum(p.numel() * scale.get(id(p), 1) for p in self.model.parameters() if id(p) not in embeddings)
        head = self.model.get_output_embeddings().weight
        active += head.numel() if id(head) in embeddings else 0  # tied: the output embedding is still a matmul
        n_heads, _ = self._head_counts()
        width = n_heads * (getattr(config, "head_dim", None) or config.hidden_size // n_heads)
        window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
        layer_types = getattr(config, "layer_types", None) or ["sliding_attention"] * config.num_hidden_layers
        keys = 0.0
        for kind in layer_types[:config.num_hidden_layers]:
            w = window if kind == "sliding_attention" and window else seq_len
            keys += seq_len / 2 if w >= seq_len else w - w * w / (2 * seq_len)
        return 6 * active + 12 * width * keys

    # ---- forward and loss ----------------------------------------------------------------------------------

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None) -> Tensor:
        """Logits ``[batch, seq, vocab]`` of whole sequences in one process (with the family's logit transform)."""
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        return self.logits(self.hidden_states({"input_ids": input_ids, "position_ids": position_ids}))

    def hidden_states(self, batch: dict[str, Any]) -> Tensor:
        """Final hidden states ``[batch, s_local, hidden]`` of this rank's part of a dict batch.

        Raises:
            NotImplementedError: an attention layer ran without the bound context
                (:func:`~lightning_fpdt.models.hf_guards.check_context_arrived`).
        """
        batch = self.prepared(batch)
        self.load_weights(batch["input_ids"].device)  # used without a Trainer: the weights at the first forward
        self._start_router_pass(batch)
        # read by fpdt_attention_forward: passed down as keywords by most families, delivered on the attention
        # layers for those whose layers do not pass them on; every layer must have run with them (hf_guards)
        keywords = {"fpdt_context": self.context, "documents": batch["documents"], "fpdt_records": self.records}
        self.records.clear()
        with delivered_to([m for _, m in attention_layers(self.model)], keywords):
            out = self.model.base_model(
                input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False, **keywords,
            )
        check_context_arrived(self.model, self.context, self._bound, batch["documents"], self.records)
        return out.last_hidden_state

    def logits(self, hidden: Tensor) -> Tensor:
        """``hidden`` ``[..., hidden]`` through the output embedding and the family's own per-logit transform
        (:attr:`head_transform`: Granite's scaling, Gemma-2's final softcap, ...): ``[..., vocab]``."""
        return self.head_transform(self.model.get_output_embeddings()(hidden))

    def loss_terms(self, batch: dict[str, Any], hidden: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``(loss_sum, num_tokens)`` of this rank's part of the batch, on pre-shifted targets. For a mixture
        of experts whose config sets ``output_router_logits``, ``loss_sum`` also holds this rank's share of
        ``router_aux_loss_coef * aux`` over the whole batch (:meth:`~lightning_fpdt.models.hf_moe.RouterLoss.add_to`;
        a collective over the world), so the token-weighted loss is transformers' loss with the auxiliary loss."""
        loss_sum, num_tokens = self._token_loss_terms(batch, hidden)
        if self.router_loss is not None:
            loss_sum = self.router_loss.add_to(loss_sum, num_tokens)
        return loss_sum, num_tokens

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """A mixture of experts counts the tokens of ``attention_mask`` in its auxiliary loss: a batch without
        one gets ones before the strategy pads it (its padding then gets zeros, as no token of one process)."""
        if self.router_loss is not None and isinstance(batch, dict) and "attention_mask" not in batch:
            ids = batch.get("input_ids")
            if isinstance(ids, Tensor) and ids.dim() == 2:
                batch = {**batch, "attention_mask": torch.ones_like(ids)}
        return batch

    def _start_router_pass(self, batch: dict[str, Any]) -> None:
        """Open the router statistics of a forward pass over this rank's tokens (1: counted, 0: padding)."""
        if self.router_loss is not None:
            mask = batch.get("attention_mask")
            self.router_loss.start(None if mask is None else mask.ne(0))

    def _token_loss_terms(self, batch: dict[str, Any], hidden: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The token-weighted cross-entropy's ``(loss_sum, num_tokens)``."""
        batch = self.prepared(batch)  # once: hidden_states and targets then find it prepared
        hidden = self.hidden_states(batch) if hidden is None else hidden
        targets = self.targets(batch)
        if self.loss_tiles == 1:  # no tiling: full logits, kept for backward by autograd
            return cross_entropy_sum(self.logits(hidden), targets)
        head = self.model.get_output_embeddings()
        if isinstance(head, nn.Linear) and head.bias is None and self.head_transform.is_identity:
            return tiled_cross_entropy_sum(hidden, head.weight, targets, self.loss_tiles)
        # a head with a bias or a logit transform: token tiles over batch x seq, each recomputed in backward, so only
        # one tile's logits exist at a time
        b, s, h = hidden.shape  # s = this rank's tokens
        total = tiled_call(self._tile_loss_sum, hidden.reshape(1, b * s, h), targets.reshape(1, b * s),
                           num_tiles=self.loss_tiles, params=head, name="loss_tile")
        return total, (targets != IGNORE_INDEX).sum()

    def _tile_loss_sum(self, hidden: Tensor, targets: Tensor) -> Tensor:
        """Summed cross-entropy of one tile: ``hidden`` ``[1, tile, hidden]``, ``targets`` ``[1, tile]``."""
        return cross_entropy_sum(self.logits(hidden), targets)[0]

    def answer_predictions(self, batch: dict[str, Any], hidden: Tensor) -> tuple[Tensor, Tensor]:
        mask = batch["answer_mask"].bool()
        return self.logits(hidden[mask]).argmax(-1), self.targets(batch)[mask]

    def save_pretrained(self, path: str, **kwargs: Any) -> None:
        """Export the transformers model (weights and config) to ``path``; loads with plain transformers
        (``from_pretrained``), which picks its own attention implementation."""
        self.load_weights()
        self.model.save_pretrained(path, **kwargs)


def _build(model: Any, from_pretrained_kwargs: dict[str, Any],
           overrides: dict[str, Any]) -> tuple[PreTrainedModel, SafetensorsCheckpoint | None]:
    """The transformers model of ``HFCausalLM``'s ``model`` argument, and the checkpoint whose weights it still
    has to read (a local safetensors checkpoint: the model is built on the meta device) or ``None``."""
    if isinstance(model, str) and torch.get_default_device().type != "meta":
        deferred = _on_meta(model, from_pretrained_kwargs, overrides)
        if deferred is not None:
            return deferred
    return _build_now(model, from_pretrained_kwargs, overrides), None


def _on_meta(path: str, from_pretrained_kwargs: dict[str, Any],
             overrides: dict[str, Any]) -> tuple[PreTrainedModel, SafetensorsCheckpoint] | None:
    """``path``'s model on the meta device with its checkpoint, or ``None`` where ``from_pretrained`` has to load
    it: not a local directory of safetensors files, ``from_pretrained`` options other than the dtype, or tensor
    names the checkpoint does not hold as they are (transformers converts them on load; logged)."""
    if not os.path.isdir(path) or set(from_pretrained_kwargs) - _META_KWARGS:
        return None
    checkpoint = SafetensorsCheckpoint.find(path)
    if checkpoint is None:
        return None
    config = apply_config_overrides(AutoConfig.from_pretrained(path, local_files_only=True), overrides)
    dtype = from_pretrained_kwargs.get("dtype", from_pretrained_kwargs.get("torch_dtype"))
    model = build_on_meta(config, checkpoint_dtype(config, dtype))
    problems = unmatched(model, checkpoint)
    if problems:
        rank_zero_info(f"HFCausalLM: {path} holds tensors under other names or shapes than"
                       f" {type(model).__name__}'s ({len(problems)}, e.g. {problems[0]}); loading it whole through"
                       " from_pretrained, which converts them (every rank holds the whole model until it is sharded).")
        return None
    return model, checkpoint


# from_pretrained options a meta-device build honours (others, e.g. device_map or quantization, need from_pretrained)
_META_KWARGS = frozenset({"dtype", "torch_dtype", "local_files_only", "attn_implementation"})


def _build_now(model: Any, from_pretrained_kwargs: dict[str, Any], overrides: dict[str, Any]) -> PreTrainedModel:
    if isinstance(model, PreTrainedModel):
        if overrides:
            raise ValueError(
                f"HFCausalLM: config_overrides {sorted(overrides)} cannot apply to a built {type(model).__name__}"
                " (its RoPE buffers are computed); pass its config, a config dict or its path instead."
            )
        return model
    if isinstance(model, dict) and "class_path" in model:  # a YAML's config class, not resolved by a CLI
        module_name, _, class_name = model["class_path"].rpartition(".")
        model = getattr(importlib.import_module(module_name), class_name)(**(model.get("init_args") or {}))
    elif isinstance(model, dict):  # a config dict, e.g. from a checkpoint's hyper-parameters
        model = AutoConfig.for_model(**model)
    if isinstance(model, PretrainedConfig):
        # a copy: the model keeps the config object it is given, and setting our attention implementation
        # (or the overrides) on a config shared with another model would change that model too
        return AutoModelForCausalLM.from_config(apply_config_overrides(copy.deepcopy(model), overrides))
    if isinstance(model, str):
        if torch.get_default_device().type == "meta":  # sizing only (the memory estimate): the config, no weights
            config = AutoConfig.from_pretrained(model, **_config_kwargs(from_pretrained_kwargs))
            return AutoModelForCausalLM.from_config(apply_config_overrides(config, overrides))
        if overrides:  # into the config before the weights load: RoPE's buffers are computed from it at build
            config = AutoConfig.from_pretrained(model, **_config_kwargs(from_pretrained_kwargs))
            config = apply_config_overrides(config, overrides)
            return AutoModelForCausalLM.from_pretrained(model, config=config, **from_pretrained_kwargs)
        return AutoModelForCausalLM.from_pretrained(model, **from_pretrained_kwargs)
    raise TypeError(
        f"HFCausalLM: model must be a transformers PreTrainedModel, a PretrainedConfig, a config dict with"
        f" 'model_type', or a name/local path for from_pretrained; got {type(model).__name__}."
    )


ROPE_KEYS = ("rope_parameters", "rope_scaling")  # transformers 5's name and its deprecated alias


def apply_config_overrides(config: PretrainedConfig, overrides: dict[str, Any]) -> PretrainedConfig:
    """Set ``overrides`` on ``config`` (in place; returned) before a model is built from it.

    ``rope_parameters`` (or its alias ``rope_scaling``) replaces the RoPE schedule: ``rope_theta`` (and
    ``partial_rotary_factor``) are kept from the config unless given, and ``original_max_position_embeddings``
    of ``llama3`` / ``yarn`` / ``longrope`` defaults to the config's ``max_position_embeddings`` *before* the
    overrides (the pre-training context). For a config with one schedule per layer type (Gemma 3:
    ``full_attention``, ``sliding_attention``), give a dict per layer type to change; the others are kept.
    The new schedule is checked by transformers' own validation.

    Raises:
        ValueError: a key the config has no attribute for (named with the config class), or one flat RoPE
            schedule for a config with one per layer type.
        KeyError: a RoPE schedule without a field its type needs (transformers' validation).
    """
    unknown = [key for key in overrides if not hasattr(config, key)]
    if unknown:
        raise ValueError(
            f"HFCausalLM: config_overrides {unknown} are not attributes of {type(config).__name__}"
            f" (model_type {getattr(config, 'model_type', '?')!r}); check the names in its config.json."
        )
    original_max = getattr(config, "max_position_embeddings", None)
    rope = [key for key in overrides if key in ROPE_KEYS]
    for key, value in overrides.items():
        if key not in ROPE_KEYS:
            setattr(config, key, copy.deepcopy(value))
    if rope:
        config.rope_parameters = _new_rope_parameters(config, dict(overrides[rope[-1]]), original_max)
        config.validate_rope()
    return config


def check_static_rope(config: PretrainedConfig) -> None:
    """Refuse RoPE types whose frequencies follow the batch's largest position id (``dynamic``, ``longrope``):
    transformers reads it from the ``position_ids`` its rotary embedding is given, which under sequence
    parallelism are one rank's shard, so ranks would rotate with different frequencies.

    Raises:
        NotImplementedError: such a type, named with the layer type it is set for.
    """
    parameters = getattr(config.get_text_config(), "rope_parameters", None) or {}
    nested = config.get_text_config().nested_rope_parameter_keys(parameters)
    for layer_type, entry in ({t: parameters[t] for t in nested} if nested else {"all": parameters}).items():
        rope_type = (entry or {}).get("rope_type", "default")
        if rope_type in ("dynamic", "longrope"):
            raise NotImplementedError(
                f"HFCausalLM: RoPE type {rope_type!r} (layers: {layer_type}) picks its frequencies from the largest"
                " position id of each forward, which under sequence parallelism is one rank's shard; set a fixed"
                " schedule with config_overrides={'rope_parameters': {'rope_type': 'yarn', 'factor': ...}}"
                " (docs/hf-models.md, Context extension)."
            )


def _new_rope_parameters(config: PretrainedConfig, new: dict[str, Any], original_max: int | None) -> dict[str, Any]:
    old = copy.deepcopy(getattr(config, "rope_parameters", None) or {})
    if not config.nested_rope_parameter_keys(old):
        return _with_defaults(new, old, original_max)
    layer_types = list(old)  # a nested schedule: every key is a layer type, used in the model or not
    flat = [key for key in new if key not in layer_types]
    if flat:
        raise ValueError(
            f"HFCausalLM: {type(config).__name__} has one RoPE schedule per layer type {layer_types}; give"
            f" rope_parameters as {{layer_type: {{rope_type: ..., ...}}}}, not the keys {flat}."
        )
    return {**old, **{t: _with_defaults(dict(p), old[t] or {}, original_max) for t, p in new.items()}}


def _with_defaults(new: dict[str, Any], old: dict[str, Any], original_max: int | None) -> dict[str, Any]:
    for key in ("rope_theta", "partial_rotary_factor"):
        if key in old and key not in new:
            new[key] = old[key]
    new.setdefault("rope_type", new.pop("type", "default"))
    if new["rope_type"] in ("llama3", "yarn", "longrope") and original_max is not None:
        new.setdefault("original_max_position_embeddings", original_max)
    return new


def _config_kwargs(from_pretrained_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The ``from_pretrained`` arguments that also apply to reading the config alone."""
    keep = ("local_files_only", "revision", "trust_remote_code", "cache_dir", "token", "subfolder")
    return {k: v for k, v in from_pretrained_kwargs.items() if k in keep}
