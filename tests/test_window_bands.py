"""A window's edge without a mask: ``blocks.unmasked_pieces`` cuts a cut rectangle into whole rectangles, causal
squares and squares on the edge, which ``sdpa`` runs as causal calls on reversed rows and keys.

The pieces are checked pair by pair against the rectangle they replace; the reversed call against the masked
``math`` kernel; and whole ``fpdt_attention`` steps on ``sdpa`` in float64, with windows long enough to be cut
into bands, against a textbook oracle written here (full scores, the causal, window and document masks, autograd).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import Tensor

from lightning_fpdt.attention import fpdt_attention, kernels
from lightning_fpdt.attention.blocks import MIN_BAND, BlockRules, Rect, unmasked_pieces
from lightning_fpdt.attention.fused_ops import visible_keys
from lightning_fpdt.attention.kernels import MathKernel, SdpaKernel
from lightning_fpdt.parallel.packed_documents import PackedDocuments
from tests.reference import rel_error

CPU = torch.device("cpu")
DOCS = [[70, 1, 121], [5, 187]]  # per sample, summing to 192: documents longer than a window, one token, a short one


def _mask(r: Rect) -> Tensor:
    seen = visible_keys(r.q_hi - r.q_lo, r.k_hi - r.k_lo, r.causal, r.lower, CPU)
    return torch.ones(r.q_hi - r.q_lo, r.k_hi - r.k_lo, dtype=torch.bool) if seen is None else seen


def _documents(docs: list[list[int]]) -> PackedDocuments:
    return PackedDocuments.from_position_ids(torch.stack([torch.cat([torch.arange(n) for n in d]) for d in docs]))


@pytest.mark.parametrize("docs", [None, DOCS], ids=["plain", "packed"])
def test_pieces_cover_each_seen_pair_once_without_a_mask(docs: list[list[int]] | None) -> None:
    """Every cut rectangle of every block, in bands of the window's height and of 7 rows: its pieces, put
    together, are its mask, each pair counted once; no piece keeps an edge other than a square's lower one, nor
    more rows than the band but for whole rectangles before the window's first edge (a rectangle without an
    edge is its own piece); every row of a piece sees one of its keys."""
    seq, cut = 192, 0
    for window, chunk in itertools.product((1, 2, 5, 16, 40, 64, 100), (12, 48, 64, 96)):
        rules = BlockRules(True, window, None if docs is None else _documents(docs))
        ranges = [(lo, min(lo + chunk, seq)) for lo in range(0, seq, chunk)]
        for q, k in itertools.product(ranges, ranges):
            for r, band in itertools.product(rules.rects(q, k) or [], (None, 7)):
                pieces = unmasked_pieces(r, band, min_band=1)
                covered = torch.zeros(r.q_hi - r.q_lo, r.k_hi - r.k_lo, dtype=torch.int)
                for p in pieces:
                    assert p.batch == r.batch and r.q_lo <= p.q_lo < p.q_hi <= r.q_hi, (r, p)
                    short = band is None or p.q_hi - p.q_lo <= band or p.lower is None and not p.causal
                    assert r.lower is None or short, (r, p)
                    assert r.k_lo <= p.k_lo < p.k_hi <= r.k_hi, (r, p)
                    square = p.q_hi - p.q_lo == p.k_hi - p.k_lo
                    assert p.lower is None or (p.lower == 0 and not p.causal and square), (r, p)
                    assert _mask(p).any(dim=1).all(), f"a row without keys in {p}"
                    covered[p.q_lo - r.q_lo:p.q_hi - r.q_lo, p.k_lo - r.k_lo:p.k_hi - r.k_lo] += _mask(p)
                assert torch.equal(covered, _mask(r).int()), (window, chunk, r, pieces)
                cut += len(pieces) > 1
    assert cut > 100  # the edges were really cut


def test_bands_of_the_window_height_give_two_calls_per_band() -> None:
    """The issue's benchmark geometry (chunks of 4096 tokens, window 2048): the diagonal block in three calls (the
    first window's causal square, then one band: an edge triangle and a causal square), the block before it
    in one (a triangle); a window shorter than MIN_BAND keeps its mask."""
    rules = BlockRules(True, 2048)
    (diagonal,), (before,) = rules.rects((8192, 12288), (8192, 12288)), rules.rects((8192, 12288), (4096, 8192))
    everything = slice(None)
    assert unmasked_pieces(diagonal) == [Rect(everything, 0, 2048, 0, 2048, True),
                                         Rect(everything, 2048, 4095, 1, 2048, False, 0),
                                         Rect(everything, 2048, 4096, 2048, 4096, True)]
    assert unmasked_pieces(before) == [before] == [Rect(everything, 0, 2047, 2049, 4096, False, 0)]
    (short,) = BlockRules(True, MIN_BAND - 1).rects((0, 256), (0, 256))
    assert unmasked_pieces(short) == [short] and short.lower is not None


@pytest.mark.parametrize(("seq", "kv_heads"), [(2, 4), (37, 2), (300, 1)])
def test_sdpa_runs_an_edge_square_reversed_exactly(seq: int, kv_heads: int, fresh_seed: int,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A square on the window's lower edge (``lower=0``) on sdpa, forward and backward, against the masked math
    kernel in float64; no mask is built for it."""
    g = torch.Generator().manual_seed(fresh_seed)
    q, dout = (torch.randn(2, seq, 4, 8, generator=g, dtype=torch.float64) * 3 for _ in range(2))
    k, v = (torch.randn(2, seq, kv_heads, 8, generator=g, dtype=torch.float64) * 3 for _ in range(2))
    kernel, math = SdpaKernel(), MathKernel()
    masks = _count_masks(monkeypatch)
    out, lse = kernel.forward(q, k, v, False, 0.3, 0)
    grads = kernel.backward(dout, q, k, v, out, lse, False, 0.3, 0)
    assert masks == []
    ref_out, ref_lse = math.forward(q, k, v, False, 0.3, 0)
    ref_grads = math.backward(dout, q, k, v, ref_out, ref_lse, False, 0.3, 0)
    # the project's float64 bound: at seq=2 a gradient can cancel to ~1e-16 entries, where another summation
    # order alone moves the relative error to ~4e-12 (seen with FPDT_TEST_SEED=364410812)
    for a, b in ((out, ref_out), (lse, ref_lse), *zip(grads, ref_grads)):
        assert rel_error(a, b) <= 1e-10


def _count_masks(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """Every edge mask the sdpa kernel builds from now on, recorded."""
    masks: list[tuple] = []
    edge_bias = kernels.edge_bias
    monkeypatch.setattr(kernels, "edge_bias", lambda *args: masks.append(args) or edge_bias(*args))
    return masks


def _oracle(q, k, v, dout, window: int, docs: list[list[int]] | None) -> list[Tensor]:
    """Textbook attention over the whole sequence with the causal, window and document masks; autograd."""
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    seq = q.shape[1]
    i, j = torch.arange(seq).unsqueeze(1), torch.arange(seq).unsqueeze(0)
    seen = ((j <= i) & (j > i - window)).expand(q.shape[0], seq, seq)
    if docs is not None:
        doc = torch.tensor([[d for d, n in enumerate(lengths) for _ in range(n)] for lengths in docs])
        seen = seen & (doc.unsqueeze(2) == doc.unsqueeze(1))
    groups = q.shape[2] // k.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(groups, dim=2)) * q.shape[-1] ** -0.5
    s = s.masked_fill(~seen.unsqueeze(1), float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1), v.repeat_interleave(groups, dim=2))
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


# (chunk_size, window, documents, rows per band): bands with nothing between their triangles, a short last band
# (a whole rectangle between), bands shorter than the window, a window longer than a chunk (edges off the
# diagonal only), packed documents
CASES = [(96, 48, None, None), (96, 40, None, None), (96, 40, None, 16), (64, 100, None, 24), (96, 40, DOCS, 16),
         (192, 33, DOCS, None)]


@pytest.mark.parametrize(("chunk", "window", "docs", "band"), CASES,
                         ids=[f"chunk{c}-window{w}-band{b}-{'packed' if d else 'plain'}" for c, w, d, b in CASES])
def test_fpdt_attention_on_sdpa_with_cut_edges_float64(chunk: int, window: int, docs: list[list[int]] | None,
                                                        band: int | None, fresh_seed: int,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """One process, 192 tokens: sdpa in float64 with the edges cut into pieces (bands of the kernel's
    ``edge_band`` rows, or shorter ones), against the oracle at 1e-10, and no mask built anywhere."""
    if band is not None:
        monkeypatch.setattr(SdpaKernel, "edge_band", band)
    g = torch.Generator().manual_seed(fresh_seed)
    q, dout = (torch.randn(2, 192, 4, 8, generator=g, dtype=torch.float64) * 3 for _ in range(2))
    k, v = (torch.randn(2, 192, 2, 8, generator=g, dtype=torch.float64) * 3 for _ in range(2))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    masks = _count_masks(monkeypatch)
    out = fpdt_attention(*leaves, chunk_size=chunk, backend="sdpa", window=window,
                         documents=None if docs is None else _documents(docs))
    out.backward(dout)
    assert masks == []
    for name, got, expected in zip(("out", "dq", "dk", "dv"), [out.detach(), *(x.grad for x in leaves)],
                                   _oracle(q, k, v, dout, window, docs)):
        assert rel_error(got, expected) <= 1e-10, name
