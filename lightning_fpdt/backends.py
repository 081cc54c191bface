"""Which attention backend runs where: the backend names, whether flash-attn and cuDNN's attention can be used
here, and the rule that turns a requested backend (``"auto"`` included) into the one that runs on a device type and
dtype.

Pure rules, no kernel: configuration (:mod:`lightning_fpdt.options`) checks a run against them before any
process group exists, and :func:`lightning_fpdt.attention.kernels.get_kernel` picks its kernel by them.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import re
import sys
from types import ModuleType

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_fpdt.errors import FPDTError

BACKENDS = ("auto", "math", "sdpa", "cudnn", "flash_attn")

# flash-attn releases whose private `_flash_attn_forward`/`_flash_attn_backward` have the argument lists and
# return arity that `kernels.FlashAttnKernel` calls: [2.7, 2.9). 2.6.x takes a `window_size` tuple and returns
# 8 values. Keep in step with the `flash` extra in pyproject.toml.
FLASH_ATTN_VERSIONS = ((2, 7), (2, 9))
FLASH_ATTN_REQUIREMENT = "flash-attn>=2.7,<2.9"

HALF_DTYPES = (torch.float16, torch.bfloat16)  # what flash-attn computes in

# cuDNN's fused attention (through torch's aten op) is picked by "auto" from this release on: earlier ones mishandle
# sequence lengths that are not a multiple of 128 (reported with torch's cuDNN route, 2025-2026)
CUDNN_MIN_VERSION = (9, 15, 1)
CUDNN_WHEELS = ("nvidia-cudnn-cu13", "nvidia-cudnn-cu12")  # where pip's torch gets its cuDNN

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


def _cudnn_release(version: int) -> tuple[int, int, int]:
    """``torch.backends.cudnn.version()`` as ``(major, minor, patch)`` (9.x: ``major * 10000 + minor * 100 + patch``;
    8.x: ``major * 1000 + minor * 100 + patch``)."""
    if version >= 90000:
        return version // 10000, version // 100 % 100, version % 100
    return version // 1000, version // 100 % 10, version % 100


def _cudnn_wheel() -> tuple[int, int, int] | None:
    """The release of the cuDNN wheel installed beside torch, if any."""
    for name in CUDNN_WHEELS:
        try:
            found = re.match(r"(\d+)\.(\d+)\.(\d+)", importlib.metadata.version(name))
        except importlib.metadata.PackageNotFoundError:
            continue
        if found is not None:
            return int(found[1]), int(found[2]), int(found[3])
    return None


@functools.cache
def cudnn_unusable_reason(device_type: str) -> str | None:
    """Why the ``cudnn`` backend (cuDNN's fused attention through torch's aten op) is not used on ``device_type``
    here, or ``None``: it needs a CUDA device of Hopper (sm90) or newer, a torch with the op, and a loaded cuDNN of
    :data:`CUDNN_MIN_VERSION` or newer. Asked once per process (every attention call of ``auto`` asks)."""
    if device_type != "cuda":
        return f"cuDNN attention runs on CUDA devices, not {device_type}"
    if not hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"):
        return f"torch {torch.__version__} has no cuDNN attention op"
    if not torch.backends.cudnn.is_available():
        return "torch cannot load cuDNN"
    major, minor = torch.cuda.get_device_capability()
    if major < 9:
        return f"the GPU is sm{major}{minor}, and cuDNN attention is picked on Hopper (sm90) and newer"
    loaded = _cudnn_release(torch.backends.cudnn.version())
    if loaded < CUDNN_MIN_VERSION:
        wheel = _cudnn_wheel()
        shadowed = (f" (the {'.'.join(map(str, wheel))} wheel is installed: a cuDNN earlier on the library path,"
                    " LD_LIBRARY_PATH, shadows it)" if wheel is not None and wheel != loaded else "")
        return (f"the loaded cuDNN is {'.'.join(map(str, loaded))}{shadowed}; releases before"
                f" {'.'.join(map(str, CUDNN_MIN_VERSION))} mishandle lengths that are not a multiple of 128")
    return None


@functools.cache
def _say_once(message: str) -> None:
    rank_zero_info(f"FPDTStrategy: {message}")


def flash_attn_available() -> bool:
    """Whether flash-attn imports (CUDA extension included) and is a release in ``FLASH_ATTN_VERSIONS``."""
    return flash_attn_unavailable_reason() is None


def resolve_backend(backend: str, device_type: str, dtype: torch.dtype) -> str:
    """The backend that ``backend`` (``auto`` included) runs as on this device type and dtype.

    ``auto``: on CUDA with half precision, ``cudnn`` where :func:`cudnn_unusable_reason` finds nothing against it
    (else said once, with the reason), then ``flash_attn`` when flash-attn imports and its version is supported,
    else ``sdpa``; ``sdpa`` on CPU and on CUDA for float32; ``math`` for float64 on CUDA.

    Raises:
        ValueError: unknown backend name, or one that cannot run on this device or dtype.
    """
    if backend not in BACKENDS:
        raise FPDTError(f"attention_backend={backend!r} is not one of {BACKENDS}.")
    half = dtype in HALF_DTYPES
    if backend == "auto":
        if device_type == "cuda" and half:
            reason = cudnn_unusable_reason(device_type)
            if reason is None:
                return "cudnn"
            _say_once(f"attention_backend='auto' does not use cuDNN's attention: {reason}.")
            if flash_attn_available():
                return "flash_attn"
        return "math" if device_type == "cuda" and dtype == torch.float64 else "sdpa"
    if backend == "cudnn":
        reason = cudnn_unusable_reason(device_type)
        if reason is None and not half:
            reason = f"it computes in float16/bfloat16, not {dtype}"
        if reason is not None:
            raise FPDTError(f"attention_backend='cudnn' but {reason}; use attention_backend='auto' (it says what it"
                            " picks) or 'sdpa'.")
        return backend
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


def route_description(backend: str, device_type: str, dtype: torch.dtype) -> str:
    """The attention route a run of ``backend`` takes on ``device_type`` in ``dtype``, with the kernel library's
    version, in words (logged once at setup, so that a fallback cannot hide)."""
    name = resolve_backend(backend, device_type, dtype)
    if name == "cudnn":
        major, minor = torch.cuda.get_device_capability()
        loaded = ".".join(map(str, _cudnn_release(torch.backends.cudnn.version())))
        return f"cudnn (cuDNN {loaded} through torch {torch.__version__}, sm{major}{minor})"
    if name == "flash_attn":
        return f"flash_attn (flash-attn {getattr(sys.modules.get('flash_attn'), '__version__', '?')})"
    if name == "math":
        return "math (torch matrix products)"
    if device_type != "cuda":
        return f"sdpa (torch {torch.__version__}'s {device_type} flash kernel)"
    if dtype in HALF_DTYPES:
        return f"sdpa (torch {torch.__version__}'s FlashAttention-2 op)"
    return f"sdpa (torch {torch.__version__}'s memory-efficient op)"
