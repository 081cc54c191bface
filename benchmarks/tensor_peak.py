"""The peak of live tensors with what was alive at that moment, for the memory benchmarks."""

from __future__ import annotations

from typing import Any

import torch

from lightning_fpdt.offload.memtrack import TensorMemoryTracker

MIB = 2**20


class PeakSnapshot(TensorMemoryTracker):
    """:class:`~lightning_fpdt.offload.memtrack.TensorMemoryTracker` that also keeps, at its peak, the operator that
    reached it and the live storages by what they are: ``labels`` maps a storage's address to a name (parameters,
    optimizer state...); the others are grouped by size (activations and temporaries).

    Args:
        labels: storage address (``untyped_storage().data_ptr()``) -> name.
    """

    def __init__(self, labels: dict[int, str]) -> None:
        super().__init__()
        self.labels = labels
        self.at_peak: tuple[str, dict[str, float]] = ("", {})

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        before = self.peak_bytes
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.peak_bytes > before:
            kinds: dict[str, float] = {}
            for ref, nbytes in self._live.values():
                storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
                if storage is None:  # freed by another thread since the last collection
                    continue
                ptr = storage.data_ptr()
                kind = self.labels.get(ptr) or (f"{nbytes / MIB:.1f} MiB" if nbytes >= MIB else "< 1 MiB")
                kinds[kind] = kinds.get(kind, 0.0) + nbytes / MIB
            self.at_peak = (str(func), kinds)
        return out

    def describe(self) -> str:
        """``"<peak> MiB (at <op>: <name> <MiB>, ...)"``, largest first."""
        op, kinds = self.at_peak
        parts = ", ".join(f"{k} {v:.0f}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]))
        return f"{self.peak_bytes / MIB:.0f} MiB (at {op}: {parts})"
