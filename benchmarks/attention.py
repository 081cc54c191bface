"""Forward+backward time and peak tensor memory of one FPDT attention layer vs plain Ulysses.

    python benchmarks/attention.py                          # CPU, 2 gloo processes, 8K and 16K tokens
    python benchmarks/attention.py --seq 1024 --repeats 1   # a quick look
    python benchmarks/attention.py --sync                   # also the pipeline with blocking all-to-alls
    python benchmarks/attention.py --whole-diagonal         # also the pipeline with one backward call per diagonal

Per rank: q, k, v shards ``[1, S/P, heads, head_dim]``, causal attention; the variants are plain
Ulysses (``chunk_size=None``) and the FPDT pipeline with ``--chunks`` chunks, its all-to-alls
asynchronous (issued before a chunk's attention, waited for after it); ``--sync`` adds the same
pipeline with each all-to-all run to completion where it is issued; ``--whole-diagonal`` adds it with
each causal diagonal block's backward as one kernel call (``sdpa`` on CPU runs a causal square of up
to ``SdpaKernel.banded_rows`` rows in column bands; Ulysses' square at 8K tokens is longer, one call
either way). Time is the best and the median of ``--repeats`` forward+backward runs, taken in rounds,
round robin over the variants, after a warm-up (a shared machine's slow phases then hit every
variant). "x ulysses" is best over best; "x ulysses, rounds" the median over rounds of the variant's
time over Ulysses' time in the same round (robust to a slow phase that spares one variant's best
run). "kernel ms" is the part of the best run spent inside the attention kernel, "other ms" the rest
(all-to-alls, merges, copies, waiting for the other rank): the pipeline's own cost.
Memory is the peak of live tensors during the warm-up forward+backward
(``lightning_fpdt.offload.memtrack.TensorMemoryTracker``), per rank.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RANKS, print_table, timed

from lightning_fpdt.attention.kernels import AttentionKernel, get_kernel
from lightning_fpdt.attention.pipeline import PipelineOptions, run_pipeline
from lightning_fpdt.attention.sources import TensorEnds
from lightning_fpdt.attention.ulysses import ulysses_attention
from lightning_fpdt.offload.memtrack import TensorMemoryTracker
from lightning_fpdt.testing import run_on_ranks


class TimedKernel:
    """Wraps a kernel and adds up the seconds spent in it."""

    def __init__(self, kernel: AttentionKernel) -> None:
        self.kernel, self.name, self.edge_band, self.seconds = kernel, kernel.name, kernel.edge_band, 0.0
        self.banded_rows = getattr(kernel, "banded_rows", None)  # sdpa's: causal squares up to it in bands on CPU

    def band(self, on: bool) -> None:
        """sdpa's causal squares' backward in bands as it runs them (``on``), or every one as one call."""
        if self.banded_rows is not None:
            self.kernel.banded_rows = self.banded_rows if on else 0

    def forward(self, *args: Any) -> Any:
        start = time.perf_counter()
        result = self.kernel.forward(*args)
        self.seconds += time.perf_counter() - start
        return result

    def backward(self, *args: Any) -> Any:
        start = time.perf_counter()
        result = self.kernel.backward(*args)
        self.seconds += time.perf_counter() - start
        return result


def _measure(rank: int, world: int, args: argparse.Namespace) -> list[list]:
    group = dist.group.WORLD if world > 1 else None
    head_dim = args.hidden // args.heads
    dtype = getattr(torch, args.dtype)
    kernel = TimedKernel(get_kernel(args.backend, torch.device("cpu"), dtype))
    scale = 1 / math.sqrt(head_dim)
    rows = []
    for seq in args.seq:
        g = torch.Generator().manual_seed(seq)
        q, k, v, dout = (torch.randn(1, seq // world, args.heads, head_dim, generator=g, dtype=dtype) for _ in range(4))
        # name -> (chunks, asynchronous all-to-alls, causal squares' backward in bands)
        variants: dict[str, tuple[int | None, bool, bool]] = {"ulysses": (None, True, True)}
        for n in args.chunks:
            variants[f"fpdt x{n}"] = (n, True, True)
            if args.sync:
                variants[f"fpdt x{n} sync"] = (n, False, True)
            if args.whole_diagonal:
                variants[f"fpdt x{n} whole diagonal"] = (n, True, False)

        def step(chunks: int | None, overlap: bool, banded: bool, inputs: tuple = (q, k, v, dout),
                 seq: int = seq) -> None:
            kernel.band(banded or chunks is None)  # Ulysses: as sdpa runs it (8K rows: one call)
            xs = [x.detach().requires_grad_() for x in inputs[:3]]
            if chunks is None:
                out = ulysses_attention(*xs, group, kernel, True, scale)
            else:
                opt = PipelineOptions.for_chunk_size(group, seq // chunks, causal=True, scale=scale, kernel=kernel,
                                                     overlap_comm=overlap)
                out, _ = run_pipeline(TensorEnds(kv_heads=args.heads), opt, *xs)
            out.backward(inputs[3])

        peaks = {}
        for name, variant in variants.items():  # warm-up, and the memory peak of one step
            with TensorMemoryTracker() as tracker:
                tracker.reset_peak()
                step(*variant)
            peaks[name] = tracker.peak_bytes
        # round robin over the variants, so that slow phases of a shared machine hit all of them
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
        for _ in range(args.repeats):
            for name, variant in variants.items():
                kernel.seconds = 0.0
                seconds = timed(lambda v=variant: step(*v), 1, group)
                times[name].append((seconds, kernel.seconds))
        best = {name: min(t) for name, t in times.items()}
        for name, (chunks, _, _) in variants.items():
            total, in_kernel = best[name]
            median = statistics.median(t for t, _ in times[name])
            paired = statistics.median(t / u for (t, _), (u, _) in zip(times[name], times["ulysses"], strict=True))
            rows.append([seq, name, chunks or 1, total * 1e3, median * 1e3, f"{total / best['ulysses'][0]:.3f}",
                         f"{paired:.3f}", in_kernel * 1e3, (total - in_kernel) * 1e3, peaks[name] / 2**20])
            if rank == 0:
                print(f"  S={seq} {name}: best {total * 1e3:.0f} ms, median {median * 1e3:.0f} ms"
                      f" (of {args.repeats})", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--chunks", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--backend", default="sdpa")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--sync", action="store_true", help="also run the pipeline with blocking all-to-alls")
    parser.add_argument("--whole-diagonal", action="store_true",
                        help="also run the pipeline with each causal diagonal's backward as one kernel call")
    args = parser.parse_args()
    print(f"FPDT attention, {args.world} CPU processes (gloo), hidden {args.hidden}, {args.heads} heads, "
          f"{args.dtype}, backend {args.backend}, causal; forward+backward per rank", flush=True)
    rows = run_on_ranks(_measure, args.world, args, **RANKS)[0]
    print_table(["tokens", "variant", "chunks", "ms fwd+bwd (best)", "median ms", "x ulysses", "x ulysses, rounds",
                 "kernel ms", "other ms", "peak MiB / rank"], rows)


if __name__ == "__main__":
    main()
