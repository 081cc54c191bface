"""Which attention backend runs where: the backend names, whether flash-attn can be used here, and the rule
that turns a requested backend (``"auto"`` included) into the one that runs on a device type and dtype.

Pure rules, no kernel: configuration (:mod:`lightning_fpdt.options`) checks a run against them before any
process group exists, and :func:`lightning_fpdt.attention.kernels.get_kernel` picks its kernel by them.
"""

from __future__ import annotations

import functools
import importlib
import re
import sys
from types import ModuleType

import torch

from lightning_fpdt.errors import FPDTError

BACKENDS = ("auto", "math", "sdpa", "flash_attn")

# flash-attn releases whose private `_flash_attn_forward`/`_flash_attn_backward` have the argument lists and
# return arity that `kernels.FlashAttnKernel` calls: [2.7, 2.9). 2.6.x takes a `window_size` tuple and returns
# 8 values. Keep in step with the `flash` extra in pyproject.toml.
FLASH_ATTN_VERSIONS = ((2, 7), (2, 9))
FLASH_ATTN_REQUIREMENT = "flash-attn>=2.7,<2.9"

HALF_DTYPES = (torch.float16, torch.bfloat16)  # what flash-attn computes in

FLASH_ATTN_FIX = (
    f" install the 'flash' extra (pip install 'lightning-fpdt[flash]', i.e. {FLASH_ATTN_REQUIREMENT}) or use"
    " attention_backend='sdpa' or 'auto'."
)


@functools.cache
def load_flash_attn() -> tuple[ModuleType | None, str]:
    """``(flash_attn.flash_attn_interface, "")``, or ``(None, why it cannot be used)``; looked up once per
    process (a failed import searches the whole path, and ``auto`` asks at every attention call)."""
    try:
        # Importing, not just finding, the package: its CUDA extension can be present but unloadable.
        interface = importlib.import_module("flash_attn.flash_attn_interface")
    except (ImportError, OSError, RuntimeError) as err:  # an extension built for another torch or CUDA
        if isinstance(err, ModuleNotFoundError) and err.name == "flash_attn":
            return None, "the flash-attn package is not installed"
        return None, f"the flash-attn package is installed but does not import ({type(err).__name__}: {err})"
    version = str(getattr(sys.modules.get("flash_attn"), "__version__", "?"))
    found = re.match(r"(\d+)\.(\d+)", version)
    low, high = FLASH_ATTN_VERSIONS
    if found is None or not low <= (int(found[1]), int(found[2])) < high:
        return None, (
            f"flash-attn {version} is installed, and this backend calls its private _flash_attn_forward/"
            f"_flash_attn_backward as {FLASH_ATTN_REQUIREMENT} define them"
        )
    return interface, ""


def flash_attn_unavailable_reason() -> str | None:
    """Why the ``flash_attn`` backend cannot be used here (not installed, does not import, wrong version), or None."""
    return load_flash_attn()[1] or None


def flash_attn_available() -> bool:
    """Whether flash-attn imports (CUDA extension included) and is a release in ``FLASH_ATTN_VERSIONS``."""
    return flash_attn_unavailable_reason() is None


def resolve_backend(backend: str, device_type: str, dtype: torch.dtype) -> str:
    """The backend that ``backend`` (``auto`` included) runs as on this device type and dtype.

    ``auto``: ``flash_attn`` on CUDA with half precision when flash-attn imports and its version is
    supported (else ``sdpa``); ``sdpa`` on CPU and on CUDA for float16/bfloat16/float32; ``math`` for
    float64 on CUDA.

    Raises:
        ValueError: unknown backend name, or one that cannot run on this device or dtype.
    """
    if backend not in BACKENDS:
        raise FPDTError(f"attention_backend={backend!r} is not one of {BACKENDS}.")
    half = dtype in HALF_DTYPES
    if backend == "auto":
        if device_type == "cuda" and half and flash_attn_available():
            return "flash_attn"
        return "math" if device_type == "cuda" and dtype == torch.float64 else "sdpa"
    if backend != "flash_attn":
        return backend
    if device_type != "cuda":
        raise FPDTError(
            f"attention_backend='flash_attn' needs a CUDA device, but this run is on {device_type}."
            " Use attention_backend='sdpa' or 'auto'."
        )
    if not flash_attn_available():
        reason = flash_attn_unavailable_reason() or "the flash-attn package is not installed"
        raise FPDTError(f"attention_backend='flash_attn' but {reason};{FLASH_ATTN_FIX}")
    if not half:
        raise FPDTError(
            f"attention_backend='flash_attn' needs float16/bfloat16 inputs, got {dtype}."
            " Use attention_backend='sdpa' or 'auto'."
        )
    return backend
