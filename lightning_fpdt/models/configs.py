"""Config helpers shared by the LightningModules: overrides of a dataclass config, and options that older
checkpoints kept in the config."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from lightning_fpdt.errors import FPDTError

Config = TypeVar("Config")


def with_overrides(config: Config, overrides: dict[str, Any] | None, owner: str) -> Config:
    """A copy of the dataclass ``config`` with the fields of ``overrides`` replaced (validated again).

    Raises:
        ValueError: a key that is not a field of the config, named with the fields there are.
    """
    if not overrides:
        return config
    names = [f.name for f in dataclasses.fields(config)]
    unknown = [key for key in overrides if key not in names]
    if unknown:
        raise FPDTError(f"{owner}: config_overrides {unknown} are not fields of {type(config).__name__}; its fields"
                        f" are {names}.")
    return dataclasses.replace(config, **overrides)


def config_and_options(config: dict[str, Any], options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(config, options)`` with a ``loss_tiles`` key of a model's config dict moved to the LightningModule's
    options: the loss's tiles are :class:`CausalLM`'s, and older checkpoints and YAMLs kept them in the config.

    Raises:
        ValueError: ``loss_tiles`` in both, with different values.
    """
    if "loss_tiles" not in config:
        return config, options
    config = dict(config)
    tiles = config.pop("loss_tiles")
    if "loss_tiles" in options and options["loss_tiles"] != tiles:
        raise FPDTError(
            f"CausalLM: loss_tiles={options['loss_tiles']!r} and config.loss_tiles={tiles!r} disagree; loss_tiles"
            " is the LightningModule's option: give it once, outside the model config."
        )
    return config, {**options, "loss_tiles": tiles}
