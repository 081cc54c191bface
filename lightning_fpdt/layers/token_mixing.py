"""Which modules of a model mix tokens outside the computations the project runs sequence-parallel, found from the
model's behaviour.

Under sequence parallelism each rank holds a shard of the sequence. Attention is run sequence-parallel (the FPDT
pipeline); anything else that computes a position's output from other positions' inputs (a gated delta-net, a
Mamba-2 mixer, a short convolution, a hand-written causal convolution, a cumulative sum) would see only this rank's
shard and train silently wrong. No list of class names can know next month's family, so the model is asked: with its
sequence-parallel parts stood in for by position-wise ones (:class:`StandIns`), the model runs on a short random
sequence twice, the second time with one position's input changed. A module *mixes tokens* when one of its output
positions changes although that position of every one of its inputs is unchanged: its output there read another
position. The innermost such modules are reported, each with the decoder layer that holds it (:class:`TokenMixer`).

The comparison is exact: a position-wise computation of the same shapes gives the same bits at every unchanged
position. Where the shapes follow the values (experts run on the tokens routed to them, so changing one token's
route changes another's matrix product shapes), an unchanged position may round differently; a change there that is
below the dtype's rounding relative to the change where the inputs changed is not mixing.

The sequence length :data:`PROBE_LENGTH` is a prime no model dimension is expected to equal, so the sequence
dimension of any tensor (``[batch, seq, ...]``, a convolution's ``[batch, channels, seq]``, heads' ``[batch, heads,
seq, dim]``) is the one of that size. Two positions are changed in turn (near the start and near the end), so
dependencies in either direction and at any distance up to the probe's length are seen.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves, tree_map

PROBE_LENGTH = 13  # a prime: the sequence dimension of a tensor is the one of this size
CHANGED = (1, PROBE_LENGTH - 2)  # the positions changed in turn


@dataclass(frozen=True)
class TokenMixer:
    """A module that mixes tokens outside the sequence-parallel computations.

    Attributes:
        layer: the decoder layer that holds it (its name in the probed root; ``""``: none).
        module: its name in the probed root.
        kind: its class name.
    """

    layer: str
    module: str
    kind: str

    def describe(self) -> str:
        where = f"layer {self.layer}: " if self.layer else ""
        return f"{where}{self.module} ({self.kind})"


def find_token_mixers(run: Callable[[Tensor], Any], inputs: tuple[Tensor, Tensor, Tensor], root: nn.Module,
                      layers: list[tuple[str, nn.Module]]) -> list[TokenMixer]:
    """The innermost modules under ``root`` whose output at a position depends on other positions' inputs.

    A mixer found hides the ones after it (their inputs change at every position the mixer spread the change to),
    so the probe runs again with the mixers found so far silenced (their outputs replaced by zeros: position-wise),
    until it finds no new one.

    Args:
        run: runs the model on one input (its parts that are sequence-parallel already stood in for).
        inputs: the input, and the same input with position ``CHANGED[0]``, then ``CHANGED[1]``, changed
            (:func:`probe_ids`).
        root: the module whose submodules are watched (names are relative to it).
        layers: ``(name, module)`` of its decoder layers, to say which one holds a mixer.
    """
    names = {id(m): name for name, m in root.named_modules()}
    found: dict[str, nn.Module] = {}
    silenced = []
    modes = [(m, m.training) for m in root.modules()]
    root.eval()  # no dropout: the runs differ only where the changed position reaches
    try:
        while True:
            new = {name: m for name, m in _probe(run, inputs, root, names).items() if name not in found}
            if not new:
                break
            found.update(new)
            silenced += [m.register_forward_hook(_zeros) for m in new.values()]
    finally:
        for handle in silenced:
            handle.remove()
        for module, training in modes:
            module.training = training
    order = {name: i for i, name in enumerate(names.values())}
    result = []
    for name in sorted(found, key=order.__getitem__):
        layer = next((n for n, _ in layers if name == n or name.startswith(f"{n}.")), "")
        result.append(TokenMixer(layer=layer, module=name, kind=type(found[name]).__name__))
    return result


def _zeros(module: nn.Module, args: Any, output: Any) -> Any:
    return tree_map(lambda t: torch.zeros_like(t) if isinstance(t, Tensor) and t.is_floating_point() else t, output)


def _probe(run: Callable[[Tensor], Any], inputs: tuple[Tensor, ...], root: nn.Module,
           names: dict[int, str]) -> dict[str, nn.Module]:
    """The innermost modules one round of the probe finds mixing."""
    flagged: dict[str, nn.Module] = {}
    runs = []
    for x in inputs:
        with _recording(root) as calls, torch.no_grad():
            run(x)
        runs.append(calls)
    baseline, *changed_runs = runs
    for changed in changed_runs:
        for key, (module, before) in baseline.items():
            after = changed.get(key)
            if after is not None and _mixes(before, after[1]):
                flagged[names.get(id(module), "?")] = module
    return {name: m for name, m in flagged.items()
            if not any(other != name and other.startswith(f"{name}.") for other in flagged)}


def probe_ids(vocab_size: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """The probe's token ids ``[1, PROBE_LENGTH]`` on ``device``, and the two copies of them with the id at position
    ``CHANGED[i]`` changed. Drawn from a fixed seed: the same probe on every rank, so every rank decides alike."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (1, PROBE_LENGTH), generator=generator).to(device)
    changed = []
    for position in CHANGED:
        other = ids.clone()
        other[:, position] = (other[:, position] + 1) % vocab_size
        changed.append(other)
    return (ids, *changed)


# ---- the recording of every module call ------------------------------------------------------------------------

Call = tuple[list[Tensor], list[Tensor]]  # (input tensors, output tensors) of one call


@contextmanager
def _recording(root: nn.Module) -> Iterator[dict[tuple[int, int], tuple[nn.Module, Call]]]:
    """Every call of a module under ``root`` while in the block, keyed by (module, its how-many-th call)."""
    calls: dict[tuple[int, int], tuple[nn.Module, Call]] = {}
    counts: dict[int, int] = {}

    def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        ins = [t.detach().clone() for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
        outs = [t.detach().clone() for t in tree_leaves(output) if isinstance(t, Tensor)]
        n = counts.get(id(module), 0)
        counts[id(module)] = n + 1
        calls[(id(module), n)] = (module, (ins, outs))

    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in root.modules()]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def _positions(t: Tensor) -> int | None:
    """The sequence dimension of ``t``: its one dimension of size ``PROBE_LENGTH``, or ``None``."""
    dims = [d for d, n in enumerate(t.shape) if n == PROBE_LENGTH]
    return dims[0] if len(dims) == 1 else None


def _changes(before: list[Tensor], after: list[Tensor]) -> dict[int, float] | None:
    """The largest change of any of the tensors at each position that changed between the two calls (a tensor
    without a sequence dimension that changed counts at every position); ``None``: not comparable."""
    if len(before) != len(after):
        return None
    changes: dict[int, float] = {}
    for a, b in zip(before, after):
        dim = _positions(a)
        if a.shape != b.shape:
            return None
        if dim is None:
            if not torch.equal(a, b):
                changes.update(dict.fromkeys(range(PROBE_LENGTH), math.inf))
            continue
        a, b = a.movedim(dim, 0).reshape(PROBE_LENGTH, -1), b.movedim(dim, 0).reshape(PROBE_LENGTH, -1)
        if not (a.is_floating_point() or a.is_complex()):
            a, b = a.double(), b.double()
        delta = (a - b).abs().nan_to_num(nan=0.0, posinf=math.inf)
        delta[(a == b) | (a.isnan() & b.isnan())] = 0
        for position, value in enumerate(delta.amax(dim=1).tolist() if delta.shape[1] else []):
            if value > 0:
                changes[position] = max(changes.get(position, 0.0), value)
    return changes


# an output change this much smaller than the change where the inputs changed is rounding: a computation whose
# shapes follow the values (experts given the tokens routed to them) rounds other rows differently
_ROUNDING = {torch.float64: 1e-8, torch.float32: 1e-4}


def _mixes(before: Call, after: Call) -> bool:
    inputs, outputs = _changes(before[0], after[0]), _changes(before[1], after[1])
    if inputs is None or outputs is None or not any(_positions(t) is not None for t in before[1]):
        return False
    leaked = [value for position, value in outputs.items() if position not in inputs]
    if not leaked:
        return False
    scale = max((value for position, value in outputs.items() if position in inputs), default=0.0)
    dtype = next((t.dtype for t in before[1] if t.is_floating_point()), torch.float32)
    return scale == 0 or max(leaked) > _ROUNDING.get(dtype, 3e-2) * scale


# ---- the message --------------------------------------------------------------------------------------------


def refusal(owner: str, mixers: list[TokenMixer], sequence_parallel_size: int) -> str:
    """The error naming each module that mixes tokens outside the sequence-parallel computations."""
    listed = "; ".join(m.describe() for m in mixers[:6]) + (f"; and {len(mixers) - 6} more" if len(mixers) > 6 else "")
    return (
        f"{owner}: {listed} mixes tokens outside attention: its output at a position depends on other positions'"
        f" inputs, and under sequence_parallel_size={sequence_parallel_size} it would see only this rank's shard of"
        " the sequence and train silently wrong. The FPDT pipeline runs attention layers sequence-parallel, not"
        " this module. Train it with sequence_parallel_size=1 (exact: one process sees every position), or replace"
        " the module (docs/hf-support.md#hybrid-models)."
    )
