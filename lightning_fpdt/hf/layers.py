"""The long-context memory stack applied to a transformers decoder from outside: tiled MLPs and
checkpointed decoder layers.

Both replace ``forward`` on the module instance with a callable object, so the classes, the parameter
names and ``save_pretrained`` stay transformers' own, and a deep copy of the model carries its own
forwards (the object is copied with the module it belongs to):

- each decoder layer's ``mlp`` runs in sequence tiles, each recomputed in backward
  (:class:`lightning_fpdt.offload.tiling.TiledForward`): no ``[tokens, intermediate]`` tensor is kept for backward,
  whatever the MLP (SwiGLU, GeLU, fused gate-up);
- each decoder layer, when the bound context asks for activation checkpointing, keeps only its input
  hidden states for backward (in the context's checkpoint store: host memory with
  ``offload_checkpoints``) and is recomputed there
  (:func:`lightning_fpdt.layers.activation_checkpoint.recomputed_layer_call`). The context arrives as the
  ``fpdt_context`` forward keyword, which the base model passes to every decoder layer, as it does to every attention
  layer; nothing is stored on the modules.

A decoder layer is a transformers ``GradientCheckpointingLayer`` (the base class of every decoder layer
in transformers 5) that holds an attention layer. Recomputation must see the same computation twice,
so dropout inside the recomputed modules is refused (:func:`check_recomputable`). A mixture-of-experts
``mlp`` (:mod:`lightning_fpdt.hf.experts`) is tiled like a dense one (its routing is per token) and
returns its router's probabilities beside its output; a checkpointed layer carries them out of its
recomputed call as extra columns of its hidden states.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer

from lightning_fpdt.errors import Unsupported
from lightning_fpdt.hf.attention import attention_layers, delivering
from lightning_fpdt.hf.experts import install_experts, routers_of
from lightning_fpdt.hf.feed_forward import feed_forward
from lightning_fpdt.hf.router_loss import RouterLoss, split_captured
from lightning_fpdt.hf.streamed import chunked_layer, stream_refusal, token_mixers
from lightning_fpdt.layers.activation_checkpoint import recomputed_layer_call
from lightning_fpdt.layers.carried import carried_layer_call
from lightning_fpdt.layers.layer_stream import stream_chunk_size
from lightning_fpdt.layers.streaming import streamed_layer_call
from lightning_fpdt.offload.recompute import needs_backward
from lightning_fpdt.offload.tiling import TiledForward
from lightning_fpdt.parallel.binding import SequenceParallelContext


def decoder_modules(model: PreTrainedModel) -> list[tuple[str, nn.Module]]:
    """``(name, layer)`` of every decoder layer of ``model``, in module order: each ``GradientCheckpointingLayer``
    of a layer stack (a ``ModuleList``) that holds one with an attention layer. A hybrid's layers without
    attention (gated delta-net, Mamba-2 or short-convolution layers) are decoder layers of the same stack."""
    attention = {id(m) for _, m in attention_layers(model)}

    def holds_attention(m: nn.Module) -> bool:
        return isinstance(m, GradientCheckpointingLayer) and any(id(c) in attention for c in m.modules())

    stacks = [name for name, m in model.named_modules()
              if isinstance(m, nn.ModuleList) and any(holds_attention(c) for c in m.children())]
    return [(f"{stack}.{i}", layer) for stack in stacks
            for i, layer in enumerate(model.get_submodule(stack).children())
            if isinstance(layer, GradientCheckpointingLayer)]


def check_decoder_modules(model: PreTrainedModel) -> list[tuple[str, nn.Module]]:
    """``model``'s decoder layers (:func:`decoder_modules`), refusing a model with attention layers outside them.

    Raises:
        NotImplementedError: attention layers outside recognisable decoder layers (the memory stack would
            silently not apply to them, and the construction probes could not run them).
    """
    layers = decoder_modules(model)
    attention = attention_layers(model)
    holders = {layer for name, _ in attention for layer, _ in layers if name.startswith(f"{layer}.")}
    if len(holders) != len(attention):
        raise Unsupported(
            f"HFCausalLM: {type(model).__name__} has {len(attention)} attention layers but {len(holders)} decoder"
            " layers that hold them (transformers GradientCheckpointingLayer modules); activation checkpointing,"
            " MLP tiling and per-layer sharding are applied to decoder layers, so this model cannot get them."
        )
    return layers


def check_recomputable(model: PreTrainedModel, mlp_tiled: bool, checkpointing: bool) -> None:
    """Refuse dropout inside what is recomputed in backward: the MLPs when tiled, whole decoder layers when
    checkpointed. A recomputation would draw another dropout mask than the forward did, and the gradients
    would silently belong to neither.

    Raises:
        NotImplementedError: an ``nn.Dropout`` with ``p > 0`` in a recomputed module, naming it.
    """
    for name, layer in decoder_modules(model):
        if checkpointing:
            scope, prefix, why = layer, "", "activation_checkpointing recomputes each decoder layer"
        elif mlp_tiled and feed_forward(layer) is not None:
            ffn = feed_forward(layer)
            prefix = next(n for n, child in layer.named_children() if child is ffn)
            scope, why = ffn, "the tiled MLP recomputes each tile"
        else:
            continue
        for sub, m in scope.named_modules(prefix=prefix):
            if isinstance(m, nn.Dropout) and m.p > 0:
                raise Unsupported(
                    f"HFCausalLM: model.{name}.{sub} is a dropout with p={m.p}; {why} in backward, which would"
                    " draw another dropout mask than the forward did. Set the config's dropout to 0 (e.g."
                    " hidden_dropout=0.0), or train with mlp_tiles=1 and activation_checkpointing=False."
                )


class CheckpointedForward:
    """A decoder layer instance's ``forward``: its class's forward, checkpointed when the ``fpdt_context``
    keyword asks for it and a backward will follow."""

    def __init__(self, layer: nn.Module, name: str, router_loss: RouterLoss | None = None) -> None:
        self.layer, self.name, self.router_loss = layer, name, router_loss

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # its attention gets the FPDT keywords even where the layer does not pass them on (StableLM), in this
        # forward and in the recomputation, which calls run with the same keywords (hf_attention.delivering)
        run = delivering(self.layer, partial(type(self.layer).forward, self.layer))
        context: SequenceParallelContext | None = kwargs.get("fpdt_context")
        if context is None:
            return run(*args, **kwargs)
        hidden = args[0] if args else kwargs.pop("hidden_states")
        args = args[1:]
        backward = needs_backward(hidden, self.layer)
        if backward and not context.activation_checkpointing:
            return run(hidden, *args, **kwargs)
        # a tensor argument with a gradient (Gemma-4's per-layer input) is an input of the recomputed call too
        with_grad = [key for key, value in [*enumerate(args), *kwargs.items()]
                     if isinstance(value, Tensor) and value.requires_grad]
        if backward:
            for key, value in [*enumerate(args), *kwargs.items()]:
                self._refuse_hidden_state(key, value)
        chunk = stream_chunk_size(context, hidden.shape[1])
        if chunk is not None and stream_refusal(self.layer, hidden, args, kwargs) is None:
            carried = bool(token_mixers(self.layer))  # its mixers' state carried from chunk to chunk
            # under a ring the chunks of the layout are not in sequence order: such layers run whole
            if not carried or (context.ring_size == 1 and not with_grad):
                return self._streamed(run, hidden, args, kwargs, with_grad, chunk, context, backward, carried)
        if not backward:
            return run(hidden, *args, **kwargs)
        kwargs = {key: RecomputedWrites(value, self.name) if isinstance(value, MutableMapping) else value
                  for key, value in kwargs.items()}
        loss, widths = self.router_loss, []

        def layer_forward(x: Tensor, *extras: Tensor) -> Tensor:
            call_args, call_kwargs = list(args), dict(kwargs)
            for key, extra in zip(with_grad, extras):
                if isinstance(key, int):
                    call_args[key] = extra
                else:
                    call_kwargs[key] = extra
            if loss is None:
                out = run(x, *call_args, **call_kwargs)
            else:  # the router probabilities leave the recomputed call beside the hidden states (hf_moe)
                with loss.capture() as captured:
                    out = run(x, *call_args, **call_kwargs)
            if not isinstance(out, Tensor):
                raise Unsupported(
                    f"HFCausalLM: decoder layer model.{self.name} ({type(self.layer).__name__}) returns"
                    f" {type(out).__name__}, not one hidden-states tensor; activation checkpointing supports"
                    " layers that return their hidden states only. Use activation_checkpointing=False."
                )
            if loss is None or not captured:
                return out
            widths[:] = [p.shape[-1] for p in captured]
            return torch.cat([out, *(p.to(out.dtype) for p in captured)], dim=-1)

        extras = [args[key] if isinstance(key, int) else kwargs[key] for key in with_grad]
        y = recomputed_layer_call(self.layer, layer_forward, hidden, context.layer_input_store, *extras,
                                  keep_answers=context.keep_attention)
        return y if loss is None or not widths else split_captured(y, hidden.shape[-1], widths, loss)

    def _streamed(self, run: Any, hidden: Tensor, args: tuple, kwargs: dict[str, Any], with_grad: list[int | str],
                  chunk: int, context: SequenceParallelContext, backward: bool, carried: bool) -> Tensor:
        """The layer streamed chunk by chunk (:mod:`lightning_fpdt.hf.streamed`): the tensor arguments with a gradient
        as its extra inputs, the router probabilities' token sums into the auxiliary loss; ``carried``: its token
        mixers' state carried from chunk to chunk (:mod:`lightning_fpdt.layers.carried`)."""
        loss = self.router_loss
        extras = [args[key] if isinstance(key, int) else kwargs[key] for key in with_grad]
        run_chunk = chunked_layer(self.layer, run, hidden, args, kwargs, with_grad, loss, self.name)
        store = context.layer_input_store if backward else None
        if carried:
            out = carried_layer_call(run_chunk, self.layer, hidden, chunk, store, sums=loss is not None)
        else:
            out = streamed_layer_call(run_chunk, self.layer, hidden, chunk, store, keep_answers=context.keep_attention,
                                      extras=extras, sums=loss is not None)
        if loss is None:
            return out
        y, sums = out
        loss.add_sums(sums)
        return y

    def _refuse_hidden_state(self, key: int | str, value: Any) -> None:
        """Refuse tensors with a gradient inside a container: only plain tensor arguments become inputs of the
        recomputed call."""
        if isinstance(value, (tuple, list)) and any(isinstance(t, Tensor) and t.requires_grad for t in value):
            raise Unsupported(
                f"HFCausalLM: decoder layer model.{self.name} receives argument {key!r} holding tensors with a"
                " gradient; activation checkpointing recomputes the layer from its hidden states and its tensor"
                " arguments only, so that gradient would be lost. Train this model with"
                " activation_checkpointing=False."
            )



_WRITES = "_fpdt_recomputed_writes"


class RecomputedWrites(MutableMapping):
    """A mapping argument of a checkpointed decoder layer (Gemma-4's ``shared_kv_states``): the layer's own mapping,
    remembering what a recomputed layer wrote into it. A recomputed layer runs its first forward without
    recording a graph, so a tensor it leaves there carries no gradient back to it: a later layer reading one (a
    Gemma-4 layer that attends with an earlier layer's keys and values, ``num_kv_shared_layers``) is refused, in
    the first forward, on every rank. Writes nobody reads (Gemma-4 stores them without sharing) are harmless."""

    def __init__(self, mapping: MutableMapping, layer_name: str) -> None:
        self.mapping, self.layer_name = mapping, layer_name
        self.writes: dict[Any, str] = getattr(mapping, _WRITES, None) or {}  # key -> the layer that wrote it
        try:  # on the mapping itself: every layer of this forward sees it, and it goes with the mapping
            setattr(mapping, _WRITES, self.writes)
        except AttributeError as error:  # a plain dict takes no attribute: its writes could not be followed
            raise Unsupported(
                f"HFCausalLM: decoder layer model.{layer_name} receives a {type(mapping).__name__} it may fill for"
                " later layers; under activation checkpointing what a recomputed layer leaves there carries no"
                " gradient, and this mapping cannot be followed. Train with activation_checkpointing=False."
            ) from error

    def __getitem__(self, key: Any) -> Any:
        writer = self.writes.get(key)
        if writer is not None and writer != self.layer_name:
            raise Unsupported(
                f"HFCausalLM: decoder layer model.{self.layer_name} reads {key!r}, which decoder layer model.{writer}"
                " left for it (as Gemma-4 shares keys and values across layers, num_kv_shared_layers);"
                " activation checkpointing recomputes layers, and what a layer's first run leaves carries no"
                " gradient back to it. Train with activation_checkpointing=False, or without the sharing."
            )
        return self.mapping[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        self.writes[key] = self.layer_name
        self.mapping[key] = value

    def __delitem__(self, key: Any) -> None:
        del self.mapping[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.mapping)

    def __len__(self) -> int:
        return len(self.mapping)


def install_memory_stack(model: PreTrainedModel, mlp_tiles: int | None, router_loss: RouterLoss | None = None) -> None:
    """Give every decoder layer of ``model`` its :class:`CheckpointedForward` and its MLP a
    :class:`~lightning_fpdt.offload.tiling.TiledForward` of ``mlp_tiles`` (``None``: automatic; ``1``: off), or, for a
    mixture-of-experts MLP, an :class:`~lightning_fpdt.hf.experts.ExpertsForward` feeding ``router_loss``.

    A decoder layer without a feed-forward (:func:`feed_forward`: a hybrid's mixer-only layer) has nothing to
    tile.

    Raises:
        NotImplementedError: attention layers outside recognisable decoder layers (the stack would silently
            not apply to them).
    """
    layers = check_decoder_modules(model)
    moe = {id(block) for block in install_experts(model, layers, mlp_tiles, router_loss)}
    routers = {id(router) for router in routers_of(model)}
    for name, layer in layers:
        layer.forward = CheckpointedForward(layer, name, router_loss)
        ffn = feed_forward(layer)
        # experts that are no block of their own (ZAYA's carry router state between layers) run as written
        if ffn is not None and id(ffn) not in moe and not any(id(m) in routers for m in ffn.modules()):
            ffn.forward = TiledForward(ffn, mlp_tiles)
