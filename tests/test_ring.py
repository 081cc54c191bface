"""The ring inside the sequence-parallel group: ``P = ulysses x ring`` ranks against one process.

The layout's zigzag gives every ring rank the same causal work; a ring rank sends a key/value part only to the
peers whose queries see some of it, and a block its queries do not see is not computed (counted pair by pair);
``fpdt_attention`` at Ulysses 2 x ring 2 and ring 4 equals textbook attention (float64, 1e-10), causal and not,
with chunks, offload, packed documents, windows and one KV head; ``ring_size="auto"`` and the head-count errors
name the ring sizes that fit. Training through ``Trainer.fit`` is in tests/test_ring_training.py.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from lightning_fpdt.attention import fpdt_attention
from lightning_fpdt.attention.blocks import BlockRules
from lightning_fpdt.attention.kernels import MathKernel
from lightning_fpdt.attention.ring import ring_plan
from lightning_fpdt.offload.stats import OffloadStats
from lightning_fpdt.parallel.comm import check_heads
from lightning_fpdt.parallel.layout import (
    fpdt_permutation,
    ring_pieces,
    shard_sequence,
    unshard_sequence,
    validate_chunk_size,
)
from lightning_fpdt.parallel.mesh import SequenceParallelGroups, placement, resolve_ring_size
from lightning_fpdt.parallel.packed_documents import PackedDocuments
from lightning_fpdt.testing import run_on_ranks
from tests.reference import rel_error

HEADS, DIM, BATCH, SEQ = 4, 8, 2, 48
DOCS = ((0, 5, 19, 20, 33), (0, 30))  # packed documents per sample: across chunk, piece and rank boundaries


def _ranges(seq: int, chunk: int) -> tuple[tuple[int, int], ...]:
    return tuple((lo, min(lo + chunk, seq)) for lo in range(0, seq, chunk))


def test_zigzag_layout_holds_pieces_a_and_2r_minus_1_minus_a() -> None:
    """sp=4 as Ulysses 2 x ring 2, chunks of 16: ring rank a's two ranks hold pieces a and 3 - a of every chunk
    (4 tokens each), in order, so the Ulysses all-to-all gathers them in order; ring 1 is the plain layout."""
    perm = fpdt_permutation(32, 4, 16, ring_size=2).view(4, -1)
    assert sorted(perm.flatten().tolist()) == list(range(32))
    group0 = torch.cat([perm[0, :4], perm[1, :4], perm[0, 4:], perm[1, 4:]])  # chunk 0, then chunk 1, of ring rank 0
    assert group0.tolist() == [*range(0, 4), *range(12, 16), *range(16, 20), *range(28, 32)]
    assert ring_pieces(16, 16, 2, 1) == ((20, 28),)  # pieces 1 and 2 touch: one range
    assert torch.equal(fpdt_permutation(32, 4, 16, ring_size=1), fpdt_permutation(32, 4, 16))
    x = torch.randn(2, 48, 3)
    shards = [shard_sequence(x, 4, r, 16, ring_size=2) for r in range(4)]
    assert torch.equal(unshard_sequence(shards, 16, ring_size=2), x)


def _pairs(rects: Any, n_q: int, n_k: int) -> int:
    if rects is None:
        return n_q * n_k
    return sum((r.q_hi - r.q_lo) * (r.q_hi - r.q_lo + 1) // 2 if r.causal else (r.q_hi - r.q_lo) * (r.k_hi - r.k_lo)
               for r in rects)


@pytest.mark.parametrize("ring", [2, 4])
def test_every_ring_rank_has_the_same_causal_work(ring: int) -> None:
    """Query-key pairs each ring rank computes under plain causal attention: equal (contiguous parts would give the
    last ring rank 2R - 1 times the first one's diagonal work)."""
    ranges = _ranges(64, 32)
    work = []
    for rank in range(ring):
        plan = ring_plan(BlockRules(True), ranges, ring, rank)
        part = sum(hi - lo for lo, hi in plan.parts[0][rank])
        work.append(sum(_pairs(rects, part, part) for rects in plan.blocks.values()))
    assert len(set(work)) == 1 and work[0] * ring == 64 * 65 // 2, work


def test_a_part_moves_only_to_the_peers_that_see_it() -> None:
    """With a window of 3 tokens over chunks of 32 (pieces of 4 at ring 4), a part travels to a peer exactly when
    some query of the peer's sees some of its keys; what one rank sends the other receives."""
    rules, ranges, ring = BlockRules(True, 3), _ranges(64, 32), 4
    plans = [ring_plan(rules, ranges, ring, a) for a in range(ring)]
    moved = 0
    for a, b in itertools.permutations(range(ring), 2):
        for j in range(len(ranges)):
            keys = [t for lo, hi in plans[0].parts[j][a] for t in range(lo, hi)]
            queries = [t for i in range(len(ranges)) for lo, hi in plans[0].parts[i][b] for t in range(lo, hi)]
            seen = any(k <= q < k + 3 for q in queries for k in keys)
            assert (b in plans[a].sends[j]) == seen == (a in plans[b].receives[j]), (a, b, j)
            moved += seen
    assert 0 < moved < ring * (ring - 1) * len(ranges)  # some parts are seen by the peer, some are not


def test_auto_ring_size_is_the_largest_ulysses_degree_that_fits() -> None:
    assert resolve_ring_size("auto", 8, 8, [(28, 4)]) == 2  # Qwen2.5-7B: 28 heads on 8 ranks, Ulysses 4 x ring 2
    assert resolve_ring_size("auto", 4, 4, [(6, 6)]) == 2
    assert resolve_ring_size("auto", 64, 8, [(32, 8)]) == 8  # Llama-3-8B on 8 nodes x 8: Ulysses 8 inside a node
    assert resolve_ring_size("auto", 4, 4, [(8, 2)]) == 1  # heads divide: plain Ulysses, as before
    assert resolve_ring_size("auto", 4, 4, [(4, 4), (6, 6)]) == 2  # every layer's heads
    assert resolve_ring_size("auto", 4, 6, [(32, 8)]) == 2  # Ulysses groups must not straddle 6-device nodes
    assert resolve_ring_size("auto", 12, 8, [(48, 12)]) == 3  # Ulysses 4 (divides 8), not 6
    assert resolve_ring_size(2, 4, 4, [(3, 3)]) == 2  # as given (the heads are checked at binding)
    with pytest.raises(ValueError, match=r"ring_size=3 does not divide sequence_parallel_size=4.*\[1, 2, 4\]"):
        resolve_ring_size(3, 4, 4)


def test_head_and_chunk_errors_name_the_ring_sizes_that_fit() -> None:
    with pytest.raises(ValueError, match=r"n_heads=28 is not divisible by sequence_parallel_size=8.*Use ring_size=2 "
                                         r"\(Ulysses 4 x ring 2.*\[2, 4, 8\]"):
        check_heads(28, 4, 8)
    with pytest.raises(ValueError, match=r"the Ulysses degree 4 \(sequence_parallel_size=8 / ring_size=2\)"):
        check_heads(6, 6, 8, 2)
    with pytest.raises(ValueError, match=r"chunk_size=6 is not divisible by 4 \(sequence_parallel_size=2, ring_size=2\)"
                                         r".*two per ring rank. Use a multiple of 4, e.g. 4 or 8"):
        validate_chunk_size(6, 2, 2)


def test_the_log_line_says_where_each_group_lies() -> None:
    assert placement(SequenceParallelGroups(1, 2, 2), 2) == (
        "sequence_parallel=4 as ulysses=2 (consecutive ranks, inside a node) x ring=2 (ranks 2 apart, across 2 nodes);"
        " data_parallel=1 outermost")
    assert placement(SequenceParallelGroups(2, 4, 1), 4) == "sequence_parallel=4 as ulysses=4 (inside a node); " \
                                                            "data_parallel=2"
    # 6 devices per node: the second group's Ulysses ranks 4-7 straddle nodes 0 and 1; rings of the second data-
    # parallel group (ranks 12 + x, 12 + 6 + x) lie across nodes 2 and 3
    assert "ulysses=4 (across up to 2 nodes)" in placement(SequenceParallelGroups(3, 4, 1), 6)
    assert "ring=2 (ranks 6 apart, across 2 nodes)" in placement(SequenceParallelGroups(2, 6, 2), 8)


# ---- on ranks --------------------------------------------------------------------------------------------------


def _groups(world: int, ring: int) -> tuple[Any, Any]:
    groups = SequenceParallelGroups.create(1, world, ring)
    return (groups.ulysses_group if ring > 1 else dist.group.WORLD), groups.ring_group


def _inputs(seed: int, kv: int) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(BATCH, SEQ, heads, DIM) for heads in (HEADS, kv, kv, HEADS)]  # q, k, v, dout
    return [torch.randn(s, generator=g, dtype=torch.float64) * 1.5 for s in shapes]


def _seen(causal: bool, window: int | None, docs: Any) -> Tensor:
    """``[batch, q, k]``: which keys each query sees."""
    i = torch.arange(SEQ)
    seen = (i[None] <= i[:, None]) if causal else torch.ones(SEQ, SEQ, dtype=torch.bool)
    if window is not None:
        seen = seen & (i[None] > i[:, None] - window)
    seen = seen.expand(BATCH, SEQ, SEQ)
    if docs is not None:
        doc = torch.stack([torch.searchsorted(torch.tensor(s), i, right=True) for s in docs])
        seen = seen & (doc[:, :, None] == doc[:, None, :])
    return seen


def _reference(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, seen: Tensor) -> list[Tensor]:
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    groups = HEADS // k.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(groups, dim=2)) / DIM ** 0.5
    s = s.masked_fill(~seen[:, None], float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1), v.repeat_interleave(groups, dim=2))
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


# (ring, chunk, causal, kv heads, window, packed documents, offload)
CASES = [
    (2, 16, True, 2, None, False, True), (2, None, True, 1, None, True, False), (2, 8, False, 4, None, False, False),
    (2, 16, True, 1, 5, True, True), (4, 8, True, 2, None, True, True), (4, 16, True, 4, 7, False, False),
    (4, None, False, 1, None, False, False), (4, 8, True, 1, 9, True, False),
]


def _run_cases(rank: int, world: int, seed: int) -> list[list[Tensor]]:
    results = []
    for n, (ring, chunk, causal, kv, window, packed, offload) in enumerate(CASES):
        group, ring_group = _groups(world, ring)
        documents = PackedDocuments(DOCS, SEQ) if packed else None
        q, k, v, dout = (shard_sequence(x, world, rank, chunk, ring_size=ring) for x in _inputs(seed + n, kv))
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        out = fpdt_attention(q, k, v, group=group, ring_group=ring_group, chunk_size=chunk, causal=causal,
                             backend="math", window=window, documents=documents, offload=offload)
        out.backward(dout)
        results.append([out.detach(), q.grad, k.grad, v.grad])
    return results


@pytest.mark.distributed
def test_ring_attention_equals_one_process(fresh_seed: int) -> None:
    # 1 s when right; a returning gradient sent to the wrong peers would wait forever: fail in seconds instead
    per_rank = run_on_ranks(_run_cases, 4, fresh_seed, timeout=20)
    for n, (ring, chunk, causal, kv, window, packed, _) in enumerate(CASES):
        expected = _reference(*_inputs(fresh_seed + n, kv), _seen(causal, window, DOCS if packed else None))
        for t, (name, want) in enumerate(zip(("out", "dq", "dk", "dv"), expected)):
            err = rel_error(unshard_sequence([r[n][t] for r in per_rank], chunk, ring_size=ring), want)
            assert err <= 1e-10, f"case {CASES[n]} seed={fresh_seed}: {name} rel. error {err:.2e}"


def _counted(rank: int, world: int, seed: int) -> list[tuple[int, int, int, int]]:
    """Per case: query-key pairs (times heads) the kernels computed forward and backward, blocks skipped, and the
    parts this rank sent (forward, as counted by the ring's batches)."""
    forward, backward = MathKernel.forward, MathKernel.backward
    calls: list[int] = []

    def pairs(q: Tensor, k: Tensor, causal: bool) -> int:
        n_q, n_k = q.shape[1], k.shape[1]
        return q.shape[0] * q.shape[2] * (n_q * (n_q + 1) // 2 if causal else n_q * n_k)

    def counted_forward(self, q, k, v, causal, scale, lower=None, softcap=None):
        calls.append(pairs(q, k, causal))
        return forward(self, q, k, v, causal, scale, lower, softcap)

    def counted_backward(self, dout, q, k, v, out, lse, causal, scale, lower=None, softcap=None):
        calls.append(-pairs(q, k, causal))
        return backward(self, dout, q, k, v, out, lse, causal, scale, lower, softcap)

    MathKernel.forward, MathKernel.backward = counted_forward, counted_backward  # in this rank's process only
    sent: list[int] = []
    batch = dist.batch_isend_irecv

    def counted_batch(ops):
        sent.extend(op.tensor.numel() for op in ops if op.op is dist.isend)
        return batch(ops)

    dist.batch_isend_irecv = counted_batch
    results = []
    for ring, attention_chunk in ((2, 5), (4, 7), (2, None)):
        group, ring_group = _groups(world, ring)
        q, k, v, dout = (shard_sequence(x, world, rank, 16, ring_size=ring).requires_grad_() for x in _inputs(seed, 2))
        calls.clear()
        sent.clear()
        stats: list[OffloadStats] = []
        out = fpdt_attention(q, k, v, group=group, ring_group=ring_group, chunk_size=16, backend="math",
                             documents=PackedDocuments(DOCS, SEQ), attention_chunk_size=attention_chunk,
                             stats_sink=stats)
        forward_sends = len(sent)
        out.backward(dout)
        results.append((sum(c for c in calls if c > 0), -sum(c for c in calls if c < 0), stats[0].blocks_skipped,
                        forward_sends))
    return results


@pytest.mark.distributed
def test_kernels_compute_exactly_the_pairs_the_ring_parts_see() -> None:
    """Every kernel call at sp=4 (Ulysses 2 x ring 2, ring 4) on packed documents with attention chunks, counted in
    query-key pairs times heads, summed over the ranks: the pairs the mask lets through, forward and backward, so
    no remote block that could be skipped is computed whole and masked away; the blocks skipped are those without
    such a pair, and a part is sent once per peer that sees it (no more messages than that)."""
    # 1 s when right; under chunked attention a rank returns gradients to other peers than it reads from: sent to
    # the wrong ones, they would wait forever (fail in seconds instead)
    per_rank = run_on_ranks(_counted, 4, 0, timeout=20)
    for n, (ring, attention_chunk) in enumerate(((2, 5), (4, 7), (2, None))):
        seen = _seen(True, None, DOCS)
        if attention_chunk is not None:  # positions counted from each document's start
            i = torch.arange(SEQ)
            start = torch.stack([torch.tensor(s)[torch.searchsorted(torch.tensor(s), i, right=True) - 1]
                                 for s in DOCS])
            block = (i - start) // attention_chunk
            seen = seen & (block[:, :, None] == block[:, None, :])
        expected = int(seen.sum()) * HEADS
        label = f"ring={ring} attention_chunk={attention_chunk}"
        assert sum(r[n][0] for r in per_rank) == expected, label
        assert sum(r[n][1] for r in per_rank) == expected, label
        chunks = _ranges(SEQ, 16)
        tokens = [[torch.cat([torch.arange(lo, hi) for lo, hi in ring_pieces(c0, c1 - c0, ring, a)]) for a in
                   range(ring)] for c0, c1 in chunks]  # the layout's pieces of each chunk, per ring rank

        def sees(i: int, a: int, j: int, b: int, seen: Tensor = seen, tokens: list = tokens) -> bool:
            """Whether some query of ring rank ``a`` in chunk ``i`` sees some key of ring rank ``b`` in chunk ``j``."""
            return bool(seen[:, tokens[i][a]][:, :, tokens[j][b]].any())

        ulysses = 4 // ring  # every rank of a Ulysses group plans its ring rank's blocks
        skipped = sum(not sees(i, a, j, b) for a, b in itertools.product(range(ring), repeat=2)
                      for i in range(len(chunks)) for j in range(i + 1))
        assert sum(r[n][2] for r in per_rank) == 2 * skipped * ulysses, label  # forward and backward
        moves = sum(any(sees(i, a, j, b) for i in range(j, len(chunks)))
                    for a, b in itertools.permutations(range(ring), 2) for j in range(len(chunks)))
        assert sum(r[n][3] for r in per_rank) == moves * ulysses, label
        if attention_chunk is not None:  # the geometry leaves something to skip and a part nobody needs
            assert skipped > 0 and moves < len(chunks) * ring * (ring - 1), label


def _returning_moves(rank: int, world: int, seed: int) -> tuple[list[str], int]:
    """Every batch of returning key/value gradients in backward, checked against its peers before it starts: each
    ring rank's (sent to, received from) lists are gathered in the ring group and every send must meet a receive.
    A mismatch is raised on every rank at once (a wrong list would otherwise wait forever for a move never made).
    Returns the faults and the number of batches whose two lists differed."""
    from lightning_fpdt.attention import backward

    real, faults, differing = backward.exchange_parts, [], [0]

    def checked(group, sends, receives, *args, **kwargs):
        mine = (sorted(sends), sorted(receives))
        differing[0] += mine[0] != mine[1]
        lists: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(lists, mine, group=group)
        me = dist.get_rank(group)
        for peer, (their_sends, their_receives) in enumerate(lists):
            if (me in their_sends) != (peer in mine[1]) or (me in their_receives) != (peer in mine[0]):
                faults.append(f"ring rank {me} sends to {mine[0]} and receives from {mine[1]}; ring rank {peer}"
                              f" sends to {their_sends} and receives from {their_receives}")
        if faults:
            raise AssertionError(faults[0])
        return real(group, sends, receives, *args, **kwargs)

    backward.exchange_parts = checked  # in this rank's process only
    for ring, attention_chunk in ((2, 5), (4, 7), (4, None)):
        group, ring_group = _groups(world, ring)
        q, k, v, dout = (shard_sequence(x, world, rank, 16, ring_size=ring) for x in _inputs(seed, 2))
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        out = fpdt_attention(q, k, v, group=group, ring_group=ring_group, chunk_size=16, backend="math",
                             documents=PackedDocuments(DOCS, SEQ), attention_chunk_size=attention_chunk)
        out.backward(dout)
    return faults, differing[0]


@pytest.mark.distributed
def test_returning_gradients_go_to_the_peers_that_sent_the_parts(fresh_seed: int) -> None:
    """Backward sends each peer's part gradient home and receives its own parts' sums from the peers it sent them to
    in forward (under attention chunks the two lists differ): every send meets a receive, checked before each batch
    starts, so a list read from the wrong plan fails here in seconds instead of hanging another test."""
    per_rank = run_on_ranks(_returning_moves, 4, fresh_seed, timeout=60)
    assert [faults for faults, _ in per_rank] == [[]] * 4
    assert sum(differing for _, differing in per_rank) > 0  # the check can tell the lists apart
