"""``class_path``/``init_args`` dicts (LightningCLI's form of an object in a YAML) made into their objects, for
the values a CLI does not resolve itself (a transformers config class given inside ``HFCausalLM``'s ``model``
argument by hand, a checkpoint's saved ``_class_path``), and the public path of a class, which the package records on
the classes it exports (:func:`publish`) rather than looking its modules up by name."""

from __future__ import annotations

import importlib
from typing import Any

import lightning.pytorch as pl

from lightning_fpdt.errors import FPDTError

IMPORT_ERRORS = (ImportError, AttributeError, ValueError)  # what importing a dotted path raises for a bad one


def import_named(path: str, default_module: str | None = None) -> Any:
    """What the dotted ``path`` names (a bare name: in ``default_module``).

    Raises:
        ImportError, AttributeError, ValueError: no such module or name (:data:`IMPORT_ERRORS`)."""
    module_name, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module_name or default_module or ""), name)


def resolve_class(class_path: str, default_module: str | None = None) -> type:
    """The class ``class_path`` names (``"package.module.Class"``; a bare ``"Class"`` is looked up in
    ``default_module``).

    Raises:
        ValueError: no such module or class, named with the fix.
    """
    try:
        return import_named(class_path, default_module)
    except IMPORT_ERRORS as err:
        raise FPDTError(f"class_path {class_path!r} names no importable class ({err}); give the full dotted path,"
                        " e.g. lightning_fpdt.models.LlamaLM.") from None


_PUBLIC_PATH = "__fpdt_public_path__"  # set on a class by publish(), read from the class's own __dict__


def publish(package: str, *classes: type) -> None:
    """Record that ``package`` exports each of ``classes`` under its own name (``lightning_fpdt.models`` publishes
    its models, ``lightning_fpdt.hf.causal_lm`` publishes ``HFCausalLM`` there): :func:`class_path_of` names them so.
    Subclasses are not published by inheritance."""
    for cls in classes:
        setattr(cls, _PUBLIC_PATH, f"{package}.{cls.__name__}")


def class_path_of(cls: type, within: type = object) -> str:
    """The dotted path :func:`resolve_class` reads back: the public one where the package exports the class
    (:func:`publish`: ``lightning_fpdt.models.GPTLM``), else its defining module's; for a class made at run time
    (FSDP2's ``FSDPGPTLM`` of a sharded module), that of the first base class, a subclass of ``within``, that can be
    imported (not FSDP2's ``FSDPModule`` mixin)."""
    for base in cls.__mro__:
        if not issubclass(base, within):
            continue
        if _PUBLIC_PATH in vars(base):
            return vars(base)[_PUBLIC_PATH]
        module = importlib.import_module(base.__module__)
        if getattr(module, base.__qualname__, None) is base:
            return f"{base.__module__}.{base.__qualname__}"
    raise FPDTError(f"{cls.__qualname__} and its base classes cannot be imported by name.")


def instantiate(value: Any) -> Any:
    """``value`` with every ``{"class_path": ..., "init_args": {...}}`` dict in it (recursively) made into its
    object; anything else as it is."""
    if isinstance(value, dict) and "class_path" in value:
        args = {k: instantiate(v) for k, v in (value.get("init_args") or {}).items()}
        return resolve_class(value["class_path"])(**args)
    return value


def check_saved_class(class_path: str | None, cls: type) -> None:
    """Refuse to build ``cls`` from a checkpoint whose hyper-parameters name another class (``class_path``, as
    :func:`class_path_of` wrote it; ``None``: nothing named). A path that no longer imports is not held against it.

    Raises:
        FPDTError: the checkpoint's class is not ``cls`` or one of its subclasses, naming both.
    """
    if class_path is None:
        return
    try:
        saved = import_named(class_path)
    except IMPORT_ERRORS:
        return
    # a name that is no LightningModule (an older save's FSDP2 mixin, FSDPModule) says nothing against cls
    if isinstance(saved, type) and issubclass(saved, pl.LightningModule) and not issubclass(saved, cls):
        raise FPDTError(f"{cls.__name__}: the checkpoint holds a {class_path}; load it with that class"
                        f" ({class_path.rpartition('.')[2]}.load_from_checkpoint), or with"
                        " lightning_fpdt.models.from_config.module_from_hyperparameters, which reads the class.")

