"""Shared pieces of the benchmark scripts: how ranks are launched, timing, tables.

Ranks run through the launcher the tests use, :func:`lightning_fpdt.testing.run_on_ranks`, with ``**RANKS``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

# how every benchmark runs its ranks: the CPU cores shared evenly between them, and no time limit (a long
# GPU run is not a hang); CPU ranks are forked (no re-import: seconds per launch), CUDA ranks spawned
RANKS: dict[str, Any] = {"threads": None, "timeout": None}


def timed(fn: Callable[[], Any], repeats: int, group: Any = None) -> float:
    """Mean seconds of ``fn()`` over ``repeats`` runs, all ranks starting together."""
    total = 0.0
    for _ in range(repeats):
        if dist.is_initialized():
            dist.barrier(group)
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if dist.is_initialized():
            dist.barrier(group)
        total += time.perf_counter() - start
    return total / repeats


def _format(value: Any) -> str:
    if not isinstance(value, float):
        return str(value)
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table (printed and returned)."""
    cells = [[str(h) for h in headers]] + [[_format(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work (CUDA); nothing to wait for on CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def release_memory(device: torch.device | str) -> None:
    """Hand the caching allocators' free blocks back between runs of different shapes: the device's, and on CUDA the
    pinned host blocks of offloaded chunks too (``empty_cache`` leaves those cached; a long run of several shapes
    would otherwise keep each shape's pinned copies of its chunks)."""
    if torch.device(device).type != "cuda":
        return
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    # public from torch 2.13 on (torch.accelerator); the private binding before it
    empty_host = getattr(torch.accelerator, "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", None)
    if empty_host is not None:
        empty_host()


def max_rel_error(a: float | torch.Tensor, b: float | torch.Tensor, floor: float = 0.0) -> float:
    """``max|a - b| / max|b|`` in float64, the denominator at least ``floor`` (a gradient's scale floored for gradients
    that are zero in exact arithmetic)."""
    a, b = (torch.as_tensor(x, dtype=torch.float64) for x in (a, b))
    return ((a - b).abs().max() / max(b.abs().max().item(), floor, 1e-300)).item()


def matmul_rate(device: torch.device | str, dtype: torch.dtype, n: int, reps: int) -> float:
    """Measured FLOP/s of ``[n, n] @ [n, n]`` in ``dtype`` on ``device`` (one warm-up, then ``reps`` timed)."""
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    a @ b
    synchronize(device)
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    synchronize(device)
    return 2 * n**3 * reps / (time.perf_counter() - start)


def is_oom(err: BaseException) -> bool:
    """Whether ``err`` is an out-of-memory error (device, pinned host or library allocations)."""
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()
