"""Where a chunk lives: on the compute device, or in host memory with double-buffered prefetch.

A :class:`ChunkStore` holds the chunks the FPDT attention pipeline saves for backward (k/v chunks,
and the query-side chunks q, out, lse, dout and the dq accumulator), under keys
``(kind, chunk_index)``, and the checkpointed block inputs under keys from :meth:`ChunkStore.new_key`.
Its life cycle is explicit:

``put(key, x)``
    take ownership of a device tensor under a key that is not in use (a live key is an error, never
    replaced silently). With offload on, a device-to-host copy starts on the copy stream and the
    device memory is given back as soon as that copy is done.
``prefetch(key)``
    start bringing an offloaded chunk back to the device on the copy stream (issue before compute).
``get(key)``
    the device tensor; waits for its prefetch (wait after compute). Without a prefetch it is
    fetched now and the wait is counted as a stall.
``evict(key)``
    the caller is done with the device copy for now; the host copy stays.
``delete(key)``
    the chunk is no longer needed at all. ``delete_later(key)`` does the same at the next ``put`` or
    ``keys``: for a finalizer, which may run in the middle of another call of the store.

On CUDA the copies run on a side stream ordered with events: no host synchronize, no barrier.
Pinned host buffers come from a pool and are reused in copy-stream order, which is the order of
the copies that read and write them. On CPU the same schedule runs with a one-thread worker in
place of the copy stream and futures in place of events, copying into separate host buffers, so
the tests exercise the synchronisation and the data path; ``copy_delay`` makes every copy slower
so that ordering bugs show.

Accounting (:class:`OffloadStats`): bytes held on the compute device by the store, current and peak,
per group of kinds; bytes moved each way; time the compute waited for copies.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import defaultdict
from collections.abc import Hashable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_fpdt.profiling import record

Key = tuple[str, int]


@dataclass
class OffloadStats:
    """What a store did. All byte counts are of tensor storage, not interpreter overhead."""

    device_bytes: int = 0
    peak_device_bytes: int = 0
    bytes_to_host: int = 0
    bytes_to_device: int = 0
    wait_seconds: float = 0.0
    stalls: int = 0
    # group name -> largest number of distinct chunk indices of that group on the device at once
    peak_resident_chunks: dict[str, int] = field(default_factory=dict)

    def merge(self, other: OffloadStats) -> None:
        """Add ``other``'s traffic and keep the larger peaks (for per-step totals over layers)."""
        self.peak_device_bytes = max(self.peak_device_bytes, other.peak_device_bytes)
        self.bytes_to_host += other.bytes_to_host
        self.bytes_to_device += other.bytes_to_device
        self.wait_seconds += other.wait_seconds
        self.stalls += other.stalls
        for name, n in other.peak_resident_chunks.items():
            self.peak_resident_chunks[name] = max(self.peak_resident_chunks.get(name, 0), n)


def _nbytes(x: Tensor) -> int:
    return x.numel() * x.element_size()


class _HostPool:
    """Reusable host buffers, by (shape, dtype). Pinned when the compute device is CUDA."""

    def __init__(self, pin: bool) -> None:
        self._pin = pin
        self._free: dict[tuple[torch.Size, torch.dtype], list[Tensor]] = defaultdict(list)
        self._lock = threading.Lock()

    def acquire(self, like: Tensor) -> Tensor:
        with self._lock:
            free = self._free[(like.shape, like.dtype)]
            if free:
                return free.pop()
        return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=self._pin)

    def release(self, buf: Tensor) -> None:
        with self._lock:
            self._free[(buf.shape, buf.dtype)].append(buf)


@dataclass
class _Entry:
    device: Tensor | None = None
    host: Tensor | None = None
    to_host: Any = None  # CUDA event or Future: host copy complete
    to_device: Any = None  # CUDA event or Future: device copy complete (pending prefetch)


class ChunkStore:
    """Chunks saved by the attention pipeline, kept on the device or offloaded to host.

    Args:
        device: the compute device.
        offload: keep chunks in host memory between uses.
        groups: kind -> group name, for the per-group residency peaks (e.g. ``{"k": "kv", "v": "kv"}``).
        copy_delay: seconds each copy sleeps on the CPU worker (tests only).
    """

    def __init__(
        self,
        device: torch.device,
        offload: bool = False,
        groups: dict[str, str] | None = None,
        copy_delay: float = 0.0,
    ) -> None:
        self.device = device
        self.offload = offload
        self.stats = OffloadStats()
        self._groups = groups or {}
        self._entries: dict[Key, _Entry] = {}
        self._serials = itertools.count()
        self._doomed: list[Key] = []  # keys to delete at the next put/keys (delete_later)
        self._copy_delay = copy_delay
        self._cuda = device.type == "cuda"
        self._pool = _HostPool(pin=self._cuda)
        self._stream: Any = None
        self._worker: ThreadPoolExecutor | None = None
        if offload and self._cuda:
            self._stream = torch.cuda.Stream(device=device)
        elif offload:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fpdt-copy")

    # ---- life cycle -------------------------------------------------------------------------

    def put(self, key: Key, x: Tensor, keep_on_device: bool = False) -> None:
        """Take ownership of device tensor ``x`` (the caller must not write to it afterwards).

        With ``keep_on_device`` the device copy stays usable (the host copy still starts now)
        until :meth:`evict`: for a chunk that is used again right away.

        Raises:
            ValueError: ``key`` holds a chunk already (delete it first, or take a fresh key from :meth:`new_key`).
        """
        self._purge()
        if key in self._entries:
            raise ValueError(
                f"ChunkStore: chunk {key!r} is already stored; replacing it would lose a chunk its owner still"
                " needs. Delete it first, or take a fresh key from new_key(kind)."
            )
        entry = _Entry(device=x)
        self._entries[key] = entry
        self._account()
        if not self.offload:
            return
        with record("fpdt/offload"):
            self._start_offload(entry, x, keep_on_device)

    def _start_offload(self, entry: _Entry, x: Tensor, keep_on_device: bool) -> None:
        host = self._pool.acquire(x)
        self.stats.bytes_to_host += _nbytes(x)
        if self._cuda:
            compute = torch.cuda.current_stream(self.device)
            self._stream.wait_stream(compute)  # x is written by kernels queued on the compute stream
            with torch.cuda.stream(self._stream):
                host.copy_(x, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self._stream)
            x.record_stream(self._stream)  # the allocator must not reuse x until the copy ran
            entry.to_host = done
        else:
            entry.to_host = self._submit(host.copy_, x)
        entry.host = host
        if not keep_on_device:
            # The device copy is dropped now: on CUDA record_stream keeps the memory alive until
            # the copy has run; on CPU the worker holds a reference until its copy is done.
            entry.device = None
            self._account()

    def prefetch(self, key: Key) -> None:
        """Start bringing ``key`` to the device, if it is not there already."""
        entry = self._entry(key)
        if entry.device is not None or entry.to_device is not None:
            return
        host = entry.host
        assert host is not None
        self.stats.bytes_to_device += _nbytes(host)
        with record("fpdt/prefetch"):
            self._start_prefetch(entry, host)
        self._account()

    def _start_prefetch(self, entry: _Entry, host: Tensor) -> None:
        if self._cuda:
            with torch.cuda.stream(self._stream):
                # ordered after this chunk's host copy: same stream
                dev = torch.empty(host.shape, dtype=host.dtype, device=self.device)
                dev.copy_(host, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(self._stream)
            entry.to_device = (dev, ready)
        else:
            # ordered after this chunk's host copy: one worker runs copies in submission order
            entry.to_device = self._submit(lambda: host.clone())

    def get(self, key: Key) -> Tensor:
        """The chunk on the device, waiting for its prefetch if one is in flight."""
        entry = self._entry(key)
        if entry.device is not None:
            return entry.device
        if entry.to_device is None:
            self.stats.stalls += 1
            self.prefetch(key)
        start = time.perf_counter()
        with record("fpdt/prefetch_wait"):
            if self._cuda:
                dev, ready = entry.to_device
                compute = torch.cuda.current_stream(self.device)
                compute.wait_event(ready)  # the compute stream waits on the GPU; the host does not
                dev.record_stream(compute)
            else:
                dev = entry.to_device.result()
        self.stats.wait_seconds += time.perf_counter() - start
        entry.device, entry.to_device = dev, None
        self._account()
        return dev

    def evict(self, key: Key) -> None:
        """Drop the device copy of an offloaded chunk (no-op without offload: it stays)."""
        entry = self._entry(key)
        if not self.offload:
            return
        entry.device = None
        entry.to_device = None
        self._account()

    def delete(self, key: Key) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        if entry.host is not None:
            if self._cuda:
                self._pool.release(entry.host)  # later copies into it are ordered on the copy stream
            else:
                fut = entry.to_host
                host = entry.host
                # give the buffer back only once the worker is done writing into it
                if isinstance(fut, Future):
                    fut.add_done_callback(lambda _f, h=host: self._pool.release(h))
        self._account()

    def delete_later(self, key: Key) -> None:
        """Delete ``key`` (if it is still there) at the next :meth:`put` or :meth:`keys`.

        Safe to call from a finalizer: it only appends to a list, while :meth:`delete` changes the
        entries another call of the store may be iterating over.
        """
        self._doomed.append(key)

    def new_key(self, kind: str) -> Key:
        """A key of ``kind`` this store has never handed out: for chunks whose lifetimes may overlap
        in any order (two forward passes of one block before its backward)."""
        return kind, next(self._serials)

    def clear(self) -> None:
        for key in list(self._entries):
            self.delete(key)

    def close(self) -> None:
        self.clear()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None

    def keys(self) -> Iterable[Hashable]:
        """The live keys, in the order they were put."""
        self._purge()
        return self._entries.keys()

    def __contains__(self, key: object) -> bool:
        self._purge()
        return key in self._entries

    def __iter__(self) -> Iterator[Key]:
        return iter(list(self.keys()))

    # ---- helpers ------------------------------------------------------------------------------

    def _entry(self, key: Key) -> _Entry:
        try:
            return self._entries[key]
        except KeyError:
            raise KeyError(f"ChunkStore: no chunk {key!r}; it was never put or was already deleted.") from None

    def _purge(self) -> None:
        while self._doomed:
            self.delete(self._doomed.pop())

    def _submit(self, fn: Any, *args: Any) -> Future:
        assert self._worker is not None
        delay = self._copy_delay

        def run() -> Any:
            if delay:
                time.sleep(delay)
            return fn(*args)

        return self._worker.submit(run)

    def _account(self) -> None:
        total = 0
        resident: dict[str, set[int]] = defaultdict(set)
        for (kind, index), entry in self._entries.items():
            # an in-flight prefetch counts: its device memory is allocated when it is issued
            if entry.device is not None:
                total += _nbytes(entry.device)
            elif entry.to_device is not None and entry.host is not None:
                total += _nbytes(entry.host)
            else:
                continue
            resident[self._groups.get(kind, kind)].add(index)
        self.stats.device_bytes = total
        self.stats.peak_device_bytes = max(self.stats.peak_device_bytes, total)
        for name, indices in resident.items():
            peak = self.stats.peak_resident_chunks
            peak[name] = max(peak.get(name, 0), len(indices))
