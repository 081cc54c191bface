"""Chunked (local) attention, Llama-4's ``attention_chunk_size``, as a block rule: a query sees the earlier keys of its
own attention chunk only (``k // A == q // A``, counted from its document's start).

Blocks no query's attention chunk reaches are skipped, blocks an attention-chunk boundary cuts become whole rectangles
and causal squares: counted here kernel call by kernel call (a block computed whole and masked away fails), then
``fpdt_attention`` at sp=1 and sp=2 against a textbook oracle with the chunk mask, forward and backward, plain and
packed, attention chunks that do not divide the pipeline's chunks. The whole Llama-4 model under FPDT is a case of
``tests/hf/test_hf_families.py``; here the mask probe's reading of each layer's chunk, and the temperature positions.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from torch import Tensor
from transformers import Llama4TextConfig, masking_utils

from lightning_fpdt.attention import fpdt_attention
from lightning_fpdt.attention.blocks import BlockRules, Rect, plan_blocks
from lightning_fpdt.attention.kernels import MathKernel
from lightning_fpdt.hf import attention as hf_attention
from lightning_fpdt.hf.masks import MaskRule, read_mask_rule
from lightning_fpdt.models import HFCausalLM
from lightning_fpdt.offload.stats import OffloadStats
from lightning_fpdt.parallel.packed_documents import PackedDocuments, token_positions
from lightning_fpdt.testing import run_on_ranks
from tests.distributed import ATTENTION_STEP, sharded_attention_step, unsharded_attention_step
from tests.reference import rel_error

SEQ, BATCH, HEADS, KV_HEADS, DIM = 32, 2, 4, 2, 8
DOCS = [[1, 12, 19], [20, 12]]  # a one-token document; documents across pipeline chunks and ranks


def _documents(docs: list[list[int]] | None) -> PackedDocuments | None:
    if docs is None:
        return None
    return PackedDocuments.from_position_ids(torch.stack([torch.cat([torch.arange(n) for n in d]) for d in docs]))


def _seen(chunk: int, docs: list[list[int]] | None, window: int | None = None) -> Tensor:
    """``[batch, S, S]``: which keys each query sees, by the definition (transformers' ``chunked_overlay`` on the
    positions inside each document, with causality and the same-document rule)."""
    lengths = docs or [[SEQ]] * BATCH
    doc = torch.tensor([[d for d, n in enumerate(ls) for _ in range(n)] for ls in lengths])
    pos = torch.stack([torch.cat([torch.arange(n) for n in ls]) for ls in lengths])
    i, j = torch.arange(SEQ)[:, None], torch.arange(SEQ)[None]
    seen = (j <= i) & (doc[:, :, None] == doc[:, None]) & (pos[:, :, None] // chunk == pos[:, None] // chunk)
    return seen & (j > i - window) if window is not None else seen


def _oracle(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, seen: Tensor) -> list[Tensor]:
    """Textbook masked attention over the whole sequence, autograd: out, lse, dq, dk, dv."""
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    groups = q.shape[2] // k.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(groups, dim=2)) * q.shape[-1] ** -0.5
    s = s.masked_fill(~seen[:, None], float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1), v.repeat_interleave(groups, dim=2))
    out.backward(dout)
    return [out.detach(), torch.logsumexp(s, dim=-1).transpose(1, 2).detach(), q.grad, k.grad, v.grad]


def _inputs(seed: int) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(BATCH, SEQ, heads, DIM) for heads in (HEADS, KV_HEADS, KV_HEADS, HEADS)]  # q, k, v, dout
    return [torch.randn(s, generator=g, dtype=torch.float64) * 2 for s in shapes]


def test_blocks_of_a_geometry_worked_by_hand() -> None:
    """32 tokens in pipeline chunks of 8, attention chunks of 12 (0-11, 12-23, 24-31): 4 of the 10 causal blocks are
    skipped; the others are whole rectangles and causal squares, no masks."""
    everything = slice(None)
    plan = plan_blocks(BlockRules(True, attention_chunk_size=12), [(0, 8), (8, 16), (16, 24), (24, 32)])
    assert plan == {
        (0, 0): [Rect(everything, 0, 8, 0, 8, True)],
        (1, 0): [Rect(everything, 0, 4, 0, 8, False)],  # queries 8-11 see keys 0-7; 12-15 none
        (1, 1): [Rect(everything, 0, 4, 0, 4, True), Rect(everything, 4, 8, 4, 8, True)],
        (2, 1): [Rect(everything, 0, 8, 4, 8, False)],  # queries 16-23 see keys 12-15
        (2, 2): [Rect(everything, 0, 8, 0, 8, True)],
        (3, 3): [Rect(everything, 0, 8, 0, 8, True)],
    }  # skipped: (2, 0), (3, 0), (3, 1), (3, 2)


def _pairs(q_rows: int, q_len: int, k_len: int, causal: bool, lower: int | None) -> int:
    """Query-key pairs a kernel call computes (a causal square: its lower triangle)."""
    assert lower is None  # chunked attention alone leaves no window edge
    return q_rows * (q_len * (q_len + 1) // 2 if causal else q_len * k_len)


@pytest.mark.parametrize("docs", [None, DOCS], ids=["plain", "packed"])
def test_kernels_compute_exactly_the_pairs_the_chunks_see(docs: list[list[int]] | None, monkeypatch) -> None:
    """A real ``fpdt_attention`` call (sp=1) per (pipeline chunk, attention chunk): every kernel call, forward and
    backward, counted in query-key pairs (times its samples and heads): their sum is the number of pairs the chunk
    mask lets through, so no pair is computed and masked away, and the blocks skipped are exactly those with no such
    pair (the pipeline's own count)."""
    calls: list[int] = []
    forward, backward = MathKernel.forward, MathKernel.backward

    def counted_forward(self, q, k, v, causal, scale, lower=None, softcap=None):
        calls.append(_pairs(q.shape[0] * q.shape[2], q.shape[1], k.shape[1], causal, lower))
        return forward(self, q, k, v, causal, scale, lower, softcap)

    def counted_backward(self, dout, q, k, v, out, lse, causal, scale, lower=None, softcap=None):
        calls.append(-_pairs(q.shape[0] * q.shape[2], q.shape[1], k.shape[1], causal, lower))
        return backward(self, dout, q, k, v, out, lse, causal, scale, lower, softcap)

    monkeypatch.setattr(MathKernel, "forward", counted_forward)
    monkeypatch.setattr(MathKernel, "backward", counted_backward)
    q, k, v, dout = (x.requires_grad_() for x in _inputs(0))
    for chunk, attention_chunk in itertools.product((8, 12), (3, 5, 6, 20)):
        seen = _seen(attention_chunk, docs)
        calls.clear()
        stats: list[OffloadStats] = []
        out = fpdt_attention(q, k, v, chunk_size=chunk, backend="math", documents=_documents(docs),
                             attention_chunk_size=attention_chunk, stats_sink=stats)
        out.backward(dout)
        expected = int(seen.sum()) * HEADS
        label = f"chunk={chunk} attention_chunk={attention_chunk}"
        assert sum(c for c in calls if c > 0) == expected, label
        assert -sum(c for c in calls if c < 0) == expected, label
        ranges = [(lo, min(lo + chunk, SEQ)) for lo in range(0, SEQ, chunk)]
        skipped = sum(not seen[:, q0:q1, k0:k1].any() for i, (q0, q1) in enumerate(ranges) for k0, k1 in ranges[:i + 1])
        assert skipped > 0 and [s.blocks_skipped for s in stats] == [2 * skipped], label  # forward and backward


CASES = [  # (pipeline chunk or None: plain Ulysses, attention chunk, packed documents, window)
    (8, 6, None, None), (8, 12, None, None), (8, 5, DOCS, None), (16, 7, DOCS, None), (None, 6, None, None),
    (8, 9, DOCS, 4),  # with a sliding window inside the attention chunks
]


def _run(rank: int, world: int, seed: int) -> list[list[Tensor]]:
    return [sharded_attention_step(rank, world, chunk, *_inputs(seed + n), documents=_documents(docs),
                                   attention_chunk_size=attention_chunk, window=window)
            for n, (chunk, attention_chunk, docs, window) in enumerate(CASES)]


@pytest.mark.parametrize("sp", [1, pytest.param(2, marks=pytest.mark.distributed)])
def test_fpdt_attention_with_attention_chunks_equals_the_masked_oracle(sp: int, fresh_seed: int) -> None:
    per_rank = run_on_ranks(_run, sp, fresh_seed) if sp > 1 else [_run(0, 1, fresh_seed)]
    for n, (chunk, attention_chunk, docs, window) in enumerate(CASES):
        got = unsharded_attention_step([r[n] for r in per_rank], chunk)
        expected = _oracle(*_inputs(fresh_seed + n), _seen(attention_chunk, docs, window))
        for name, a, b in zip(ATTENTION_STEP, got, expected):
            err = rel_error(a, b)
            assert err <= 1e-10, f"sp={sp} {CASES[n]}: {name} rel. error {err:.2e}"


def test_sdpa_computes_the_rectangles_as_they_are(fresh_seed: int) -> None:
    """Whole rectangles and causal squares need no mask: sdpa (float64, one process) equals the oracle too."""
    for n, (chunk, attention_chunk, docs, window) in enumerate(CASES[:4]):
        q, k, v, dout = _inputs(fresh_seed + n)
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = fpdt_attention(*leaves, chunk_size=chunk, backend="sdpa", documents=_documents(docs),
                             attention_chunk_size=attention_chunk)
        out.backward(dout)
        expected = _oracle(q, k, v, dout, _seen(attention_chunk, docs, window))
        for name, a, b in zip(("out", "dq", "dk", "dv"), [out.detach(), *(x.grad for x in leaves)],
                              [expected[0], *expected[2:]]):
            assert rel_error(a, b) <= 1e-10, f"sdpa {CASES[n]}: {name}"


@pytest.mark.parametrize(("options", "message"), [
    ({"attention_chunk_size": 0}, r"attention_chunk_size=0; an attention chunk holds at least 1 token"),
    ({"attention_chunk_size": -3}, r"attention_chunk_size=-3; .* give a positive int"),
    ({"attention_chunk_size": 4, "causal": False}, r"attention_chunk_size=4 with causal=False; chunked attention is"
                                                   r" supported for causal attention only"),
])
def test_bad_attention_chunks_are_refused_by_number(options: dict[str, Any], message: str) -> None:
    q = torch.zeros(1, 8, 2, 4)
    with pytest.raises(ValueError, match=message):
        fpdt_attention(q, q, q, **options)


def test_the_mask_probe_reads_attention_chunks() -> None:
    """transformers' chunked causal mask reads as its chunk size; a strided pattern is still refused."""
    for size in (2, 6, 8, 8192):
        chunked = masking_utils.chunked_causal_mask_function(size, torch.zeros(1, dtype=torch.long))
        assert read_mask_rule(chunked) == MaskRule(causal=True, window=None, chunk=size)
    strided = masking_utils.and_masks(masking_utils.causal_mask_function, lambda b, h, q, k: (q - k) % 3 != 1)
    assert not read_mask_rule(strided).pattern


def _llama4(attention_chunk_size: int | None) -> HFCausalLM:
    return HFCausalLM(Llama4TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64,
                                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, head_dim=8,
                                       attention_chunk_size=attention_chunk_size, moe_layers=[]))


def test_each_llama4_layer_gets_its_own_rule(monkeypatch) -> None:
    """The chunked layers' calls carry no chunk size: each gets the one its own mask has (6), the NoPE layer (full
    causal attention in Llama-4) none."""
    calls: list[Any] = []

    def spy(*args: Any, attention_chunk_size: Any = None, **kwargs: Any) -> Tensor:
        calls.append(attention_chunk_size)
        return fpdt_attention(*args, attention_chunk_size=attention_chunk_size, **kwargs)

    monkeypatch.setattr(hf_attention, "fpdt_attention", spy)
    _llama4(6).forward(torch.randint(0, 64, (1, 16)))
    assert calls == [6, 6, 6, None]


def test_flops_count_the_keys_of_each_attention_chunk() -> None:
    """At 32 tokens in attention chunks of 6 a query attends (5 x 6^2 + 2^2) / (2 x 32) = 2.875 keys on average in
    the count's continuous form, against 16 under full causal attention, on each of the three chunked layers."""
    chunked, full = _llama4(6).flops_per_token(SEQ), _llama4(None).flops_per_token(SEQ)
    assert chunked - full == pytest.approx(12 * 4 * 8 * 3 * (2.875 - 16), rel=1e-12)


def test_temperature_positions_are_the_tokens_own_in_their_documents() -> None:
    """Llama-4's NoPE layers scale q by position: each rank's tokens (FPDT layout of chunks of 8 on 2 ranks) at
    their positions inside their documents."""
    documents = _documents(DOCS)
    positions = torch.stack([torch.cat([torch.arange(n) for n in d]) for d in DOCS])
    for rank in range(2):
        held = torch.tensor([c * 8 + rank * 4 + t for c in range(4) for t in range(4)])  # sub-chunk `rank` of each
        got = token_positions(16, 2, rank, 8, documents, torch.device("cpu"))
        assert torch.equal(got, positions[:, held]), rank
        assert torch.equal(token_positions(16, 2, rank, 8, None, torch.device("cpu")), held[None])
