"""Named profiler ranges (``fpdt/...``) so ``Trainer(profiler="pytorch")`` traces show the pipeline."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from torch.profiler import record_function

_profiling = getattr(torch.autograd, "_profiler_enabled", lambda: True)


def named_range(name: str) -> AbstractContextManager:
    """A ``torch.profiler.record_function`` range while a profiler runs; nothing otherwise (a range costs a few
    microseconds, and a pass opens hundreds)."""
    return record_function(name) if _profiling() else nullcontext()
