"""Forward+backward time and peak tensor memory of one FPDT attention layer vs plain Ulysses.

    python benchmarks/attention.py                      # CPU, 2 gloo processes, 4K..32K tokens
    python benchmarks/attention.py --seq 1024 --repeats 1   # a quick look

Per rank: q, k, v shards ``[1, S/P, heads, head_dim]``; the variants are plain Ulysses
(``chunk_size=None``) and the FPDT pipeline with 1, 4 and 8 chunks. Time is the fastest of
``--repeats`` forward+backward runs, taken round robin over the variants after a warm-up (a shared
machine's slow phases then hit every variant); memory is the peak of live tensors during one
forward+backward (``lightning_fpdt.memtrack.TensorMemoryTracker``), per rank.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table, run_on_ranks, timed  # noqa: E402

from lightning_fpdt.attention import fpdt_attention  # noqa: E402
from lightning_fpdt.memtrack import TensorMemoryTracker  # noqa: E402


def _measure(rank: int, world: int, args: argparse.Namespace) -> list[list]:
    group = dist.group.WORLD if world > 1 else None
    head_dim = args.hidden // args.heads
    dtype = getattr(torch, args.dtype)
    rows = []
    for seq in args.seq:
        g = torch.Generator().manual_seed(seq)
        q, k, v, dout = (torch.randn(1, seq // world, args.heads, head_dim, generator=g, dtype=dtype) for _ in range(4))
        variants = {"ulysses": None, **{f"fpdt x{n}": seq // n for n in args.chunks}}

        def step(chunk_size: int | None) -> None:
            xs = [x.detach().requires_grad_() for x in (q, k, v)]
            out = fpdt_attention(*xs, group=group, chunk_size=chunk_size, backend=args.backend)
            out.backward(dout)

        peaks = {}
        for name, chunk_size in variants.items():  # warm-up, and the memory peak of one step
            step(chunk_size)
            with TensorMemoryTracker() as tracker:
                tracker.reset_peak()
                step(chunk_size)
            peaks[name] = tracker.peak_bytes
        # round robin over the variants, so that slow phases of a shared machine hit all of them
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.repeats):
            for name, chunk_size in variants.items():
                times[name].append(timed(lambda c=chunk_size: step(c), 1, group))
        best = {name: min(t) for name, t in times.items()}
        for name in variants:
            rows.append([seq, name, best[name] * 1e3, best[name] / best["ulysses"], peaks[name] / 2**20])
            if rank == 0:
                print(f"  S={seq} {name}: {best[name] * 1e3:.1f} ms (min of {args.repeats})", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backend", default="sdpa")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    print(f"FPDT attention, {args.world} CPU processes (gloo), hidden {args.hidden}, {args.heads} heads, "
          f"{args.dtype}, backend {args.backend}; forward+backward per rank", flush=True)
    rows = run_on_ranks(_measure, args.world, args)
    print_table(["seq", "variant", "time ms", "x ulysses", "peak MiB / rank"], rows)


if __name__ == "__main__":
    main()
