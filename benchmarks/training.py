"""Training-step benchmark: tokens/s, peak memory and memory-per-token slope of the FPDT variants.

    python benchmarks/training.py                   # CPU, 2 gloo processes, the default table
    python benchmarks/training.py --seq 2048 4096 --variants ulysses fpdt_full
    python benchmarks/training.py --device cuda     # one process per GPU (NCCL), bf16, + longest sequence

Model: Llama-style, hidden 512, 8 heads (4 KV heads), 4 layers, vocabulary 32000, float32, batch 1.
``--models llama hf`` runs each variant for the project's own ``LlamaLM`` and for
``HFCausalLM(transformers.LlamaForCausalLM)`` of the same shape, with the same strategy options (the
HF model's attention through the FPDT pipeline, its MLPs tiled and decoder layers checkpointed by
``lightning_fpdt.hf.layers``).
Variants (``--variants``):

- ``single``: one process, no sequence parallelism (plain model, no tiling, no checkpointing);
- ``ulysses``: sequence parallel over ``--world`` processes, ``chunk_size=None``;
- ``fpdt``: the same with ``--chunks`` attention chunks;
- ``fpdt_full``: chunks plus tiled MLP and loss and activation checkpointing.

Each (variant, length) runs in fresh processes: one measured step (peak resident set over the
step, from ``ru_maxrss`` minus the resident set before it; and the peak of live tensors from
``TensorMemoryTracker``), then ``--repeats`` timed steps. A step is forward, backward, gradient
all-reduce and an AdamW update. The slope is (peak at the longest length - peak at the shortest) /
(difference in tokens per rank). "CPU MFU" is the model's FLOP/s per process divided by the
measured float32 matmul rate of one process with the same number of threads.

``--device cuda``: one process per visible GPU (NCCL), bf16 autocast over float32 weights, host
offload of attention chunks on for ``fpdt`` and of block checkpoints for ``fpdt_full``; memory is
``torch.cuda.max_memory_allocated`` (tensors) and ``max_memory_reserved`` (the allocator's pool, in
the RSS column); MFU is against the measured bf16 matmul rate of one GPU. ``--find-longest`` (on by
default on CUDA) then doubles the sequence per variant, from the longest ``--seq``, until a step runs
out of memory, takes longer than ``--probe-seconds`` or passes ``--longest-limit``, and reports the
longest length whose step ran. Each length runs in fresh processes: a rank that runs out of memory
ends its process at once (it may have left the others inside a collective it will never join), and
the launcher then ends the others, so no rank ever moves on to a different collective. The default
CUDA run (4 variants x 2 lengths, then the search) is sized to finish within 8 minutes on one H200.
Every run first checks, on its device, that one FPDT step's loss and every parameter's gradient equal
the plain model's (float32) to float32 rounding, with the ``math`` kernel and with ``--backend``.
For one GPU, ``benchmarks/gpu_check.py`` checks every attention route and measures MFU and offload.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RANKS, is_oom, matmul_rate, print_table, synchronize

from lightning_fpdt.layers.activation_checkpoint import new_layer_input_store
from lightning_fpdt.layers.loss import token_weighted_loss
from lightning_fpdt.memory import EstimateOptions, ModelShape, estimate
from lightning_fpdt.models import CausalLM, Llama, LlamaConfig, LlamaLM
from lightning_fpdt.offload.memtrack import peak_step_bytes
from lightning_fpdt.parallel.batches import shard_batch
from lightning_fpdt.parallel.binding import SequenceParallelContext, bind
from lightning_fpdt.testing import RankFailed, run_on_ranks

VARIANTS = ("single", "ulysses", "fpdt", "fpdt_full")
MODELS = ("llama", "hf")
OOM_EXIT = 75  # exit status of a rank that ran out of memory in the longest-sequence search


def model_config(variant: str, args: argparse.Namespace) -> LlamaConfig:
    tiled = variant == "fpdt_full"
    return LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads // 2,
        rope_theta=10000.0, mlp_tiles=None if tiled else 1,
    )


def chunk_size(variant: str, seq: int, world: int, args: argparse.Namespace) -> int | None:
    return None if variant in ("single", "ulysses") else max(world, seq // args.chunks // world * world)


def offloads(variant: str, args: argparse.Namespace) -> bool:
    """On CUDA the chunked variants keep their attention chunks (and fpdt_full its checkpoints) on the host."""
    return args.device == "cuda" and variant in ("fpdt", "fpdt_full")


def build(model: str, config: LlamaConfig) -> CausalLM:
    """The project's ``LlamaLM`` of ``config``, or ``HFCausalLM`` around a transformers Llama of the same
    shape with the same tiling (``model="hf"``)."""
    if model == "llama":
        return LlamaLM(config, loss_tiles=config.mlp_tiles)  # the loss is tiled exactly when the MLP is
    import transformers  # optional extra, needed only for --models hf

    from lightning_fpdt.models import HFCausalLM

    hf_config = transformers.LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, rope_theta=config.rope_theta, max_position_embeddings=1 << 22,
    )
    return HFCausalLM(hf_config, mlp_tiles=config.mlp_tiles, loss_tiles=config.mlp_tiles)


def flops_per_token(config: LlamaConfig, seq: int) -> float:
    """Model FLOPs per token of a Llama of ``config`` (the same for both ``--models``)."""
    with torch.device("meta"):
        return Llama(config).flops_per_token(seq)


def estimated_peak(variant: str, seq: int, world: int, args: argparse.Namespace, model: str = "llama") -> int:
    """``lightning_fpdt.memory``'s device peak for this variant (the measured column's counterpart)."""
    tiled, cuda = variant == "fpdt_full", args.device == "cuda"
    with torch.device("meta"):
        shape, _ = ModelShape.from_module(build(model, model_config(variant, args)))
    options = EstimateOptions(
        sequence_parallel_size=world, chunk_size=chunk_size(variant, seq, world, args), mlp_tiled=tiled,
        loss_tiled=tiled, activation_checkpointing=tiled, offload=offloads(variant, args),
        offload_checkpoints=offloads(variant, args) and tiled, precision="bf16-mixed" if cuda else "32-true",
        attention_backend=args.backend,
    )
    return estimate(shape, seq, options).device_peak


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def matmul_flops(threads: int, n: int = 1024, device: str = "cpu") -> float:
    """Measured matmul FLOP/s of this process: float32 on CPU, bf16 on CUDA."""
    if device == "cuda":
        return matmul_rate(device, torch.bfloat16, n=8192, reps=50)
    torch.set_num_threads(threads)
    return matmul_rate(device, torch.float32, n=n, reps=10)


def _setup(rank: int, world: int, variant: str, seq: int, args: argparse.Namespace, config: LlamaConfig | None = None,
           backend: str | None = None, model: str = "llama") -> tuple[CausalLM, torch.optim.Optimizer, Any]:
    """The model bound to this variant's FPDT options, its optimizer, and a step function."""
    group = dist.group.WORLD if world > 1 else None
    cuda = args.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    mixed = cuda and config is None  # the correctness check (an explicit config) runs in float32
    config = config or model_config(variant, args)
    module = build(model, config).to(device)
    chunk = chunk_size(variant, seq, world, args)
    full = variant == "fpdt_full"
    context = SequenceParallelContext(
        group=group, chunk_size=chunk, attention_backend=backend or args.backend, activation_checkpointing=full,
        offload=offloads(variant, args),
        layer_input_store=new_layer_input_store(device) if offloads(variant, args) and full else None,
    )
    bind(module, context)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(seq)
    ids = torch.randint(0, config.vocab_size, (1, seq), generator=g)
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v  # "documents" may be None
             for k, v in shard_batch({"input_ids": ids}, world, rank, chunk).items()}
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if mixed else contextlib.nullcontext()

    def step(update: bool = True) -> torch.Tensor:
        """One training step; without ``update`` the synchronised gradients stay in ``.grad``."""
        with autocast:
            loss, mean = token_weighted_loss(*module.loss_terms(batch))
        loss.backward()
        if world > 1:
            for p in module.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        if update:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return mean.detach()

    return module, optimizer, step


def _run(rank: int, world: int, variant: str, seq: int, args: argparse.Namespace, model: str = "llama") -> dict:
    module, optimizer, step = _setup(rank, world, variant, seq, args, model=model)
    cuda = args.device == "cuda"
    if cuda:
        step()  # warm-up (optimizer state, kernels)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        rss_peak, tensor_peak = torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated()
    else:
        rss_before = _rss_bytes()
        step()  # the measured step: optimizer state is created here too (a constant, not per token)
        rss_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
        tensor_peak = peak_step_bytes(step, module, optimizer)  # parameters, gradients, AdamW state, activations
    if world > 1:
        dist.barrier()
    start = time.perf_counter()
    for _ in range(args.repeats):
        step()
    synchronize(args.device)
    if world > 1:
        dist.barrier()
    seconds = (time.perf_counter() - start) / args.repeats
    flops = flops_per_token(model_config(variant, args), seq) * seq / world / seconds  # per process
    return {"rss": rss_peak, "tensors": tensor_peak, "seconds": seconds, "flops": flops}


def _probe(rank: int, world: int, variant: str, seq: int, args: argparse.Namespace) -> float:
    """Seconds of one step at ``seq`` after a warm-up (rank 0's figure).

    A rank that runs out of memory (device, pinned host or library allocations) ends its process at
    once with status ``OOM_EXIT``: the other ranks may be waiting in a collective it will never join,
    and any further collective, even an all-reduce of an "I failed" flag, would pair with the wrong
    one. The launcher sees the exit and ends the other ranks (:func:`_fits`).
    """
    try:
        _, _, step = _setup(rank, world, variant, seq, args)
        step()  # warm-up: optimizer state, pinned buffers, kernels
        synchronize(args.device)
        began = time.perf_counter()
        step()
        synchronize(args.device)
        return time.perf_counter() - began
    except (torch.OutOfMemoryError, RuntimeError) as err:
        if not is_oom(err):
            raise
        print(f"rank {rank}: out of memory at {seq} tokens ({variant})", file=sys.stderr, flush=True)
        os._exit(OOM_EXIT)


def _fits(world: int, variant: str, seq: int, args: argparse.Namespace, comm: str) -> float | None:
    """:func:`_probe` in fresh processes: its seconds, or ``None`` if a rank ran out of memory."""
    try:
        return run_on_ranks(_probe, world, variant, seq, args, backend=comm, **RANKS)[0]
    except RankFailed as err:  # the launcher has ended the other ranks
        if err.exit_code == OOM_EXIT:
            return None
        raise


def _longest(world: int, variant: str, start: int, args: argparse.Namespace, comm: str) -> dict:
    """Double the sequence from ``start`` until a step fails to fit or is too slow; the longest that ran."""
    longest, seconds, seq = 0, 0.0, start
    while seq <= args.longest_limit:
        elapsed = _fits(world, variant, seq, args, comm)
        if elapsed is None:
            break
        longest, seconds = seq, elapsed
        if elapsed > args.probe_seconds:
            break
        seq *= 2
    return {"longest": longest, "seconds": seconds}


def _check_exact(rank: int, world: int, args: argparse.Namespace) -> dict[str, tuple[float, float]]:
    """Relative differences between one FPDT step (4 chunks, tiling, checkpointing, offload on CUDA) and
    the plain model's on the same device, float32, with the ``math`` kernel and with the measured
    backend (``--backend``): ``(loss, worst parameter gradient)``. A gradient's error is relative to its
    own largest element, floored at 1e-3 of the model's largest (some are zero in exact arithmetic)."""
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, mlp_tiles=None)
    module, _, step = _setup(0, 1, "single", 1024, args, config=config, backend="math")  # every rank, alone
    reference = step(update=False).item()
    grads = {name: p.grad.detach().clone() for name, p in module.named_parameters()}
    floor = 1e-3 * max(g.abs().max().item() for g in grads.values())
    errors = {}
    for backend in dict.fromkeys(("math", args.backend)):
        module, _, step = _setup(rank, world, "fpdt_full", 1024, args, config=config, backend=backend)
        loss = step(update=False).item()
        grad_error = max(((p.grad - grads[name]).abs().max() / max(grads[name].abs().max().item(), floor)).item()
                         for name, p in module.named_parameters())
        errors[backend] = (abs(loss - reference) / abs(reference), grad_error)
    return errors


def _matmul_rate(rank: int, world: int, args: argparse.Namespace) -> float:
    return matmul_flops(max(1, (os.cpu_count() or 1) // world), device=args.device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--models", nargs="+", default=["llama"], choices=MODELS,
                        help="llama: the project's LlamaLM; hf: HFCausalLM(transformers.LlamaForCausalLM)")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--backend", default="sdpa")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--find-longest", action=argparse.BooleanOptionalAction, default=None,
                        help="search the longest sequence per variant (default: on for cuda)")
    parser.add_argument("--longest-limit", type=int, default=1 << 22, help="stop the search at this length")
    parser.add_argument("--probe-seconds", type=float, default=20.0, help="stop the search after a step this slow")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    if cuda:
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device is visible.")
        args.world = min(args.world, torch.cuda.device_count())
        if args.seq == [2048, 8192]:
            args.seq = [16384, 65536]  # GPU lengths
    comm = "nccl" if cuda else "gloo"
    find_longest = cuda if args.find_longest is None else args.find_longest

    def threads(world: int) -> int:  # what run_on_ranks(threads=None) gives each process
        return max(1, (os.cpu_count() or 1) // world)

    # the matmul rate a process reaches: the "peak" of MFU
    # measured in a child process like the runs (the parent keeps no CUDA context on the GPU)
    peak_flops = {w: run_on_ranks(_matmul_rate, w, args, backend=comm, **RANKS)[0] for w in {1, args.world}}
    kind = "bf16 matmul (one GPU)" if cuda else "float32 matmul"
    print(f"Llama-style hidden {args.hidden}, {args.heads} heads, {args.layers} layers, vocab {args.vocab}; "
          + "; ".join(f"{w} process(es) x {threads(w)} thread(s): {kind} {f / 1e9:.1f} GFLOP/s per process"
                      for w, f in sorted(peak_flops.items())), flush=True)
    errors = run_on_ranks(_check_exact, args.world, args, backend=comm, **RANKS)[0]
    where = "CUDA" if cuda else "CPU"
    print(f"correctness on {where}: FPDT (4 chunks, tiling, checkpointing{', offload' if cuda else ''}) vs plain"
          " model, one step, float32: " + ", ".join(f"{b}: loss rel. difference {loss:.2e}, worst gradient {grad:.2e}"
                                                     for b, (loss, grad) in errors.items()), flush=True)
    if max(max(e) for e in errors.values()) > 1e-4:
        raise SystemExit(f"FPDT on {args.device} does not match the plain model: not measuring.")
    results: dict[tuple[str, str, int], dict] = {}
    runs = [(model, variant) for variant in args.variants for model in args.models]
    for model, variant in runs:
        world = 1 if variant == "single" else args.world
        for seq in args.seq:
            r = run_on_ranks(_run, world, variant, seq, args, model, backend=comm, **RANKS)[0]
            results[(model, variant, seq)] = r
            print(f"  {model} {variant} S={seq}: {r['seconds']:.2f} s/step, rss +{r['rss'] / 2**20:.0f} MiB",
                  flush=True)
    rows = []
    lo, hi = min(args.seq), max(args.seq)
    for model, variant in runs:
        world = 1 if variant == "single" else args.world
        low, high = results[(model, variant, lo)], results[(model, variant, hi)]
        # a slope needs two lengths: with one --seq the columns say so instead of dividing by zero
        slope_rss: float | str = (high["rss"] - low["rss"]) / ((hi - lo) / world) / 1024 if hi > lo else "-"
        slope_t: float | str = (high["tensors"] - low["tensors"]) / ((hi - lo) / world) / 1024 if hi > lo else "-"
        for seq in args.seq:
            r = results[(model, variant, seq)]
            est = estimated_peak(variant, seq, world, args, model)
            rows.append([model, variant, seq, world, seq / r["seconds"], r["rss"] / 2**20, r["tensors"] / 2**20,
                         est / 2**20, f"{est / r['tensors']:.2f}", slope_rss, slope_t,
                         f"{100 * r['flops'] / peak_flops[world]:.1f}%"])
    print_table(["model", "variant", "seq", "procs", "tokens/s",
                 "peak reserved MiB/rank" if cuda else "peak RSS MiB/rank",
                 "peak tensors MiB/rank", "estimate MiB", "estimate/tensors",
                 "reserved KiB/token" if cuda else "RSS KiB/token", "tensors KiB/token", "MFU" if cuda else "CPU MFU"],
                rows)
    if find_longest:
        longest = []
        for variant in args.variants:
            world = 1 if variant == "single" else args.world
            r = _longest(world, variant, max(args.seq), args, comm)
            longest.append([variant, world, r["longest"], r["seconds"]])
            print(f"  {variant}: longest {r['longest']} tokens ({r['seconds']:.1f} s/step)", flush=True)
        print_table(["variant", "procs", "longest sequence that ran", "s/step at that length"], longest)


if __name__ == "__main__":
    main()
