"""Measure the peak memory of live tensors, without interpreter or allocator overhead.

CPU has no ``torch.cuda.max_memory_allocated``. :class:`TensorMemoryTracker` is a dispatch mode that
sees every tensor an operator produces or consumes, counts each storage once while it is alive (weak
references, polled after every op) and keeps the peak. On CUDA, prefer the allocator's own figures.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class TensorMemoryTracker(TorchDispatchMode):
    """``with TensorMemoryTracker() as t: ...`` then ``t.peak_bytes`` / ``t.current_bytes``.

    Tensors alive before the block are counted from the first op that touches them, unless passed to
    :meth:`track` first (do that for parameters and optimizer state, which a training step touches late:
    otherwise the peak during backward misses the optimizer's moments). Storages touched only on other
    threads are not seen until an op here uses them.
    """

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[tuple[int, int], tuple[StorageWeakRef, int]] = {}
        self.current_bytes = 0
        self.peak_bytes = 0

    def reset_peak(self) -> None:
        self._collect()
        self.peak_bytes = self.current_bytes

    def track(self, *tensors: torch.Tensor) -> None:
        """Count these (already alive) tensors from now on."""
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._track(t)
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self._collect()
        for t in tree_flatten((args, kwargs, out))[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._track(t)
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        return out

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        key = (storage.data_ptr(), nbytes)
        if nbytes == 0 or key in self._live:
            return
        self._live[key] = (StorageWeakRef(storage), nbytes)
        self.current_bytes += nbytes

    def _collect(self) -> None:
        dead = [key for key, (ref, _) in self._live.items() if ref.expired()]
        for key in dead:
            self.current_bytes -= self._live.pop(key)[1]


def peak_step_bytes(
    step: Callable[[], Any], module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> int:
    """Peak bytes of live tensors while ``step()`` runs, counting ``module``'s parameters and
    ``optimizer``'s state from the start (run one step before, so that the state exists)."""
    alive = list(module.parameters())
    if optimizer is not None:
        alive += [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    with TensorMemoryTracker() as tracker:
        tracker.track(*alive)
        tracker.reset_peak()
        step()
    return tracker.peak_bytes
