"""Peak memory (resident set) of one training step and the memory-per-token slope, per variant.

    python benchmarks/memory.py

The memory columns of ``benchmarks/training.py`` on CPU with 2 processes, at two sequence lengths,
for plain Ulysses, FPDT chunking, and FPDT with tiled MLP/loss and activation checkpointing. Target:
FPDT's slope <= 1/8 of plain Ulysses'.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import training

if __name__ == "__main__":
    defaults = ["--variants", "ulysses", "fpdt", "fpdt_full", "--repeats", "1"]
    sys.argv = [sys.argv[0], *defaults, *sys.argv[1:]]
    training.main()
