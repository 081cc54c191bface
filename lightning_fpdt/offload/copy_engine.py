"""The copy machinery of the offload, one per device for the whole process: copy streams and host buffers.

A :class:`CopyEngine` holds two copy streams on CUDA (device-to-host and host-to-device, so the two
directions run at once) or, on CPU, two one-thread workers in their place, and a :class:`HostPool` of
host buffers (pinned for CUDA). Every :class:`~lightning_fpdt.offload.chunk_store.ChunkStore` on a device uses that
device's engine, from :func:`copy_engine`: one stream pair and one buffer pool for the whole run,
however many stores (attention calls, layers, steps) come and go. :func:`release_copy_engines` gives
them back (at the end of training); a later store makes a fresh engine.

Process-wide on purpose: streams and pinned memory are resources of the device and the process (like
torch's own caching allocators), and they hold nothing about any one call. After ``fork`` the child
starts with no engines: the parent's worker threads do not exist there.
"""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor


class HostPool:
    """Host buffers (``uint8``, by size in bytes) reused by every store on one device. Pinned for CUDA.

    A buffer comes back with its *fences*: the events (CUDA) or futures (CPU) of copies that may still
    read or write it. Whoever takes it next must order its own copy after them (``ChunkStore`` does, on
    the copy stream or in the worker), so reuse never needs a host-side wait.
    """

    def __init__(self, pin: bool) -> None:
        self._pin = pin
        self._free: dict[int, list[tuple[Tensor, list[Any]]]] = defaultdict(list)
        self._lock = threading.Lock()
        self.allocations = 0  # buffers ever allocated (a reused one is not counted again)
        self.allocated_bytes = 0
        self.pointers: set[int] = set()  # the buffers' storage addresses (host_buffer)

    def acquire(self, nbytes: int) -> tuple[Tensor, list[Any]]:
        """A buffer of ``nbytes`` and the fences its next write must wait for."""
        with self._lock:
            free = self._free[nbytes]
            if free:
                return free.pop()
            self.allocations += 1
            self.allocated_bytes += nbytes
        _ALLOCATING.active = True
        try:
            buf = torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=self._pin)
        finally:
            _ALLOCATING.active = False
        with self._lock:
            self.pointers.add(buf.untyped_storage().data_ptr())
        return buf, []

    def release(self, buf: Tensor, fences: Sequence[Any]) -> None:
        with self._lock:
            self._free[buf.numel()].append((buf, [f for f in fences if f is not None]))

    def free_bytes(self) -> int:
        with self._lock:
            return sum(n * len(bufs) for n, bufs in self._free.items())

    def clear(self) -> None:
        with self._lock:
            for bufs in self._free.values():
                self.pointers.difference_update(buf.untyped_storage().data_ptr() for buf, _ in bufs)
            self._free.clear()


_ALLOCATING = threading.local()  # set while a pool allocates a buffer on this thread


def host_buffer(data_ptr: int) -> bool:
    """Whether a storage at ``data_ptr`` is a host buffer of the offload (or one is being allocated on this thread):
    for :class:`~lightning_fpdt.offload.memtrack.TensorMemoryTracker`, which counts device memory only."""
    if getattr(_ALLOCATING, "active", False):
        return True
    return any(data_ptr in engine.pool.pointers for engine in list(_ENGINES.by_device.values()))


def _run_after(waits: Sequence[Future], delay: float, fn: Callable[..., Any], *args: Any) -> Any:
    """A CPU copy job: the futures it is ordered after, the test delay, then the copy."""
    for fut in waits:
        fut.result()
    if delay:
        time.sleep(delay)
    with torch.no_grad():  # a worker thread starts in grad mode; a copy is never part of the graph
        return fn(*args)


class CopyEngine:
    """The copy machinery of one device for the whole process: two copy streams (CUDA) or two one-thread
    workers (CPU), one per direction, and the :class:`HostPool`. Made by :func:`copy_engine`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.pool = HostPool(pin=self.cuda)
        self.to_host: Any = None
        self.to_device: Any = None
        if self.cuda:
            self.to_host = torch.cuda.Stream(device=device)
            self.to_device = torch.cuda.Stream(device=device)
        else:
            self.to_host = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fpdt-to-host")
            self.to_device = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fpdt-to-device")

    def submit(self, worker: ThreadPoolExecutor, waits: Sequence[Future], delay: float, fn: Callable[..., Any],
               *args: Any) -> Future:
        """CPU: run ``fn(*args)`` on ``worker`` once every future in ``waits`` is done."""
        return worker.submit(_run_after, [w for w in waits if w is not None], delay, fn, *args)

    def close(self) -> None:
        """Finish the copies in flight, then drop the workers or streams and the pooled buffers."""
        if self.cuda:
            self.to_host.synchronize()
            self.to_device.synchronize()
        else:
            self.to_host.shutdown(wait=True)
            self.to_device.shutdown(wait=True)
        self.pool.clear()


class _Engines:
    """The process's copy engines by device (see the module docstring for why process-wide)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_device: dict[tuple[str, int | None], CopyEngine] = {}

    def forget(self) -> None:
        # after fork: the parent's worker threads and streams do not exist in the child
        self.lock = threading.Lock()
        self.by_device = {}


_ENGINES = _Engines()
os.register_at_fork(after_in_child=_ENGINES.forget)


def _device_key(device: torch.device) -> tuple[str, int | None]:
    if device.type == "cuda" and device.index is None:
        return "cuda", torch.cuda.current_device()
    return device.type, device.index


def copy_engine(device: torch.device) -> CopyEngine:
    """The process's :class:`CopyEngine` for ``device``, made on first use."""
    key = _device_key(device)
    with _ENGINES.lock:
        engine = _ENGINES.by_device.get(key)
        if engine is None:
            engine = _ENGINES.by_device[key] = CopyEngine(torch.device(*key) if key[1] is not None else device)
        return engine


def release_copy_engines() -> None:
    """Finish every copy in flight and give back the copy streams, workers and pooled host buffers.

    Call when training is over (``FPDTStrategy.teardown``); a later store makes a fresh engine.
    """
    with _ENGINES.lock:
        engines, _ENGINES.by_device = list(_ENGINES.by_device.values()), {}
    for engine in engines:
        engine.close()
