"""Forward+backward time and peak tensor memory of one FPDT attention layer vs plain Ulysses.

    python benchmarks/attention.py                      # CPU, 2 gloo processes, 4K..32K tokens
    python benchmarks/attention.py --seq 1024 --repeats 1   # a quick look

Per rank: q, k, v shards ``[1, S/P, heads, head_dim]``; the variants are plain Ulysses
(``chunk_size=None``) and the FPDT pipeline with 1, 4 and 8 chunks. Time is the mean of
``--repeats`` runs after one warm-up; memory is the peak of live tensors during one
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
        base_time = None
        for chunks in [0, *args.chunks]:
            chunk_size = None if chunks == 0 else seq // chunks

            def step() -> None:
                xs = [x.detach().requires_grad_() for x in (q, k, v)]
                out = fpdt_attention(*xs, group=group, chunk_size=chunk_size, backend=args.backend)
                out.backward(dout)

            step()  # warm-up
            seconds = timed(step, args.repeats, group)
            with TensorMemoryTracker() as tracker:
                step()
            name = "ulysses" if chunks == 0 else f"fpdt x{chunks}"
            base_time = base_time or seconds
            rows.append([seq, name, seconds * 1e3, seconds / base_time, tracker.peak_bytes / 2**20])
            if rank == 0:
                print(f"  measured S={seq} {name}: {seconds * 1e3:.1f} ms", flush=True)
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
