"""Sliding windows, attention-logit softcapping and attention sinks in the FPDT pipeline, against one process.

The oracle is written here, apart from the pipeline: the full ``[S, S]`` scores (scaled, then capped), the
causal, window and document masks, the sink column, softmax, and autograd for every gradient. Its mask is
checked against transformers' own mask functions; the block rules are checked against it token by token.
Inputs are float64 with scaled scores of order 10 (so a cap of 5 bites), fresh every run.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from lightning_fpdt.attention import fpdt_attention
from lightning_fpdt.attention.blocks import BlockRules, Rect
from lightning_fpdt.attention.fused_ops import visible_keys
from lightning_fpdt.attention.kernels import MathKernel
from lightning_fpdt.attention.pipeline import PipelineOptions, run_pipeline
from lightning_fpdt.attention.sources import TensorEnds
from lightning_fpdt.offload.stats import OffloadStats
from lightning_fpdt.parallel.layout import shard_sequence, unshard_sequence
from lightning_fpdt.parallel.packed_documents import PackedDocuments
from lightning_fpdt.testing import run_on_ranks
from tests.reference import rel_error

HEADS, HEAD_DIM, SEQ = 4, 8, 32
SCALE = HEAD_DIM**-0.5
STD = 3.0  # q and k: scaled scores q.k / sqrt(d) of standard deviation STD**2 = 9
# per sample: document lengths (sum SEQ): a one-token document, documents across chunk (8, 12) and rank
# boundaries, one longer than a chunk
DOCS = [[1, 5, 11, 2, 13], [16, 1, 1, 14]]
RESULTS = ("out", "lse", "dq", "dk", "dv", "dsinks")


def _position_ids(docs: list[list[int]]) -> Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in docs])


def _documents(docs: list[list[int]] | None) -> PackedDocuments | None:
    return None if docs is None else PackedDocuments.from_position_ids(_position_ids(docs))


def _inputs(seed: int, batch: int, kv_heads: int, dtype: torch.dtype = torch.float64) -> tuple[Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, SEQ, HEADS, HEAD_DIM, generator=g, dtype=dtype) * STD
    k = torch.randn(batch, SEQ, kv_heads, HEAD_DIM, generator=g, dtype=dtype) * STD
    v = torch.randn(batch, SEQ, kv_heads, HEAD_DIM, generator=g, dtype=dtype)
    dout = torch.randn(batch, SEQ, HEADS, HEAD_DIM, generator=g, dtype=dtype)
    sinks = 8.0 + 4.0 * torch.randn(HEADS, generator=g, dtype=dtype)  # near the rows' log-sum-exps: they matter
    return q, k, v, dout, sinks


def _visible(batch: int, window: int | None, docs: list[list[int]] | None) -> Tensor:
    """``[batch, S, S]``: query ``i`` sees key ``j``: causal, inside the window, in the same document."""
    i, j = torch.arange(SEQ).unsqueeze(1), torch.arange(SEQ).unsqueeze(0)
    seen = j <= i
    if window is not None:
        seen = seen & (j > i - window)
    seen = seen.expand(batch, SEQ, SEQ)
    if docs is not None:
        doc = torch.tensor([[d for d, n in enumerate(lengths) for _ in range(n)] for lengths in docs])
        seen = seen & (doc.unsqueeze(2) == doc.unsqueeze(1))
    return seen


def _reference(q, k, v, dout, seen: Tensor, softcap: float | None, sinks: Tensor | None) -> dict[str, Tensor | None]:
    """Textbook attention on the whole sequence, with the mask ``seen`` ``[b, S, S]``, the cap and the sinks."""
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    sinks = None if sinks is None else sinks.clone().requires_grad_()
    groups = HEADS // k.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(groups, dim=2)) * SCALE
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~seen.unsqueeze(1), float("-inf"))
    if sinks is not None:  # gpt-oss: one more column, the head's logit, dropped after the softmax
        s = torch.cat([s, sinks.view(1, -1, 1, 1).expand(*s.shape[:3], 1)], dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1)[..., :SEQ]
    out = torch.einsum("bhqk,bkhd->bqhd", p, v.repeat_interleave(groups, dim=2))
    (out * dout).sum().backward()
    return {"out": out.detach(), "lse": lse.detach().transpose(1, 2), "dq": q.grad, "dk": k.grad, "dv": v.grad,
            "dsinks": None if sinks is None else sinks.grad}


def _check(got: dict[str, Tensor | None], expected: dict[str, Tensor | None], what: str, tol: float = 1e-10) -> None:
    for name in RESULTS:
        a, b = got[name], expected[name]
        assert (a is None) == (b is None), f"{what}: {name}"
        if a is not None and b is not None:
            err = rel_error(a.to(b.dtype), b)
            assert err <= tol, f"{what}: {name} rel. error {err:.2e}"


def test_the_oracle_masks_as_transformers_does() -> None:
    """The oracle's window, plain and packed, is transformers' sliding-window causal mask, element by element."""
    from transformers import masking_utils as mu  # optional dependency of the package, a test requirement here

    # the mask functions are index-based: evaluated on broadcast index tensors [batch, S, S], as transformers'
    # vmap-free mask builders do
    batch = torch.arange(len(DOCS)).view(-1, 1, 1)
    rows, cols = torch.arange(SEQ).view(1, -1, 1), torch.arange(SEQ).view(1, 1, -1)
    head = torch.zeros((), dtype=torch.long)
    pos = _position_ids(DOCS)
    for window in (1, 3, 8):
        plain = mu.sliding_window_causal_mask_function(window)
        expected = plain(batch, head, rows, cols).expand(len(DOCS), SEQ, SEQ)
        assert torch.equal(_visible(len(DOCS), window, None), expected), window
        packed = mu.and_masks(mu.remap_positions_for_packed_sequence(plain, pos),
                              mu.packed_sequence_mask_function(mu.find_packed_sequence_indices(pos)))
        assert torch.equal(_visible(len(DOCS), window, DOCS), packed(batch, head, rows, cols)), window


@pytest.mark.parametrize("docs", [None, DOCS], ids=["plain", "packed"])
def test_block_rules_cover_exactly_the_visible_pairs(docs: list[list[int]] | None) -> None:
    """Every block's kind and rectangles against the oracle's mask: skip iff no pair is seen, full iff all are,
    and the rectangles' own masks (causal diagonal, window edge) put together are the block's mask."""
    batch = 2 if docs is None else len(docs)
    for window, chunk in itertools.product((None, 1, 3, 4, 8, 13, 40), (4, 8, 12)):
        rules = BlockRules(True, window, _documents(docs))
        seen = _visible(batch, window, docs)
        ranges = [(lo, min(lo + chunk, SEQ)) for lo in range(0, SEQ, chunk)]
        for q, k in itertools.product(ranges, ranges):
            block = seen[:, q[0]:q[1], k[0]:k[1]]
            rects = rules.rects(q, k)
            expected_kind = "skip" if not block.any() else "full" if block.all() else "cut"
            assert rules.kind(q, k) == expected_kind, (window, chunk, q, k)
            if rects is None:
                continue
            covered = torch.zeros_like(block)
            for r in rects:
                mask = visible_keys(r.q_hi - r.q_lo, r.k_hi - r.k_lo, r.causal, r.lower, torch.device("cpu"))
                assert mask is None or mask.any(dim=1).all(), f"a row without keys in {r}"
                part = covered[r.batch, r.q_lo:r.q_hi, r.k_lo:r.k_hi]
                assert not part.any(), f"overlapping rectangles in block {q} x {k}"
                covered[r.batch, r.q_lo:r.q_hi, r.k_lo:r.k_hi] = True if mask is None else mask
            assert torch.equal(covered, block), (window, chunk, q, k)


# (chunk_size, window): smaller than a chunk, equal to it, across several chunks, one chunk, >= S
ONE_PROCESS = [(8, 3), (8, 8), (4, 13), (None, 5), (16, SEQ), (4, 40)]


@pytest.mark.parametrize(("chunk", "window"), ONE_PROCESS, ids=[f"chunk{c}-window{w}" for c, w in ONE_PROCESS])
def test_window_one_process(chunk: int | None, window: int, fresh_seed: int) -> None:
    q, k, v, dout, _ = _inputs(fresh_seed, 2, 2)
    got = _step(0, 1, chunk, q, k, v, dout, None, window=window)
    _check(got, _reference(q, k, v, dout, _visible(2, window, None), None, None), f"chunk={chunk} window={window}")


@pytest.mark.parametrize(("chunk", "window"), [(None, None), (8, None), (8, 5)], ids=["ulysses", "chunked", "window"])
def test_softcap_one_process(chunk: int | None, window: int | None, fresh_seed: int) -> None:
    q, k, v, dout, _ = _inputs(fresh_seed, 2, 2)
    got = _step(0, 1, chunk, q, k, v, dout, None, window=window, softcap=5.0)
    _check(got, _reference(q, k, v, dout, _visible(2, window, None), 5.0, None), f"softcap chunk={chunk}")


def _step(rank: int, world: int, chunk: int | None, q, k, v, dout, sinks: Tensor | None, **options: Any) -> dict:
    """One sharded ``fpdt_attention`` forward and backward on this rank; sinks' gradient as the rank returns it."""
    group = dist.group.WORLD if world > 1 else None
    shards = [shard_sequence(x, world, rank, chunk).requires_grad_() for x in (q, k, v)]
    sinks = None if sinks is None else sinks.clone().requires_grad_()
    out, lse = fpdt_attention(*shards, group=group, chunk_size=chunk, backend=options.pop("backend", "math"),
                              return_lse=True, sinks=sinks, **options)
    out.backward(shard_sequence(dout.to(out.dtype), world, rank, chunk))
    return {"out": out.detach(), "lse": lse, "dq": shards[0].grad, "dk": shards[1].grad, "dv": shards[2].grad,
            "dsinks": None if sinks is None else sinks.grad}


# (chunk_size, window, documents, softcap, sinks, offload), run at sp=2 with one KV head
DISTRIBUTED = [
    (8, 6, DOCS, None, False, False),
    (4, 13, DOCS, None, False, True),
    (8, 3, None, 5.0, False, False),
    (4, None, None, None, True, False),
    (8, 6, DOCS, None, True, False),
    (4, 5, DOCS, 5.0, True, True),
]


def _distributed_cases(rank: int, world: int, seed: int) -> list[dict]:
    results = []
    for case_id, (chunk, window, docs, softcap, with_sinks, offload) in enumerate(DISTRIBUTED):
        q, k, v, dout, sinks = _inputs(seed + case_id, len(DOCS), 1)
        results.append(_step(rank, world, chunk, q, k, v, dout, sinks if with_sinks else None, window=window,
                             documents=_documents(docs), softcap=softcap, offload=offload))
    return results


@pytest.mark.distributed
def test_window_softcap_sinks_documents_at_sp2(fresh_seed: int) -> None:
    """sp=2, chunked, one KV head (below the SP size): windows with packed documents (a one-token document,
    documents across chunk and rank boundaries), softcap, sinks (rank-sliced heads, their gradient summed over
    the ranks), some offloaded."""
    per_rank = run_on_ranks(_distributed_cases, 2, fresh_seed)
    for case_id, (chunk, window, docs, softcap, with_sinks, _) in enumerate(DISTRIBUTED):
        q, k, v, dout, sinks = _inputs(fresh_seed + case_id, len(DOCS), 1)
        ranks = [r[case_id] for r in per_rank]
        got: dict[str, Tensor | None] = {name: unshard_sequence([r[name] for r in ranks], chunk)
                                         for name in RESULTS[:5]}
        got["dsinks"] = sum(r["dsinks"] for r in ranks) if with_sinks else None
        expected = _reference(q, k, v, dout, _visible(len(DOCS), window, docs), softcap, sinks if with_sinks else None)
        _check(got, expected, f"sp=2 case {DISTRIBUTED[case_id]}")


@pytest.mark.parametrize(("chunk", "window", "docs"), [(8, 6, None), (4, 3, DOCS), (None, 7, DOCS)])
def test_sinks_one_process(chunk: int | None, window: int, docs: list[list[int]] | None, fresh_seed: int) -> None:
    q, k, v, dout, sinks = _inputs(fresh_seed, len(DOCS), 2)
    got = _step(0, 1, chunk, q, k, v, dout, sinks, window=window, documents=_documents(docs))
    expected = _reference(q, k, v, dout, _visible(len(DOCS), window, docs), None, sinks)
    _check(got, expected, f"sinks chunk={chunk} window={window}")


@pytest.mark.parametrize(("chunk", "window"), [(8, 5), (4, 13), (None, 6)])
def test_window_on_sdpa_float32(chunk: int | None, window: int, fresh_seed: int) -> None:
    """The sdpa backend (CPU, a mask on cut blocks only) in float32 against the float64 oracle."""
    q, k, v, dout, _ = _inputs(fresh_seed, 2, 2)
    got = _step(0, 1, chunk, *(x.float() for x in (q, k, v, dout)), None, window=window, backend="sdpa")
    _check(got, _reference(q, k, v, dout, _visible(2, window, None), None, None), f"sdpa window={window}", tol=2e-5)


def test_softcap_on_sdpa_runs_the_math_kernel_exactly(fresh_seed: int) -> None:
    q, k, v, dout, _ = _inputs(fresh_seed, 2, 2)
    got = _step(0, 1, 8, q, k, v, dout, None, window=6, softcap=5.0, backend="sdpa")
    _check(got, _reference(q, k, v, dout, _visible(2, 6, None), 5.0, None), "sdpa softcap")


class CountingKernel(MathKernel):
    """The math kernel, counting its calls."""

    def __init__(self) -> None:
        self.calls = {"forward": 0, "backward": 0}

    def forward(self, *args: Any) -> tuple[Tensor, Tensor]:
        self.calls["forward"] += 1
        return super().forward(*args)

    def backward(self, *args: Any) -> tuple[Tensor, Tensor, Tensor]:
        self.calls["backward"] += 1
        return super().backward(*args)


def test_blocks_outside_the_window_are_skipped(fresh_seed: int) -> None:
    """64 tokens in 8 chunks of 8 with a window of 10: the kernel runs once per block that holds a seen pair,
    in forward and in backward, counted token by token here; the result (offloaded) stays exact."""
    seq, chunk, window = 64, 8, 10
    g = torch.Generator().manual_seed(fresh_seed)
    q, k, v, dout = (torch.randn(1, seq, 2, HEAD_DIM, generator=g, dtype=torch.float64) * STD for _ in range(4))
    i, j = torch.arange(seq).unsqueeze(1), torch.arange(seq).unsqueeze(0)
    seen = (j <= i) & (j > i - window)
    n = seq // chunk
    blocks = sum(bool(seen[a * chunk:(a + 1) * chunk, b * chunk:(b + 1) * chunk].any())
                 for a in range(n) for b in range(n))
    assert n * (n + 1) // 2 - blocks == 15  # of the 36 causal blocks, 15 lie wholly outside every window

    kernel, stats = CountingKernel(), []
    opt = PipelineOptions.for_chunk_size(None, chunk, causal=True, scale=SCALE, kernel=kernel, offload=True,
                                         stats_sink=stats, window=window)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, _ = run_pipeline(TensorEnds(kv_heads=2), opt, *leaves)
    out.backward(dout)
    assert kernel.calls == {"forward": blocks, "backward": blocks}
    assert isinstance(stats[0], OffloadStats) and stats[0].bytes_to_device > 0
    q2, k2, v2 = (x.clone().requires_grad_() for x in (q, k, v))
    s = (torch.einsum("bqhd,bkhd->bhqk", q2, k2) * SCALE).masked_fill(~seen, float("-inf"))
    ref = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1), v2)
    ref.backward(dout)
    for a, b in ((out, ref), (leaves[0].grad, q2.grad), (leaves[1].grad, k2.grad), (leaves[2].grad, v2.grad)):
        assert rel_error(a.detach(), b.detach()) <= 1e-10


@pytest.mark.parametrize(("options", "match"), [
    ({"window": 0}, r"window=0; a sliding window holds at least 1 token"),
    ({"window": 4, "causal": False}, r"window=4 with causal=False; sliding windows are supported for causal"),
    ({"softcap": -1.0}, r"softcap=-1.0; the attention-logit cap must be positive"),
    ({"sinks": torch.zeros(3)}, r"sinks has shape \(3,\); it takes one logit per query head, \[n_heads\] = \[4\]"),
])
def test_variant_errors_name_the_value_and_the_fix(options: dict, match: str) -> None:
    q = torch.zeros(1, 8, HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match=match):
        fpdt_attention(q, q, q, chunk_size=4, **options)


def test_rect_is_the_whole_block_on_a_plain_diagonal() -> None:
    """Without window or documents the causal diagonal is one rectangle, the whole block: one kernel call."""
    assert BlockRules(True).rects((8, 16), (8, 16)) == [Rect(slice(None), 0, 8, 0, 8, True)]
    assert BlockRules(True).rects((8, 16), (0, 8)) is None
    assert BlockRules(True, window=8).rects((8, 16), (0, 8)) == [Rect(slice(None), 0, 7, 1, 8, False, 0)]
