"""A process's host memory as the benchmarks report it: resident set, its high-water mark, and glibc's heap.

Imports nothing heavy (no torch), so a script can sample its memory before its first import.
"""

from __future__ import annotations

import ctypes
import resource

MIB = 2**20


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


try:
    _libc = ctypes.CDLL("libc.so.6")
    _libc.mallinfo2.restype = _MallInfo2
except (OSError, AttributeError):  # not glibc (or older than 2.33): no allocator columns
    _libc = None


_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def fix_mmap_threshold(nbytes: int) -> None:
    """glibc: serve every allocation of ``nbytes`` or more by its own ``mmap``, returned to the system when freed,
    and keep that threshold fixed (as ``MALLOC_MMAP_THRESHOLD_=nbytes`` does). By default glibc raises the
    threshold to the size of each mmapped block freed, up to 32 MiB, so later blocks below it come from its
    heaps, which keep what is freed."""
    if _libc is None or _libc.mallopt(_M_MMAP_THRESHOLD, nbytes) != 1:
        raise OSError(f"mallopt(M_MMAP_THRESHOLD, {nbytes}) failed: glibc's malloc is needed")


def trim() -> None:
    """glibc: give the free pages of every malloc arena back to the system (``malloc_trim(0)``)."""
    if _libc is not None:
        _libc.malloc_trim(0)


def _status_kib(*keys: str) -> dict[str, int]:
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    return {k: int(fields[k].split()[0]) for k in keys}


def sample(phase: str) -> dict[str, float | str]:
    """This process's memory now, in MiB:

    - ``rss``: the resident set; ``peak``: ``ru_maxrss`` so far (the high-water mark);
    - ``file``: resident pages mapped from files (the shared libraries' code and data) and shared memory;
      ``anon``: the rest;
    - glibc's ``malloc`` over all its arenas (``mallinfo2``): ``in_use`` (handed out and not freed, mmapped
      blocks included), ``free_held`` (freed inside the arenas, still the process's) and ``mmapped``.
    """
    status = _status_kib("VmRSS", "RssAnon", "RssFile", "RssShmem")
    row: dict[str, float | str] = {
        "phase": phase, "rss": status["VmRSS"] / 1024, "anon": status["RssAnon"] / 1024,
        "file": (status["RssFile"] + status["RssShmem"]) / 1024,
        "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    if _libc is not None:
        info = _libc.mallinfo2()
        row.update(in_use=(info.uordblks + info.hblkhd) / MIB, free_held=info.fordblks / MIB, mmapped=info.hblkhd / MIB)
    return row


COLUMNS = ("phase", "rss", "peak", "file", "anon", "in_use", "free_held", "mmapped", "params", "grads", "optimizer")


def format_rows(rows: list[dict]) -> str:
    """The samples as a fixed-width table (MiB), one line per phase."""
    header = " | ".join(f"{c:>{28 if c == 'phase' else 9}}" for c in COLUMNS)
    lines = [header, "-" * len(header)]
    for row in rows:
        cells = [f"{row['phase']:>28}"] + [f"{row[c]:9.0f}" if c in row else f"{'':9}" for c in COLUMNS[1:]]
        lines.append(" | ".join(cells))
    return "\n".join(lines)
