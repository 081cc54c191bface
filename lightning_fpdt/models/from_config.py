"""One way from a configuration to a LightningModule: a YAML's ``model`` section, or a checkpoint's saved hyper-
parameters. ``fpdt-train`` (LightningCLI), ``fpdt-export`` and ``python -m lightning_fpdt.memory`` all read a model
section by these rules, so a YAML that trains also exports and sizes the same model.

A section is parsed as LightningCLI parses it (:func:`model_parser`: the same ``add_lightning_class_args`` call and
the same default, ``LlamaLM``): bare class names, nested ``class_path``/``init_args`` objects, dataclass configs and
type checks are jsonargparse's. ``fpdt-train`` trains :class:`~lightning_fpdt.models.causal_lm.CausalLM` subclasses;
the parser here takes any LightningModule (the memory estimate sizes a user's own module too).

Saved hyper-parameters name their class in ``_class_path`` (a LightningCLI run); without it, ``HFCausalLM`` is known
by its ``model`` argument and a bundled family by the fields of its saved config
(:func:`~lightning_fpdt.models.convert.family_holding`).
"""

from __future__ import annotations

from argparse import ArgumentError
from contextlib import nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LightningArgumentParser

from lightning_fpdt.errors import FPDTError
from lightning_fpdt.models.bundled import BundledLM
from lightning_fpdt.models.causal_lm import CausalLM
from lightning_fpdt.models.class_paths import resolve_class
from lightning_fpdt.models.convert import family_holding

MODEL_DEFAULT = {"class_path": "lightning_fpdt.models.LlamaLM"}  # fpdt-train's default model


def model_parser() -> LightningArgumentParser:
    """A parser of the ``model`` key alone, built as ``fpdt-train``'s LightningCLI builds its ``model`` key (any
    LightningModule subclass where ``fpdt-train`` takes ``CausalLM``'s)."""
    parser = LightningArgumentParser(exit_on_error=False)
    parser.add_lightning_class_args(pl.LightningModule, "model", subclass_mode=True, required=True)
    parser.set_defaults({"model": MODEL_DEFAULT})
    return parser


def module_from_yaml(section: dict[str, Any] | None, on_meta: bool = False) -> pl.LightningModule:
    """The LightningModule of a YAML's ``model`` section (``None``: the default, ``LlamaLM``).

    Args:
        on_meta: build under the meta device (sizing and export: no memory, no weights read).

    Raises:
        ValueError: a section jsonargparse refuses (an unknown class or argument, a value of the wrong type),
            with its message.
    """
    parser = model_parser()
    try:
        config = parser.parse_object({"model": section or MODEL_DEFAULT})
    except (ArgumentError, TypeError, ValueError) as err:
        raise FPDTError(f"the YAML's model section cannot be read as fpdt-train reads it: {err}") from None
    with torch.device("meta") if on_meta else nullcontext():
        return parser.instantiate(config).model


def saved_class(hparams: dict[str, Any]) -> type[CausalLM]:
    """The LightningModule class of a checkpoint's saved hyper-parameters.

    Raises:
        ValueError: hyper-parameters that name no class and fit no known one.
    """
    if hparams.get("_class_path"):
        named = resolve_class(hparams["_class_path"], "lightning_fpdt.models")
        if isinstance(named, type) and issubclass(named, pl.LightningModule):
            return named  # else a mixin an older save recorded (FSDP2's FSDPModule): known by its arguments below
    if "model" in hparams:  # HFCausalLM saves its model argument (a path or the config's dict)
        return resolve_class("lightning_fpdt.models.HFCausalLM")
    family = family_holding(hparams.get("config") or {})
    if family is not None:
        for module in BundledLM.__subclasses__():
            if module.family is family:
                return module
    raise FPDTError(f"saved hyper-parameters {sorted(hparams)} name no LightningModule (_class_path) and are not"
                    " those of HFCausalLM, LlamaLM or GPTLM; pass the fit's YAML instead.")


def module_from_hyperparameters(hparams: dict[str, Any], on_meta: bool = False) -> CausalLM:
    """The LightningModule a checkpoint's saved hyper-parameters rebuild (:func:`saved_class`)."""
    args = {k: v for k, v in hparams.items() if k not in ("_class_path", "_instantiator")}
    with torch.device("meta") if on_meta else nullcontext():
        return saved_class(hparams)(**args)
