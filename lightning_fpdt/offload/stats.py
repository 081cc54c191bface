"""What a chunk store did (:class:`OffloadStats`): bytes held on the compute device by the store, current and
peak, per group of kinds; bytes moved each way; ``stalls``, the chunks used without a prefetch; and the wait.

``wait_seconds`` is compute time lost waiting for copies. On CUDA, per ``get`` of a prefetched chunk: the time from
the compute stream reaching the ``wait_event`` to the copy's completion, ``max(0, t(copy done) - t(compute reached
the wait))``, from two timing events, read lazily when the figure is read (after the step, so no synchronize inside
it). On CPU: the time ``get`` blocks on the copy's future. ``late`` counts the gets that waited at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class OffloadStats:
    """What a store did. All byte counts are of tensor storage, not interpreter overhead.

    ``wait_seconds`` and ``late`` are properties: on CUDA they read the timing events of the step's
    waits when first asked for (module docstring), which synchronizes with those events.
    """

    device_bytes: int = 0
    peak_device_bytes: int = 0
    bytes_to_host: int = 0
    bytes_to_device: int = 0
    stalls: int = 0
    # group name -> largest number of distinct chunk indices of that group on the device at once
    peak_resident_chunks: dict[str, int] = field(default_factory=dict)
    # attention blocks (query chunk, key chunk) of the pipeline using this store, each pass counted: computed,
    # and skipped by the block rules (no query sees a key) before any copy or kernel
    blocks_computed: int = 0
    blocks_skipped: int = 0
    _wait_s: float = field(default=0.0, repr=False)
    _late: int = field(default=0, repr=False)
    # (compute reached the wait, copy done) timing-event pairs not read yet (CUDA)
    _pending: list[tuple[Any, Any]] = field(default_factory=list, repr=False)

    @property
    def wait_seconds(self) -> float:
        """Compute time lost waiting for copies (module docstring)."""
        self._resolve()
        return self._wait_s

    @property
    def late(self) -> int:
        """Gets that waited for a copy still in flight."""
        self._resolve()
        return self._late

    def add_wait(self, seconds: float) -> None:
        if seconds > 0:
            self._wait_s += seconds
            self._late += 1

    def add_timed_wait(self, reached: Any, done: Any) -> None:
        """A CUDA wait, measured when read: ``reached`` on the compute stream, ``done`` on the copy stream."""
        self._pending.append((reached, done))

    def _resolve(self) -> None:
        while self._pending:
            reached, done = self._pending.pop()
            reached.synchronize()
            done.synchronize()
            self.add_wait(reached.elapsed_time(done) / 1e3)  # milliseconds; negative: it was there first

    def count_blocks(self, computed: int, candidates: int) -> None:
        """One pass of attention computed ``computed`` of its ``candidates`` blocks (``j <= i`` when causal,
        all otherwise); the others were skipped."""
        self.blocks_computed += computed
        self.blocks_skipped += candidates - computed

    def merge(self, other: OffloadStats) -> None:
        """Add ``other``'s traffic and keep the larger peaks (for per-step totals over layers)."""
        self.peak_device_bytes = max(self.peak_device_bytes, other.peak_device_bytes)
        self.bytes_to_host += other.bytes_to_host
        self.bytes_to_device += other.bytes_to_device
        self.stalls += other.stalls
        self.blocks_computed += other.blocks_computed
        self.blocks_skipped += other.blocks_skipped
        self._wait_s += other._wait_s
        self._late += other._late
        self._pending.extend(other._pending)
        for name, n in other.peak_resident_chunks.items():
            self.peak_resident_chunks[name] = max(self.peak_resident_chunks.get(name, 0), n)
