"""Which kernel each attention block ran on, tallied over a step, so that a block that left the run's route (a
softcapped layer that cuDNN's op cannot cap, a window's edge handed to the memory-efficient op as a mask, a head too
wide for cuDNN) is said, not silent.

The kernels note each forward call while a :func:`tally` is open (the strategy opens one over its first training
step, :class:`FirstStep`, and logs it once; FPDTMonitor writes it to TensorBoard); outside one, noting is a no-op.
A block's backward runs where its forward ran, so forwards are what is counted.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_LOCK = threading.Lock()
_OPEN: list[Counter[tuple[str, str]]] = []  # the tallies being filled, innermost last


def note(route: str, why: str = "") -> None:
    """Counts one kernel call on ``route`` (its words), with ``why`` it is not the run's own route (``""``: it is)."""
    if _OPEN:
        with _LOCK:
            for counts in _OPEN:
                counts[(route, why)] += 1


@contextmanager
def tally() -> Iterator[Counter[tuple[str, str]]]:
    """``{(route, why): calls}`` of the attention forwards made inside the block."""
    counts: Counter[tuple[str, str]] = Counter()
    with _LOCK:
        _OPEN.append(counts)
    try:
        yield counts
    finally:
        with _LOCK:  # by identity: another open tally may hold equal counts
            del _OPEN[next(n for n, open_ in enumerate(_OPEN) if open_ is counts)]


def describe(counts: Counter[tuple[str, str]]) -> str:
    """The tally in words, most calls first: ``"cudnn: 224 calls; math: 32 calls (cuDNN's op cannot cap the scores
    (softcap))"``."""
    if not counts:
        return "no attention call"
    parts = []
    for (route, why), calls in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
        parts.append(f"{route}: {calls} call{'s' if calls != 1 else ''}" + (f" ({why})" if why else ""))
    return "; ".join(parts)


class FirstStep:
    """Tallies the attention calls of the first step run under :meth:`watch` and says them once."""

    def __init__(self) -> None:
        self.said: str | None = None  # the first step's tally in words, once it has run (None: not yet, or none)
        self._watched = False

    @contextmanager
    def watch(self, say: Callable[[str], None]) -> Iterator[None]:
        if self._watched:
            yield
            return
        self._watched = True
        with tally() as counts:
            yield
        if counts:  # none: the model's attention is not FPDT's (nothing bound), nothing to say
            self.said = describe(counts)
            say(self.said)
