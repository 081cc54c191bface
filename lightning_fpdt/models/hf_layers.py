"""The long-context memory stack applied to a transformers decoder from outside: tiled MLPs and
checkpointed decoder layers.

Both replace ``forward`` on the module instance with a callable object, so the classes, the parameter
names and ``save_pretrained`` stay transformers' own, and a deep copy of the model carries its own
forwards (the object is copied with the module it belongs to):

- each decoder layer's ``mlp`` runs in sequence tiles, each recomputed in backward
  (:class:`lightning_fpdt.tiling.TiledForward`): no ``[tokens, intermediate]`` tensor is kept for backward,
  whatever the MLP (SwiGLU, GeLU, fused gate-up);
- each decoder layer, when the bound context asks for activation checkpointing, keeps only its input
  hidden states for backward (in the context's checkpoint store: host memory with
  ``offload_checkpoints``) and is recomputed there (:func:`lightning_fpdt.activation_checkpoint.checkpointed_call`).
  The context arrives as the ``fpdt_context`` forward keyword, which the base model passes to every
  decoder layer, as it does to every attention layer; nothing is stored on the modules.

A decoder layer is a transformers ``GradientCheckpointingLayer`` (the base class of every decoder layer
in transformers 5) that holds an attention layer. Recomputation must see the same computation twice,
so dropout inside the recomputed modules is refused (:func:`check_recomputable`), as are mixture-of-experts
layers (:func:`check_dense`), whose router loss the project's token-weighted loss does not include.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from torch import Tensor, nn
from transformers import PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer

from lightning_fpdt.activation_checkpoint import checkpointed_call
from lightning_fpdt.binding import SequenceParallelContext
from lightning_fpdt.models.hf_attention import attention_layers
from lightning_fpdt.recompute import needs_backward
from lightning_fpdt.tiling import TiledForward

_MOE_CONFIG_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_MOE_CLASS_WORDS = ("moe", "expert", "router")


def decoder_layers(model: PreTrainedModel) -> list[tuple[str, nn.Module]]:
    """``(name, layer)`` of every decoder layer of ``model`` (a ``GradientCheckpointingLayer`` holding an
    attention layer), in module order."""
    attention = {id(m) for _, m in attention_layers(model)}
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, GradientCheckpointingLayer) and any(id(c) in attention for c in m.modules())]


def check_dense(model: PreTrainedModel) -> None:
    """Refuse mixture-of-experts models, naming the layer.

    Raises:
        NotImplementedError: a decoder layer with experts or a router (Mixtral, Qwen3-MoE, GPT-OSS, ...).
    """
    why = ("Mixture-of-experts models are not supported: their router's auxiliary (load-balancing) loss is"
           " computed by transformers from every token's router logits in one process, and the token-weighted loss"
           " under sequence parallelism does not include it, so training would silently drop it. Use a dense model.")
    for name, layer in decoder_layers(model):
        moe = [f"{sub}: {type(m).__name__}" for sub, m in layer.named_modules()
               if any(word in type(m).__name__.lower() for word in _MOE_CLASS_WORDS)]
        if moe:
            raise NotImplementedError(
                f"HFCausalLM: layer model.{name} ({type(layer).__name__}) is a mixture-of-experts layer ({moe[0]})."
                f" {why}"
            )
    config = model.config.get_text_config()
    experts = {name: getattr(config, name) for name in _MOE_CONFIG_FIELDS if getattr(config, name, None)}
    if experts:
        settings = ", ".join(f"{k}={v}" for k, v in experts.items())
        raise NotImplementedError(f"HFCausalLM: {type(model).__name__}'s config has experts ({settings}). {why}")


def check_recomputable(model: PreTrainedModel, mlp_tiled: bool, checkpointing: bool) -> None:
    """Refuse dropout inside what is recomputed in backward: the MLPs when tiled, whole decoder layers when
    checkpointed. A recomputation would draw another dropout mask than the forward did, and the gradients
    would silently belong to neither.

    Raises:
        NotImplementedError: an ``nn.Dropout`` with ``p > 0`` in a recomputed module, naming it.
    """
    for name, layer in decoder_layers(model):
        if checkpointing:
            scope, prefix, why = layer, "", "activation_checkpointing recomputes each decoder layer"
        elif mlp_tiled and isinstance(getattr(layer, "mlp", None), nn.Module):
            scope, prefix, why = layer.mlp, "mlp", "the tiled MLP recomputes each tile"
        else:
            continue
        for sub, m in scope.named_modules(prefix=prefix):
            if isinstance(m, nn.Dropout) and m.p > 0:
                raise NotImplementedError(
                    f"HFCausalLM: model.{name}.{sub} is a dropout with p={m.p}; {why} in backward, which would"
                    " draw another dropout mask than the forward did. Set the config's dropout to 0 (e.g."
                    " hidden_dropout=0.0), or train with mlp_tiles=1 and activation_checkpointing=False."
                )


class CheckpointedForward:
    """A decoder layer instance's ``forward``: its class's forward, checkpointed when the ``fpdt_context``
    keyword asks for it and a backward will follow."""

    def __init__(self, layer: nn.Module, name: str) -> None:
        self.layer, self.name = layer, name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        run = partial(type(self.layer).forward, self.layer)
        context: SequenceParallelContext | None = kwargs.get("fpdt_context")
        if context is None or not context.activation_checkpointing:
            return run(*args, **kwargs)
        hidden = args[0] if args else kwargs.pop("hidden_states")
        args = args[1:]
        if not needs_backward(hidden, self.layer):
            return run(hidden, *args, **kwargs)
        for key, value in [*enumerate(args), *kwargs.items()]:
            tensors = value if isinstance(value, (tuple, list)) else (value,)
            if any(isinstance(t, Tensor) and t.requires_grad for t in tensors):
                raise NotImplementedError(
                    f"HFCausalLM: decoder layer model.{self.name} receives argument {key!r} with a gradient;"
                    " activation checkpointing keeps only the layer's hidden states, so that gradient would be"
                    " lost. Train this model with activation_checkpointing=False."
                )

        def layer_forward(x: Tensor) -> Tensor:
            out = run(x, *args, **kwargs)
            if not isinstance(out, Tensor):
                raise NotImplementedError(
                    f"HFCausalLM: decoder layer model.{self.name} ({type(self.layer).__name__}) returns"
                    f" {type(out).__name__}, not one hidden-states tensor; activation checkpointing supports"
                    " layers that return their hidden states only. Use activation_checkpointing=False."
                )
            return out

        return checkpointed_call(self.layer, layer_forward, hidden, context.checkpoint_store)


def install_memory_stack(model: PreTrainedModel, mlp_tiles: int | None) -> None:
    """Give every decoder layer of ``model`` its :class:`CheckpointedForward` and its MLP a
    :class:`~lightning_fpdt.tiling.TiledForward` of ``mlp_tiles`` (``None``: automatic; ``1``: off).

    Raises:
        NotImplementedError: attention layers outside recognisable decoder layers (the stack would silently
            not apply to them).
        ValueError: a decoder layer without an ``mlp`` module to tile (when ``mlp_tiles != 1``).
    """
    layers = decoder_layers(model)
    attention = attention_layers(model)
    if len(layers) != len(attention):
        raise NotImplementedError(
            f"HFCausalLM: {type(model).__name__} has {len(attention)} attention layers but {len(layers)} decoder"
            " layers that hold them (transformers GradientCheckpointingLayer modules); activation checkpointing,"
            " MLP tiling and per-layer sharding are applied to decoder layers, so this model cannot get them."
        )
    for name, layer in layers:  # everything checked before anything is changed
        if mlp_tiles != 1 and not isinstance(getattr(layer, "mlp", None), nn.Module):
            raise ValueError(
                f"HFCausalLM: decoder layer model.{name} ({type(layer).__name__}) has no 'mlp' module to tile;"
                " use mlp_tiles=1."
            )
    for name, layer in layers:
        layer.forward = CheckpointedForward(layer, name)
        if isinstance(getattr(layer, "mlp", None), nn.Module):
            layer.mlp.forward = TiledForward(layer.mlp, mlp_tiles)
