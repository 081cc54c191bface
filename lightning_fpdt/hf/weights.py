"""A transformers model's weights from its safetensors files into a model built on the meta device.

``HFCausalLM`` given a local model directory builds the transformers model on the meta device (its
config only: no memory, any size) and reads the weights later, where they are needed:

- whole (:func:`load_whole`): one copy, on the device and in the dtype it trains in, read tensor by tensor;
- sharded (:func:`load_shards`): after FSDP2's ``fully_shard`` has replaced each parameter by its shard of
  dim 0, each rank reads the rows of each tensor it owns and nothing else, so no rank ever holds the whole
  model. Every rank reads its own slices from the files (no collective): a rank's peak is its shards plus
  one slice being read.

Parameters are matched to the stored names by their transformers names (a tied pair by either name), with
the same shapes; :func:`unmatched` lists what does not match (files whose names transformers converts
on load, e.g. a mixture of experts stored per expert), for which ``HFCausalLM`` loads through
``from_pretrained`` instead. Files that lack a tensor of the model are refused, naming it, unless random
values for it are meant (``from_pretrained_kwargs={"allow_missing_weights": True}``;
:func:`~lightning_fpdt.hf.build.build_model`): ``from_pretrained`` would draw it at random, silently. Buffers
that are not stored (RoPE's ``inv_freq``, Gemma's ``embed_scale``) are computed by the model's own
``_init_weights``, as ``from_pretrained`` computes them.

``HFCausalLM`` hands :class:`PretrainedWeights` to :class:`~lightning_fpdt.models.causal_lm.CausalLM`, which calls it
where the weights are needed; the bundled models read the same files through their weight-name tables
(:mod:`~lightning_fpdt.models.pretrained`); both read through :mod:`lightning_fpdt.models.weight_files`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers import initialization as hf_init

from lightning_fpdt.models.weight_files import SafetensorsFiles, fill_shard, tensor_names


def build_on_meta(config: PretrainedConfig, dtype: torch.dtype) -> PreTrainedModel:
    """``config``'s causal LM on the meta device, its floating-point tensors in ``dtype`` (a copy of the config
    is built, so the caller's is not changed)."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=dtype)


def pretrained_dtype(config: PretrainedConfig, dtype: str | torch.dtype | None) -> torch.dtype:
    """The dtype ``from_pretrained(dtype=dtype)`` builds in: ``"auto"`` (transformers' default) and ``None``
    take the config's ``dtype`` when it has one, else torch's default dtype."""
    if dtype is None or dtype == "auto":
        dtype = getattr(config, "dtype", None) or torch.get_default_dtype()
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def unmatched(model: nn.Module, files: SafetensorsFiles) -> list[str]:
    """The names of ``model``'s tensors the files lack or holds in another shape (``name (reason)``)."""
    shapes = files.shapes()
    problems = []
    for name, aliases in tensor_names(model).items():
        key = next((alias for alias in aliases if alias in shapes), None)
        expected = tuple(named_tensor(model, name).shape)
        if key is None:
            problems.append(f"{name} (not in the files)")
        elif shapes[key] != expected:
            problems.append(f"{name} (stored {list(shapes[key])}, model {list(expected)})")
    return problems


def compute_buffers(model: PreTrainedModel) -> None:
    """Fill the non-persistent buffers of ``model`` (just materialised, uninitialised) as transformers does after
    loading: each buffer's owning module, and each ``PreTrainedModel`` in it (a family may fill a layer's buffer from
    its base model's branch: Falcon-H1's mixers' ``mup_vector``), through the ``_init_weights`` of its innermost
    ``PreTrainedModel``, children first. Every parameter and persistent buffer is marked as read meanwhile
    (``_is_hf_initialized``, which transformers' init functions, and torch's under its guard, leave alone): they are
    read from the checkpoint afterwards, and on the sharded path they are DTensors. No other module is visited: an
    init that writes a parameter without asking the mark (through a slice, say) never runs."""
    marked = [t for t in (named_tensor(model, name) for name in tensor_names(model))  # what a checkpoint holds
              if not getattr(t, "_is_hf_initialized", False)]

    def visit(module: nn.Module, owner: PreTrainedModel) -> None:
        owner = module if isinstance(module, PreTrainedModel) else owner
        for child in module.children():
            visit(child, owner)
        if module is owner or any(name in module._non_persistent_buffers_set for name in module._buffers):
            owner._init_weights(module)

    for t in marked:
        t._is_hf_initialized = True
    try:
        with torch.no_grad(), hf_init.guard_torch_init_functions():
            visit(model, model)
    finally:
        for t in marked:
            t.__dict__.pop("_is_hf_initialized", None)


def materialize(model: PreTrainedModel, device: torch.device | str) -> None:
    """Give the meta-device ``model`` uninitialised tensors on ``device`` (tied weights tied again) and its
    computed buffers; the parameters and persistent buffers are then to be filled."""
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gives each name of a tied pair its own new tensor
    compute_buffers(model)


def load_whole(model: PreTrainedModel, files: SafetensorsFiles, device: torch.device | str) -> None:
    """Materialise the meta-device ``model`` on ``device`` and read every tensor into it (one copy of the
    model, in its own dtypes; each tensor cast as it is copied)."""
    materialize(model, device)
    with torch.no_grad():
        for name, aliases in tensor_names(model).items():
            key = next(alias for alias in aliases if alias in files.files)
            named_tensor(model, name).copy_(files.read(key))


def load_shards(module: nn.Module, model: PreTrainedModel, files: SafetensorsFiles,
                device: torch.device | str) -> None:
    """Materialise the meta-device, FSDP2-sharded ``model`` (inside ``module``, the root ``fully_shard`` was
    applied to) on ``device`` and read into each parameter's local shard the rows of dim 0 it owns.

    Raises:
        ValueError: a parameter sharded other than along dim 0 of a one-dimensional mesh.
    """
    module.to_empty(device=device)
    compute_buffers(model)
    with torch.no_grad():
        for name, aliases in tensor_names(model).items():
            key = next(alias for alias in aliases if alias in files.files)
            fill_shard(named_tensor(model, name), name, lambda rows, key=key: files.read(key, rows), "HFCausalLM")


@dataclass(frozen=True, eq=False)
class PretrainedWeights:
    """The weights a meta-device transformers ``model`` still has to read from ``files``, matched by name
    (``HFCausalLM``'s :class:`~lightning_fpdt.models.causal_lm.PendingWeights`)."""

    model: PreTrainedModel
    files: SafetensorsFiles

    def tensor_names(self) -> list[str]:
        return list(tensor_names(self.model))

    def materialize(self, device: torch.device | str) -> None:
        materialize(self.model, device)

    def load_whole(self, device: torch.device | str) -> None:
        load_whole(self.model, self.files, device)

    def load_shards(self, root: nn.Module, device: torch.device | str) -> None:
        load_shards(root, self.model, self.files, device)


def named_tensor(model: nn.Module, name: str) -> Tensor:
    """The parameter or buffer of ``model`` called ``name`` itself (not a copy: it is filled in place)."""
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    return module._parameters[leaf] if leaf in module._parameters else module._buffers[leaf]
