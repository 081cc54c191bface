"""Training-step benchmark: tokens/s, peak memory and memory-per-token slope of the FPDT variants.

    python benchmarks/training.py                   # CPU, 2 gloo processes, the default table
    python benchmarks/training.py --seq 2048 4096 --variants ulysses fpdt_full

Model: Llama-style, hidden 512, 8 heads (4 KV heads), 4 layers, vocabulary 32000, float32, batch 1.
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
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table, run_on_ranks  # noqa: E402

from lightning_fpdt.block import FPDTBlock, SequenceParallelContext  # noqa: E402
from lightning_fpdt.layout import shard_batch  # noqa: E402
from lightning_fpdt.loss import token_weighted_loss  # noqa: E402
from lightning_fpdt.memory import ModelShape, estimate  # noqa: E402
from lightning_fpdt.memtrack import peak_step_bytes  # noqa: E402
from lightning_fpdt.models import LlamaConfig, LlamaLM  # noqa: E402

VARIANTS = ("single", "ulysses", "fpdt", "fpdt_full")


def model_config(variant: str, args: argparse.Namespace) -> LlamaConfig:
    tiled = variant == "fpdt_full"
    return LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads // 2,
        rope_theta=10000.0, mlp_tiles=None if tiled else 1, loss_tiles=None if tiled else 1,
    )


def chunk_size(variant: str, seq: int, world: int, args: argparse.Namespace) -> int | None:
    return None if variant in ("single", "ulysses") else max(world, seq // args.chunks // world * world)


def estimated_peak(variant: str, seq: int, world: int, args: argparse.Namespace) -> int:
    """``lightning_fpdt.memory``'s device peak for this variant (the measured column's counterpart)."""
    tiled = variant == "fpdt_full"
    return estimate(ModelShape.from_config(model_config(variant, args)), seq, sequence_parallel_size=world,
                    chunk_size=chunk_size(variant, seq, world, args), mlp_tiled=tiled, loss_tiled=tiled,
                    activation_checkpointing=tiled).device_peak


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def matmul_flops(threads: int, n: int = 1024) -> float:
    """Measured float32 matmul FLOP/s of this process."""
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    start = time.perf_counter()
    reps = 10
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (time.perf_counter() - start)


def _run(rank: int, world: int, variant: str, seq: int, args: argparse.Namespace) -> dict:
    group = dist.group.WORLD if world > 1 else None
    torch.manual_seed(0)
    config = model_config(variant, args)
    module = LlamaLM(config)
    chunk = chunk_size(variant, seq, world, args)
    context = SequenceParallelContext(group=group, chunk_size=chunk, attention_backend=args.backend,
                                      activation_checkpointing=variant == "fpdt_full")
    for index, block in enumerate(m for m in module.modules() if isinstance(m, FPDTBlock)):
        block.bind(context, layer_index=index)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(seq)
    batch = shard_batch({"input_ids": torch.randint(0, args.vocab, (1, seq), generator=g)}, world, rank, chunk)

    def step() -> None:
        loss, _ = token_weighted_loss(*module.loss_terms(batch))
        loss.backward()
        if world > 1:
            for p in module.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    rss_before = _rss_bytes()
    step()  # the measured step: optimizer state is created here too (a constant, not per token)
    rss_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
    tensor_peak = peak_step_bytes(step, module, optimizer)  # parameters, gradients, AdamW state, activations
    if world > 1:
        dist.barrier()
    start = time.perf_counter()
    for _ in range(args.repeats):
        step()
    if world > 1:
        dist.barrier()
    seconds = (time.perf_counter() - start) / args.repeats
    flops = module.model.flops_per_token(seq) * seq / world / seconds  # per process
    return {"rss": rss_peak, "tensors": tensor_peak, "seconds": seconds, "flops": flops}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--backend", default="sdpa")
    args = parser.parse_args()
    def threads(world: int) -> int:  # what benchmarks/common.py gives each process
        return max(1, (os.cpu_count() or 1) // world)

    # the matmul rate a process with that many threads reaches: the "peak" of CPU MFU
    peak_flops = {w: matmul_flops(threads(w)) for w in {1, args.world}}
    print(f"Llama-style hidden {args.hidden}, {args.heads} heads, {args.layers} layers, vocab {args.vocab}; "
          + "; ".join(f"{w} process(es) x {threads(w)} thread(s): float32 matmul {f / 1e9:.1f} GFLOP/s per process"
                      for w, f in sorted(peak_flops.items())), flush=True)
    results: dict[tuple[str, int], dict] = {}
    for variant in args.variants:
        world = 1 if variant == "single" else args.world
        for seq in args.seq:
            results[(variant, seq)] = run_on_ranks(_run, world, variant, seq, args)
            r = results[(variant, seq)]
            print(f"  {variant} S={seq}: {r['seconds']:.2f} s/step, rss +{r['rss'] / 2**20:.0f} MiB", flush=True)
    rows = []
    lo, hi = min(args.seq), max(args.seq)
    for variant in args.variants:
        world = 1 if variant == "single" else args.world
        slope_rss = (results[(variant, hi)]["rss"] - results[(variant, lo)]["rss"]) / ((hi - lo) / world)
        slope_t = (results[(variant, hi)]["tensors"] - results[(variant, lo)]["tensors"]) / ((hi - lo) / world)
        for seq in args.seq:
            r = results[(variant, seq)]
            est = estimated_peak(variant, seq, world, args)
            rows.append([variant, seq, world, seq / r["seconds"], r["rss"] / 2**20, r["tensors"] / 2**20,
                         est / 2**20, f"{est / r['tensors']:.2f}", slope_rss / 1024, slope_t / 1024,
                         f"{100 * r['flops'] / peak_flops[world]:.1f}%"])
    print_table(["variant", "seq", "procs", "tokens/s", "peak RSS MiB/rank", "peak tensors MiB/rank",
                 "estimate MiB", "estimate/tensors", "RSS KiB/token", "tensors KiB/token", "CPU MFU"], rows)


if __name__ == "__main__":
    main()
