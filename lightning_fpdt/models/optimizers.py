"""The optimizer and learning-rate schedule of a :class:`~lightning_fpdt.models.CausalLM`.

By default AdamW (matrices decayed; norms, biases and embeddings not) under a linear warm-up and a cosine decay to a
floor, stepped every optimizer step. Any torch optimizer or scheduler replaces them by class path, as LightningCLI
writes one (``{"class_path": "torch.optim.SGD", "init_args": {"lr": 0.1}}``; ``fpdt-train`` links its top-level
``optimizer:`` and ``lr_scheduler:`` keys to the model's arguments of those names). They are made in
``configure_optimizers``, on the parameters the strategy set up (sharded or not), so the spec is plain data that a
checkpoint keeps and a resumed run makes again.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.cli import instantiate_class
from torch import nn

from lightning_fpdt.errors import FPDTError
from lightning_fpdt.models.class_paths import IMPORT_ERRORS, import_named

SCHEDULER_BASES = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


def checked_spec(spec: Any, what: str, bases: tuple[type, ...], owner: str) -> dict[str, Any] | None:
    """``spec`` (``None``, a class path, or ``{"class_path", "init_args"}``) as a dict, its class imported and
    checked to be one of ``bases``.

    Raises:
        FPDTError: not a class path of such a class, or init_args that are not a dict; naming the value."""
    if spec is None:
        return None
    if isinstance(spec, str):
        spec = {"class_path": spec}
    if not isinstance(spec, dict) or not isinstance(spec.get("class_path"), str):
        raise FPDTError(f"{owner}: {what}={spec!r} must be a class path, or a dict with 'class_path' (e.g."
                        f" 'torch.optim.SGD') and 'init_args'.")
    init_args = spec.get("init_args") or {}
    if not isinstance(init_args, dict):
        raise FPDTError(f"{owner}: {what}.init_args={init_args!r} must be a dict of the class's arguments.")
    cls = _import(spec["class_path"], what, owner)
    if not (isinstance(cls, type) and issubclass(cls, bases)):
        raise FPDTError(f"{owner}: {what} class_path {spec['class_path']!r} is not a"
                        f" {' or '.join(b.__name__ for b in bases)} class.")
    return {"class_path": spec["class_path"], "init_args": dict(init_args)}


def _import(path: str, what: str, owner: str) -> Any:
    try:
        return import_named(path)
    except IMPORT_ERRORS as err:
        raise FPDTError(f"{owner}: {what} class_path {path!r} cannot be imported ({type(err).__name__}: {err});"
                        " give the full module path, e.g. 'torch.optim.AdamW'.") from None


def parameter_groups(module: nn.Module, weight_decay: float | None) -> list[dict[str, Any]]:
    """The trainable parameters in two groups: matrices (decayed) and the rest (norms, biases, embeddings: weight
    decay 0). ``weight_decay=None``: the first group takes the optimizer's own."""
    decay, no_decay = [], []
    for name, p in module.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 and "embed" not in name else no_decay).append(p)
    first = {"params": decay} if weight_decay is None else {"params": decay, "weight_decay": weight_decay}
    return [first, {"params": no_decay, "weight_decay": 0.0}]


def warmup_cosine(warmup: int, total: int, floor: float) -> Callable[[int], float]:
    """The factor of each group's initial learning rate at an optimizer step: linear from ``1 / warmup`` to 1 over
    ``warmup`` steps, then a cosine to ``floor`` at ``total``."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def make_optimizers(module: nn.Module, optimizer: dict[str, Any] | None, lr_scheduler: dict[str, Any] | None,
                    adamw: dict[str, Any], warmup: int, floor: float, total_steps: int) -> dict[str, Any]:
    """``configure_optimizers``' result: ``optimizer`` (a spec; ``None``: AdamW with ``adamw``'s ``lr``,
    ``betas`` and ``weight_decay``) on :func:`parameter_groups`, and ``lr_scheduler`` (a spec made on it; ``None``:
    :func:`warmup_cosine` over ``total_steps``), stepped every optimizer step."""
    if optimizer is None:
        made = torch.optim.AdamW(parameter_groups(module, adamw["weight_decay"]), lr=adamw["lr"],
                                 betas=adamw["betas"])
    else:
        made = instantiate_class(parameter_groups(module, None), optimizer)
    if lr_scheduler is None:
        scheduler = torch.optim.lr_scheduler.LambdaLR(made, warmup_cosine(warmup, total_steps, floor))
    else:
        scheduler = instantiate_class(made, lr_scheduler)
    config: dict[str, Any] = {"scheduler": scheduler, "interval": "step"}
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        config["monitor"] = "train/loss"  # the token-weighted training loss, logged every step
    return {"optimizer": made, "lr_scheduler": config}
