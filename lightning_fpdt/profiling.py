"""Named profiler ranges (``fpdt/...``) so ``Trainer(profiler="pytorch")`` traces show the pipeline."""

from __future__ import annotations

from contextlib import AbstractContextManager

from torch.profiler import record_function


def named_range(name: str) -> AbstractContextManager:
    """A ``torch.profiler.record_function`` range; nearly free when no profiler is running."""
    return record_function(name)
