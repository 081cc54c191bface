"""``HFCausalLM``: any Hugging Face causal LM, trained exactly under FPDT.

The transformers model stays a plain transformers model (its parameters keep their names under
``model.``). Three things change, for this model only:

- its attention runs through the FPDT pipeline (:mod:`lightning_fpdt.hf.attention`), bound to the
  sequence-parallel context by ``FPDTStrategy`` through :meth:`HFCausalLM.bind_sequence_parallel`;
- the loss is this project's: token-weighted across ranks on pre-shifted targets, from the base model's
  hidden states and the output embedding, never transformers' own loss (which shifts the labels of this
  rank's shard locally, crossing rank boundaries wrongly, and casts logits to float32);
- the memory stack (:mod:`lightning_fpdt.hf.layers`): the decoder MLPs run in sequence tiles, each
  decoder layer is checkpointed (its input optionally in host memory) when the strategy's
  ``activation_checkpointing`` says so, and ``shard_parameters`` shards each decoder layer (FSDP2) through
  :meth:`HFCausalLM.decoder_layers`. The loss runs in token tiles, so no full logits tensor exists
  (``loss_tiles=1`` turns the tiling off and keeps them).

``lora`` adds peft's LoRA adapters to the decoder layers' projections and freezes the rest
(:mod:`lightning_fpdt.hf.lora`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig, PreTrainedModel

from lightning_fpdt.errors import FPDTError, Unsupported, is_positive_int
from lightning_fpdt.hf.attention import (
    LayerRecords,
    attention_layers,
    check_supported,
    delivered_to,
    install,
    receives_keywords,
)
from lightning_fpdt.hf.build import build_model
from lightning_fpdt.hf.decoder_layers import describe_layers
from lightning_fpdt.hf.experts import check_experts, expert_blocks, routers_of
from lightning_fpdt.hf.flops import flops_per_token
from lightning_fpdt.hf.guards import check_context_arrived, check_static_rope
from lightning_fpdt.hf.head_transform import find_head_transform
from lightning_fpdt.hf.layers import check_decoder_modules, check_recomputable, install_memory_stack
from lightning_fpdt.hf.lora import AdaptedWeights, AdapterCalls, add_adapters, check_adapter_dropout, merged_state_dict
from lightning_fpdt.hf.masks import check_mask_windows
from lightning_fpdt.hf.mixer_install import install_recurrences, install_short_convs, unsupported_release
from lightning_fpdt.hf.mixing import hf_token_mixers
from lightning_fpdt.hf.recurrent import SequenceParallelRecurrence
from lightning_fpdt.hf.router_loss import router_loss_for
from lightning_fpdt.hf.streamed import final_norm, norm_skipped
from lightning_fpdt.hf.weights import PretrainedWeights
from lightning_fpdt.layers.loss import cross_entropy_sum, tiled_cross_entropy_sum
from lightning_fpdt.layers.token_mixing import TokenMixer
from lightning_fpdt.models.causal_lm import CausalLM
from lightning_fpdt.models.class_paths import publish
from lightning_fpdt.offload.tiling import tiled_call
from lightning_fpdt.parallel.binding import AttentionRecord, DecoderLayer, SequenceParallelContext
from lightning_fpdt.parallel.layout import IGNORE_INDEX


class HFCausalLM(CausalLM):
    """Trains a transformers causal LM (see :class:`~lightning_fpdt.models.causal_lm.CausalLM` for batches and options).

    Args:
        model: a ``PreTrainedModel`` (used as is; its attention implementation is switched to FPDT's), a
            name or local path (``AutoModelForCausalLM.from_pretrained``), a ``PretrainedConfig``
            (``AutoModelForCausalLM.from_config``, random weights), or a config dict with ``model_type``.
        loss_tiles: token tiles of the loss (``None``: tiles of 1024 tokens), so no full
            ``[tokens, vocab]`` logits tensor exists; ``1``: off (full logits, kept for backward).
        mlp_tiles: sequence tiles of every decoder layer's MLP, each recomputed in backward (``None``: tiles
            of ``max(hidden, 1024)`` tokens; ``1``: off, the MLP's intermediates kept for backward).
        from_pretrained_kwargs: extra arguments of ``from_pretrained`` (e.g. ``{"dtype": "bfloat16"}``);
            ``"allow_missing_weights": True`` (ours, not passed on): load a checkpoint that lacks tensors of the
            model, initialising them at random (refused otherwise, naming them).
        config_overrides: config attributes set before the weights load (a name, path, config or config dict
            only), e.g. ``{"rope_parameters": {"rope_type": "yarn", "factor": 4.0}, "max_position_embeddings":
            32768}`` for context extension (:func:`~lightning_fpdt.hf.build.apply_config_overrides`;
            docs/context-extension.md).
        lora: LoRA adapters (peft's ``LoraConfig`` options: ``r``, ``lora_alpha``, ``target_modules``,
            ``lora_dropout``, ...; :func:`~lightning_fpdt.hf.lora.lora_config`) on the decoder layers' ``nn.Linear``
            projections; every other parameter is frozen (a built ``model`` is adapted in place). ``None``: no
            adapters, every parameter trained.
        **kwargs: the optimizer and schedule options of :class:`CausalLM`.

    Raises:
        NotImplementedError: the model uses a feature the FPDT pipeline does not compute (bidirectional layers,
            attention dropout, a position bias, or a sliding window its mask has and its attention call does not
            pass: :func:`~lightning_fpdt.hf.attention.check_supported`; sliding windows, attention-logit
            softcapping and attention sinks are computed), has experts whose routing or auxiliary loss cannot be
            reproduced (:func:`~lightning_fpdt.hf.experts.check_experts`), or has dropout in a tiled MLP; the
            message names the feature and the layer. Also a head whose forward transforms the logits in a way the
            loss cannot reproduce (:func:`~lightning_fpdt.hf.head_transform.find_head_transform`); when bound to more
            than one rank, a RoPE schedule that changes with the sequence length
            (:func:`~lightning_fpdt.hf.guards.check_static_rope`); and, at the first forward under a bound
            context, an attention layer that ran without it (:func:`~lightning_fpdt.hf.guards.check_context_arrived`).
            LoRA targets that are no decoder layer's ``nn.Linear``, or dropout in a recomputed adapter
            (:func:`~lightning_fpdt.hf.lora.add_adapters`, :func:`~lightning_fpdt.hf.lora.check_adapter_dropout`).
        TypeError: ``model`` of another type.
        ValueError: ``mlp_tiles`` below 1; ``config_overrides`` with a built model, or naming an attribute the
            config does not have (:func:`~lightning_fpdt.hf.build.apply_config_overrides`).
    """

    def __init__(
        self,
        model: PreTrainedModel | PretrainedConfig | str | dict[str, Any],
        loss_tiles: int | None = None,
        mlp_tiles: int | None = None,
        from_pretrained_kwargs: dict[str, Any] | None = None,
        config_overrides: dict[str, Any] | None = None,
        lora: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(loss_tiles=loss_tiles, **kwargs)
        if mlp_tiles is not None and not is_positive_int(mlp_tiles):
            raise FPDTError(f"HFCausalLM: mlp_tiles must be a positive int or None (automatic), got {mlp_tiles!r}.")
        self.model, files = build_model(model, from_pretrained_kwargs, config_overrides)
        if files is not None:  # built on the meta device: read where needed (CausalLM.weights_pending)
            self._pending_weights = PretrainedWeights(self.model, files)
        layers = check_decoder_modules(self.model)  # first: the probes below run the layers
        # the mask probe runs the model (on the meta device where its forward allows, else once the weights are in)
        self._masks_probed = check_supported(self.model)
        check_experts(self.model, layers)
        self.head_transform = find_head_transform(self.model)  # what its forward does after the output embedding
        check_recomputable(self.model, mlp_tiled=mlp_tiles != 1, checkpointing=False)
        # short convolutions, gated delta-nets and Mamba-2 mixers run sequence-parallel where exact (once the weights
        # are in, for a meta-device model); what else mixes tokens outside attention is refused when bound to more
        # than one rank (token_mixers)
        self.short_convs = install_short_convs(self.model)
        self.recurrences, self.not_installed = install_recurrences(self.model)  # refused beyond one rank
        install(self.model)
        # the auxiliary loss of a mixture of experts where its forward adds one, or None
        self.router_loss = router_loss_for(self.model, routers_of(self.model),
                                           [router for _, router in expert_blocks(self.model, layers)])
        install_memory_stack(self.model, mlp_tiles, self.router_loss)
        # adapters last: the stack's forwards read their submodules at each call, so they run the adapted projections
        self.lora = add_adapters(self.model, lora)  # peft's resolved LoraConfig, or None
        check_adapter_dropout(self.model, checkpointing=False)
        if files is not None and self.lora is not None:  # the base under transformers' names, the adapters drawn
            self._pending_weights = AdaptedWeights(self.model, files)
        self.adapter_calls = AdapterCalls(self.model)  # every adapted layer must run at the first forward
        self.mlp_tiles = mlp_tiles
        self.context = SequenceParallelContext()
        self._defer_norm = True  # the loss applies the final norm (_hidden_before_norm)
        self._bound = False  # whether a strategy bound self.context (hf_guards.check_context_arrived)
        self.records = LayerRecords()  # each attention layer's latest call
        saved = model if isinstance(model, str) else self.model.config.to_dict()  # a module is not a hyper-parameter
        # a saved config already holds the overrides (applying them twice would re-default the original context)
        overrides = {"config_overrides": config_overrides} if isinstance(model, str) and config_overrides else {}
        overrides.update({"lora": lora} if lora is not None else {})
        self.save_hyperparameters({"model": saved, "loss_tiles": loss_tiles, "mlp_tiles": mlp_tiles, **overrides,
                                   **kwargs})

    # ---- weights: read where they are needed (CausalLM's plumbing, lightning_fpdt.hf.weights) --------

    def _weights_loaded(self) -> None:
        """Run what needs values on a model built on the meta device, now that its weights are in (the mask probe,
        where its forward could not be probed on the meta device; the check that installs the short convolutions),
        and refuse what mixes tokens when already bound to more than one rank; when sharded,
        through the root's FSDP hooks (every layer's weights gathered once, in turn, then every module sharded
        again).

        Raises:
            NotImplementedError: the mask probe's refusal (:func:`~lightning_fpdt.hf.attention.check_supported`);
                a module that mixes tokens outside attention, when already bound to more than one rank.
        """
        self._call_with_whole_weights("_probe_with_weights")
        if self._bound:
            self.refuse_token_mixers(self.context.size)

    def _probe_with_weights(self) -> None:
        if not self._masks_probed:
            self._masks_probed = check_mask_windows(self.model, attention_layers(self.model))
        self.short_convs += install_short_convs(self.model)
        installed, failed = install_recurrences(self.model)
        self.recurrences += installed
        self.not_installed.update(failed)

    def refuse_token_mixers(self, sequence_parallel_size: int) -> None:
        """:meth:`CausalLM.refuse_token_mixers <lightning_fpdt.models.CausalLM.refuse_token_mixers>`, first refusing
        the gated delta-net and Mamba-2 layers that could not be given their sequence-parallel forward
        (:func:`~lightning_fpdt.hf.mixer_install.install_recurrences`) with the reason, the installed transformers
        release and the tested range.

        Raises:
            NotImplementedError: naming the first such layer, or each module that mixes tokens outside attention.
        """
        if sequence_parallel_size > 1 and self.not_installed:
            raise Unsupported(unsupported_release(type(self).__name__, {
                f"model.{name}": why for name, why in self.not_installed.items()}, sequence_parallel_size))
        super().refuse_token_mixers(sequence_parallel_size)

    def _find_token_mixers(self) -> list[TokenMixer] | None:
        """What mixes tokens outside the attention layers (:func:`~lightning_fpdt.hf.mixing.hf_token_mixers`)."""
        return hf_token_mixers(self.model)

    def check_model(self, model: nn.Module) -> bool:
        """A transformers model, not a :class:`~lightning_fpdt.models.contract.DecoderModel`: its contract is
        checked by :func:`~lightning_fpdt.hf.build.build_model` and the checks in ``__init__``; the documents reach
        its attention through :meth:`hidden_states`."""
        return True

    # ---- the SequenceParallelAttention protocol (lightning_fpdt.parallel.binding) ---------------------------------

    def bind_sequence_parallel(self, context: SequenceParallelContext) -> None:
        """Use ``context`` (group, chunk size, backend, offload, checkpointing) in every decoder layer's next
        forward.

        Raises:
            NotImplementedError: ``context.activation_checkpointing`` with dropout in a decoder layer; on a group
                of more than one rank (one process sees every position, so these train exactly there) a
                ``dynamic`` or ``longrope`` RoPE schedule, or a module that mixes tokens outside attention
                (:func:`~lightning_fpdt.hf.mixing.hf_token_mixers`: a gated delta-net, Mamba-2 or short-convolution
                layer), named with its layer.
            ValueError: a gated delta-net or Mamba-2 layer whose head counts the group cannot split
                (:meth:`~lightning_fpdt.hf.recurrent.SequenceParallelRecurrence.check_heads`).
        """
        self.check_binding(context.size, context.activation_checkpointing)
        self.context, self._bound = context, True

    def check_binding(self, sequence_parallel_size: int, activation_checkpointing: bool) -> None:
        """The refusals of :meth:`bind_sequence_parallel` that the run's configuration alone decides: on every rank
        as it binds (every rank binds the same config, so every rank raises together), and in ``fpdt-train`` before
        any process starts."""
        if sequence_parallel_size > 1:
            check_static_rope(self.model.config)
            self.refuse_token_mixers(sequence_parallel_size)
            for m in self.model.modules():  # head counts the group cannot split (hf/recurrent.py)
                if isinstance(forward := m.__dict__.get("forward"), SequenceParallelRecurrence):
                    forward.check_heads(sequence_parallel_size)
        if activation_checkpointing:
            check_adapter_dropout(self.model, checkpointing=True)  # first: its message names the adapter
            check_recomputable(self.model, mlp_tiled=self.mlp_tiles != 1, checkpointing=True)

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
        """The transformers decoder layers, as the strategy shards them and the memory model reads them
        (:func:`~lightning_fpdt.hf.decoder_layers.describe_layers`)."""
        return describe_layers(self.model, self._head_counts(), mlp_tiled=self.mlp_tiles != 1)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token at global length ``seq_len`` (:func:`~lightning_fpdt.hf.flops.flops_per_token`)."""
        return flops_per_token(self.model, seq_len)

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
                (:func:`~lightning_fpdt.hf.guards.check_context_arrived`).
        """
        batch = self.prepared(batch)
        self.load_weights(batch["input_ids"].device)  # used without a Trainer: the weights at the first forward
        self._start_router_pass(batch)
        # read by fpdt_attention_forward and the recurrences: passed down as keywords by most families, delivered on
        # the attention layers and recurrences for those whose layers do not pass them on; every attention layer must
        # have run with them (hf_guards)
        keywords = {"fpdt_context": self.context, "documents": batch["documents"], "fpdt_records": self.records}
        self.records.clear()
        receivers = [m for m in self.model.modules() if receives_keywords(m)]
        with delivered_to(receivers, keywords), self.adapter_calls.watch():
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
        ``router_aux_loss_coef * aux`` over the whole batch (:meth:`~lightning_fpdt.hf.router_loss.RouterLoss.add_to`;
        a collective over the world), so the token-weighted loss is transformers' loss with the auxiliary loss."""
        loss_sum, num_tokens = self._token_loss_terms(batch, hidden)
        if self.router_loss is not None:
            loss_sum = self.router_loss.add_to(loss_sum, num_tokens)
        return loss_sum, num_tokens

    def complete_batch(self, batch: Any) -> Any:
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
        targets = self.targets(batch)
        if self.loss_tiles == 1:  # no tiling: full logits, kept for backward by autograd
            return cross_entropy_sum(self.logits(self.hidden_states(batch) if hidden is None else hidden), targets)
        norm = None
        if hidden is None:  # the final norm is applied by the loss's tiles
            hidden, norm = self._hidden_before_norm(batch)
        head = self.model.get_output_embeddings()
        if isinstance(head, nn.Linear) and head.bias is None and self.head_transform.is_identity:
            return tiled_cross_entropy_sum(hidden, head.weight, targets, self.loss_tiles, norm=norm)
        # a head with a bias or a logit transform: token tiles over batch x seq, each recomputed in backward, so only
        # one tile's logits exist at a time
        b, s, h = hidden.shape  # s = this rank's tokens
        total = tiled_call(lambda x, t: self._tile_loss_sum(x, t, norm), hidden.reshape(1, b * s, h),
                           targets.reshape(1, b * s), num_tiles=self.loss_tiles,
                           params=nn.ModuleList([head] if norm is None else [head, norm]), name="loss_tile")
        return total, (targets != IGNORE_INDEX).sum()

    def _hidden_before_norm(self, batch: dict[str, Any]) -> tuple[Tensor, nn.Module | None]:
        """The hidden states before the base model's final norm and that norm, or, for a family where something
        follows the norm (the model's output is not the norm's input), the normed states and ``None``."""
        norm = final_norm(self.model) if self._defer_norm and self.context.streaming else None
        if norm is None:
            return self.hidden_states(batch), None
        with norm_skipped(norm) as seen:
            hidden = self.hidden_states(batch)
        if len(seen) == 1 and hidden is seen[0]:
            return hidden, norm
        self._defer_norm = False  # not this family: run it again as written, and never try again
        return self.hidden_states(batch), None

    def _tile_loss_sum(self, hidden: Tensor, targets: Tensor, norm: nn.Module | None = None) -> Tensor:
        """Summed cross-entropy of one tile: ``hidden`` ``[1, tile, hidden]`` (before ``norm``, when given), ``targets``
        ``[1, tile]``."""
        return cross_entropy_sum(self.logits(hidden if norm is None else norm(hidden)), targets)[0]

    def answer_predictions(self, batch: dict[str, Any], hidden: Tensor) -> tuple[Tensor, Tensor]:
        mask = batch["answer_mask"].bool()
        return self.logits(hidden[mask]).argmax(-1), self.targets(batch)[mask]

    def save_pretrained(self, path: str, **kwargs: Any) -> None:
        """Export the transformers model (weights and config) to ``path``; loads with plain transformers
        (``from_pretrained``), which picks its own attention implementation. With adapters: the merged model
        (:func:`~lightning_fpdt.hf.lora.merged_state_dict`; ``fpdt-export --adapter`` writes the adapter alone)."""
        self.load_weights()
        if self.lora is not None:
            kwargs.setdefault("state_dict", merged_state_dict(self.model))
        self.model.save_pretrained(path, **kwargs)


publish("lightning_fpdt.models", HFCausalLM)  # its public path: lightning_fpdt.models.HFCausalLM
