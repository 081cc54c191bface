"""Optional dependencies, imported where they are used, each behind one install hint.

``transformers`` is the extra ``hf``: the strategy, the bundled models and the data modules work without it;
``HFCausalLM``, conversion to and from ``transformers`` and reading a pretrained directory need it. ``peft`` (the same
extra) is needed for ``HFCausalLM(lora=...)`` only. Both need Python 3.11 or newer: the transformers releases the extra
names (5.24 on) require it, so on Python 3.10 the extra does not install and the hint says which Python to use.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

HINTS = {"transformers": "pip install 'lightning-fpdt[hf]'", "peft": "pip install 'lightning-fpdt[hf]'"}
# the oldest Python the hf extra's releases install on (transformers 5.24.0: Requires-Python >=3.11)
HF_PYTHON = (3, 11)


def install_hint(package: str, python: tuple[int, ...] | None = None) -> str:
    """How to get ``package``: the extra that brings it, or, on a Python older than the extra's releases need
    (``python``: ``sys.version_info`` when not given), that Python first."""
    python = tuple(sys.version_info[:3]) if python is None else python
    if package in HINTS and python[:2] < HF_PYTHON:
        oldest, this = ".".join(map(str, HF_PYTHON)), ".".join(map(str, python[:3]))
        return (f"the releases the 'hf' extra names need Python >= {oldest} (transformers 5.24 on), and this is Python"
                f" {this}: use Python {oldest} or newer, then {HINTS[package]}")
    return HINTS.get(package, f"pip install {package}")


def require(module: str, feature: str) -> ModuleType:
    """The module ``module`` (``"transformers"`` or one of its submodules), imported now.

    Args:
        feature: what needs it, for the message (``"HFCausalLM"``, ``"LlamaLM(hf_checkpoint=...)"``).

    Raises:
        ModuleNotFoundError: the package is not installed, with the command that installs it.
    """
    package = module.split(".")[0]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name != package:
            raise
        raise ModuleNotFoundError(f"{feature} needs {package}: {install_hint(package)}.",
                                  name=package) from err
