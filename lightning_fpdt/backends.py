"""Which attention backend runs where: the backend names, whether flash-attn (2, 3 or 4) and cuDNN's attention can
be used here, and the rule that turns a requested backend (``"auto"`` included) into the one that runs on a device
type and dtype.

Pure rules, no kernel: configuration (:mod:`lightning_fpdt.options`) checks a run against them before any
process group exists, and :func:`lightning_fpdt.attention.kernels.get_kernel` picks its kernel by them.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_fpdt.errors import FPDTError

BACKENDS = ("auto", "math", "sdpa", "cudnn", "flash_attn", "flash_attn_3", "flash_attn_4")

# flash-attn releases whose private `_flash_attn_forward`/`_flash_attn_backward` have the argument lists and
# return arity that `kernels.FlashAttnKernel` calls: [2.7, 2.9). 2.6.x takes a `window_size` tuple and returns
# 8 values. Keep in step with the `flash` extra in pyproject.toml.
FLASH_ATTN_VERSIONS = ((2, 7), (2, 9))
FLASH_ATTN_REQUIREMENT = "flash-attn>=2.7,<2.9"

HALF_DTYPES = (torch.float16, torch.bfloat16)  # what flash-attn computes in
HALF_ONLY_BACKENDS = ("cudnn", "flash_attn", "flash_attn_3", "flash_attn_4")

# cuDNN's fused attention (through torch's aten op) is picked by "auto" from this release on: earlier ones mishandle
# sequence lengths that are not a multiple of 128 (reported with torch's cuDNN route, 2025-2026)
CUDNN_MIN_VERSION = (9, 15, 1)
CUDNN_WHEELS = ("nvidia-cudnn-cu13", "nvidia-cudnn-cu12")  # where pip's torch gets its cuDNN

FLASH_ATTN_FIX = (
    f" install the 'flash' extra (pip install 'lightning-fpdt[flash]', i.e. {FLASH_ATTN_REQUIREMENT}) or use"
    " attention_backend='sdpa' or 'auto'."
)


class NotInstalled(str):
    """Why a package cannot be used, when the reason is that it is not installed: the one reason ``auto`` passes over
    in silence, and the one whose fix is to install it."""


class InstalledUnusable(str):
    """Why a package cannot be used although it is installed (it does not import; its version or interface is not
    the one its route calls): ``auto`` says it once, since the user installed it to be used."""


@functools.cache
def load_flash_attn() -> tuple[ModuleType | None, str]:
    """``(flash_attn.flash_attn_interface, "")``, or ``(None, why it cannot be used)``; looked up once per
    process (a failed import searches the whole path, and ``auto`` asks at every attention call)."""
    try:
        # Importing, not just finding, the package: its CUDA extension can be present but unloadable.
        interface = importlib.import_module("flash_attn.flash_attn_interface")
    except (ImportError, OSError, RuntimeError) as err:  # an extension built for another torch or CUDA
        if isinstance(err, ModuleNotFoundError) and err.name == "flash_attn":
            return None, NotInstalled("the flash-attn package is not installed")
        return None, InstalledUnusable(f"the flash-attn package is installed but does not import ({type(err).__name__}:"
                                       f" {err})")
    version = str(getattr(sys.modules.get("flash_attn"), "__version__", "?"))
    found = re.match(r"(\d+)\.(\d+)", version)
    low, high = FLASH_ATTN_VERSIONS
    if found is None or not low <= (int(found[1]), int(found[2])) < high:
        return None, InstalledUnusable(
            f"flash-attn {version} is installed, and this backend calls its private _flash_attn_forward/"
            f"_flash_attn_backward as {FLASH_ATTN_REQUIREMENT} define them"
        )
    return interface, ""


@dataclass(frozen=True)
class FlashPackage:
    """A FlashAttention package that a route calls through its private forward and backward functions.

    Their argument lists change between commits and the packages have no release to pin (FlashAttention-3 is built
    from source), so what is checked when the package loads is the interface itself: each function in ``calls``
    takes every keyword the route passes, and every argument it does not pass has a default.
    """

    backend: str  # the attention_backend name
    title: str
    module: str  # imported; it loads the package's kernels
    distribution: str  # its version, for the logs
    calls: tuple[tuple[str, tuple[str, ...]], ...]  # (function, the keywords the route passes); nothing positional
    runs_on: tuple[int, ...]  # GPU compute-capability majors the package has kernels for
    auto_on: tuple[int, ...]  # where ``auto`` picks it (when cuDNN's attention is not usable)
    install: str


FLASH_ATTN_3 = FlashPackage(
    "flash_attn_3", "FlashAttention-3", "flash_attn_interface", "flash_attn_3",
    calls=(
        ("_flash_attn_forward", ("q", "k", "v", "softmax_scale", "causal", "window_size_left", "window_size_right",
                                 "softcap")),
        ("_flash_attn_backward", ("dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "softmax_scale",
                                  "is_causal", "window_size_left", "window_size_right", "softcap")),
    ),
    runs_on=(8, 9), auto_on=(9,),
    install="build it from flash-attention's hopper/ directory (pip install --no-build-isolation . there)",
)
FLASH_ATTN_4 = FlashPackage(
    "flash_attn_4", "FlashAttention-4", "flash_attn.cute.interface", "flash-attn-4",
    calls=(
        ("_flash_attn_fwd", ("q", "k", "v", "softmax_scale", "causal", "softcap", "window_size_left",
                             "window_size_right", "return_lse")),
        ("_flash_attn_bwd", ("q", "k", "v", "out", "dout", "lse", "softmax_scale", "causal", "softcap",
                             "window_size_left", "window_size_right")),
    ),
    runs_on=(9, 10, 11, 12), auto_on=(9, 10, 11, 12),
    install="pip install 'lightning-fpdt[flash4]' (the flash-attn-4 package)",
)
# auto's order: on Hopper FlashAttention-3, its own build, before FlashAttention-4; on Blackwell only -4 runs
FLASH_PACKAGES = {package.backend: package for package in (FLASH_ATTN_3, FLASH_ATTN_4)}


def _arguments(function: Callable) -> dict[str, bool] | None:
    """``{argument name: has a default}`` of a plain function or a ``torch.library`` custom op (FlashAttention-3
    registers its functions as ops, whose Python signature is ``(*args, **kwargs)``); None where neither says."""
    schema = getattr(getattr(function, "_opoverload", None), "_schema", None)
    if schema is not None:
        return {argument.name: argument.has_default_value() for argument in schema.arguments}
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters):
        return None
    return {p.name: p.default is not p.empty for p in parameters}


def interface_problem(module: ModuleType, package: FlashPackage) -> str | None:
    """Why ``module`` does not take the calls ``package``'s route makes, or None."""
    for name, passed in package.calls:
        function = getattr(module, name, None)
        if function is None:
            return f"{package.module} has no {name}"
        arguments = _arguments(function)
        if arguments is None:
            return f"the arguments of {package.module}.{name} cannot be read"
        unknown = [key for key in passed if key not in arguments]
        required = [key for key, has_default in arguments.items() if key not in passed and not has_default]
        if unknown or required:
            what = "; ".join(filter(None, [
                f"it takes no {', '.join(unknown)}" if unknown else "",
                f"it requires {', '.join(required)}, which this route does not pass" if required else "",
            ]))
            return f"its {name} is not the one this route calls ({what})"
    return None


def package_version(package: FlashPackage) -> str:
    try:
        return importlib.metadata.version(package.distribution)
    except importlib.metadata.PackageNotFoundError:
        return "?"


@functools.cache
def load_flash_package(backend: str) -> tuple[ModuleType | None, str]:
    """``(the package's interface module, "")``, or ``(None, why it cannot be used)``; looked up once per process."""
    package = FLASH_PACKAGES[backend]
    try:
        module = importlib.import_module(package.module)
    except Exception as err:  # an extension built for another torch, CUDA or DSL release: not used, named
        parts = package.module.split(".")
        prefixes = {".".join(parts[:n]) for n in range(1, len(parts) + 1)}  # flash_attn alone is flash-attn 2's
        if isinstance(err, ModuleNotFoundError) and err.name in prefixes:
            return None, NotInstalled(f"the {package.title} package ({package.distribution}) is not installed")
        return None, InstalledUnusable(f"the {package.title} package is installed but does not import"
                                       f" ({type(err).__name__}: {err})")
    problem = interface_problem(module, package)
    if problem is not None:
        return None, InstalledUnusable(f"{package.title} {package_version(package)} is installed, but {problem}")
    return module, ""


def flash_package_unusable_reason(backend: str, device_type: str, auto: bool = False) -> str | None:
    """Why the FlashAttention-3/4 route ``backend`` cannot run (or, with ``auto``, is not picked) here, or None."""
    package = FLASH_PACKAGES[backend]
    if device_type != "cuda":
        return f"{package.title} runs on CUDA devices, not {device_type}"
    majors = package.auto_on if auto else package.runs_on
    # the GPU before the import: the package's kernels are of no use on another generation (and without a GPU, as
    # in the tests' pretend machines, the package decides)
    major, minor = torch.cuda.get_device_capability() if torch.cuda.is_available() else (majors[0], 0)
    if major not in majors:
        where, verb = "/".join(f"sm{m}x" for m in majors), "is picked by auto on" if auto else "runs on"
        return f"the GPU is sm{major}{minor}, and {package.title} {verb} {where}"
    return load_flash_package(backend)[1] or None


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


def flash_route(device_type: str) -> str:
    """The FlashAttention package ``auto`` takes on CUDA in half precision where cuDNN's route is not used, and where
    the blocks cuDNN's op declines go (softcaps, window edges, wide heads): ``flash_attn_3`` (sm90), ``flash_attn_4``
    (sm90 and newer), ``flash_attn``, or ``"sdpa"`` where none is installed and usable. A package installed but not
    usable is named once."""
    for package in FLASH_PACKAGES:
        reason = flash_package_unusable_reason(package, device_type, auto=True)
        if reason is None:
            return package
        if isinstance(reason, InstalledUnusable):  # installed, yet not used: say so
            _say_once(f"{FLASH_PACKAGES[package].title} is not used: {reason}.")
    return "flash_attn" if flash_attn_available() else "sdpa"


def resolve_backend(backend: str, device_type: str, dtype: torch.dtype) -> str:
    """The backend that ``backend`` (``auto`` included) runs as on this device type and dtype.

    ``auto``: on CUDA with half precision, ``cudnn`` where :func:`cudnn_unusable_reason` finds nothing against it
    (else said once, with the reason), then ``flash_attn_3`` (sm90) and ``flash_attn_4`` (sm90 and newer) where
    installed with the interface their routes call (one installed but not usable is said once), then ``flash_attn``
    when flash-attn imports and its version is supported, else ``sdpa``; ``sdpa`` on CPU and on CUDA for float32;
    ``math`` for float64 on CUDA.

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
            return flash_route(device_type)
        return "math" if device_type == "cuda" and dtype == torch.float64 else "sdpa"
    if backend == "cudnn":
        reason = cudnn_unusable_reason(device_type)
        if reason is None and not half:
            reason = f"it computes in float16/bfloat16, not {dtype}"
        if reason is not None:
            raise FPDTError(f"attention_backend='cudnn' but {reason}; use attention_backend='auto' (it says what it"
                            " picks) or 'sdpa'.")
        return backend
    if backend in FLASH_PACKAGES:
        reason = flash_package_unusable_reason(backend, device_type)
        if reason is None and not half:
            reason = f"it computes in float16/bfloat16, not {dtype}"
        if reason is not None:
            fix = f" {FLASH_PACKAGES[backend].install}, or" if isinstance(reason, NotInstalled) else ""
            raise FPDTError(f"attention_backend={backend!r} but {reason};{fix} use attention_backend='auto' (it says"
                            " what it picks) or 'sdpa'.")
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
        declined = route_description(flash_route(device_type), device_type, dtype)
        return (f"cudnn (cuDNN {loaded} through torch {torch.__version__}, sm{major}{minor}; the blocks its op"
                f" declines: {declined})")
    if name == "flash_attn":
        return f"flash_attn (flash-attn {getattr(sys.modules.get('flash_attn'), '__version__', '?')})"
    if name in FLASH_PACKAGES:
        package, (major, minor) = FLASH_PACKAGES[name], torch.cuda.get_device_capability()
        return f"{name} ({package.title} {package_version(package)}, sm{major}{minor})"
    if name == "math":
        return "math (torch matrix products)"
    if device_type != "cuda":
        return f"sdpa (torch {torch.__version__}'s {device_type} flash kernel)"
    if dtype in HALF_DTYPES:
        return f"sdpa (torch {torch.__version__}'s FlashAttention-2 op)"
    return f"sdpa (torch {torch.__version__}'s memory-efficient op)"
