"""Measure the peak memory of live tensors, without interpreter or allocator overhead.

CPU has no ``torch.cuda.max_memory_allocated``. :class:`TensorMemoryTracker` is a dispatch mode that
sees every tensor an operator produces or consumes, counts each storage once while it is alive (weak
references, polled after every op) and keeps the peak. The offload's host buffers
(:func:`lightning_fpdt.offload.copy_engine.host_buffer`) are not counted: on CPU under ``offload="emulate"`` the figure
is then what a GPU would hold on the device. On CUDA, prefer the allocator's own figures.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lightning_fpdt.offload.copy_engine import host_buffer


class TensorMemoryTracker(TorchDispatchMode):
    """``with TensorMemoryTracker() as t: ...`` then ``t.peak_bytes`` / ``t.current_bytes``.

    Tensors alive before the block are counted from the first op that touches them, unless passed to
    :meth:`track` first (do that for parameters and optimizer state, which a training step touches late:
    otherwise the peak during backward misses the optimizer's moments). Storages touched only on other
    threads are not seen until an op here uses them. A ``DTensor`` counts as its local shard.

    Args:
        resizable: re-read every live storage's size after each op, for storages resized in place outside the
            dispatcher: FSDP2 frees and re-allocates its unsharded parameters that way. Slower; without it a
            storage counts with the size it had when first seen.
    """

    def __init__(self, resizable: bool = False) -> None:
        super().__init__()
        self._resizable = resizable
        self._live: dict[Any, tuple[StorageWeakRef, int]] = {}
        self._counted = 0  # bytes of the storages in _live, some of which may have died since the last collection
        self.peak_bytes = 0

    @property
    def current_bytes(self) -> int:
        """Bytes of the live tensors counted now."""
        self._collect()
        return self._counted

    def reset_peak(self) -> None:
        self.peak_bytes = self.current_bytes

    def track(self, *tensors: torch.Tensor) -> None:
        """Count these (already alive) tensors from now on."""
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._track(t)
        self._new_peak()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self._resizable:  # sizes change in place: read them after every op
            self._collect()
        for t in tree_flatten((args, kwargs, out))[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._track(t)
        self._new_peak()
        return out

    def _new_peak(self) -> None:
        # the count is never below the live bytes, so a new peak can only be where the count passes the old one:
        # only there are the dead storages collected (the same peak as collecting after every op, far cheaper)
        if self._counted > self.peak_bytes:
            self._collect()
            self.peak_bytes = max(self.peak_bytes, self._counted)

    def _track(self, t: torch.Tensor) -> None:
        local = getattr(t, "_local_tensor", None)  # a DTensor: the wrapper has no storage, its shard has
        try:
            storage = (local if isinstance(local, torch.Tensor) else t).untyped_storage()
            nbytes = storage.nbytes()
            pointer = storage.data_ptr()
        except RuntimeError:  # a wrapper without a storage of its own (a functional collective's pending result)
            return
        if host_buffer(pointer):  # the offload's host memory (on CPU, "emulate" offload's buffers): not the device's
            return
        if self._resizable:  # by identity: the size may change (to 0 and back) while the storage lives
            ref = StorageWeakRef(storage)
            if ref.cdata not in self._live:
                self._live[ref.cdata] = (ref, nbytes)
                self._counted += nbytes
            return
        if nbytes == 0:
            return
        key = (storage.data_ptr(), nbytes)
        known = self._live.get(key)
        if known is not None and not known[0].expired():
            return
        if known is not None:  # a dead storage not collected yet, its memory reused by this one: same bytes, new owner
            self._live[key] = (StorageWeakRef(storage), nbytes)
            return
        self._live[key] = (StorageWeakRef(storage), nbytes)
        self._counted += nbytes

    def _collect(self) -> None:
        if not self._resizable:
            for key in [key for key, (ref, _) in self._live.items() if ref.expired()]:
                self._counted -= self._live.pop(key)[1]
            return
        # one read per storage: its size now, or None once freed (a liveness check before the read would leave
        # a window in which another thread, autograd's or a collective's worker, frees it)
        for key, (ref, nbytes) in list(self._live.items()):
            storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
            now = 0 if storage is None else storage.nbytes()
            if storage is None:
                del self._live[key]
            elif now != nbytes:
                self._live[key] = (ref, now)
            self._counted += now - nbytes


def peak_step_bytes(
    step: Callable[[], Any], module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
    resizable: bool = False,
) -> int:
    """Peak bytes of live tensors while ``step()`` runs, counting ``module``'s parameters and
    ``optimizer``'s state from the start (run one step before, so that the state exists); ``resizable``: see
    :class:`TensorMemoryTracker` (for a module sharded by FSDP2)."""
    alive = list(module.parameters())
    if optimizer is not None:
        alive += [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    with TensorMemoryTracker(resizable) as tracker:
        tracker.track(*alive)
        tracker.reset_peak()
        step()
    return tracker.peak_bytes
