"""How a transformers release binds a family's sequence-mixing kernels, and a family function with them rebound.

A hybrid family's recurrent layer calls its kernels by module-level names, and releases bind those names
differently:

- transformers 5.24: the layer's forward calls the kernels themselves (``causal_conv1d_fn``,
  ``torch_chunk_gated_delta_rule``, ``mamba2_chunk_scan``), plain functions wrapped by
  ``use_kernel_func_from_hub_with_fallback`` (which picks flash-linear-attention, mamba-ssm or causal-conv1d where
  installed and the inputs are on their device);
- transformers 5.25: the same functions are ``kernels`` ``Func`` modules (``use_kernel_forward_from_hub`` on a
  function), the class is decorated with ``use_kernelized_func`` (each call routed to a per-instance copy that
  ``kernelize`` may replace with a hub kernel), and the convolution and the scan are reached through per-layer
  wrappers that manage a generation cache (``causal_conv1d_forward(conv1d, x, cache, ...)``,
  ``mamba2_scan_forward(module, x, B, C, dt, cache)``), which call the kernels by name.

A kernel is therefore recognised by the function it is (:func:`kernel_name`: its own ``__name__`` under any
wrapping), not by the name it is bound to, and it is found where the forward reaches it: in the forward's own code
or in a function of the family's module the forward calls (:func:`reached_kernels`). :func:`rebind` gives a family
function a namespace in which each such kernel is replaced and each family function on the way to one is rebound
to the same namespace, so the family's projections, gates, norms and cache-handling wrappers run as written and
only the kernels change; the module and the family stay untouched (another model in the process is unaffected).
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from torch import nn

_DEPTH = 4  # how many family functions deep a kernel is looked for (5.25: forward -> wrapper -> kernel)


def kernel_function(binding: Any) -> Callable[..., Any] | None:
    """The Python function behind a module-level ``binding``: a function itself, or the one a ``kernels`` ``Func``
    module's forward calls (``use_kernel_forward_from_hub`` applied to a function); ``None`` for anything else."""
    if isinstance(binding, nn.Module):
        if not hasattr(type(binding), "kernel_layer_name"):  # not a kernels Func: an ordinary module
            return None
        cells = getattr(type(binding).forward, "__closure__", None) or ()
        functions = [c.cell_contents for c in cells if inspect.isfunction(c.cell_contents)]
        return functions[0] if len(functions) == 1 else None
    return binding if inspect.isfunction(binding) else None


def kernel_name(binding: Any) -> str | None:
    """The own name of the function behind ``binding`` (:func:`kernel_function`), through any ``functools.wraps``
    wrappers (transformers' fallback to a kernel package keeps the torch function as ``__wrapped__``)."""
    function = kernel_function(binding)
    return None if function is None else inspect.unwrap(function).__name__


def _global_names(code: types.CodeType) -> Iterator[str]:
    """The names ``code`` reads, its nested functions' and comprehensions' included (globals among them)."""
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _global_names(const)


def _family_calls(function: Callable[..., Any]) -> Iterator[tuple[str, Any, Callable[..., Any] | None]]:
    """``(global name, binding, family function or None)`` for every global of ``function``'s module that its code
    reads; the family function is the plain function behind the binding when it is defined in that same module."""
    family = function.__globals__
    for name in dict.fromkeys(_global_names(function.__code__)):
        if name not in family:
            continue
        binding = family[name]
        inner = kernel_function(binding)
        inner = inspect.unwrap(inner) if inner is not None else None
        yield name, binding, inner if inner is not None and inner.__globals__ is family else None


def reached_kernels(function: Callable[..., Any], depth: int = _DEPTH) -> dict[str, str]:
    """``{kernel name: the global name it is bound to}`` for every function ``function`` calls by a global name of
    its module, in its own code or in the family functions it calls (up to ``depth`` deep)."""
    found: dict[str, str] = {}
    seen: set[int] = set()

    def walk(f: Callable[..., Any], level: int) -> None:
        if id(f.__code__) in seen or level > depth:
            return
        seen.add(id(f.__code__))
        for name, binding, inner in _family_calls(f):
            if (own := kernel_name(binding)) is not None:
                found.setdefault(own, name)
            if inner is not None:
                walk(inner, level + 1)

    walk(inspect.unwrap(function), 0)
    return found


def rebind(function: Callable[..., Any], stand_ins: Mapping[str, Callable[..., Any]],
           depth: int = _DEPTH) -> types.FunctionType:
    """A copy of ``function`` (unwrapped) whose module-level kernels named in ``stand_ins`` (by
    :func:`kernel_name`) are the stand-ins, in its own code and in every family function on its way to one (those
    are copied with the same namespace). The family's namespace itself is not changed."""
    function = inspect.unwrap(function)
    namespace = dict(function.__globals__)
    reaching: dict[int, bool] = {}  # per family function: whether it reaches a stand-in (False while being walked)

    def reaches(f: Callable[..., Any], level: int) -> bool:
        key = id(f.__code__)
        if key in reaching or level > depth:
            return reaching.get(key, False)
        reaching[key] = False
        for name, binding, inner in _family_calls(f):
            if (own := kernel_name(binding)) in stand_ins:
                namespace[name] = stand_ins[own]
                reaching[key] = True
            elif inner is not None and reaches(inner, level + 1):
                namespace[name] = _copy(inner, namespace)
                reaching[key] = True
        return reaching[key]

    reaches(function, 0)
    return _copy(function, namespace)


def _copy(function: Callable[..., Any], namespace: dict[str, Any]) -> types.FunctionType:
    copy = types.FunctionType(function.__code__, namespace, function.__name__, function.__defaults__,
                              function.__closure__)
    copy.__kwdefaults__ = function.__kwdefaults__
    return copy
