"""What the project knows about a bundled model family, as one record: :class:`Family`.

Each family file (:mod:`~lightning_fpdt.models.llama`, :mod:`~lightning_fpdt.models.gpt`) holds its model and one
``FAMILY`` record: the ``transformers`` ``model_type`` and class it corresponds to, its config class and the config
mapping both ways, and its weight-name table. Conversion (:mod:`~lightning_fpdt.models.convert`), reading a
pretrained directory (:mod:`~lightning_fpdt.models.pretrained`) and ``fpdt-export`` look the record up; none of them
knows a family by name.

A weight-name table is a list of :class:`Weight` rows (our parameter, its ``transformers`` name, how the two
tensors are laid out), read in both directions, so an import and an export cannot disagree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from torch import Tensor, nn


class Weight(NamedTuple):
    """One row of a weight-name table.

    Attributes:
        ours: our parameter.
        name: the ``transformers`` parameter it corresponds to.
        transposed: the ``transformers`` tensor is ``[in, out]`` (GPT-2's ``Conv1D``), ours ``[out, in]``.
        rows: the rows of the (transposed) ``transformers`` tensor that are ours (a fused q/k/v projection);
            ``None``: all of it.
    """

    ours: nn.Parameter
    name: str
    transposed: bool = False
    rows: slice | None = None

    def theirs(self, tensor: Tensor) -> Tensor:
        """The view of ``transformers``' ``tensor`` that holds our parameter (writes go through to it)."""
        view = tensor.T if self.transposed else tensor
        return view if self.rows is None else view[self.rows]


@dataclass(frozen=True, eq=False)
class Family:
    """A bundled model family.

    Attributes:
        name: the model class's name (``"Llama"``), for messages.
        model_type: the ``transformers`` ``model_type`` of its checkpoints (``"llama"``).
        hf_class: the ``transformers`` causal LM class (``"LlamaForCausalLM"``).
        model_class: our model (built from ``config_class``).
        config_class: our config dataclass.
        config_from_hf: ``(transformers config, **field overrides) -> our config``; raises
            ``NotImplementedError`` for what the model does not compute.
        config_to_hf: ``our config -> the transformers config's keyword arguments``; raises
            ``NotImplementedError`` for a config ``transformers`` has no counterpart of.
        weights: the weight-name table of a model.
        converter: the name of the function that converts a whole loaded ``transformers`` model
            (``"llama_from_hf"``), for messages.
    """

    name: str
    model_type: str
    hf_class: str
    model_class: type[nn.Module]
    config_class: type
    config_from_hf: Callable[..., Any]
    config_to_hf: Callable[[Any], dict[str, Any]]
    weights: Callable[[Any], list[Weight]]
    converter: str

    def holds(self, config: Mapping[str, Any]) -> bool:
        """Whether the config dict ``config`` (a checkpoint's saved hyper-parameters) names fields of this family's
        config class only."""
        names = {f.name for f in dataclasses.fields(self.config_class)}
        return bool(config) and set(config) - {"loss_tiles"} <= names  # loss_tiles: older checkpoints' config


def check_table(model: nn.Module, table: list[Weight]) -> None:
    """Refuse a weight-name table that misses a parameter of ``model`` (the parameter would keep no weights).

    Raises:
        RuntimeError: the parameters missing, named.
    """
    covered = {id(w.ours) for w in table}
    missing = [name for name, p in model.named_parameters() if id(p) not in covered]
    if missing:
        raise RuntimeError(f"The weight table of {type(model).__name__} misses {missing}.")
