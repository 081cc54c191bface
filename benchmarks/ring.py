"""Ulysses x ring on CPU: one sequence-parallel group of 4 ranks as Ulysses 4, Ulysses 2 x ring 2 and ring 4.

    python benchmarks/ring.py                  # the default table: 4 gloo processes, 4096 tokens (~1 min)
    python benchmarks/ring.py --seq 8192 --kv-heads 8 --steps 5
    python benchmarks/ring.py --smoke          # tiny sizes, a few seconds (tests/test_benchmarks.py)

Model: the project's ``LlamaLM``, hidden 256, 8 heads (2 KV heads: Llama-3's 4 query heads per KV head), 4 layers,
vocabulary 4096, MLP and loss tiled, float32, batch 1, ``--chunks`` attention chunks, the ``sdpa`` kernel, nothing
offloaded. The same model, sequence and chunk size for every configuration (``--configs``):

- ``ulysses 4`` (``ring_size=1``): heads scattered over all 4 ranks; KV heads fewer than 4 replicated first;
- ``ulysses 2 x ring 2``: all-to-alls inside 2 groups of 2 consecutive ranks, key/value parts point to point
  between ranks 2 apart;
- ``ring 4``: no all-to-all; every key/value part goes to the 3 other ranks.

First a correctness gate: one step of each configuration in float64 with the ``math`` kernel, whose losses and
gradients must agree to float64 rounding (else nothing is measured). Then each configuration in fresh processes:
``--warmup`` steps, one measured step and ``--steps`` timed ones (the median is reported: rank 0's time between two
barriers; and the fastest). A step is forward, backward, the gradient all-reduce and an AdamW update.

Measured in the measured step, per rank: the bytes this rank sends, by wrapping ``torch.distributed.all_to_all_single``
(the part of its input that goes to other ranks: ``(U - 1) / U`` of it) and ``torch.distributed.batch_isend_irecv``
(the tensors of its ``isend`` ops) in the rank's process, split into forward and backward; and the peak of live tensors
(:class:`~lightning_fpdt.offload.memtrack.TensorMemoryTracker`: parameters, gradients, AdamW state, activations; the
largest rank). Next to them the memory model's figures: :func:`lightning_fpdt.memory.communication_bytes` and
:func:`~lightning_fpdt.memory.estimate`'s device peak. The gradient all-reduce (the same in every configuration) is not
counted. On CPU gloo moves bytes through memory copies and loopback sockets, not NVLink or InfiniBand: the times say
nothing about a GPU cluster; the bytes and the memory do.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RANKS, print_table

from lightning_fpdt.layers.loss import token_weighted_loss
from lightning_fpdt.memory import EstimateOptions, ModelShape, communication_bytes, estimate
from lightning_fpdt.models import LlamaConfig, LlamaLM
from lightning_fpdt.offload.memtrack import peak_step_bytes
from lightning_fpdt.parallel.batches import shard_batch
from lightning_fpdt.parallel.binding import SequenceParallelContext, bind
from lightning_fpdt.parallel.mesh import SequenceParallelGroups
from lightning_fpdt.testing import run_on_ranks

CONFIGS = {"ulysses 4": 1, "ulysses 2 x ring 2": 2, "ring 4": 4}  # name -> ring size (at --world 4)
MIB = 2**20
KINDS = ("all_to_all", "ring")
PASSES = ("forward", "backward")


class Traffic:
    """Counts the bytes this process sends while active (``with Traffic() as t``), by ``t.phase`` and kind:
    ``all_to_all`` (``dist.all_to_all_single``: the blocks of its input meant for other ranks) and ``ring``
    (``dist.batch_isend_irecv``: the tensors of its ``isend`` ops). The functions are wrapped on the module, where
    ``lightning_fpdt.parallel.comm`` and ``lightning_fpdt.attention.ring`` look them up at each call."""

    def __init__(self) -> None:
        self.phase = "forward"
        self.sent: dict[tuple[str, str], int] = defaultdict(int)
        self._saved: dict[str, Callable[..., Any]] = {}

    def __enter__(self) -> Traffic:
        all_to_all, batch = dist.all_to_all_single, dist.batch_isend_irecv
        self._saved = {"all_to_all_single": all_to_all, "batch_isend_irecv": batch}

        def counted_all_to_all(output: torch.Tensor, input: torch.Tensor, output_split_sizes: Any = None,
                               input_split_sizes: Any = None, group: Any = None, async_op: bool = False) -> Any:
            size, rank = dist.get_world_size(group), dist.get_rank(group)
            rows = input.shape[0] if input.dim() else 1
            row_bytes = input.nbytes // max(1, rows)
            splits = input_split_sizes or [rows // size] * size
            self.sent[(self.phase, "all_to_all")] += sum(n for r, n in enumerate(splits) if r != rank) * row_bytes
            return all_to_all(output, input, output_split_sizes, input_split_sizes, group, async_op)

        def counted_batch(p2p_op_list: list[dist.P2POp]) -> Any:
            self.sent[(self.phase, "ring")] += sum(op.tensor.nbytes for op in p2p_op_list if op.op is dist.isend)
            return batch(p2p_op_list)

        dist.all_to_all_single, dist.batch_isend_irecv = counted_all_to_all, counted_batch
        return self

    def __exit__(self, *exc: Any) -> None:
        dist.all_to_all_single = self._saved["all_to_all_single"]  # type: ignore[assignment]
        dist.batch_isend_irecv = self._saved["batch_isend_irecv"]  # type: ignore[assignment]


def model_config(args: argparse.Namespace) -> LlamaConfig:
    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                       num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                       rope_theta=10000.0, mlp_tiles=None)  # None: tiled, in automatic tiles


def chunk_size(seq: int, args: argparse.Namespace) -> int:
    return seq // args.chunks


def _setup(rank: int, world: int, ring: int, seq: int, args: argparse.Namespace, float64: bool = False,
           phase: Callable[[str], None] | None = None) -> tuple[LlamaLM, torch.optim.Optimizer, Callable[..., Any]]:
    """The model bound to Ulysses ``world / ring`` x ring ``ring``, its optimizer, and a step function (``phase``
    is told "forward" and "backward" as the step enters each)."""
    torch.manual_seed(0)
    module = LlamaLM(model_config(args))  # the loss is tiled like the MLP
    if float64:
        module = module.double()
    groups = SequenceParallelGroups.create(1, world, ring)
    chunk = chunk_size(seq, args)
    bind(module, SequenceParallelContext(
        group=dist.group.WORLD, chunk_size=chunk, attention_backend="math" if float64 else args.backend,
        activation_checkpointing=args.checkpointing, ulysses_group=groups.ulysses_group, ring_group=groups.ring_group,
    ))
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
    ids = torch.randint(0, args.vocab, (1, seq), generator=torch.Generator().manual_seed(seq))
    batch = shard_batch({"input_ids": ids}, world, rank, chunk, ring_size=ring)
    tell = phase or (lambda _: None)

    def step(update: bool = True) -> torch.Tensor:
        tell("forward")
        loss, mean = token_weighted_loss(*module.loss_terms(batch))
        tell("backward")
        loss.backward()
        for p in module.parameters():
            dist.all_reduce(p.grad)
        if update:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return mean.detach()

    return module, optimizer, step


def _gate(rank: int, world: int, rings: list[int], args: argparse.Namespace) -> list[dict[str, Any]]:
    """One float64 step (``math`` kernel, no update) per ring size, in one process group: the loss and every
    parameter's gradient (rank 0's)."""
    results = []
    for ring in rings:
        module, _, step = _setup(rank, world, ring, args.gate_seq, args, float64=True)
        loss = step(update=False).item()
        grads = {n: p.grad.clone() for n, p in module.named_parameters()} if rank == 0 else {}
        results.append({"loss": loss, "grads": grads})
    return results


def _run(rank: int, world: int, ring: int, args: argparse.Namespace) -> dict[str, Any]:
    traffic = Traffic()
    module, optimizer, step = _setup(rank, world, ring, args.seq, args, phase=lambda p: setattr(traffic, "phase", p))
    for _ in range(args.warmup):  # the optimizer state, the first-call costs
        step()
    with traffic:
        peak = peak_step_bytes(step, module, optimizer)
    times = []
    for _ in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        dist.barrier()
        times.append(time.perf_counter() - start)
    peaks = torch.tensor([peak], dtype=torch.int64)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    return {"seconds": statistics.median(times), "fastest": min(times), "peak": int(peaks.item()),
            "sent": dict(traffic.sent)}


def _modelled(ring: int, world: int, args: argparse.Namespace) -> tuple[dict[str, float], int]:
    """The memory model's bytes moved per step and device peak of this configuration."""
    with torch.device("meta"):
        shape, tiling = ModelShape.from_module(LlamaLM(model_config(args)))
    options = EstimateOptions(sequence_parallel_size=world, ring_size=ring, chunk_size=chunk_size(args.seq, args),
                              activation_checkpointing=args.checkpointing, attention_backend=args.backend, **tiling)
    return communication_bytes(shape, options, args.seq), estimate(shape, args.seq, options).device_peak


def check_gate(world: int, configs: list[str], args: argparse.Namespace) -> str:
    """Run the float64 gate; a sentence for the log, or ``SystemExit`` when the configurations disagree."""
    gated = run_on_ranks(_gate, world, [CONFIGS[name] for name in configs], args, **RANKS)[0]
    results = dict(zip(configs, gated))
    first = results[configs[0]]
    worst_loss = worst_grad = 0.0
    for name in configs[1:]:
        r = results[name]
        worst_loss = max(worst_loss, abs(r["loss"] - first["loss"]) / abs(first["loss"]))
        for n, g in first["grads"].items():
            scale = max(g.abs().max().item(), 1e-30)
            worst_grad = max(worst_grad, (r["grads"][n] - g).abs().max().item() / scale)
    text = (f"correctness gate (float64, math kernel, {args.gate_seq} tokens, {args.chunks} chunks): loss"
            f" {first['loss']:.12f}; worst loss rel. difference {worst_loss:.1e}, worst gradient {worst_grad:.1e}"
            f" over {', '.join(configs)}")
    if worst_loss > 1e-12 or worst_grad > 1e-9:
        raise SystemExit(text + ": the configurations disagree, not measuring.")
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--gate-seq", type=int, default=1024, help="tokens of the float64 correctness gate")
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3, help="timed steps (their median is reported)")
    parser.add_argument("--backend", default="sdpa", choices=["sdpa", "math"])
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing (forward moves twice)")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: a few seconds")
    args = parser.parse_args()
    if args.smoke:
        args.seq, args.gate_seq, args.chunks, args.hidden, args.heads = 256, 128, 2, 64, 4
        args.layers, args.vocab, args.warmup, args.steps = 1, 256, 1, 2
    world = 4  # every configuration is one sequence-parallel group of 4 ranks
    cores = os.cpu_count() or 1
    print(f"LlamaLM hidden {args.hidden}, {args.heads} heads ({args.kv_heads} KV heads), {args.layers} layers, vocab"
          f" {args.vocab}; {args.seq} tokens in {args.chunks} chunks; {world} gloo processes x"
          f" {max(1, cores // world)} thread(s) on {cores} core(s)", flush=True)
    print(check_gate(world, args.configs, args), flush=True)
    rows, passes = [], []
    for name in args.configs:
        ring = CONFIGS[name]
        r = run_on_ranks(_run, world, ring, args, **RANKS)[0]
        model, peak_model = _modelled(ring, world, args)
        sent = r["sent"]
        measured = {kind: sum(sent.get((p, kind), 0) for p in PASSES) for kind in KINDS}
        exact = all(sent.get((p, k), 0) == round(model[f"{k}_{p}"]) for k in KINDS for p in PASSES)
        rows.append([name, f"{world // ring} x {ring}", f"{r['seconds']:.3f}", f"{r['fastest']:.3f}",
                     args.seq / r["seconds"],
                     f"{measured['all_to_all'] / MIB:.2f}",
                     f"{(model['all_to_all_forward'] + model['all_to_all_backward']) / MIB:.2f}",
                     f"{measured['ring'] / MIB:.2f}", f"{(model['ring_forward'] + model['ring_backward']) / MIB:.2f}",
                     "exact" if exact else "differ", f"{r['peak'] / MIB:.1f}", f"{peak_model / MIB:.1f}",
                     f"{peak_model / r['peak']:.2f}"])
        passes.append([name, *(f"{sent.get((p, kind), 0) / MIB:.2f} / {model[f'{kind}_{p}'] / MIB:.2f}"
                               for kind in KINDS for p in PASSES)])
        print(f"  {name}: {r['seconds']:.3f} s/step", flush=True)
    print_table(["configuration", "ulysses x ring", "s/step (median)", "fastest", "tokens/s", "all-to-all MiB/rank",
                 "model", "ring MiB/rank", "model", "bytes vs model", "peak tensors MiB/rank", "estimate MiB",
                 "estimate/measured"], rows)
    print("bytes sent per step per rank by pass, measured / model (MiB):")
    print_table(["configuration", "all-to-all forward", "all-to-all backward", "ring forward", "ring backward"], passes)


if __name__ == "__main__":
    main()
