"""Packed documents: attention cost grows with the sum of squared document lengths, not with S**2.

    python benchmarks/documents.py                     # 32K tokens, 8 chunks, sp=2, 64 documents of 512
    python benchmarks/documents.py --seq 8192 --docs 16 --repeats 2

One FPDT attention layer (``fpdt_attention``: per-chunk all-to-all, online softmax, chunked backward),
forward and backward, on ``--world`` gloo processes, float32, ``sdpa`` backend, batch 1, 8 heads of
64. The same tokens are timed as one document and as ``--docs`` documents of equal length (packed,
``position_ids`` restarting): blocks that share no document are skipped (no kernel, no copy), the
others run one kernel call per shared document. The table gives the mean seconds of a forward +
backward and the packed time as a fraction of the one-document time.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RANKS, print_table, timed

from lightning_fpdt.attention import fpdt_attention
from lightning_fpdt.parallel.layout import shard_sequence
from lightning_fpdt.parallel.packed_documents import PackedDocuments
from lightning_fpdt.testing import run_on_ranks

HEADS, HEAD_DIM = 8, 64


def _measure(rank: int, world: int, seq: int, chunks: int, docs: int, repeats: int) -> list[list]:
    group = dist.group.WORLD
    chunk = seq // chunks
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, seq, HEADS, HEAD_DIM, generator=g) for _ in range(4))
    q, k, v, dout = (shard_sequence(x, world, rank, chunk) for x in (q, k, v, dout))
    length = seq // docs
    packed = PackedDocuments.from_position_ids(torch.arange(seq).remainder(length).unsqueeze(0))
    rows = []
    for name, documents in (("one document", None), (f"{docs} documents of {length}", packed)):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]

        def step(leaves: list = leaves, documents: PackedDocuments | None = documents) -> None:
            out = fpdt_attention(*leaves, group=group, chunk_size=chunk, backend="sdpa", documents=documents)
            out.backward(dout)

        step()  # warm-up
        rows.append([seq, chunks, name, timed(step, repeats)])
    base = rows[0][3]
    for row in rows:
        row.append(row[3] / base)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--docs", type=int, default=64)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = run_on_ranks(_measure, args.world, args.seq, args.chunks, args.docs, args.repeats, **RANKS)[0]
    print_table(["tokens", "chunks", "documents", "s fwd+bwd", "x one document"], rows)


if __name__ == "__main__":
    main()
