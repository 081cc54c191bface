"""``class_path``/``init_args`` dicts (LightningCLI's form of an object in a YAML) made into their objects, for
the values a CLI does not resolve itself (a transformers config class given inside ``HFCausalLM``'s ``model``
argument by hand, a checkpoint's saved ``_class_path``)."""

from __future__ import annotations

import importlib
from typing import Any


def resolve_class(class_path: str, default_module: str | None = None) -> type:
    """The class ``class_path`` names (``"package.module.Class"``; a bare ``"Class"`` is looked up in
    ``default_module``).

    Raises:
        ValueError: no such module or class, named with the fix.
    """
    module_name, _, class_name = class_path.rpartition(".")
    module_name = module_name or default_module or ""
    try:
        return getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"class_path {class_path!r} names no importable class ({err}); give the full dotted path,"
                         " e.g. lightning_fpdt.models.LlamaLM.") from None


def class_path_of(cls: type, within: type = object) -> str:
    """The dotted path :func:`resolve_class` reads back: the public one where ``lightning_fpdt.models`` exports the
    class (``lightning_fpdt.models.GPTLM``), else its defining module's; for a class made at run time (FSDP2's
    ``FSDPGPTLM`` of a sharded module), that of the first base class, a subclass of ``within``, that can be
    imported (not FSDP2's ``FSDPModule`` mixin)."""
    models = importlib.import_module("lightning_fpdt.models")
    for base in cls.__mro__:
        if not issubclass(base, within):
            continue
        if getattr(models, base.__name__, None) is base:
            return f"lightning_fpdt.models.{base.__name__}"
        module = importlib.import_module(base.__module__)
        if getattr(module, base.__qualname__, None) is base:
            return f"{base.__module__}.{base.__qualname__}"
    raise ValueError(f"{cls.__qualname__} and its base classes cannot be imported by name.")


def instantiate(value: Any) -> Any:
    """``value`` with every ``{"class_path": ..., "init_args": {...}}`` dict in it (recursively) made into its
    object; anything else as it is."""
    if isinstance(value, dict) and "class_path" in value:
        args = {k: instantiate(v) for k, v in (value.get("init_args") or {}).items()}
        return resolve_class(value["class_path"])(**args)
    return value
