"""Carry the forward's autocast state into backward: a recomputation (:mod:`lightning_fpdt.offload.recompute`), and the
attention pipeline's chunk-by-chunk projections."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AutocastState:
    device_type: str
    enabled: bool
    dtype: torch.dtype | None

    @classmethod
    def capture(cls, device_type: str) -> AutocastState:
        if device_type not in ("cpu", "cuda") or not torch.is_autocast_enabled(device_type):
            return cls(device_type, False, None)
        return cls(device_type, True, torch.get_autocast_dtype(device_type))

    def restore(self) -> AbstractContextManager:
        if not self.enabled:
            return nullcontext()
        # no autocast cache, as in Lightning's forward: a cast cached under no_grad (inside an autograd Function's
        # forward) and read again with grad would carry no gradient; weight_casts casts each weight once instead
        return torch.autocast(self.device_type, dtype=self.dtype, cache_enabled=False)
