"""Host offload of one FPDT attention layer on a single GPU: peak HBM, step time, copy bandwidth.

    python benchmarks/offload_gpu.py                 # an H200-class GPU; finishes within ~8 minutes
    python benchmarks/offload_gpu.py --cpu           # a seconds-long smoke run on CPU (used by the tests)

For each sequence length (doubling until one does not fit or the time budget is spent) the script
runs forward+backward of ``fpdt_attention`` on ``[1, S, heads, head_dim]`` (one process, so P = 1)
with ``chunk_size`` tokens per chunk, with and without ``offload=True``, and prints:

- peak memory (``torch.cuda.max_memory_allocated``; on CPU the peak of live tensors);
- step time (mean of ``--repeats`` after a warm-up) and the offload overhead;
- bytes moved each way and the achieved bandwidth over the step, next to the bandwidth of a plain
  pinned-host <-> device copy.

Before measuring it checks correctness on the device: offload on/off bitwise equal, and the chosen
backend against float32 ``math`` attention.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table  # noqa: E402

from lightning_fpdt.attention import fpdt_attention  # noqa: E402
from lightning_fpdt.memtrack import TensorMemoryTracker  # noqa: E402
from lightning_fpdt.offload import OffloadStats  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(q, k, v, dout, chunk_size, backend, offload) -> OffloadStats:
    xs = [x.detach().requires_grad_() for x in (q, k, v)]
    stats: list[OffloadStats] = []
    out = fpdt_attention(*xs, chunk_size=chunk_size, backend=backend, offload=offload, stats_sink=stats)
    out.backward(dout)
    return stats[0]


def check_correctness(device: torch.device, dtype: torch.dtype, backend: str, heads: int, head_dim: int) -> str:
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v, dout = (torch.randn(1, 512, heads, head_dim, generator=g).to(device, dtype) for _ in range(4))
    grads = {}
    for offload in (False, True):
        xs = [x.detach().requires_grad_() for x in (q, k, v)]
        out = fpdt_attention(*xs, chunk_size=128, backend=backend, offload=offload)
        out.backward(dout)
        grads[offload] = [out.detach(), *(x.grad for x in xs)]
    same = all(torch.equal(a, b) for a, b in zip(grads[False], grads[True]))
    xs = [x.detach().float().requires_grad_() for x in (q, k, v)]
    ref = fpdt_attention(*xs, backend="math")
    ref.backward(dout.float())
    err = max(((a.float() - b).abs().max() / b.abs().max()).item()
              for a, b in zip(grads[False], [ref.detach(), *(x.grad for x in xs)]))
    tol = 2e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-4
    status = "ok" if same and err <= tol else "FAILED"
    return f"correctness: offload bitwise equal={same}, {backend} vs float32 math rel. error {err:.2e} (<= {tol}): {status}"


def copy_bandwidth(device: torch.device, nbytes: int) -> tuple[float, float]:
    """GB/s of a pinned-host -> device and device -> pinned-host copy of ``nbytes``."""
    if device.type != "cuda":
        host, dev = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        start = time.perf_counter()
        dev.copy_(host)
        h2d = nbytes / (time.perf_counter() - start) / 1e9
        start = time.perf_counter()
        host.copy_(dev)
        return h2d, nbytes / (time.perf_counter() - start) / 1e9
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    rates = []
    for dst, src in ((dev, host), (host, dev)):
        dst.copy_(src, non_blocking=True)  # warm-up
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(3):
            dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        rates.append(3 * nbytes / (begin.elapsed_time(end) / 1e3) / 1e9)
    return rates[0], rates[1]


def measure(device, dtype, backend, seq, chunk_size, heads, head_dim, offload, repeats) -> dict:
    g = torch.Generator(device="cpu").manual_seed(seq)
    q, k, v, dout = (torch.randn(1, seq, heads, head_dim, generator=g).to(device, dtype) for _ in range(4))
    _step(q, k, v, dout, chunk_size, backend, offload)  # warm-up: pools, kernels
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        stats = _step(q, k, v, dout, chunk_size, backend, offload)
        _sync(device)
        peak = torch.cuda.max_memory_allocated(device) - base
    else:
        with TensorMemoryTracker() as tracker:
            tracker.reset_peak()
            stats = _step(q, k, v, dout, chunk_size, backend, offload)
        peak = tracker.peak_bytes
    start = time.perf_counter()
    for _ in range(repeats):
        _step(q, k, v, dout, chunk_size, backend, offload)
    _sync(device)
    seconds = (time.perf_counter() - start) / repeats
    return {"peak": peak, "seconds": seconds, "stats": stats}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="a seconds-long smoke run on CPU")
    parser.add_argument("--seq", type=int, nargs="+", default=None, help="sequence lengths (default: doubling)")
    parser.add_argument("--chunk-size", type=int, default=None, help="tokens per chunk (GPU default 65536)")
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--budget-s", type=float, default=420.0, help="stop starting new lengths after this")
    args = parser.parse_args()
    started = time.perf_counter()

    if args.cpu:
        device, dtype = torch.device("cpu"), torch.float32
        seqs, chunk, heads, head_dim = args.seq or [256, 512], args.chunk_size or 64, args.heads or 2, 16
    else:
        if not torch.cuda.is_available():
            sys.exit("No CUDA device: run with --cpu for the smoke run.")
        device, dtype = torch.device("cuda"), torch.bfloat16
        seqs = args.seq or [65536 * 2**i for i in range(6)]  # 64K .. 2M
        chunk, heads, head_dim = args.chunk_size or 65536, args.heads or 32, args.head_dim
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"device {name}; dtype {dtype}; backend {args.backend}; heads {heads} x {head_dim}; chunk {chunk}", flush=True)
    print(check_correctness(device, dtype, args.backend, heads, head_dim), flush=True)
    h2d, d2h = copy_bandwidth(device, 2**30 if device.type == "cuda" else 2**24)
    print(f"plain copy bandwidth: host->device {h2d:.1f} GB/s, device->host {d2h:.1f} GB/s", flush=True)

    rows = []
    for seq in seqs:
        if time.perf_counter() - started > args.budget_s:
            print(f"time budget of {args.budget_s:.0f}s spent; stopping before S={seq}", flush=True)
            break
        results = {}
        for offload in (False, True):
            try:
                results[offload] = measure(device, dtype, args.backend, seq, chunk, heads, head_dim, offload, args.repeats)
            except torch.OutOfMemoryError:
                results[offload] = None
                torch.cuda.empty_cache()
            print(f"  S={seq} offload={offload}: "
                  + ("out of memory" if results[offload] is None else f"{results[offload]['seconds'] * 1e3:.1f} ms"),
                  flush=True)
        plain, off = results[False], results[True]
        moved = off["stats"].bytes_to_host + off["stats"].bytes_to_device if off else 0
        rows.append([
            seq, seq // chunk if seq >= chunk else 1,
            "OOM" if plain is None else plain["peak"] / 2**30, "OOM" if off is None else off["peak"] / 2**30,
            "OOM" if plain is None else plain["seconds"] * 1e3, "OOM" if off is None else off["seconds"] * 1e3,
            "-" if plain is None or off is None else f"{(off['seconds'] / plain['seconds'] - 1) * 100:+.1f}%",
            "-" if off is None else moved / 2**30,
            "-" if off is None else moved / off["seconds"] / 1e9,
        ])
        if off is None:
            break
    print_table(["seq", "chunks", "peak GiB", "peak GiB offload", "step ms", "step ms offload", "offload cost",
                 "GiB moved", "GB/s over step"], rows)


if __name__ == "__main__":
    main()
