"""The cost of the per-batch agreement check (``lightning_fpdt.parallel.batches.BatchGate``) against a training step.

    python benchmarks/batch_gate.py                  # 2 gloo processes, sp=2, 8K tokens
    python benchmarks/batch_gate.py --seq 2048 8192 --repeats 5

Per length, on ``--world`` processes forming one sequence-parallel group: the mean time of the gate on
a whole batch (the fingerprint of the token ids, the range and dtype checks, this rank's shard and
the one all_gather of the ``[world, 6]`` summary table), and the mean time of one training step of the
benchmark model (the ``fpdt`` variant of benchmarks/training.py: Llama-style, hidden 512, 8 heads,
4 layers, vocabulary 32000, 4 attention chunks; forward, backward, gradient all-reduce, AdamW). The
step time excludes the gate. The table's last column is the gate's share of a step.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RANKS, print_table, timed

from lightning_fpdt.layers.loss import token_weighted_loss
from lightning_fpdt.models import LlamaConfig, LlamaLM
from lightning_fpdt.parallel.batches import BatchGate, shard_batch
from lightning_fpdt.parallel.binding import SequenceParallelContext, bind
from lightning_fpdt.testing import run_on_ranks


def _measure(rank: int, world: int, seq_lens: list[int], chunks: int, repeats: int) -> list[list]:
    config = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4)
    torch.manual_seed(0)
    module = LlamaLM(config)
    group = dist.new_group(list(range(world)))
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
    gate = BatchGate(world, world, rank, torch.device("cpu"), config.vocab_size)
    rows = []
    for seq in seq_lens:
        chunk = seq // chunks
        bind(module, SequenceParallelContext(group=group, chunk_size=chunk, attention_backend="sdpa"))
        batch = {"input_ids": torch.randint(0, config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(1))}

        def shard(b: dict, chunk: int = chunk) -> dict:
            return shard_batch(b, world, rank, chunk)

        local = shard(batch)

        def step(local: dict = local) -> None:
            optimizer.zero_grad(set_to_none=True)
            loss, _ = token_weighted_loss(*module.loss_terms(local))
            loss.backward()
            for p in module.parameters():  # what DDP does: average the gradients over the world
                dist.all_reduce(p.grad)
                p.grad /= world
            optimizer.step()

        step()  # warm-up
        gate_s = timed(lambda batch=batch, shard=shard: gate(batch, shard), repeats * 10)
        step_s = timed(step, repeats)
        rows.append([seq, chunks, gate_s * 1e3, step_s * 1e3, 100 * gate_s / step_s])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, nargs="+", default=[8192])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = run_on_ranks(_measure, args.world, args.seq, args.chunks, args.repeats, **RANKS)[0]
    print_table(["tokens", "chunks", "gate ms", "step ms", "gate % of step"], rows)


if __name__ == "__main__":
    main()
