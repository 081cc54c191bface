"""LoRA adapters (peft) on ``HFCausalLM``'s transformers model, trained under FPDT with the whole memory stack.

``HFCausalLM(model, lora={"r": 16, "lora_alpha": 32, "target_modules": ["q_proj", "v_proj"]})`` injects peft's LoRA
layers into the transformers model in place (:func:`add_adapters`: peft's ``inject_adapter_in_model``), so the model
stays the transformers model (its ``base_model``, config and decoder layers, which the strategy binds, tiles,
checkpoints and shards as before). Each targeted ``nn.Linear`` becomes peft's ``lora.Linear``, which computes
``base_layer(x) + lora_B(lora_A(dropout(x))) * scaling`` as a module call, and every other parameter is frozen
(``requires_grad=False``): only the adapters reach the optimizer, DDP's reducer and FSDP2's reduce-scatter. Names are
peft's: ``model.<layer>.base_layer.weight`` (the frozen base), ``model.<layer>.lora_A.default.weight`` and
``model.<layer>.lora_B.default.weight``; a training checkpoint holds them all, by name.

What the FPDT path asks of a target, checked here so that nothing is trained silently wrong:

- an ``nn.Linear`` inside a decoder layer (the attention's and the MLP's projections): the output embedding's weight
  is read directly by the tiled loss, a convolution's by the sequence-parallel mixers, a router's logits by the
  auxiliary loss (:func:`add_adapters` refuses them, named);
- no dropout where the layer is recomputed in backward (the tiled MLP, checkpointed decoder layers): random numbers
  are not replayed there (:mod:`lightning_fpdt.offload.recompute`), so the recomputation would draw another mask than
  the forward (:func:`check_adapter_dropout`);
- called: at the first forward every adapted layer must run as a module (:class:`AdapterCalls`); a family that reads
  a projection's weight directly would bypass its adapter.

A model built on the meta device (a local directory) reads its base weights under transformers' names and draws its
adapters as peft does (:class:`AdaptedWeights`). Exports (:mod:`lightning_fpdt.export.adapter`): the merged model
(``W + scaling * B @ A`` under transformers' names, :func:`export_sources`) or the adapter in peft's format
(:func:`adapter_keys`, :func:`adapter_config`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from lightning_fpdt.errors import FPDTError, Unsupported, WrongType
from lightning_fpdt.hf.experts import ExpertsForward
from lightning_fpdt.hf.layers import decoder_modules
from lightning_fpdt.hf.weights import PretrainedWeights, compute_buffers, named_tensor
from lightning_fpdt.memory.shape import adapter_part
from lightning_fpdt.models.weight_files import fill_shard, tensor_names
from lightning_fpdt.offload.tiling import TiledForward
from lightning_fpdt.optional import require
from lightning_fpdt.parallel.dtensors import local_tensor

ADAPTER = "default"  # peft's adapter name: one adapter per model
# the LoraConfig fields HFCausalLM takes; the others change what a layer computes or trains in ways not tested here
OPTIONS = ("r", "lora_alpha", "lora_dropout", "target_modules", "exclude_modules", "use_rslora", "init_lora_weights",
           "layers_to_transform", "layers_pattern", "rank_pattern", "alpha_pattern", "bias")
INITS = (True, False, "gaussian")  # initialisations that read no base weight (a meta-device model has none yet)


def lora_config(spec: dict[str, Any]) -> Any:
    """peft's ``LoraConfig`` of ``HFCausalLM``'s ``lora`` argument (task ``CAUSAL_LM``).

    Raises:
        TypeError: ``spec`` is not a dict.
        ValueError: a key that is no ``LoraConfig`` field, or values peft refuses.
        NotImplementedError: a ``LoraConfig`` option HFCausalLM does not support (DoRA, ``modules_to_save``, trained
            biases, initialisations from the base weights, ...), named.
    """
    LoraConfig = require("peft", "HFCausalLM(lora=...)").LoraConfig  # imported only when adapters are asked for

    if not isinstance(spec, dict):
        raise WrongType(f"HFCausalLM: lora must be a dict of LoraConfig options (r, lora_alpha, target_modules,"
                        f" lora_dropout, ...) or None, got {type(spec).__name__}.")
    fields = set(LoraConfig.__dataclass_fields__)
    unknown = sorted(set(spec) - fields)
    if unknown:
        raise FPDTError(f"HFCausalLM: lora option(s) {unknown} are not LoraConfig options; use {', '.join(OPTIONS)}.")
    unsupported = sorted(set(spec) - set(OPTIONS) - {"task_type"})
    if unsupported:
        raise Unsupported(
            f"HFCausalLM: lora option(s) {unsupported} are not supported (plain LoRA on nn.Linear projections is: DoRA,"
            f" modules_to_save, LoRA biases, target_parameters and the other variants are not tested under FPDT)."
            f" Supported: {', '.join(OPTIONS)}."
        )
    if spec.get("bias", "none") != "none":
        raise Unsupported(f"HFCausalLM: lora bias={spec['bias']!r} trains the base model's biases too; only"
                                  " bias='none' (the adapters alone) is supported.")
    init = spec.get("init_lora_weights", True)
    if not any(init is x or init == x for x in INITS) or isinstance(init, int) and not isinstance(init, bool):
        raise Unsupported(
            f"HFCausalLM: lora init_lora_weights={init!r} is not supported; use True (peft's default: A uniform, B"
            " zero), 'gaussian' or False (both random). Initialisations from the base weights (pissa, olora, loftq,"
            " eva, corda) are not: a model built on the meta device has no weights when its adapters are drawn."
        )
    try:
        return LoraConfig(**{"task_type": "CAUSAL_LM", **spec})
    except (ValueError, TypeError) as err:
        raise FPDTError(f"HFCausalLM: lora={spec!r}: {err}") from None


def adapter_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, peft LoRA layer)`` of every adapted layer of ``model`` (none when peft never injected into it)."""
    if not hasattr(model, "peft_config"):  # set by peft's injection: a model without it has no adapters
        return []
    # optional: peft is imported only when adapters are asked for (a model with peft_config was given them)
    from peft.tuners.lora import LoraLayer

    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLayer)]


def is_adapter_name(name: str) -> bool:
    """Whether ``name`` (a parameter's) is one of an adapter's tensors
    (:func:`~lightning_fpdt.memory.shape.adapter_part`)."""
    return adapter_part(name) is not None


def add_adapters(model: PreTrainedModel, spec: dict[str, Any] | None) -> Any:
    """Inject the LoRA layers of ``spec`` into ``model`` in place and freeze everything else; returns the resolved
    ``LoraConfig`` (peft's, with the matched ``target_modules``), or ``None`` without ``spec``.

    Called last in ``HFCausalLM.__init__``: the memory stack's forwards (tiled MLPs, checkpointed layers) read their
    submodules at every call, so they run the adapted projections, and the probes before saw the base model.

    Raises:
        ValueError, TypeError, NotImplementedError: :func:`lora_config`'s; ``target_modules`` that match no module.
        NotImplementedError: a target that is no ``nn.Linear``, lies outside the decoder layers, or runs FPDT's own
            forward (a router), named.
    """
    if spec is None:
        return None
    config = lora_config(spec)
    # optional: peft is imported only when adapters are asked for
    from peft import inject_adapter_in_model

    layers = [name for name, _ in decoder_modules(model)]
    head = model.get_output_embeddings()
    try:
        inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    except ValueError as err:  # e.g. "Target modules {...} not found in the base model"
        raise FPDTError(f"HFCausalLM: lora={spec!r} cannot be applied to {type(model).__name__}: {err}") from None
    for name, layer in adapter_layers(model):
        base = layer.base_layer
        where = f"model.{name}"
        if "forward" in vars(base):
            raise Unsupported(
                f"HFCausalLM: lora targets {where}, which runs FPDT's own forward"
                f" ({type(vars(base)['forward']).__name__}: a router whose logits the auxiliary loss reads, which"
                " would miss the adapter). Leave it out of target_modules (or exclude_modules)."
            )
        if not isinstance(base, nn.Linear):
            why = ("the sequence-parallel convolutions read their weights directly, so an adapter would be skipped"
                   if isinstance(base, nn.modules.conv._ConvNd) else "only nn.Linear projections are supported under"
                   " FPDT (fused experts, embeddings and other layers are not)")
            raise Unsupported(
                f"HFCausalLM: lora targets {where}, a {type(base).__name__}: {why}. Target the attention and MLP"
                " projections by name, or leave it out with exclude_modules."
            )
        if not any(name.startswith(f"{layer_name}.") for layer_name in layers):
            why = ("the output embedding, whose weight the tiled loss reads directly" if base is head else
                   "no decoder layer the strategy binds, tiles and shards")
            raise Unsupported(
                f"HFCausalLM: lora targets {where}, which lies outside the decoder layers ({why}); under FPDT LoRA"
                " adapts the projections inside decoder layers only. Leave it out of target_modules (or"
                " exclude_modules)."
            )
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter_name(name))
    for _, layer in adapter_layers(model):  # as peft's get_peft_model does: adapters of a 16-bit base train in float32
        for part in (layer.lora_A[ADAPTER], layer.lora_B[ADAPTER]):
            if part.weight.dtype in (torch.float16, torch.bfloat16):
                part.float()
    return model.peft_config[ADAPTER]


def check_adapter_dropout(model: PreTrainedModel, checkpointing: bool) -> None:
    """Refuse ``lora_dropout > 0`` on a layer recomputed in backward: inside a tiled MLP (or tiled experts), or in
    any decoder layer when ``checkpointing``. Random numbers are not replayed by a recomputation
    (:mod:`lightning_fpdt.offload.recompute`): it would draw another mask than the forward did, and the gradients would
    belong to neither. Elsewhere (the attention's projections without checkpointing) dropout runs once, as in peft.

    Raises:
        NotImplementedError: naming the layer, the dropout and the fixes.
    """
    layers = [name for name, _ in decoder_modules(model)]
    for name, layer in adapter_layers(model):
        p = max((d.p for d in layer.lora_dropout.values() if isinstance(d, nn.Dropout)), default=0.0)
        if p == 0:
            continue
        tiled = any(isinstance(f := vars(m).get("forward"), (TiledForward, ExpertsForward)) and f.num_tiles != 1
                    for m in _ancestors(model, name))
        if tiled:
            why = "the tiled MLP recomputes each tile in backward"
        elif checkpointing and any(name.startswith(f"{layer_name}.") for layer_name in layers):
            why = "activation_checkpointing recomputes each decoder layer in backward"
        else:
            continue
        raise Unsupported(
            f"HFCausalLM: lora_dropout={p} on model.{name}; {why}, and a recomputation draws another dropout mask than"
            " the forward did (random numbers are not replayed), so its gradients would belong to neither. Use"
            " lora_dropout=0.0, or keep the adapters out of what is recomputed (mlp_tiles=1 for the MLP's,"
            " activation_checkpointing=False for the attention's)."
        )


def _ancestors(model: nn.Module, name: str) -> list[nn.Module]:
    """The modules that hold ``model``'s submodule ``name``, outermost first (``model`` itself left out)."""
    parts = name.split(".")
    return [model.get_submodule(".".join(parts[:i])) for i in range(1, len(parts))]


class AdapterCalls:
    """Checks, at the first forward of a model with adapters, that every adapted layer ran as a module: a family whose
    forward reads a projection's ``weight`` directly would bypass its adapter, which would then never train. Layers
    inside a mixture of experts' block are not checked: an expert no token was routed to in that forward is idle,
    not bypassed."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.checked = not adapter_layers(model)

    @contextmanager
    def watch(self) -> Iterator[None]:
        """Around one forward of the model; raises after it when an adapted layer did not run.

        Raises:
            NotImplementedError: naming the layers that did not run.
        """
        if self.checked:
            yield
            return
        called: set[str] = set()
        layers = [(name, m) for name, m in adapter_layers(self.model)
                  if not any(isinstance(vars(a).get("forward"), ExpertsForward) for a in _ancestors(self.model, name))]
        handles = [m.register_forward_pre_hook(lambda *_, name=name: called.add(name)) for name, m in layers]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
        missed = [f"model.{name}" for name, _ in layers if name not in called]
        if missed:
            shown = ", ".join(missed[:3]) + (f" and {len(missed) - 3} more" if len(missed) > 3 else "")
            raise Unsupported(
                f"HFCausalLM: the adapted layer(s) {shown} did not run in the forward: the family reads their weights"
                " directly or does not use them for text, so their adapters would never train. Leave them out of"
                " lora's target_modules (or exclude_modules)."
            )
        self.checked = True


def init_adapters(model: nn.Module) -> None:
    """Draw the adapters of ``model`` (just materialised: uninitialised, whole or FSDP2 shards) as peft does for its
    ``init_lora_weights``: ``True``: A uniform in ``+-1/sqrt(in)`` (``kaiming_uniform_(a=sqrt(5))``), B zero;
    ``"gaussian"``: A normal with std ``1/r``, B zero; ``False``: both as ``nn.Linear`` draws its weight. A shard of dim
    0 is drawn alone: each element is independent, and the fan-in is dim 1, whole in every shard."""
    layers = adapter_layers(model)
    if not layers:
        return
    init = model.peft_config[ADAPTER].init_lora_weights
    with torch.no_grad():
        for _, layer in layers:
            a, b = layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight
            if init == "gaussian":
                local_tensor(a).normal_(std=1 / layer.r[ADAPTER])
            else:
                local_tensor(a).uniform_(-1 / math.sqrt(a.shape[1]), 1 / math.sqrt(a.shape[1]))
            if init is False:
                local_tensor(b).uniform_(-1 / math.sqrt(b.shape[1]), 1 / math.sqrt(b.shape[1]))
            else:
                local_tensor(b).zero_()


def stored_name(name: str) -> str:
    """The transformers name of an adapted model's tensor ``name``: a target's base weight is its layer's weight."""
    return name.replace(".base_layer.", ".")


@dataclass(frozen=True, eq=False)
class AdaptedWeights(PretrainedWeights):
    """The weights a meta-device ``model`` with adapters still has to read (``HFCausalLM``'s
    :class:`~lightning_fpdt.models.pending_weights.PendingWeights`): its base tensors from ``files`` under
    transformers' names (:func:`stored_name`), its adapters drawn (:func:`init_adapters`)."""

    def materialize(self, device: torch.device | str) -> None:
        super().materialize(device)
        init_adapters(self.model)

    def load_whole(self, device: torch.device | str) -> None:
        self.materialize(device)
        with torch.no_grad():
            for name, key in self._base_tensors():
                named_tensor(self.model, name).copy_(self.files.read(key))

    def load_shards(self, root: nn.Module, device: torch.device | str) -> None:
        root.to_empty(device=device)
        compute_buffers(self.model)
        init_adapters(self.model)
        with torch.no_grad():
            for name, key in self._base_tensors():
                fill_shard(named_tensor(self.model, name), name, lambda rows, key=key: self.files.read(key, rows),
                           "HFCausalLM")

    def _base_tensors(self) -> list[tuple[str, str]]:
        """``(name in the model, key in the files)`` of every tensor but the adapters'."""
        found = []
        for name, aliases in tensor_names(self.model).items():
            if not is_adapter_name(name):
                found.append((name, next(stored_name(a) for a in aliases if stored_name(a) in self.files.files)))
        return found


# ---- exports: merged, or the adapter in peft's format ----------------------------------------------------------


def merge_weight(tensors: list[Tensor], scaling: float) -> Tensor:
    """``base + (lora_B @ lora_A) * scaling`` (peft's ``merge``), computed in float32 or wider, in ``base``'s dtype."""
    base, a, b = tensors
    acc = torch.promote_types(base.dtype, torch.float32)
    return (base.to(acc) + (b.to(acc) @ a.to(acc)) * scaling).to(base.dtype)


def export_sources(model: nn.Module, names: list[str]) -> tuple[dict[str, list[str]], dict[str, Callable]]:
    """The tensors of the merged model: its transformers name -> the names in ``model`` it is made of (``names``, in
    order: every tensor of the model), and for an adapted layer's weight the function that merges its base weight,
    ``lora_A`` and ``lora_B`` (:func:`merge_weight`). Without adapters every name is its own."""
    adapted = {f"{name}.base_layer.weight": (name, layer.scaling[ADAPTER]) for name, layer in adapter_layers(model)}
    sources: dict[str, list[str]] = {}
    merges: dict[str, Callable] = {}
    for name in names:
        if is_adapter_name(name):
            continue
        if name in adapted:
            layer, scaling = adapted[name]
            sources[stored_name(name)] = [name, f"{layer}.lora_A.{ADAPTER}.weight", f"{layer}.lora_B.{ADAPTER}.weight"]
            merges[stored_name(name)] = partial(merge_weight, scaling=scaling)
        else:
            sources[stored_name(name)] = [name]
    return sources, merges


def adapter_keys(model: nn.Module) -> dict[str, str]:
    """peft's key of each adapter tensor in ``adapter_model.safetensors`` -> its name in ``model``
    (``base_model.model.<layer>.lora_A.weight``, as ``PeftModel.save_pretrained`` writes it)."""
    keys = {}
    for name, _ in adapter_layers(model):
        for part in ("lora_A", "lora_B"):
            keys[f"base_model.model.{name}.{part}.weight"] = f"{name}.{part}.{ADAPTER}.weight"
    return keys


def adapter_config(model: nn.Module, base_model: str | None) -> Any:
    """The ``LoraConfig`` to save beside the adapter (inference mode, naming ``base_model`` when known)."""
    config = copy.deepcopy(model.peft_config[ADAPTER])
    config.inference_mode = True
    config.base_model_name_or_path = base_model
    return config


def merged_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The merged model's state dict under transformers' names (for ``save_pretrained``; the whole model at once)."""
    state = model.state_dict()
    sources, merges = export_sources(model, list(state))
    return {name: merges[name]([state[k] for k in keys]) if name in merges else state[keys[0]]
            for name, keys in sources.items()}
