"""Where a chunk lives: on the compute device, or in host memory with double-buffered prefetch.

A :class:`ChunkStore` holds the chunks the FPDT attention pipeline saves for backward (k/v chunks,
and the query-side chunks q, out, lse, dout and the dq accumulator), under keys
``(kind, chunk_index)``, and the inputs of recomputed layers under keys from :meth:`ChunkStore.new_key`.
Its life cycle is explicit:

``put(key, x)``
    take ownership of a device tensor under a key that is not in use (a live key is an error, never
    replaced silently). With offload on, a device-to-host copy starts and the device memory is given
    back as soon as that copy is done.
``prefetch(key)``
    start bringing an offloaded chunk back to the device (issue before compute).
``get(key)``
    the device tensor; waits for its prefetch (wait after compute). Without a prefetch it is
    fetched now and counted as a stall.
``evict(key)``
    the caller is done with the device copy for now; the host copy stays.
``delete(key)``
    the chunk is no longer needed at all. ``delete_later(key)`` does the same at the next ``put`` or
    ``keys``: for a finalizer, which may run in the middle of another call of the store.

Copies and buffers (:class:`~lightning_fpdt.offload.copy_engine.CopyEngine`, one per device for the whole
process, shared by every store): on CUDA, device-to-host copies run on one side stream and
host-to-device copies on another, so both directions run at once; a prefetch waits (on the GPU, with
an event) for its own chunk's host copy, and the compute stream waits for the prefetch. No host
synchronize, no barrier. Pinned host buffers come from one pool per device, keyed by size, and
survive the store that used them: a buffer goes back to the pool with the events of the copies that
still touch it, and its next device-to-host copy waits for them on the GPU. Prefetched device tensors
are allocated on the host-to-device stream (one stream for the run, so its allocator pool stays as
small as the chunks in flight) and handed to the compute stream with ``record_stream``. On CPU the
same structure runs with two one-thread workers (one per direction) in place of the streams and
futures in place of events, copying into separate host buffers, so the tests exercise the
synchronisation, the buffer reuse and the data path; tests make every copy slower with
:func:`slow_copies` so that ordering bugs show. :func:`~lightning_fpdt.offload.copy_engine.release_copy_engines`
gives the streams, workers and pooled buffers back (strategy teardown).

Accounting: :class:`~lightning_fpdt.offload.stats.OffloadStats` (its own module), kept by every store.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter, defaultdict
from collections.abc import Hashable, Iterable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_fpdt.errors import FPDTError
from lightning_fpdt.offload.copy_engine import copy_engine
from lightning_fpdt.offload.stats import OffloadStats
from lightning_fpdt.profiling import named_range

__all__ = ["ChunkStore", "Key", "slow_copies"]

_CLOSING: list[ChunkStore] = []  # stores to close at the next safe point (ChunkStore.close_later)

Key = tuple[str, int]


def _nbytes(x: Tensor) -> int:
    return x.numel() * x.element_size()


@dataclass
class _Entry:
    device: Tensor | None = None
    host: Tensor | None = None  # typed view of ``raw``
    raw: Tensor | None = None  # the pool's buffer
    to_host: Any = None  # CUDA event or Future: host copy complete
    to_device: Any = None  # (tensor, CUDA event) or Future: the prefetch in flight
    last_read: Any = None  # event or future of the latest prefetch: the buffer is read until it is done


class ChunkStore:
    """Chunks saved by the attention pipeline, kept on the device or offloaded to host.

    Args:
        device: the compute device.
        offload: keep chunks in host memory between uses.
        groups: kind -> group name, for the per-group residency peaks (e.g. ``{"k": "kv", "v": "kv"}``).
    """

    # seconds each CPU copy sleeps before it runs, read when the copy is started: a test hook, set only by
    # slow_copies (a real run never sleeps)
    _copy_delay: ClassVar[float] = 0.0

    def __init__(self, device: torch.device, offload: bool = False, groups: dict[str, str] | None = None) -> None:
        while _CLOSING:  # stores whose owners were dropped (close_later): closed at this safe point
            _CLOSING.pop().close()
        self.device = device
        self.offload = offload
        self.stats = OffloadStats()
        self._groups = groups or {}
        self._entries: dict[Key, _Entry] = {}
        self._serials = itertools.count()
        self._doomed: list[Key] = []  # keys to delete at the next put/keys (delete_later)
        self._cuda = device.type == "cuda"
        self._resident: dict[Key, int] = {}  # keys with device memory (or an in-flight prefetch): their bytes
        self._resident_chunks: defaultdict[str, Counter[int]] = defaultdict(Counter)  # group -> index -> keys

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
            raise FPDTError(
                f"ChunkStore: chunk {key!r} is already stored; replacing it would lose a chunk its owner still"
                " needs. Delete it first, or take a fresh key from new_key(kind)."
            )
        entry = _Entry(device=x)
        self._entries[key] = entry
        self._account(key)
        if not self.offload:
            return
        with named_range("fpdt/offload"):
            self._start_offload(key, entry, x, keep_on_device)

    def _start_offload(self, key: Key, entry: _Entry, x: Tensor, keep_on_device: bool) -> None:
        engine = copy_engine(self.device)
        raw, fences = engine.pool.acquire(_nbytes(x))
        host = raw.view(x.dtype).view(x.shape)
        self.stats.bytes_to_host += _nbytes(x)
        if self._cuda:
            stream = engine.to_host
            stream.wait_stream(torch.cuda.current_stream(self.device))  # x is written by kernels queued there
            for fence in fences:  # a prefetch from this reused buffer may still be reading it
                stream.wait_event(fence)
            with torch.cuda.stream(stream):
                host.copy_(x, non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
            x.record_stream(stream)  # the allocator must not reuse x until the copy ran
            entry.to_host = done
        else:
            entry.to_host = engine.submit(engine.to_host, fences, self._copy_delay, host.copy_, x)
        entry.host, entry.raw = host, raw
        if not keep_on_device:
            # The device copy is dropped now: on CUDA record_stream keeps the memory alive until
            # the copy has run; on CPU the worker holds a reference until its copy is done.
            entry.device = None
            self._account(key)

    def prefetch(self, key: Key) -> None:
        """Start bringing ``key`` to the device, if it is not there already."""
        entry = self._entry(key)
        if entry.device is not None or entry.to_device is not None:
            return
        host = entry.host
        assert host is not None
        self.stats.bytes_to_device += _nbytes(host)
        with named_range("fpdt/prefetch"):
            self._start_prefetch(entry, host)
        self._account(key)

    def _start_prefetch(self, entry: _Entry, host: Tensor) -> None:
        engine = copy_engine(self.device)
        if self._cuda:
            stream = engine.to_device
            stream.wait_event(entry.to_host)  # after this chunk's host copy, which runs on the other stream
            with torch.cuda.stream(stream):
                dev = torch.empty(host.shape, dtype=host.dtype, device=self.device)
                dev.copy_(host, non_blocking=True)
                ready = torch.cuda.Event(enable_timing=True)
                ready.record(stream)
            entry.to_device = (dev, ready)
            entry.last_read = ready
        else:
            fut = engine.submit(engine.to_device, [entry.to_host], self._copy_delay, host.clone)
            # the buffer's fence must not hold the copy's result: the device tensor would live as long as the fence
            read = Future()
            fut.add_done_callback(lambda _: read.set_result(None))
            entry.to_device, entry.last_read = fut, read

    def get(self, key: Key) -> Tensor:
        """The chunk on the device, waiting for its prefetch if one is in flight."""
        entry = self._entry(key)
        if entry.device is not None:
            return entry.device
        if entry.to_device is None:
            self.stats.stalls += 1
            self.prefetch(key)
        with named_range("fpdt/prefetch_wait"):
            if self._cuda:
                dev, ready = entry.to_device
                compute = torch.cuda.current_stream(self.device)
                reached = torch.cuda.Event(enable_timing=True)
                reached.record(compute)
                compute.wait_event(ready)  # the compute stream waits on the GPU; the host does not
                dev.record_stream(compute)
                self.stats.add_timed_wait(reached, ready)
            else:
                fut = entry.to_device
                if fut.done():
                    dev = fut.result()
                else:
                    start = time.perf_counter()
                    dev = fut.result()
                    self.stats.add_wait(max(time.perf_counter() - start, 1e-9))
        entry.device, entry.to_device = dev, None
        self._account(key)
        return dev

    def evict(self, key: Key) -> None:
        """Drop the device copy of an offloaded chunk (no-op without offload: it stays)."""
        entry = self._entry(key)
        if not self.offload:
            return
        entry.device = None
        entry.to_device = None
        self._account(key)

    def delete(self, key: Key) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        if entry.raw is not None:
            # back to the pool with the copies that may still touch it; its next writer waits for them
            copy_engine(self.device).pool.release(entry.raw, (entry.to_host, entry.last_read))
        self._account(key)

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
        """Delete every chunk. The copy engine is the process's (see
        :func:`~lightning_fpdt.offload.copy_engine.release_copy_engines`)."""
        self.clear()

    def close_later(self) -> None:
        """:meth:`close` this store when the next store is made: for a finalizer (a store whose owner's graph was
        dropped), which may run in the middle of a call that holds the host pool's lock."""
        _CLOSING.append(self)

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

    def _account(self, key: Key) -> None:
        """Update the device figures after ``key``'s entry changed (kept incrementally: a pass changes entries
        hundreds of times, and a sum over every entry each time grew with the square of the chunks)."""
        entry = self._entries.get(key)
        now = None
        # an in-flight prefetch counts: its device memory is allocated when it is issued
        if entry is not None and entry.device is not None:
            now = _nbytes(entry.device)
        elif entry is not None and entry.to_device is not None and entry.host is not None:
            now = _nbytes(entry.host)
        before = self._resident.pop(key, None)
        kind, index = key
        group = self._groups.get(kind, kind)
        chunks = self._resident_chunks[group]
        if before is not None:
            chunks[index] -= 1
            if not chunks[index]:
                del chunks[index]
        if now is not None:
            self._resident[key] = now
            chunks[index] += 1
        stats = self.stats
        stats.device_bytes += (now or 0) - (before or 0)
        stats.peak_device_bytes = max(stats.peak_device_bytes, stats.device_bytes)
        if now is not None:
            stats.peak_resident_chunks[group] = max(stats.peak_resident_chunks.get(group, 0), len(chunks))


@contextmanager
def slow_copies(seconds: float) -> Iterator[None]:
    """Tests only: every CPU copy a store starts inside the ``with`` block sleeps ``seconds`` before it runs
    (on the copy workers, not the caller), so a chunk used before its copy is done, or a host buffer reused
    while a copy still reads it, shows up as a wrong result or a stall."""
    before = ChunkStore._copy_delay
    ChunkStore._copy_delay = seconds
    try:
        yield
    finally:
        ChunkStore._copy_delay = before
