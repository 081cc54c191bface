"""Which token-mixing layers get their sequence-parallel forward, and why the others do not: gated delta-nets (Kimi
delta attention too) and Mamba-2 mixers (:mod:`lightning_fpdt.hf.recurrent`), short convolutions
(:mod:`lightning_fpdt.hf.short_conv`), one install loop for both.

:func:`install_recurrences` gives each module :func:`~lightning_fpdt.hf.recurrent.recurrence_core` recognises a
:class:`~lightning_fpdt.hf.recurrent.SequenceParallelRecurrence` forward, once a check in one process shows it
computes what the module's own forward does. What it cannot install is kept with the reason (:class:`NotInstalled`):
a check that raised or disagreed, or a layer the suite shows exact (:data:`SEQUENCE_PARALLEL_LAYERS`) whose kernels
the installed transformers release binds in a way that is not recognised. Beyond one rank such a layer is refused
in one line naming the release, the tested range and the fix (:func:`unsupported_release`); at one rank it runs its
family's own forward.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from lightning_fpdt.errors import described
from lightning_fpdt.hf.kernel_binding import reached_kernels
from lightning_fpdt.hf.recurrent import CONV, DELTA_RULE, KDA, SCAN, SequenceParallelRecurrence, recurrence_core
from lightning_fpdt.hf.recurrent_heads import LIGHTNING
from lightning_fpdt.hf.short_conv import SequenceParallelShortConv, is_short_conv
from lightning_fpdt.hf.versions import TESTED_TRANSFORMERS, installed_transformers, untested_release_fix
from lightning_fpdt.parallel.binding import SequenceParallelContext

SEQUENCE_PARALLEL_LAYERS = frozenset({
    "Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet", "Qwen3NextGatedDeltaNet", "OlmoHybridGatedDeltaNet",
    "NemotronHMamba2Mixer", "GraniteMoeHybridMambaLayer", "BambaMixer", "FalconH1Mixer", "Zamba2MambaMixer",
    "KimiLinearDeltaAttention", "JambaMambaMixer", "MiniMaxLightningAttention",
})
"""The recurrent layers the suite shows exact at sp=2 against plain transformers (tests/hf/test_recurrent.py) with the
releases of :data:`~lightning_fpdt.hf.versions.TESTED_TRANSFORMERS`. Only the wording of a refusal reads it: a
layer of these classes that :func:`install_recurrences` cannot install is refused naming the installed release,
not as an unknown token mixer."""


class NotInstalled(NamedTuple):
    """A recurrent layer :func:`install_recurrences` did not give its sequence-parallel forward: its class, and why."""

    kind: str
    why: str


def install_recurrences(model: nn.Module) -> tuple[list[str], dict[str, NotInstalled]]:
    """Give every gated delta-net and Mamba-2 module of ``model`` (:func:`recurrence_core`) a
    :class:`SequenceParallelRecurrence` forward where it computes what the module's own forward does (checked in one
    process on random input, in chunks of 4 tokens, to the kernels' float32 rounding).

    Returns:
        The installed modules' names, and why each of the others was not installed: a module whose check failed
        (what it raised, or how far it was from the module's own forward), or a layer of
        :data:`SEQUENCE_PARALLEL_LAYERS` whose kernels this release binds in a way :func:`recurrence_core` does not
        recognise. A module on the meta device is checked once its weights are in (call again). A module that is
        not installed stays as it is: beyond one rank it is refused (:func:`unsupported_release`, or the
        token-mixing guard).
    """
    def make(module: nn.Module) -> SequenceParallelRecurrence | str | None:
        core = recurrence_core(module)
        if core is None:
            return _unrecognised(module) if type(module).__name__ in SEQUENCE_PARALLEL_LAYERS else None
        return SequenceParallelRecurrence(module, core)

    return _install(model, make, _disagreement)


def install_short_convs(model: nn.Module) -> list[str]:
    """Give every short-convolution module of ``model`` (:func:`~lightning_fpdt.hf.short_conv.is_short_conv`) a
    :class:`~lightning_fpdt.hf.short_conv.SequenceParallelShortConv` forward where it computes what the module's own
    forward does (checked on random input in one process, relative 1e-6 in the module's dtype); returns their names.
    A module that does not pass stays as it is, and the token-mixing guard refuses it beyond one rank."""
    installed, _ = _install(model, lambda m: SequenceParallelShortConv(m) if is_short_conv(m) else None,
                            _short_conv_disagreement)
    return installed


Forward = Any  # a sequence-parallel forward: SequenceParallelRecurrence or SequenceParallelShortConv


def _install(model: nn.Module, make: Callable[[nn.Module], Forward | str | None],
             disagreement: Callable[[nn.Module, Forward], str | None]) -> tuple[list[str], dict[str, NotInstalled]]:
    """The one install loop: for each module of ``model`` without an installed forward, ``make(module)`` gives its
    sequence-parallel forward, why it cannot have one (a string), or ``None`` (not such a module); a forward is
    installed where ``disagreement`` finds none (a module on the meta device waits for its weights)."""
    installed, failed = [], {}
    for name, module in model.named_modules():
        if hasattr(module.__dict__.get("forward"), "position_wise"):  # installed already (hf/mixing.py's switch)
            continue
        forward = make(module)
        if forward is None:
            continue
        if isinstance(forward, str):
            failed[name] = NotInstalled(type(module).__name__, forward)
            continue
        param = next(module.parameters(), None)
        if param is None or param.device.type == "meta":
            continue
        why = disagreement(module, forward)
        if why is None:
            module.forward = forward
            installed.append(name)
        else:
            failed[name] = NotInstalled(type(module).__name__, why)
    return installed, failed


def _unrecognised(module: nn.Module) -> str:
    reached = reached_kernels(type(module).forward)
    found = [k for k in (CONV, DELTA_RULE, KDA, SCAN) if k in reached]
    return (f"its forward does not call the kernels lightning-fpdt runs sequence-parallel ({CONV} with"
            f" {DELTA_RULE}, {KDA} or {SCAN}, under any binding); it reaches {', '.join(found) or 'none of them'}")


def unsupported_release(owner: str, failed: dict[str, NotInstalled], sequence_parallel_size: int) -> str:
    """The one-line refusal of recurrent layers :func:`install_recurrences` could not install, naming the first
    layer, the installed transformers release, the tested range and the fix."""
    name, (kind, why) = next(iter(failed.items()))
    more = f" (and {len(failed) - 1} more layer(s) alike)" if len(failed) > 1 else ""
    tested = (f" lightning-fpdt runs these layers sequence-parallel with transformers{TESTED_TRANSFORMERS} (tested)."
              if kind in SEQUENCE_PARALLEL_LAYERS else "")
    return (f"{owner}: {name} ({kind}){more} cannot run sequence-parallel (sequence_parallel_size="
            f"{sequence_parallel_size}) with the installed transformers {installed_transformers()}: {why}.{tested}"
            f" {untested_release_fix()}.")


def _disagreement(module: nn.Module, forward: SequenceParallelRecurrence) -> str | None:
    """``None`` where ``forward`` computes what ``module``'s own forward does; else why not, in words."""
    # the input in the dtype of its projections (a family may keep a vector such as A_log in float32 beside them)
    param = next((p for p in module.parameters() if p.dim() >= 2), next(module.parameters()))
    width = getattr(module, "hidden_size", None) or getattr(getattr(module, "qkv_proj", None), "in_features", None)
    if not isinstance(width, int):
        return f"{type(module).__name__} has no integer hidden_size to check its sequence-parallel forward on"
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 12, width, generator=generator).to(param.device, param.dtype)
    training = module.training
    module.eval()
    try:
        with torch.no_grad():
            extra = {} if forward.core != LIGHTNING else {"position_embeddings": None, "attention_mask": None}
            theirs = _first(type(module).forward(module, x, **extra))
            ours = _first(forward(x, fpdt_context=SequenceParallelContext(chunk_size=4), **extra))  # 3 chunks
    except Exception as err:  # a release's kernels with other arguments: reported by the refusal, not swallowed
        return f"its sequence-parallel forward raised {described(err)}"
    finally:
        module.train(training)
    if not isinstance(theirs, Tensor) or not isinstance(ours, Tensor) or theirs.shape != ours.shape:
        shapes = [tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__ for t in (theirs, ours)]
        return f"its own forward returned {shapes[0]} and the sequence-parallel one {shapes[1]}"
    # the family's kernels may compute in float32 whatever the dtype (transformers' torch ones do): agreement to
    # their rounding; a different computation is off by the size of the output
    tolerance = 1e-5 if param.dtype in (torch.float64, torch.float32) else 5e-2
    scale = theirs.abs().max().clamp_min(math.ulp(1.0))
    error = ((ours - theirs).abs().max() / scale).item()
    if error <= tolerance:
        return None
    return (f"its sequence-parallel forward differs from the module's own by {error:.2g} of the output's largest"
            f" value (allowed: {tolerance:g}) on one process in chunks of 4 tokens")


def _first(out: Any) -> Any:
    """A layer's output, or the first of the outputs it returns (lightning attention returns its state beside it)."""
    return out[0] if isinstance(out, tuple) else out


def _short_conv_disagreement(module: nn.Module, forward: SequenceParallelShortConv) -> str | None:
    """``None`` where ``forward`` computes what the short convolution's own forward does; else why not."""
    param = next(module.parameters())
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 7, module.in_proj.in_features, generator=generator).to(param.device, param.dtype)
    with torch.no_grad():
        try:
            theirs = type(module).forward(module, x)
        except Exception as err:  # a module whose own forward takes other inputs: not such a layer after all
            return f"its own forward raised {type(err).__name__} on a plain input"
        ours = forward(x)
    if not isinstance(theirs, Tensor) or theirs.shape != ours.shape:
        return "its own forward returns another shape"
    tolerance = 1e-10 if param.dtype == torch.float64 else 1e-5
    error = ((ours - theirs).abs().max() / theirs.abs().max().clamp_min(1e-30)).item()
    return None if error <= tolerance else f"its sequence-parallel forward differs from its own by {error:.2g}"
