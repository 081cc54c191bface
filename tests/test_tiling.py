"""Tiled MLP, tiled cross-entropy and block activation checkpointing equal their plain versions (float64)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from lightning_fpdt.layers.activation_checkpoint import new_layer_input_store
from lightning_fpdt.layers.block import FPDTAttention, FPDTBlock
from lightning_fpdt.layers.loss import tiled_cross_entropy_sum
from lightning_fpdt.layers.rope import RotaryEmbedding
from lightning_fpdt.models.gpt import GeLUMLP
from lightning_fpdt.models.llama import RMSNorm, SwiGLU
from lightning_fpdt.offload.chunk_store import slow_copies
from lightning_fpdt.offload.memtrack import TensorMemoryTracker
from lightning_fpdt.offload.tiling import TiledMLP, tile_bounds
from lightning_fpdt.parallel.binding import SequenceParallelContext
from tests.reference import rel_error


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters()}


def test_tile_bounds_cover_the_sequence() -> None:
    assert tile_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert tile_bounds(2, 5) == [(0, 1), (1, 2)]


@pytest.mark.parametrize("mlp_cls", [SwiGLU, GeLUMLP])
@pytest.mark.parametrize("tiles", [2, 5])
def test_tiled_mlp_matches_plain(mlp_cls, tiles: int, fresh_seed: int) -> None:
    torch.manual_seed(fresh_seed)
    mlp = mlp_cls(16, 40).double()
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.25)
    tiled = TiledMLP(copy.deepcopy(mlp), num_tiles=tiles)
    x = torch.randn(3, 23, 16, dtype=torch.float64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    g = torch.randn(3, 23, 16, dtype=torch.float64)
    mlp(x).backward(g)
    out = tiled(x2)
    out.backward(g)
    assert rel_error(out, mlp(x)) <= 1e-13
    assert rel_error(x2.grad, x.grad) <= 1e-13
    for name, grad in _grads(mlp).items():
        assert rel_error(_grads(tiled.mlp)[name], grad) <= 1e-13, name


@pytest.mark.parametrize("tiles", [1, 4, 7])
def test_tiled_cross_entropy_matches_full_logits(tiles: int, fresh_seed: int) -> None:
    torch.manual_seed(fresh_seed)
    h = torch.randn(2, 13, 8, dtype=torch.float64, requires_grad=True)
    w = (torch.randn(50, 8, dtype=torch.float64) * 30).requires_grad_()  # huge logits: p(target) underflows f32
    targets = torch.randint(0, 50, (2, 13))
    targets[0, :3] = -100
    upstream = -2 - 2 * torch.rand((), dtype=torch.float64)  # as a loss scale or 1 / tokens: never 1
    ref = F.cross_entropy((h @ w.T).reshape(-1, 50), targets.reshape(-1), ignore_index=-100, reduction="sum")
    ref.backward(upstream)
    ref_gh, ref_gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    loss, count = tiled_cross_entropy_sum(h, w, targets, tiles)
    loss.backward(upstream)
    assert count.item() == 23
    assert rel_error(loss, ref) <= 1e-13
    assert rel_error(h.grad, ref_gh) <= 1e-12 and rel_error(w.grad, ref_gw) <= 1e-12


def test_tiled_cross_entropy_float32_large_logits_is_finite() -> None:
    h = torch.randn(1, 16, 8)
    w = torch.randn(64, 8) * 40  # logits ~ +-300: exp overflows, softmax().log() would give -inf
    targets = torch.randint(0, 64, (1, 16))
    loss, _ = tiled_cross_entropy_sum(h, w, targets, 3)
    ref = F.cross_entropy((h.double() @ w.double().T)[0], targets[0], reduction="sum")
    assert torch.isfinite(loss) and rel_error(loss.double(), ref) <= 1e-5


def test_tiled_cross_entropy_keeps_one_tile_of_logits() -> None:
    """Forward and backward each hold one ``[tile, vocab]`` tensor at a time: the logits are overwritten by
    their exponentials (forward) or their softmax (backward), never kept beside them."""
    tokens, vocab, hidden, tiles = 256, 4096, 8, 4
    h = torch.randn(1, tokens, hidden, dtype=torch.float64, requires_grad=True)
    w = torch.randn(vocab, hidden, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, vocab, (1, tokens))
    inputs = (h.numel() + w.numel() + targets.numel()) * 8
    tile_logits = tokens // tiles * vocab * 8
    with TensorMemoryTracker() as forward:
        forward.track(h, w, targets)
        forward.reset_peak()
        loss, _ = tiled_cross_entropy_sum(h, w, targets, tiles)
    with TensorMemoryTracker() as backward:
        backward.track(h, w, targets)
        backward.reset_peak()
        loss.backward()
    gradients = (h.numel() + w.numel()) * 8
    # one tile of logits besides per-token vectors and one tile's d(hidden): far below two tiles
    assert forward.peak_bytes - inputs < 1.25 * tile_logits, (forward.peak_bytes, tile_logits)
    assert backward.peak_bytes - inputs - gradients < 1.25 * tile_logits, (backward.peak_bytes, tile_logits)


def test_resizable_tracker_survives_a_storage_freed_by_another_thread(monkeypatch) -> None:
    """A storage can die while the tracker reads the sizes (autograd's or a collective's thread frees it), even after
    a liveness check said alive: that storage leaves the count, and the others keep theirs."""
    import lightning_fpdt.offload.memtrack as memtrack

    kept = torch.zeros(64, dtype=torch.float64)
    with TensorMemoryTracker(resizable=True) as tracker:
        gone = torch.zeros(32, dtype=torch.float64)
        tracker.track(kept, gone)
        assert tracker.current_bytes == 96 * 8
        # freed "after" the check: the weak reference still answers alive, but nothing can be read back
        monkeypatch.setattr(memtrack.StorageWeakRef, "expired", lambda self: False)
        del gone
        assert tracker.current_bytes == 64 * 8
        kept.untyped_storage().resize_(16 * 8)
        assert tracker.current_bytes == 16 * 8


def _block() -> FPDTBlock:
    return FPDTBlock(
        attention=FPDTAttention(32, 4, 2, rope=RotaryEmbedding(8)),
        mlp=TiledMLP(SwiGLU(32, 48), num_tiles=3),
        attention_norm=RMSNorm(32),
        mlp_norm=RMSNorm(32),
    ).double()


@pytest.mark.parametrize("offload", [False, True], ids=["in-memory", "offloaded"])
def test_recomputed_blocks_match_plain(offload: bool, fresh_seed: int) -> None:
    torch.manual_seed(fresh_seed)
    plain = torch.nn.ModuleList([_block(), _block()])
    ckpt = copy.deepcopy(plain)
    store = new_layer_input_store(torch.device("cpu")) if offload else None
    for i, block in enumerate(ckpt):
        block.bind(SequenceParallelContext(activation_checkpointing=True, layer_input_store=store,
                                           chunk_size=8, attention_backend="math"), layer_index=i)
    pos = torch.arange(24).expand(2, 24)
    x = torch.randn(2, 24, 32, dtype=torch.float64)
    g = torch.randn(2, 24, 32, dtype=torch.float64)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1 = x1
    for b in plain:
        y1 = b(y1, pos)
    y1.backward(g)
    with slow_copies(0.001):  # every offload copy slower: a layer input used before its copy is done shows
        y2 = x2
        for b in ckpt:
            y2 = b(y2, pos)
        y2.backward(g)
    assert rel_error(y2, y1) <= 1e-13 and rel_error(x2.grad, x1.grad) <= 1e-12
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        assert rel_error(b.grad, a.grad) <= 1e-12, name
    if store is not None:
        assert not list(store.keys())  # every layer input was consumed and deleted
        assert store.stats.bytes_to_host == 2 * x.numel() * 8
        assert store.stats.peak_resident_chunks["layer_input"] <= 2
        store.close()
