"""Each weight cast once per forward and once per recomputation under mixed precision.

Autocast casts a float32 weight to the compute dtype at every op that uses it, and Lightning's mixed-precision plugin
turns autocast's cast cache off. FPDT runs a layer's weights many times per pass (once per attention chunk, MLP tile
and loss tile), so without a cache a 64K-token chunk size or 1024-token tiles multiplied the casts of every weight.
Inside :func:`weights_cast_once` each weight is cast once:

- the ``nn.Linear`` weights and biases of a module (the ones autocast would cast: its matrix products) are swapped,
  for the scope, for their casts, so the module's own forward (an FPDT block's, a transformers layer's, a tiled MLP's)
  multiplies by them without another cast;
- a weight used by a closure (the tiled loss's output embedding) is cast on first use through :func:`autocast_weight`.

A cast is a detached leaf in the compute dtype that requires grad when its weight does, so a scope may be made with
or without grad mode and used in either. Whoever differentiates inside a scope takes the gradient with respect to the
casts as well as the weights (:func:`with_casts`) and adds the two, in float32 or wider, for the weight; an autograd
Function called inside a scope takes the weights themselves as its inputs (:func:`original`), so its gradient reaches
them in their own dtype. The matrix products compute what autocast computes (a cast is autocast's cast), and a
weight's gradient from each chunk or tile is summed in float32 as before. Two differences from autocast without a
cache: a Linear used twice in one differentiated graph has its two gradients added in the compute dtype (autograd
adds them at the cast; the layers FPDT runs use each once per chunk or tile), and anything else that reads a swapped
weight sees it in the compute dtype (``x.to(linear.weight.dtype)``, a Linear called with autocast switched off).

Scopes nest: an inner scope of the same dtype shares the outer one's casts (a tiled MLP inside a recomputed layer).
Without autocast, or for weights already in the compute dtype (FSDP2's mixed-precision policy gathers them in it),
nothing is cast or swapped.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import Tensor, nn

from lightning_fpdt.offload.autocast_state import AutocastState

_SCOPE: ContextVar[_Casts | None] = ContextVar("fpdt_weight_casts", default=None)


class _Casts:
    """The casts of one scope (and of the scopes nested in it): weight -> cast, cast -> weight."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.by_weight: dict[int, Tensor] = {}
        self.weights: dict[int, Tensor] = {}

    def cast(self, weight: Tensor) -> Tensor:
        found = self.by_weight.get(id(weight))
        if found is None:
            with torch.no_grad():
                found = weight.to(self.dtype).requires_grad_(weight.requires_grad)
            self.by_weight[id(weight)] = found
            self.weights[id(found)] = weight
        return found


def _castable(t: Tensor, dtype: torch.dtype) -> bool:
    """Whether autocast would cast ``t`` to ``dtype`` (a floating tensor of another dtype, float64 excepted)."""
    return t.is_floating_point() and t.dtype not in (dtype, torch.float64)


@contextmanager
def weights_cast_once(params: nn.Module | Sequence[nn.Module | Tensor], autocast: AutocastState) -> Iterator[None]:
    """Inside, each weight of ``params`` is cast to ``autocast``'s dtype once (module docstring): the ``nn.Linear``
    weights and biases of a module (or of each module of a sequence) are swapped for their casts; tensors (a
    closure's weights) are cast by :func:`autocast_weight`. Nothing happens unless ``autocast`` is on: the state a
    forward runs in (``AutocastState.capture``), or the one a backward restores piece by piece (its own work between
    the pieces stays outside autocast)."""
    if not autocast.enabled:
        yield
        return
    dtype = autocast.dtype
    assert dtype is not None
    outer = _SCOPE.get()
    scope = outer if outer is not None and outer.dtype == dtype else _Casts(dtype)
    token = _SCOPE.set(scope)
    swapped: list[tuple[nn.Module, str, Tensor]] = []
    try:
        roots = [params] if isinstance(params, nn.Module) else [p for p in params if isinstance(p, nn.Module)]
        for module in (m for root in roots for m in root.modules()):
            if not isinstance(module, nn.Linear):
                continue
            for name in ("weight", "bias"):
                weight = module._parameters.get(name)
                if weight is not None and _castable(weight, dtype):
                    module._parameters[name] = scope.cast(weight)  # type: ignore[assignment]
                    swapped.append((module, name, weight))
        yield
    finally:
        for module, name, weight in reversed(swapped):
            module._parameters[name] = weight  # type: ignore[assignment]
        _SCOPE.reset(token)


def autocast_weight(weight: Tensor) -> Tensor:
    """``weight`` as a product inside the open scope should use it: its cast (made once), or ``weight`` itself where
    no scope casts (autocast then casts it at the op, as without this module)."""
    scope = _SCOPE.get()
    if scope is None or not _castable(weight, scope.dtype) or id(weight) in scope.weights:
        return weight
    return scope.cast(weight)


def original(t: Tensor) -> Tensor:
    """The weight behind a cast of the open scope; any other tensor as it is."""
    scope = _SCOPE.get()
    return t if scope is None else scope.weights.get(id(t), t)


def with_casts(weights: Sequence[Tensor]) -> list[Tensor | None]:
    """For each of ``weights``, its cast in the open scope when it has one (``None`` otherwise): the other tensor its
    gradient arrives at inside the scope."""
    scope = _SCOPE.get()
    return [None if scope is None else scope.by_weight.get(id(w)) for w in weights]
