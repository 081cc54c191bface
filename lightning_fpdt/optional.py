"""Optional dependencies, imported where they are used, each behind one install hint.

``transformers`` is the extra ``hf``: the strategy, the bundled models and the data modules work without it;
``HFCausalLM``, conversion to and from ``transformers`` and reading a pretrained directory need it. ``peft`` (the same
extra) is needed for ``HFCausalLM(lora=...)`` only.
"""

from __future__ import annotations

import importlib
from types import ModuleType

HINTS = {"transformers": "pip install 'lightning-fpdt[hf]'", "peft": "pip install 'lightning-fpdt[hf]'"}


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
        raise ModuleNotFoundError(f"{feature} needs {package}: {HINTS.get(package, f'pip install {package}')}.",
                                  name=package) from err
