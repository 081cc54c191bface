"""``HFCausalLM``'s ``model`` argument to a transformers config and model: the one way, used by training,
``fpdt-export`` and the memory estimate alike, so that a run's export holds the config it trained with.

The ``model`` argument is a built ``PreTrainedModel``, a ``PretrainedConfig``, a config dict (with ``model_type``:
a checkpoint's saved hyper-parameters; or a YAML's ``class_path``/``init_args`` of a config class), or a name or
local path. :func:`hf_config` gives its config with ``config_overrides`` applied (:func:`apply_config_overrides`:
RoPE scaling merged with the schedule's defaults, ``max_position_embeddings``); :func:`build_model` the model: a
local directory of safetensors files on the meta device, its weights read later
(:class:`~lightning_fpdt.hf.weights.PretrainedWeights`), anything else built now.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
from collections.abc import Iterator
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from lightning_fpdt.errors import FPDTError, WrongType, described, one_line
from lightning_fpdt.hf.weights import build_on_meta, pretrained_dtype, unmatched
from lightning_fpdt.models.class_paths import instantiate
from lightning_fpdt.models.weight_files import SafetensorsFiles, tensor_names


def hf_config(model: Any, from_pretrained_kwargs: dict[str, Any] | None = None,
              overrides: dict[str, Any] | None = None) -> PretrainedConfig:
    """The transformers config of ``HFCausalLM``'s ``model`` argument with ``overrides`` applied (a new object:
    the caller's config is not changed).

    Raises:
        ValueError: ``overrides`` with a built model (its RoPE buffers are computed), or naming an attribute the
            config does not have (:func:`apply_config_overrides`).
        TypeError: ``model`` of another type.
    """
    overrides = overrides or {}
    if isinstance(model, PreTrainedModel):
        if overrides:
            raise FPDTError(
                f"HFCausalLM: config_overrides {sorted(overrides)} cannot apply to a built {type(model).__name__}"
                " (its RoPE buffers are computed); pass its config, a config dict or its path instead."
            )
        return copy.deepcopy(model.config)
    if isinstance(model, dict) and "class_path" in model:  # a YAML's config class, not resolved by a CLI
        model = instantiate(model)
    elif isinstance(model, dict):  # a config dict, e.g. from a checkpoint's hyper-parameters
        model = AutoConfig.for_model(**model)
    if isinstance(model, PretrainedConfig):
        # a copy: the model keeps the config object it is given, and setting our attention implementation
        # (or the overrides) on a config shared with another model would change that model too
        return apply_config_overrides(copy.deepcopy(model), overrides)
    if isinstance(model, (str, os.PathLike)):
        with named_checkpoint(os.fspath(model)):
            config = AutoConfig.from_pretrained(os.fspath(model), **_config_kwargs(from_pretrained_kwargs or {}))
        return apply_config_overrides(config, overrides)
    raise WrongType(
        f"HFCausalLM: model must be a transformers PreTrainedModel, a PretrainedConfig, a config dict with"
        f" 'model_type', or a name/local path for from_pretrained; got {type(model).__name__}."
    )


# a Hugging Face Hub id: a name, or owner/name (letters, digits, '-', '_', '.'; not starting with '.' or '-')
_HUB_ID = re.compile(r"[A-Za-z0-9_][\w.-]*(/[A-Za-z0-9_][\w.-]*)?")
_ASKED_THE_HUB: set[str] = set()


@contextlib.contextmanager
def named_checkpoint(name: str) -> Iterator[None]:
    """Reads ``HFCausalLM``'s ``model`` name inside: a local directory, else a Hugging Face Hub id.

    A name that is no directory here and cannot be a Hub id (``./x``, ``/x``, ``~/x``, ``a/b/c``) is refused before
    anything is read, where transformers would ask the Hub for it (retrying a minute without a network) and then
    not name it. A name the Hub does not give is refused naming it and the working directory, with transformers'
    whole reason (a gated repository's link, a token's hint); a local directory's errors are transformers' own.

    Raises:
        FPDTError: as above.
    """
    if os.path.isdir(name):
        yield
        return
    here = f"(working directory {os.getcwd()})"
    if not _HUB_ID.fullmatch(name):
        raise FPDTError(f"HFCausalLM: model {name!r} is not a directory {here}, nor a Hugging Face Hub id; give the"
                        " checkpoint's directory (config.json and weights).")
    if name not in _ASKED_THE_HUB:  # said once: the config and the model are read apart
        _ASKED_THE_HUB.add(name)
        rank_zero_info(f"HFCausalLM: model {name!r} is not a directory here {here}: asking the Hugging Face Hub for"
                       " it.")
    try:
        yield
    except OSError as err:
        raise FPDTError(f"HFCausalLM: model {name!r} is not a directory here {here}, and the Hugging Face Hub did not"
                        f" give it: {one_line(err)} (a local checkpoint: give its directory as seen from"
                        " here).") from err


ALLOW_MISSING = "allow_missing_weights"  # from_pretrained_kwargs' own key: random values for missing tensors are meant


def build_model(model: Any, from_pretrained_kwargs: dict[str, Any] | None = None,
                overrides: dict[str, Any] | None = None) -> tuple[PreTrainedModel, SafetensorsFiles | None]:
    """The transformers model of ``HFCausalLM``'s ``model`` argument, and the files whose weights it still has
    to read (a local directory of safetensors files: the model is built on the meta device) or ``None``.

    Under a meta default device (sizing: the memory estimate, ``fpdt-export``) a name or path gives its config's
    model on the meta device, and nothing is read.

    A checkpoint that lacks a tensor of the model is refused (``from_pretrained`` would draw it at random and
    training would start from it), unless ``from_pretrained_kwargs`` holds ``"allow_missing_weights": True``
    (taken out before ``from_pretrained`` sees the rest): then those tensors are initialised by the model, and
    a warning names them.

    Raises:
        ValueError: a checkpoint lacking tensors of the model, named and counted (:func:`missing_weights_error`).
    """
    from_pretrained_kwargs, overrides = dict(from_pretrained_kwargs or {}), overrides or {}
    allow_missing = bool(from_pretrained_kwargs.pop(ALLOW_MISSING, False))
    if isinstance(model, PreTrainedModel):
        hf_config(model, from_pretrained_kwargs, overrides)  # refuses overrides
        return own_base_model(model), None
    if not isinstance(model, (str, os.PathLike)) or torch.get_default_device().type == "meta":
        built = from_config(hf_config(model, from_pretrained_kwargs, overrides))
        return own_base_model(built), None
    deferred, problems = _on_meta(os.fspath(model), from_pretrained_kwargs, overrides, allow_missing)
    if deferred is not None:
        return own_base_model(deferred[0]), deferred[1]
    if overrides:  # into the config before the weights load: RoPE's buffers are computed from it at build
        from_pretrained_kwargs["config"] = hf_config(model, from_pretrained_kwargs, overrides)
    with named_checkpoint(os.fspath(model)):
        built, info = AutoModelForCausalLM.from_pretrained(model, output_loading_info=True, **from_pretrained_kwargs)
    built.train()  # from_pretrained returns it in eval mode; training is what it is built for
    missing = sorted(info["missing_keys"])
    if missing and not allow_missing:
        raise missing_weights_error(os.fspath(model), type(built).__name__, missing)
    if missing:
        rank_zero_warn(f"HFCausalLM: {os.fspath(model)} lacks {len(missing)} tensors of {type(built).__name__}"
                       f" ({_first(missing)}); they are initialised at random ({ALLOW_MISSING}=True).")
    elif problems:  # the names did not match, and from_pretrained found every tensor: it converted them
        rank_zero_info(f"HFCausalLM: {os.fspath(model)} holds tensors under other names or shapes than"
                       f" {type(built).__name__}'s ({len(problems)}, e.g. {problems[0]}); loaded it whole through"
                       " from_pretrained, which converts them (every rank holds the whole model until it is sharded).")
    return own_base_model(built), None


def from_config(config: PretrainedConfig) -> PreTrainedModel:
    """transformers' causal LM of ``config`` with random weights.

    Raises:
        ValueError: transformers' own constructor failed on ``config`` (a family whose defaults leave a size unset,
            such as dots1's ``n_routed_experts``), naming the class, the error and the config's unset sizes.
    """
    try:
        return AutoModelForCausalLM.from_config(config)
    except (TypeError, ValueError, AttributeError, IndexError, AssertionError, RuntimeError) as error:
        text = config.get_text_config()
        unset = [k for k, v in vars(text).items() if v is None and not k.startswith("_")
                 and any(word in k for word in ("num", "size", "experts", "dim", "rank", "group", "top"))]
        hint = f"; the config leaves {', '.join(unset[:6])} unset (None): set them" if unset else ""
        raise FPDTError(
            f"HFCausalLM: transformers could not build {type(config).__name__}'s causal LM from this config"
            f" ({described(error)}){hint}."
        ) from error


def own_base_model(model: PreTrainedModel) -> PreTrainedModel:
    """``model`` with ``model.base_model`` its decoder (what the loss, the probes and the guards run): a causal LM
    whose ``base_model_prefix`` names no attribute of its own has ``base_model`` the whole model (Llama-4's
    ``Llama4ForCausalLM``: prefix ``language_model``, its decoder at ``model``, for multimodal checkpoints); then its
    instance's prefix becomes ``"model"`` when that is its decoder. Its class and other instances keep theirs."""
    decoder = getattr(model, "model", None)
    if model.base_model is model and isinstance(decoder, PreTrainedModel):
        model.base_model_prefix = "model"
    return model


def missing_weights_error(path: str, model_class: str, missing: list[str]) -> ValueError:
    """The refusal of a checkpoint that lacks the tensors ``missing`` of ``model_class``."""
    return ValueError(
        f"HFCausalLM: {path} lacks {len(missing)} tensor{'s' if len(missing) > 1 else ''} of {model_class}"
        f" ({_first(missing)}): from_pretrained would initialise {'them' if len(missing) > 1 else 'it'} at random"
        " and training would start from there. Use a complete checkpoint (copy or download it again, or save it"
        f" again with save_pretrained), or pass from_pretrained_kwargs={{'{ALLOW_MISSING}': True}} if random"
        " initialisation of these tensors is meant."
    )


def _first(names: list[str], count: int = 3) -> str:
    return ", ".join(names[:count]) + (f" and {len(names) - count} more" if len(names) > count else "")


def _on_meta(path: str, from_pretrained_kwargs: dict[str, Any], overrides: dict[str, Any],
             allow_missing: bool) -> tuple[tuple[PreTrainedModel, SafetensorsFiles] | None, list[str]]:
    """``path``'s model on the meta device with its files, or ``None`` where ``from_pretrained`` has to load
    it: not a local directory of safetensors files, ``from_pretrained`` options other than the dtype, or tensor
    names the files do not hold as they are (transformers may convert them on load); with the mismatches found.

    Raises:
        ValueError: files that lack tensors of the model and hold nothing else it could be converted from (unless
            ``allow_missing``).
    """
    if not os.path.isdir(path) or set(from_pretrained_kwargs) - _META_KWARGS:
        return None, []
    files = SafetensorsFiles.find(path)
    if files is None:
        return None, []
    config = hf_config(path, {"local_files_only": True}, overrides)
    dtype = from_pretrained_kwargs.get("dtype", from_pretrained_kwargs.get("torch_dtype"))
    model = build_on_meta(config, pretrained_dtype(config, dtype))
    problems = unmatched(model, files)
    if not problems:
        return (model, files), []
    known = {alias for aliases in tensor_names(model).values() for alias in aliases}
    parameters = {name for name, _ in model.named_parameters()}
    missing = [problem.split(" (")[0] for problem in problems if problem.endswith("(not in the files)")]
    if (len(missing) == len(problems) and set(missing) <= parameters and set(files.files) <= known
            and not allow_missing):
        # parameters absent, and nothing in the files under another name that a conversion could give them from:
        # refused before any read (a missing buffer is from_pretrained's to judge: it may compute it)
        raise missing_weights_error(path, type(model).__name__, missing)
    return None, problems


# from_pretrained options a meta-device build honours (others, e.g. device_map or quantization, need from_pretrained)
_META_KWARGS = frozenset({"dtype", "torch_dtype", "local_files_only", "attn_implementation"})


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
        raise FPDTError(
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


def _new_rope_parameters(config: PretrainedConfig, new: dict[str, Any], original_max: int | None) -> dict[str, Any]:
    old = copy.deepcopy(getattr(config, "rope_parameters", None) or {})
    if not config.nested_rope_parameter_keys(old):
        return _with_defaults(new, old, original_max)
    layer_types = list(old)  # a nested schedule: every key is a layer type, used in the model or not
    flat = [key for key in new if key not in layer_types]
    if flat:
        raise FPDTError(
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
