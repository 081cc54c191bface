"""One command for a GPU: every CUDA attention route checked, the host link, offload overlap, and MFU.

    python benchmarks/gpu_check.py          # one CUDA GPU; sized to finish within 8 minutes on an H200
    python benchmarks/gpu_check.py --cpu    # the same code paths on tiny shapes on CPU (seconds; run by the tests)

One process, one device, nothing installed: torch and lightning (flash-attn 2, 3 and 4 when they import). Prints
Markdown tables, in this order:

1. **Routes.** Every attention route (``sdpa`` in bf16 and fp16: torch's flash op; ``sdpa`` in fp32:
   the memory-efficient op; ``math`` in fp32; ``cudnn`` in bf16/fp16 where torch's cuDNN works; ``flash_attn``,
   ``flash_attn_3`` and ``flash_attn_4`` in bf16/fp16 when their packages import), on small
   shapes (GQA, a head dim and a length that need padding), against float64 ``math`` attention:
   the kernel's own forward and backward (out, lse, dq, dk, dv; also with Gemma-2's softcap of 30, which cuDNN's op
   hands on and ``sdpa`` runs on banded ``math``), and the chunked pipeline with offload
   through autograd (out and the gradients of q, k, v), plus offload on/off bitwise equal. Then a
   small Llama with every FPDT feature (chunks, tiled MLP and loss, activation checkpointing, offloaded
   attention chunks and checkpoints) against the plain model in float64: the loss and every
   parameter's gradient. Error: ``max|a - b| / max|b|`` (a gradient's scale floored at 1e-3 of the
   largest gradient, for gradients that are zero in exact arithmetic). Last, ``shard_parameters`` with
   ``offload_optimizer`` (FSDP2's CPU offload, the shards in host memory) of a meta-device model read from a
   Hugging Face directory: one step against the unsharded model (``gpu_sharded.py``).
2. **Host link.** Pinned host -> device, device -> host, and both at once on the two copy streams of
   ``lightning_fpdt.offload.chunk_store`` (GB/s).
3. **Offload.** One causal attention layer (P = 1, ``--chunk-size`` tokens per chunk), forward+backward
   with and without offload, doubling the length until it does not fit ("OOM") or the next length
   would overrun the time budget: peak memory above the inputs (``max_memory_allocated``), step
   time, the compute stream's wait for prefetches (``OffloadStats.wait_seconds``: event-timed idle time
   of the compute stream), and ``overlap = 1 - exposed / copy``, where ``copy`` is the time the step's
   offload traffic takes on the link at the rates of section 2 and ``exposed = max(0, step with
   offload - step without)``: 1 means the copies cost no step time.
4. **MFU.** A Llama-1B-shaped model (hidden 2048, 16 layers, 32 heads, 8 KV heads, vocabulary
   128256, untied output layer so its matmul is counted) on one GPU (P = 1), bf16 autocast, chunked
   attention with offload, tiled MLP and loss, activation checkpointing with offloaded checkpoints,
   at 64K and 256K tokens: forward+backward time (the optimizer step is left out: its cost does not
   depend on the length) and MFU = model FLOPs (``Llama.flops_per_token``) per second over the
   nominal dense bf16 peak, and over the measured bf16 matmul rate.

The exit status is 1 if a correctness check failed (after every table is printed).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import is_oom, matmul_rate, max_rel_error, print_table, release_memory, synchronize
from gpu_mfu import baseline_rows, mfu_rows, phase_rows
from gpu_sharded import offload_optimizer_rows

from lightning_fpdt.attention import fpdt_attention, math_kernel, routes
from lightning_fpdt.attention.kernels import MathKernel, get_kernel
from lightning_fpdt.backends import route_description
from lightning_fpdt.layers.activation_checkpoint import new_layer_input_store
from lightning_fpdt.layers.loss import token_weighted_loss
from lightning_fpdt.models import LlamaConfig, LlamaLM
from lightning_fpdt.offload.copy_engine import copy_engine, release_copy_engines
from lightning_fpdt.offload.memtrack import TensorMemoryTracker
from lightning_fpdt.offload.stats import OffloadStats
from lightning_fpdt.parallel.batches import shard_batch
from lightning_fpdt.parallel.binding import SequenceParallelContext, bind

# max|a - b| / max|b| allowed per input dtype (the float64 reference is exact by comparison)
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 2e-3}
# dense bf16 tensor-core peaks (NVIDIA data sheets, half the figures "with sparsity"), the first name the device's
# contains wins: the PCIe and NVL boards run slower clocks than the SXM ones their plain names are; other GPUs: the
# measured matmul rate only
NOMINAL_BF16_FLOPS = (("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H200 NVL", 835e12), ("H100", 989.4e12),
                      ("H200", 989.4e12), ("A100", 312e12))


def _batch(ids: torch.Tensor, chunk: int | None, device: torch.device) -> dict[str, Any]:
    """One sequence (P = 1) as the strategy hands it to the model, on ``device``."""
    batch = shard_batch({"input_ids": ids}, 1, 0, chunk)
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


# ---- 1. routes ---------------------------------------------------------------------------------


def _routes(cpu: bool) -> list[tuple[str, torch.dtype]]:
    if cpu:
        return [("sdpa", torch.float32), ("sdpa", torch.bfloat16), ("math", torch.float32)]
    return [("sdpa", torch.bfloat16), ("sdpa", torch.float16), ("sdpa", torch.float32), ("math", torch.float32),
            ("cudnn", torch.bfloat16), ("cudnn", torch.float16), ("flash_attn", torch.bfloat16),
            ("flash_attn", torch.float16), ("flash_attn_3", torch.bfloat16), ("flash_attn_3", torch.float16),
            ("flash_attn_4", torch.bfloat16), ("flash_attn_4", torch.float16)]


def _kernel_row(kernel: Any, device: torch.device, dtype: torch.dtype, causal: bool, shape: tuple,
                softcap: float | None = None) -> tuple[list[float], str]:
    """The route's forward and backward vs float64 ``math``: errors of out, lse, dq, dk, dv, and the kernel the
    block ran on (``softcap``: Gemma-2's attention-logit cap, which cuDNN's op hands to a FlashAttention package or
    to ``sdpa``'s banded ``math``)."""
    b, s, h, g, d = shape
    gen = torch.Generator().manual_seed(s + h + d)
    q, do = (torch.randn(b, s, h, d, generator=gen) for _ in range(2))
    k, v = (torch.randn(b, s, g, d, generator=gen) for _ in range(2))
    scale = d**-0.5
    ref = MathKernel()
    x64 = [x.to(device, torch.float64) for x in (q, k, v, do)]
    out_ref, lse_ref = ref.forward(*x64[:3], causal, scale, None, softcap)
    grads_ref = ref.backward(x64[3], *x64[:3], out_ref, lse_ref, causal, scale, None, softcap)
    xs = [x.to(device, dtype) for x in (q, k, v, do)]
    with routes.tally() as ran:
        out, lse = kernel.forward(*xs[:3], causal, scale, None, softcap)
    grads = kernel.backward(xs[3], *xs[:3], out, lse, causal, scale, None, softcap)
    errors = [max_rel_error(out, out_ref), max_rel_error(lse, lse_ref),
              *(max_rel_error(a, r) for a, r in zip(grads, grads_ref, strict=True))]
    return errors, " + ".join(route for route, _ in ran)


def _softcap_row(kernel: Any, device: torch.device, dtype: torch.dtype, causal: bool, shape: tuple,
                 ) -> tuple[list[float], str]:
    """:func:`_kernel_row` with a softcap of 30, ``sdpa``'s banded ``math`` in bands of 16 rows, and the kernel the
    block ran on (cuDNN's op hands it on: to a FlashAttention package or to the bands)."""
    b, s, h = shape[:3]
    banded = math_kernel.MATH_BAND_SCORES
    math_kernel.MATH_BAND_SCORES = b * h * s * 16
    try:
        return _kernel_row(kernel, device, dtype, causal, shape, 30.0)
    finally:
        math_kernel.MATH_BAND_SCORES = banded


def _pipeline_row(backend: str, device: torch.device, dtype: torch.dtype, causal: bool, shape: tuple,
                  chunk: int) -> tuple[list[float], bool]:
    """The chunked pipeline with offload, through autograd, vs float64 ``math`` on the whole sequence;
    and whether offload on and off agree bit for bit."""
    b, s, h, g, d = shape
    gen = torch.Generator().manual_seed(7 * s + d)
    q, do = (torch.randn(b, s, h, d, generator=gen) for _ in range(2))
    k, v = (torch.randn(b, s, g, d, generator=gen) for _ in range(2))

    def run(xs: list[torch.Tensor], dout: torch.Tensor, **options: Any) -> list[torch.Tensor]:
        xs = [x.detach().requires_grad_() for x in xs]
        out = fpdt_attention(*xs, causal=causal, **options)
        out.backward(dout)
        return [out.detach(), *(x.grad for x in xs)]

    expected = run([x.to(device, torch.float64) for x in (q, k, v)], do.to(device, torch.float64), backend="math")
    xs, dout = [x.to(device, dtype) for x in (q, k, v)], do.to(device, dtype)
    got = run(xs, dout, backend=backend, chunk_size=chunk, offload=True)
    plain = run(xs, dout, backend=backend, chunk_size=chunk, offload=False)
    same = all(torch.equal(a, p) for a, p in zip(got, plain, strict=True))
    return [max_rel_error(a, e) for a, e in zip(got, expected, strict=True)], same


def check_routes(device: torch.device, cpu: bool) -> tuple[list[list], bool]:
    rows, ok = [], True
    # (batch, seq, heads, kv_heads, head_dim): GQA; a length not a multiple of 32 (the efficient op's lse
    # tiles) and a head dim not a multiple of 8 (padded for the flash kernels)
    shapes = [(2, 200, 8, 2, 64), (1, 96, 4, 4, 36)]
    for backend, dtype in _routes(cpu):
        try:
            kernel = get_kernel(backend, device, dtype)
        except ValueError as err:  # a FlashAttention package not installed, cuDNN's route not usable here
            rows.append([backend, str(dtype).removeprefix("torch."), "-", "-", *["-"] * 5, "-", f"skipped: {err}"[:90]])
            continue
        tol = TOLERANCE[dtype]
        for causal in (True, False):
            for shape in shapes:
                errs, _ = _kernel_row(kernel, device, dtype, causal, shape)
                good = max(errs) <= tol
                ok &= good
                rows.append([backend, str(dtype).removeprefix("torch."), f"kernel {shape}", causal, *errs, tol,
                             "ok" if good else "FAILED"])
            errs, ran = _softcap_row(kernel, device, dtype, causal, shapes[0])
            good = max(errs) <= tol
            ok &= good
            rows.append([backend, str(dtype).removeprefix("torch."), f"kernel {shapes[0]} softcap 30 on {ran}", causal,
                         *errs, tol, "ok" if good else "FAILED"])
            errs, same = _pipeline_row(backend, device, dtype, causal, (2, 256, 8, 2, 64), chunk=64)
            good = max(errs) <= tol and same
            ok &= good
            rows.append([backend, str(dtype).removeprefix("torch."), "pipeline 4 chunks + offload", causal,
                         errs[0], "-", *errs[1:], tol,
                         ("ok" if good else "FAILED") + ("" if same else " (offload changed bits)")])
    return rows, ok


def check_model(device: torch.device, cpu: bool) -> tuple[list[list], bool]:
    """A small Llama with every FPDT feature vs the plain model in float64: loss and every gradient."""
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0, mlp_tiles=None)
    seq, chunk = (512, 128) if cpu else (2048, 256)
    torch.manual_seed(0)
    module = LlamaLM(config).to(device)
    reference = copy.deepcopy(module).double()
    ids = torch.randint(0, config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(1))
    batch = _batch(ids, chunk, device)
    loss_ref, _ = token_weighted_loss(*reference.loss_terms(_batch(ids, None, device)))
    loss_ref.backward()
    grads_ref = {n: p.grad for n, p in reference.named_parameters()}
    floor = 1e-3 * max(g.abs().max().item() for g in grads_ref.values())
    rows, ok = [], True
    for backend, dtype in (("math", torch.float32), ("auto", torch.float32), ("auto", torch.bfloat16)):
        for p in module.parameters():
            p.grad = None
        context = SequenceParallelContext(chunk_size=chunk, attention_backend=backend, offload=True,
                                          activation_checkpointing=True, keep_attention=True,
                                          layer_input_store=new_layer_input_store(device))
        bind(module, context)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            loss, _ = token_weighted_loss(*module.loss_terms(batch))
        loss.backward()
        context.layer_input_store.close()
        grad_err = max(max_rel_error(p.grad, grads_ref[n], floor) for n, p in module.named_parameters())
        errs = [max_rel_error(loss.detach(), loss_ref.detach()), grad_err]
        good = max(errs) <= (1e-4 if backend == "math" else TOLERANCE[dtype])
        ok &= good
        rows.append([f"llama {seq} tokens, {seq // chunk} chunks", backend, str(dtype).removeprefix("torch."), *errs,
                     "ok" if good else "FAILED"])
    return rows, ok


# ---- 2. host link --------------------------------------------------------------------------------


def host_link(device: torch.device, nbytes: int) -> dict[str, float]:
    """GB/s of pinned host <-> device copies, one way at a time and both ways at once (CPU: memcpy)."""
    if device.type != "cuda":
        src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        start = time.perf_counter()
        dst.copy_(src)
        rate = nbytes / (time.perf_counter() - start) / 1e9
        return {"host -> device": rate, "device -> host": rate, "both at once (sum)": rate}
    engine = copy_engine(device)  # the offload's own copy streams
    host_in = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host_out = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev_in, dev_out = (torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2))

    def timed_ms(work: Callable[[], None]) -> float:
        work()  # warm-up
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(3):
            work()
        torch.cuda.synchronize(device)
        return (time.perf_counter() - start) / 3

    def h2d() -> None:
        with torch.cuda.stream(engine.to_device):
            dev_in.copy_(host_in, non_blocking=True)

    def d2h() -> None:
        with torch.cuda.stream(engine.to_host):
            host_out.copy_(dev_out, non_blocking=True)

    def both() -> None:
        h2d()
        d2h()

    return {"host -> device": nbytes / timed_ms(h2d) / 1e9, "device -> host": nbytes / timed_ms(d2h) / 1e9,
            "both at once (sum)": 2 * nbytes / timed_ms(both) / 1e9}


# ---- 3. offload ----------------------------------------------------------------------------------


def _attention_step(device: torch.device, seq: int, args: argparse.Namespace, offload: bool) -> dict[str, Any]:
    """Warm-up, then one measured forward+backward of one attention layer."""
    gen = torch.Generator().manual_seed(seq)
    dtype = torch.float32 if args.cpu else torch.bfloat16
    q, dout = (torch.randn(1, seq, args.heads, args.head_dim, generator=gen).to(device, dtype) for _ in range(2))
    k, v = (torch.randn(1, seq, args.kv_heads, args.head_dim, generator=gen).to(device, dtype) for _ in range(2))

    def step() -> OffloadStats:
        xs = [x.detach().requires_grad_() for x in (q, k, v)]
        stats: list[OffloadStats] = []
        out = fpdt_attention(*xs, chunk_size=args.chunk_size, backend=args.backend, offload=offload, stats_sink=stats)
        out.backward(dout)
        return stats[0]

    step()
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        start = time.perf_counter()
        stats = step()
        synchronize(device)
        seconds = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated(device) - base
    else:
        with TensorMemoryTracker() as tracker:
            tracker.reset_peak()
            start = time.perf_counter()
            stats = step()
            seconds = time.perf_counter() - start
        peak = tracker.peak_bytes
    return {"seconds": seconds, "peak": peak, "stats": stats}


def offload_table(device: torch.device, args: argparse.Namespace, link: dict[str, float],
                  deadline: float) -> tuple[list[list], str]:
    rows, seq, stop = [], args.chunk_size, "length limit"
    last_seconds = 0.0
    while seq <= args.max_seq:
        # a step costs ~4x when the length doubles; two steps (warm-up, measured) of each variant
        if last_seconds and time.perf_counter() + 2 * 4 * last_seconds > deadline:
            stop = f"time budget (next: {seq} tokens)"
            break
        results: dict[bool, Any] = {}
        for offload in (False, True):
            try:
                results[offload] = _attention_step(device, seq, args, offload)
            except (torch.OutOfMemoryError, RuntimeError) as err:
                if not is_oom(err):
                    raise
                results[offload] = None
            release_memory(device)
        release_copy_engines()  # bound the pinned memory: the pool holds this length's buffers only,
        release_memory(device)  # and the host allocator's cache none of them
        plain, off = results[False], results[True]
        if off is None or plain is None:
            rows.append([seq, seq // args.chunk_size, "OOM" if plain is None else plain["peak"] / 2**30,
                         "OOM" if off is None else off["peak"] / 2**30, *["-"] * 7])
            if off is None:
                stop = f"out of memory at {seq} tokens"
                break
            seq *= 2
            continue
        stats: OffloadStats = off["stats"]
        copy_s = (stats.bytes_to_host / (link["device -> host"] * 1e9)
                  + stats.bytes_to_device / (link["host -> device"] * 1e9))
        exposed = max(0.0, off["seconds"] - plain["seconds"])
        overlap = 1 - exposed / copy_s if copy_s > 0 else float("nan")
        # causal attention's forward and backward as FlashAttention's benchmarks count them: 2 matmuls forward, 5
        # backward, of 2 S^2 h d FLOPs each, halved by causality
        flops = 3.5 * 2 * seq**2 * args.heads * args.head_dim
        rows.append([seq, seq // args.chunk_size, plain["peak"] / 2**30, off["peak"] / 2**30, plain["seconds"] * 1e3,
                     off["seconds"] * 1e3, flops / plain["seconds"] / 1e12,
                     (stats.bytes_to_host + stats.bytes_to_device) / 2**30, stats.wait_seconds * 1e3, copy_s * 1e3,
                     f"{max(0.0, min(1.0, overlap)):.2f}"])
        print(f"  offload S={seq}: {plain['seconds'] * 1e3:.0f} ms without, {off['seconds'] * 1e3:.0f} ms with",
              flush=True)
        last_seconds = plain["seconds"] + off["seconds"]
        seq *= 2
    return rows, stop


# ---- 4. MFU ----------------------------------------------------------------------------------------


def nominal_peak(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for chip, flops in NOMINAL_BF16_FLOPS if chip in name), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="tiny shapes on CPU: a smoke run of the same code paths")
    parser.add_argument("--quick", action="store_true", help="the short run (about 3 minutes on an H200)")
    parser.add_argument("--budget-s", type=float, default=None, help="the whole run's time budget (default 460 s,"
                        " 170 s with --quick)")
    parser.add_argument("--chunk-size", type=int, default=None, help="tokens per chunk (GPU 65536, CPU 64)")
    parser.add_argument("--heads", type=int, default=32, help="query heads of the offload layer")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--max-seq", type=int, default=None, help="longest length of the offload search")
    parser.add_argument("--backend", default="auto")
    args = parser.parse_args()
    started = time.perf_counter()
    budget = args.budget_s or (170.0 if args.quick else 460.0)
    if args.cpu:
        device = torch.device("cpu")
        args.chunk_size = args.chunk_size or 64
        args.heads, args.kv_heads, args.head_dim = 4, 2, 16
        args.max_seq = args.max_seq or 256
        runs, baseline_seq, profiled = [("llama-1b", 128), ("llama3-8b", 256)], 128, (256, 64)
    else:
        if not torch.cuda.is_available():
            sys.exit("gpu_check: no CUDA device is visible. Run with --cpu for the smoke run.")
        device = torch.device("cuda", torch.cuda.current_device())
        args.chunk_size = args.chunk_size or 65536
        args.max_seq = args.max_seq or (2**19 if args.quick else 2**21)
        runs = [("llama-1b", 65536), ("llama3-8b", 65536)]
        if not args.quick:
            runs += [("llama3-8b", 131072), ("llama-1b", 262144)]
        baseline_seq, profiled = 16384, (16384, None)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    cuda = torch.version.cuda or "-"
    print(f"gpu_check{' --quick' if args.quick else ''} on {name}; torch {torch.__version__}, CUDA {cuda};"
          f" {time.strftime('%Y-%m-%d %H:%M')}", flush=True)

    print("\n## 1. Attention routes vs float64 math (max|a-b| / max|b|)\n", flush=True)
    rows, routes_ok = check_routes(device, args.cpu)
    print_table(["backend", "dtype", "check", "causal", "out", "lse", "dq", "dk", "dv", "tolerance", "status"], rows)
    print()
    rows, model_ok = check_model(device, args.cpu)
    print_table(["model (all FPDT features, attention kept) vs plain float64", "backend", "dtype", "loss",
                 "worst gradient", "status"], rows)
    print()
    rows, sharded_ok = offload_optimizer_rows(device, args.cpu)
    print_table(["FSDP2 sharded, one step vs unsharded (float32)", "shards on", "loss", "worst gradient",
                 "worst weight after the step", "tolerance", "status"], rows)

    print("\n## 2. Host link (pinned memory, the offload's copy streams)\n", flush=True)
    link = host_link(device, 2**30 if device.type == "cuda" else 2**24)
    print_table(["direction", "GB/s"], [[k, v] for k, v in link.items()])

    layer_route = route_description(args.backend, device.type, torch.float32 if args.cpu else torch.bfloat16)
    print(f"\n## 3. One attention layer with and without offload ({args.heads} heads, {args.kv_heads} KV heads, "
          f"head dim {args.head_dim}, chunk {args.chunk_size}, backend {args.backend}: {layer_route})\n", flush=True)
    rows, stop = offload_table(device, args, link, deadline=started + 0.3 * budget)
    print_table(["tokens", "chunks", "peak GiB", "peak GiB offload", "step ms", "step ms offload",
                 "TFLOP/s (no offload)", "GiB moved", "compute waited ms", "copy ms (link)", "overlap"], rows)
    print(f"search stopped: {stop}", flush=True)
    release_copy_engines()  # the pinned buffers of these lengths are not needed again

    print(f"\n## 4. The full stack vs the unbound model, Llama-1B shape, {baseline_seq} tokens in one chunk\n",
          flush=True)
    rows = baseline_rows(device, baseline_seq, args.backend, started + 0.45 * budget, args.cpu)
    print_table(["model", "tokens", "s / step", "peak GiB", "attention route"], rows)

    print(f"\n## 5. Where a full-stack step's time goes, Llama-1B shape, {profiled[0]} tokens (torch.profiler)\n",
          flush=True)
    print_table(["phase", "ms (device)" if not args.cpu else "ms (CPU)", "share"],
                phase_rows(device, profiled[0], profiled[1], args.backend, args.cpu))

    print("\n## 6. MFU, one GPU, forward+backward (strict: causal attention halved, recomputation not counted;"
          " Megatron: neither)\n", flush=True)
    dtype = torch.float32 if args.cpu else torch.bfloat16
    measured = matmul_rate(device, dtype, n=8192 if not args.cpu else 512, reps=20 if not args.cpu else 5)
    nominal = nominal_peak(device)
    rows = mfu_rows(device, runs, args.chunk_size, args.backend, nominal, measured, started + budget, args.cpu)
    print_table(["shape", "tokens", "s / step", "peak GiB", "TFLOP/s", "MFU strict", "MFU Megatron",
                 "strict / measured matmul", "attention route"], rows)
    print(f"matmul rate ({str(dtype).removeprefix('torch.')}, measured): {measured / 1e12:.1f} TFLOP/s; nominal peak: "
          + ("unknown for this device" if nominal is None else f"{nominal / 1e12:.0f} TFLOP/s")
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""), flush=True)
    print(f"\ntotal {time.perf_counter() - started:.0f} s", flush=True)
    if not (routes_ok and model_ok and sharded_ok):
        sys.exit("gpu_check: a correctness check FAILED (see the tables above).")


if __name__ == "__main__":
    main()
