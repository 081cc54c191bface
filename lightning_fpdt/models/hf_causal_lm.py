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
from typing import Any

import torch
from torch import Tensor, nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from lightning_fpdt.binding import AttentionRecord, DecoderLayer, SequenceParallelContext
from lightning_fpdt.layout import IGNORE_INDEX
from lightning_fpdt.loss import cross_entropy_sum, tiled_cross_entropy_sum
from lightning_fpdt.models.hf_attention import LayerRecords, attention_layers, check_supported, delivered_to, install
from lightning_fpdt.models.hf_guards import check_context_arrived, find_head_transform
from lightning_fpdt.models.hf_layers import check_decoder_layers, check_recomputable, install_memory_stack
from lightning_fpdt.models.hf_layers import decoder_layers as hf_decoder_layers
from lightning_fpdt.models.hf_moe import check_experts, router_loss_for
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
        **kwargs: the optimizer and schedule options of :class:`CausalLM`.

    Raises:
        NotImplementedError: the model uses a feature the FPDT pipeline does not compute (sliding-window
            attention, attention-logit softcapping, attention sinks, bidirectional layers, attention dropout),
            has experts whose routing or auxiliary loss cannot be reproduced
            (:func:`~lightning_fpdt.models.hf_moe.check_experts`), or has dropout in a tiled MLP; the message
            names the feature and the layer. Also a head whose forward transforms the logits in a way the loss
            cannot reproduce
            (:func:`~lightning_fpdt.models.hf_guards.find_head_transform`), and, at the first forward under a
            bound context, an attention layer that ran without it
            (:func:`~lightning_fpdt.models.hf_guards.check_context_arrived`).
        TypeError: ``model`` of another type.
        ValueError: ``mlp_tiles`` below 1.
    """

    def __init__(
        self,
        model: PreTrainedModel | PretrainedConfig | str | dict[str, Any],
        loss_tiles: int | None = None,
        mlp_tiles: int | None = None,
        from_pretrained_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(loss_tiles=loss_tiles, **kwargs)
        if mlp_tiles is not None and (isinstance(mlp_tiles, bool) or not isinstance(mlp_tiles, int) or mlp_tiles < 1):
            raise ValueError(f"HFCausalLM: mlp_tiles must be a positive int or None (automatic), got {mlp_tiles!r}.")
        self.model = _build(model, from_pretrained_kwargs or {})
        layers = check_decoder_layers(self.model)  # first: the probes below run the layers
        check_supported(self.model)
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
        self.save_hyperparameters({"model": saved, "loss_tiles": loss_tiles, "mlp_tiles": mlp_tiles, **kwargs})

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
            NotImplementedError: ``context.activation_checkpointing`` with dropout in a decoder layer.
        """
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
        self.model.save_pretrained(path, **kwargs)


def _build(model: Any, from_pretrained_kwargs: dict[str, Any]) -> PreTrainedModel:
    if isinstance(model, PreTrainedModel):
        return model
    if isinstance(model, dict) and "class_path" in model:  # a YAML's config class, not resolved by a CLI
        module_name, _, class_name = model["class_path"].rpartition(".")
        model = getattr(importlib.import_module(module_name), class_name)(**(model.get("init_args") or {}))
    elif isinstance(model, dict):  # a config dict, e.g. from a checkpoint's hyper-parameters
        model = AutoConfig.for_model(**model)
    if isinstance(model, PretrainedConfig):
        # a copy: the model keeps the config object it is given, and setting our attention implementation
        # on a config shared with another model would switch that model too
        return AutoModelForCausalLM.from_config(copy.deepcopy(model))
    if isinstance(model, str):
        if torch.get_default_device().type == "meta":  # sizing only (the memory estimate): the config, no weights
            config = AutoConfig.from_pretrained(model, **_config_kwargs(from_pretrained_kwargs))
            return AutoModelForCausalLM.from_config(config)
        return AutoModelForCausalLM.from_pretrained(model, **from_pretrained_kwargs)
    raise TypeError(
        f"HFCausalLM: model must be a transformers PreTrainedModel, a PretrainedConfig, a config dict with"
        f" 'model_type', or a name/local path for from_pretrained; got {type(model).__name__}."
    )


def _config_kwargs(from_pretrained_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The ``from_pretrained`` arguments that also apply to reading the config alone."""
    keep = ("local_files_only", "revision", "trust_remote_code", "cache_dir", "token", "subfolder")
    return {k: v for k, v in from_pretrained_kwargs.items() if k in keep}
