"""Packed documents: their arithmetic, and attention that stays inside each document.

The oracle runs each document of each sample as its own sequence through the textbook attention and
puts the results back in place; the FPDT pipeline runs the packed sample, sharded and chunked, with
the documents crossing chunk and rank boundaries, one-token documents, a document longer than a chunk.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from lightning_fpdt.data import PackedTokenDataset
from lightning_fpdt.parallel.batches import shard_batch
from lightning_fpdt.parallel.packed_documents import PackedDocuments, find_documents
from lightning_fpdt.testing import run_on_ranks
from tests.distributed import ATTENTION_STEP, sharded_attention_step, unsharded_attention_step
from tests.reference import naive_attention, rel_error

HEADS, HEAD_DIM = 4, 8
SEQ = 32
# per sample: document lengths (sum SEQ). Sample 0: a one-token document, documents across the chunk
# (8, 12) and rank boundaries, one longer than a chunk; sample 1: others, so samples differ.
DOCS = [[1, 5, 11, 2, 13], [16, 1, 1, 14]]
CHUNKS = [None, 16, 12, 8]


def _position_ids(docs: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in docs])


def _packed(docs: list[list[int]]) -> PackedDocuments:
    packed = PackedDocuments.from_position_ids(_position_ids(docs))
    assert packed is not None
    return packed


def _inputs(seed: int, kv_heads: int, batch: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, SEQ, HEADS, HEAD_DIM, generator=g, dtype=torch.float64)
    k = torch.randn(batch, SEQ, kv_heads, HEAD_DIM, generator=g, dtype=torch.float64)
    v = torch.randn(batch, SEQ, kv_heads, HEAD_DIM, generator=g, dtype=torch.float64)
    dout = torch.randn(batch, SEQ, HEADS, HEAD_DIM, generator=g, dtype=torch.float64)
    return q, k, v, dout


def _reference(docs: list[list[int]], q, k, v, dout, causal: bool) -> list[torch.Tensor]:
    """Every document alone through the textbook attention; outputs, lse and gradients put back in place."""
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    outs, lses = torch.zeros_like(q), torch.zeros(q.shape[:3], dtype=q.dtype)
    total = 0
    for b, lengths in enumerate(docs):
        start = 0
        for n in lengths:
            sl = slice(start, start + n)
            out, lse = naive_attention(q[b:b + 1, sl], k[b:b + 1, sl], v[b:b + 1, sl], causal)
            total = total + (out * dout[b:b + 1, sl]).sum()
            outs[b:b + 1, sl], lses[b:b + 1, sl] = out.detach(), lse.detach()
            start += n
    total.backward()
    return [outs, lses, q.grad, k.grad, v.grad]


def _cases(sp: int) -> list[tuple[int | None, bool, int]]:
    kv_options = sorted({1, 2, HEADS})
    return [(c, causal, kv) for c, causal, kv in itertools.product(CHUNKS, (True, False), kv_options)
            if c is None or c % sp == 0]


def _run(rank: int, world: int, seed: int, offload: bool) -> dict:
    packed = _packed(DOCS)
    return {(chunk, causal, kv): sharded_attention_step(rank, world, chunk, *_inputs(seed + case_id, kv, len(DOCS)),
                                                        causal=causal, offload=offload, documents=packed)
            for case_id, (chunk, causal, kv) in enumerate(_cases(world))}


@pytest.mark.distributed
@pytest.mark.parametrize(("sp", "offload"), [(1, False), (2, False), (2, True), (4, False)],
                         ids=["sp1", "sp2", "sp2-offload-emulated", "sp4"])
def test_packed_attention_equals_each_document_alone(sp: int, offload: bool, fresh_seed: int) -> None:
    per_rank = run_on_ranks(_run, sp, fresh_seed, offload) if sp > 1 else [_run(0, 1, fresh_seed, offload)]
    for case_id, (chunk, causal, kv) in enumerate(_cases(sp)):
        expected = _reference(DOCS, *_inputs(fresh_seed + case_id, kv, len(DOCS)), causal)
        got = unsharded_attention_step([r[(chunk, causal, kv)] for r in per_rank], chunk)
        for name, a, b in zip(ATTENTION_STEP, got, expected):
            err = rel_error(a, b)
            assert err <= 1e-10, f"sp={sp} chunk={chunk} causal={causal} kv_heads={kv}: {name} rel. error {err:.2e}"


def _expected_blocks(docs: list[list[int]], chunk: int, causal: bool) -> tuple[int, int]:
    """``(computed, skipped)`` blocks of one attention pass, from the document lengths and the chunk bounds alone:
    block (query chunk ``i``, key chunk ``j``; ``j <= i`` when causal) has work iff a document of some sample
    reaches into both chunks."""
    bounds = [(lo, min(lo + chunk, SEQ)) for lo in range(0, SEQ, chunk)]
    documents = []  # (start, end) of every document of every sample
    for lengths in docs:
        ends = list(itertools.accumulate(lengths))
        documents += zip([0, *ends[:-1]], ends)
    computed = skipped = 0
    for i, (q0, q1) in enumerate(bounds):
        for k0, k1 in bounds[: i + 1] if causal else bounds:
            shared = any(s < q1 and e > q0 and s < k1 and e > k0 for s, e in documents)
            computed, skipped = computed + shared, skipped + (not shared)
    return computed, skipped


ALIGNED = [[8, 8, 8, 8], [8, 8, 16]]  # documents on chunk boundaries: most blocks share none


def _block_counts(rank: int, world: int, seed: int) -> dict:
    """Every case's ``(blocks computed, blocks skipped)`` over a forward and backward of this rank's pipeline."""
    counts = {}
    for docs_id, docs in enumerate((DOCS, ALIGNED, None)):
        packed = None if docs is None else _packed(docs)
        for chunk, causal in itertools.product((4, 8), (True, False)):
            stats: list = []
            sharded_attention_step(rank, world, chunk, *_inputs(seed, 2, 2), causal=causal, documents=packed,
                                   stats_sink=stats)
            assert len(stats) == 1  # one pipeline call: its forward and backward share one store
            counts[(docs_id, chunk, causal)] = (stats[0].blocks_computed, stats[0].blocks_skipped)
    return counts


@pytest.mark.parametrize("sp", [1, pytest.param(2, marks=pytest.mark.distributed)])
def test_blocks_sharing_no_document_are_skipped_not_computed(sp: int, fresh_seed: int) -> None:
    assert _expected_blocks(DOCS, 8, True) == (8, 2)  # chunk 3 shares no document with chunks 0 and 1
    assert _expected_blocks(ALIGNED, 8, False) == (6, 10)
    per_rank = run_on_ranks(_block_counts, sp, fresh_seed) if sp > 1 else [_block_counts(0, 1, fresh_seed)]
    for rank, counts in enumerate(per_rank):
        for (docs_id, chunk, causal), got in counts.items():
            n = SEQ // chunk
            if docs_id == 2:  # one document per sample: every candidate block is computed
                computed, skipped = (n * (n + 1) // 2 if causal else n * n), 0
            else:
                computed, skipped = _expected_blocks((DOCS, ALIGNED)[docs_id], chunk, causal)
            # forward and backward each count their blocks
            assert got == (2 * computed, 2 * skipped), (
                f"rank {rank}, {('DOCS', 'ALIGNED', 'no documents')[docs_id]}, chunk={chunk}, causal={causal}:"
                f" (computed, skipped) = {got}, expected {(2 * computed, 2 * skipped)}")


def _brute_segments(packed: PackedDocuments, q_range, k_range) -> set:
    """(sample, q, k) pairs that attend: same document, both in range."""
    pairs = set()
    for b, starts in enumerate(packed.starts):
        doc = torch.zeros(packed.length, dtype=torch.long)
        for s in starts[1:]:
            doc[s:] += 1
        for qi in range(*q_range):
            for ki in range(*k_range):
                if doc[qi] == doc[ki]:
                    pairs.add((b, qi - q_range[0], ki - k_range[0]))
    return pairs


def test_segments_and_block_skipping_match_a_brute_force_mask(fresh_seed: int) -> None:
    rng = random.Random(fresh_seed)
    for _ in range(20):
        docs = []
        for _b in range(rng.randint(1, 3)):
            lengths, left = [], SEQ
            while left:
                n = min(left, rng.choice([1, 2, 5, 9, 17]))
                lengths.append(n)
                left -= n
            docs.append(lengths)
        if all(len(d) == 1 for d in docs):
            continue
        packed = _packed(docs)
        for c in (4, 8, 12):
            ranges = [(lo, min(lo + c, SEQ)) for lo in range(0, SEQ, c)]
            for qr, kr in itertools.product(ranges, ranges):
                expected = _brute_segments(packed, qr, kr)
                batch = len(docs)
                got = set()
                for seg in packed.segments(qr, kr, causal=False):
                    for b in range(batch)[seg.batch]:
                        got |= {(b, qi, ki) for qi in range(seg.q_lo, seg.q_hi) for ki in range(seg.k_lo, seg.k_hi)}
                assert got == expected, (docs, c, qr, kr)
                assert packed.shares_document(qr, kr) == bool(expected), (docs, c, qr, kr)


def test_documents_from_position_ids_and_padding_masks() -> None:
    assert PackedDocuments.from_position_ids(torch.arange(8).expand(2, 8)) is None  # plain sequences
    pos = _position_ids([[3, 5], [8]])
    packed = find_documents(pos, None)
    assert packed.starts == ((0, 3), (0,)) and packed.length == 8
    assert packed.padded(10).starts == ((0, 3, 8), (0, 8))  # the padding is a document of its own
    mask = torch.tensor([[1] * 8, [1] * 6 + [0] * 2])
    assert find_documents(pos, mask).starts == ((0, 3), (0, 6))
    assert find_documents(torch.arange(8).expand(2, 8), mask).starts == ((0,), (0, 6))
    with pytest.raises(
        ValueError, match=r"'attention_mask' is not right-padded in sample\(s\) \[1\].*padding_side='right'"
    ):
        find_documents(pos, torch.tensor([[1] * 8, [0] * 2 + [1] * 6]))
    with pytest.raises(ValueError, match=r"'attention_mask' has shape \(2, 1, 8, 8\); only the Hugging Face 2-D"):
        find_documents(pos, torch.ones(2, 1, 8, 8))


def test_targets_never_cross_documents_padding_or_the_loss_mask() -> None:
    ids = torch.arange(1, 9).expand(2, 8).clone()
    pos = _position_ids([[3, 5], [8]])
    mask = torch.tensor([[1] * 8, [1] * 6 + [0] * 2])
    loss_mask = torch.ones(2, 8, dtype=torch.long)
    loss_mask[1, 2] = 0  # token 2 of sample 1 is not a target
    out = shard_batch({"input_ids": ids, "position_ids": pos, "attention_mask": mask, "loss_mask": loss_mask}, 1, 0)
    assert out["shift_labels"].tolist() == [
        [2, 3, -100, 5, 6, 7, 8, -100],  # the last token of document 0 does not predict document 1
        [2, -100, 4, 5, 6, -100, -100, -100],  # token 2 masked; targets in the padding ignored
    ]
    assert out["documents"].starts == ((0, 3), (0, 6))


def test_packed_token_data_marks_its_documents() -> None:
    tokens = torch.tensor([5, 6, 0, 7, 8, 9, 0, 4, 3, 2, 0, 1])  # 0 ends a document
    sample = PackedTokenDataset(tokens.numpy(), seq_len=12, eos_token_id=0)[0]
    batch = shard_batch({k: v.unsqueeze(0) for k, v in sample.items()}, 2, 0)
    assert batch["documents"].starts == ((0, 3, 7, 11),)
    assert batch["documents"].length == 12
