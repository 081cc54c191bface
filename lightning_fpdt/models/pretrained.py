"""``LlamaLM`` and ``GPTLM`` from a pretrained Hugging Face model directory: our model built on the meta device, its
weights read where they are needed (``LlamaLM(hf_checkpoint=path)``, ``GPTLM(hf_checkpoint=path)``).

The config comes from the directory's ``config.json`` (transformers' ``AutoConfig``, mapped by the family's
``config_from_hf``), the model is built on the meta device (its config only: no memory, any size), and
:class:`TableWeights` reads the safetensors files (:mod:`lightning_fpdt.models.weight_files`) through the family's
weight-name table (the rows ``llama_from_hf`` / ``gpt_from_hf`` copy), for
:class:`~lightning_fpdt.models.causal_lm.CausalLM` to call where the weights are needed:

- whole: each row of the table read once, into the model on its device and in its dtype;
- sharded: after FSDP2's ``fully_shard``, a parameter's local shard holds rows ``r0:r1`` of dim 0 of our tensor
  (:func:`~lightning_fpdt.models.weight_files.owned_rows`). In the stored tensor these are rows ``r0:r1`` (Llama;
  GPT-2's norms and biases), rows ``o + r0 : o + r1`` of a fused tensor whose part from row ``o`` is ours (GPT-2's
  ``c_attn`` bias: q, k and v are its thirds), or columns ``o + r0 : o + r1`` of a transposed ``[in, out]`` weight
  (GPT-2's ``Conv1D``; ``c_attn``'s weight is transposed and fused). Each rank reads those elements only, so no
  rank ever holds the whole model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_fpdt.errors import FPDTError, WrongType
from lightning_fpdt.models.configs import with_overrides
from lightning_fpdt.models.family import Family, Weight, check_table
from lightning_fpdt.models.weight_files import SafetensorsFiles, fill_shard, tensor_names
from lightning_fpdt.optional import require


def from_pretrained_dir(family: Family, path: str | Path, config: Any | None, overrides: dict[str, Any] | None,
                        owner: str) -> tuple[nn.Module, TableWeights | None]:
    """``family``'s model on the meta device for the pretrained directory ``path``, and the weights it still has to
    read (``None`` when built under a meta default device: sizing only, as the memory estimate and ``fpdt-export``
    build modules).

    Args:
        config: the config to build (a reload's saved one); ``None``: the directory's ``config.json``, mapped.
        overrides: config fields to set on it (:func:`~lightning_fpdt.models.configs.with_overrides`).
        owner: the LightningModule's name, for messages.

    Raises:
        FileNotFoundError: no directory at ``path``, or no safetensors files in it.
        ModuleNotFoundError: ``transformers`` is not installed (to read ``config.json``), with the install command.
        TypeError: a directory of another ``model_type``.
        ValueError: an override that is no config field; files lacking a tensor of the model or holding it in
            another shape (:meth:`TableWeights.check`).
    """
    directory = Path(path)
    sizing = torch.get_default_device().type == "meta"  # shapes only: no weights are read
    if (config is None or not sizing) and not directory.is_dir():
        raise FileNotFoundError(f"{owner}: no Hugging Face checkpoint directory at {str(path)!r} (hf_checkpoint is a"
                                " local directory; nothing is downloaded).")
    if config is None:
        config = _read_config(directory, family, owner)
    config = with_overrides(config, overrides, owner)
    with torch.device("meta"):
        model = family.model_class(config)
    if sizing:
        return model, None
    files = SafetensorsFiles.find(directory, owner)
    if files is None:
        raise FileNotFoundError(
            f"{owner}: {directory} holds no model.safetensors or model.safetensors.index.json; save it with"
            f" transformers' save_pretrained (safetensors files), or convert it whole with {family.converter}(path)"
            f" and assign the model."
        )
    weights = TableWeights(model, files, family.weights, owner)
    weights.check()
    return model, weights


@dataclass(frozen=True, eq=False)
class TableWeights:
    """The weights a meta-device bundled ``model`` still has to read from ``files``, row by row of its
    weight-name ``table`` (a :class:`~lightning_fpdt.models.causal_lm.PendingWeights`).

    The table is built again from the model at each load: ``to_empty`` and ``fully_shard`` replace the parameter
    objects its rows point to.
    """

    model: nn.Module
    files: SafetensorsFiles
    table: Callable[[Any], list[Weight]]
    owner: str

    def tensor_names(self) -> list[str]:
        names = [name for name, _ in self.model.named_parameters()]  # a tied parameter once
        state = self.model.state_dict(keep_vars=True)
        return names + [name for name, _ in self.model.named_buffers() if name in state]

    def check(self) -> None:
        """Refuse files that lack a tensor of the table or hold it in a shape that does not give ours
        (read from the file headers: no tensor is read).

        Raises:
            ValueError: the tensors that do not fit, named with both shapes.
            RuntimeError: a table that misses a parameter of the model (it would keep no weights).
        """
        table = self.table(self.model)
        check_table(self.model, table)
        names = {id(p): name for name, p in self.model.named_parameters()}
        shapes = self.files.shapes()
        problems = []
        for w in table:
            ours = names[id(w.ours)]
            if w.name not in shapes:
                problems.append(f"{w.name} (not in the files; {ours})")
                continue
            got = tuple(w.theirs(torch.empty(shapes[w.name], device="meta")).shape)
            if got != tuple(w.ours.shape):
                problems.append(f"{w.name} (stored {list(shapes[w.name])} gives {ours} {list(got)}, the model has"
                                f" {list(w.ours.shape)})")
        if problems:
            raise FPDTError(
                f"{self.owner}: {self.files.directory} does not hold the weights of this"
                f" {type(self.model).__name__} ({len(problems)} tensors, e.g. {problems[:3]}); the config must be the"
                " checkpoint's: drop config_overrides (or a given config) that change sizes, the vocabulary, tied"
                " embeddings or the position embedding."
            )

    def materialize(self, device: torch.device | str) -> None:
        tied = _tied_names(self.model)
        self.model.to_empty(device=device)
        _tie(self.model, tied)  # to_empty gives each name of a tied pair its own new tensor
        self.model.compute_buffers()

    def load_whole(self, device: torch.device | str) -> None:
        self.materialize(device)
        with torch.no_grad():
            for w in self.table(self.model):
                w.ours.copy_(self._read(w))

    def load_shards(self, root: nn.Module, device: torch.device | str) -> None:
        root.to_empty(device=device)  # FSDP2's parameters: tied ones stay one parameter
        self.model.compute_buffers()
        names = {id(p): name for name, p in self.model.named_parameters()}
        with torch.no_grad():
            for w in self.table(self.model):
                fill_shard(w.ours, names[id(w.ours)], lambda rows, w=w: self._read(w, rows), self.owner)

    def _read(self, w: Weight, rows: tuple[int, int] | None = None) -> Tensor:
        """Rows ``rows`` of dim 0 of our tensor ``w.ours`` (``None``: all), read from the stored tensor ``w.name``
        and nothing else of it."""
        start, end = rows or (0, w.ours.shape[0])
        offset = (w.rows.start or 0) if w.rows is not None else 0  # a fused tensor: our part starts there
        span = (offset + start, offset + end)
        if w.transposed:  # stored [in, out]: our rows are its columns
            return self.files.read(w.name, columns=span).T
        if rows is None and w.rows is None:
            return self.files.read(w.name)
        return self.files.read(w.name, rows=span)


def _read_config(directory: Path, family: Family, owner: str) -> Any:
    """Our config of the directory's ``config.json``.

    Raises:
        TypeError: another ``model_type`` than the family's.
    """
    auto_config = require("transformers", f"{owner}(hf_checkpoint=...)").AutoConfig
    hf_config = auto_config.from_pretrained(str(directory), local_files_only=True)
    if hf_config.model_type != family.model_type:
        raise WrongType(
            f"{owner}: {directory} holds a {hf_config.model_type!r} checkpoint"
            f" ({', '.join(hf_config.architectures or [])}); {owner} reads {family.model_type!r}"
            f" ({family.hf_class}). Train it with HFCausalLM({str(directory)!r}), which takes any transformers"
            " causal LM."
        )
    return family.config_from_hf(hf_config)


def _tied_names(model: nn.Module) -> list[list[str]]:
    """The names of each parameter that has more than one (tied weights)."""
    return [group for group in tensor_names(model).values() if len(group) > 1]


def _tie(model: nn.Module, tied: list[list[str]]) -> None:
    """Make every name of each group the parameter of its first name again."""
    for first, *others in tied:
        param = model.get_parameter(first)
        for name in others:
            module_name, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(module_name), leaf, param)
