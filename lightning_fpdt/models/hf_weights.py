"""A transformers model's weights from its safetensors files into a model built on the meta device.

``HFCausalLM`` given a local checkpoint directory builds the transformers model on the meta device (its
config only: no memory, any size) and reads the weights later, where they are needed:

- whole (:func:`load_whole`): one copy, on the device and in the dtype it trains in, read tensor by tensor;
- sharded (:func:`load_shards`): after FSDP2's ``fully_shard`` has replaced each parameter by its shard of
  dim 0, each rank reads the rows of each tensor it owns and nothing else, so no rank ever holds the whole
  model. Every rank reads its own slices from the files (no collective): a rank's peak is its shards plus
  one slice being read.

Parameters are matched to checkpoint keys by their transformers names (a tied pair by either name), with
the same shapes; :func:`unmatched` lists what does not match (a checkpoint whose names transformers converts
on load, e.g. a mixture of experts stored per expert), for which ``HFCausalLM`` loads through
``from_pretrained`` instead. Buffers that are not in the checkpoint (RoPE's ``inv_freq``, Gemma's
``embed_scale``) are computed by the model's own ``_init_weights``, as ``from_pretrained`` computes them.

``HFCausalLM`` hands :class:`PretrainedWeights` to :class:`~lightning_fpdt.models.lm.CausalLM`, which calls it
where the weights are needed; the bundled models read the same files through their weight-name tables
(:mod:`~lightning_fpdt.models.hf_checkpoint`, with :class:`SafetensorsCheckpoint` and :func:`fill_shard`).

Each read opens its file, reads one tensor or one slice, and closes it: the memory map of a file is never
held beyond one read, so the pages read do not accumulate in the process's resident memory.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclass(frozen=True)
class SafetensorsCheckpoint:
    """The safetensors files of a transformers checkpoint directory.

    Attributes:
        directory: the checkpoint directory.
        files: each tensor's key -> the file (in ``directory``) that holds it.
    """

    directory: Path
    files: dict[str, str]

    @classmethod
    def find(cls, directory: str | Path) -> SafetensorsCheckpoint | None:
        """The checkpoint in ``directory`` (``model.safetensors.index.json`` or ``model.safetensors``), or
        ``None`` when it has neither (a hub name, ``pytorch_model.bin`` files)."""
        directory = Path(directory)
        if (directory / INDEX_FILE).is_file():
            weight_map = json.loads((directory / INDEX_FILE).read_text())["weight_map"]
            return cls(directory, dict(weight_map))
        if (directory / SINGLE_FILE).is_file():
            with safe_open(str(directory / SINGLE_FILE), framework="pt") as f:
                return cls(directory, {key: SINGLE_FILE for key in f.keys()})
        return None

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape, from the file headers (no tensor is read)."""
        shapes: dict[str, tuple[int, ...]] = {}
        for file in sorted(set(self.files.values())):
            with safe_open(str(self.directory / file), framework="pt") as f:
                for key in f.keys():
                    shapes[key] = tuple(f.get_slice(key).get_shape())
        return shapes

    def read(self, key: str, rows: tuple[int, int] | None = None, columns: tuple[int, int] | None = None) -> Tensor:
        """Tensor ``key`` in its stored dtype on the CPU: whole, rows ``start:end`` of dim 0 only, or columns
        ``start:end`` of dim 1 only (a transposed ``[in, out]`` weight's output rows: GPT-2's ``Conv1D``). A slice
        is a view of the memory-mapped file: only the pages that hold it are read, when it is copied.

        Raises:
            ValueError: both ``rows`` and ``columns``.
        """
        if rows is not None and columns is not None:
            raise ValueError(f"SafetensorsCheckpoint.read({key!r}): give rows or columns, not both.")
        with safe_open(str(self.directory / self.files[key]), framework="pt") as f:
            if rows is not None:
                return f.get_slice(key)[rows[0]:rows[1]]
            if columns is not None:
                return f.get_slice(key)[:, columns[0]:columns[1]]
            return f.get_tensor(key)


def build_on_meta(config: PretrainedConfig, dtype: torch.dtype) -> PreTrainedModel:
    """``config``'s causal LM on the meta device, its floating-point tensors in ``dtype`` (a copy of the config
    is built, so the caller's is not changed)."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=dtype)


def checkpoint_dtype(config: PretrainedConfig, dtype: str | torch.dtype | None) -> torch.dtype:
    """The dtype ``from_pretrained(dtype=dtype)`` builds in: ``"auto"`` (transformers' default) and ``None``
    take the config's ``dtype`` when it has one, else torch's default dtype."""
    if dtype is None or dtype == "auto":
        dtype = getattr(config, "dtype", None) or torch.get_default_dtype()
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def tensor_names(model: nn.Module) -> dict[str, list[str]]:
    """What a checkpoint must hold for ``model``: its first name -> all names, for each parameter (tied ones
    once, under every name they have) and each persistent buffer."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    for prefix, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and name not in module._non_persistent_buffers_set:
                names.setdefault(id(buffer), []).append(f"{prefix}.{name}" if prefix else name)
    return {group[0]: group for group in names.values()}


def unmatched(model: nn.Module, checkpoint: SafetensorsCheckpoint) -> list[str]:
    """The names of ``model``'s tensors the checkpoint lacks or holds in another shape (``name (reason)``)."""
    shapes = checkpoint.shapes()
    problems = []
    for name, aliases in tensor_names(model).items():
        key = next((alias for alias in aliases if alias in shapes), None)
        expected = tuple(_target(model, name).shape)
        if key is None:
            problems.append(f"{name} (not in the checkpoint)")
        elif shapes[key] != expected:
            problems.append(f"{name} (checkpoint {list(shapes[key])}, model {list(expected)})")
    return problems


def compute_buffers(model: PreTrainedModel) -> None:
    """Fill the non-persistent buffers of ``model`` (just materialised, uninitialised) as transformers does
    after loading: each owning module through the ``_init_weights`` of its innermost ``PreTrainedModel``.
    The owning modules hold no parameters in the families this is used for; any they hold are read from the
    checkpoint afterwards."""
    def visit(module: nn.Module, owner: PreTrainedModel) -> None:
        owner = module if isinstance(module, PreTrainedModel) else owner
        for child in module.children():
            visit(child, owner)
        if any(name in module._non_persistent_buffers_set for name in module._buffers):
            with torch.no_grad():
                owner._init_weights(module)

    visit(model, model)


def materialize(model: PreTrainedModel, device: torch.device | str) -> None:
    """Give the meta-device ``model`` uninitialised tensors on ``device`` (tied weights tied again) and its
    computed buffers; the parameters and persistent buffers are then to be filled."""
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gives each name of a tied pair its own new tensor
    compute_buffers(model)


def load_whole(model: PreTrainedModel, checkpoint: SafetensorsCheckpoint, device: torch.device | str) -> None:
    """Materialise the meta-device ``model`` on ``device`` and read every tensor into it (one copy of the
    model, in its own dtypes; each tensor cast as it is copied)."""
    materialize(model, device)
    with torch.no_grad():
        for name, aliases in tensor_names(model).items():
            key = next(alias for alias in aliases if alias in checkpoint.files)
            _target(model, name).copy_(checkpoint.read(key))


def load_shards(module: nn.Module, model: PreTrainedModel, checkpoint: SafetensorsCheckpoint,
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
            key = next(alias for alias in aliases if alias in checkpoint.files)
            fill_shard(_target(model, name), name, lambda rows, key=key: checkpoint.read(key, rows))


def fill_shard(target: Tensor, name: str, read: Callable[[tuple[int, int] | None], Tensor],
               owner: str = "HFCausalLM") -> None:
    """Copy into this rank's shard of ``target`` (a DTensor sharded on dim 0, or a plain tensor: all of it) what
    ``read(rows)`` returns for the rows it owns (``None``: all rows); a rank that owns no rows reads nothing."""
    local = target.to_local() if isinstance(target, DTensor) else target
    rows = owned_rows(target, name, owner)
    if rows is None:
        local.copy_(read(None))
    elif rows[1] > rows[0]:  # a rank past the end of a short dim 0 owns no rows
        local.copy_(read(rows))


@dataclass(frozen=True, eq=False)
class PretrainedWeights:
    """The weights a meta-device transformers ``model`` still has to read from ``checkpoint``, matched by name
    (``HFCausalLM``'s :class:`~lightning_fpdt.models.lm.PendingWeights`)."""

    model: PreTrainedModel
    checkpoint: SafetensorsCheckpoint

    def tensor_names(self) -> list[str]:
        return list(tensor_names(self.model))

    def materialize(self, device: torch.device | str) -> None:
        materialize(self.model, device)

    def load_whole(self, device: torch.device | str) -> None:
        load_whole(self.model, self.checkpoint, device)

    def load_shards(self, root: nn.Module, device: torch.device | str) -> None:
        load_shards(root, self.model, self.checkpoint, device)


def owned_rows(tensor: Tensor, name: str, owner: str = "HFCausalLM") -> tuple[int, int] | None:
    """The rows ``start, end`` of dim 0 this rank's shard of ``tensor`` holds (``None``: not a DTensor, so all).

    FSDP2 shards dim 0 as ``torch.chunk`` does: chunks of ``ceil(rows / world)``, the last ones shorter or empty.

    Raises:
        ValueError: another placement than ``Shard(0)`` on a one-dimensional mesh.
    """
    if not isinstance(tensor, DTensor):
        return None
    if tensor.device_mesh.ndim != 1 or tensor.placements != (Shard(0),):
        raise ValueError(f"{owner}: {name} is sharded as {tensor.placements} over a mesh of shape"
                         f" {tuple(tensor.device_mesh.shape)}; loading reads shards of dim 0 on one mesh dimension"
                         " (FSDP2's fully_shard) only.")
    rows, world = tensor.shape[0], tensor.device_mesh.size()
    rank = tensor.device_mesh.get_local_rank()
    per_rank = -(-rows // world)
    start, end = min(rank * per_rank, rows), min((rank + 1) * per_rank, rows)
    if tensor.to_local().shape[0] != end - start:
        raise ValueError(f"{owner}: {name}: this rank's shard has {tensor.to_local().shape[0]} rows, but"
                         f" ceil({rows} / {world}) chunks give rank {rank} rows {start}:{end}.")
    return start, end


def _target(model: nn.Module, name: str) -> Tensor:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    return module._parameters[leaf] if leaf in module._parameters else module._buffers[leaf]
