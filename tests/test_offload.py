"""Host offload: bitwise the same results, at most two chunks resident, a correct store life cycle."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_fpdt.attention import fpdt_attention
from lightning_fpdt.layers.block import FPDTAttention
from lightning_fpdt.layers.rope import RotaryEmbedding
from lightning_fpdt.offload.chunk_store import ChunkStore, slow_copies
from lightning_fpdt.offload.stats import OffloadStats
from lightning_fpdt.parallel.binding import SequenceParallelContext
from lightning_fpdt.parallel.layout import shard_sequence
from lightning_fpdt.testing import run_on_ranks

CHUNKS = range(2, 9)  # every chunk count from 2 to 8


def _lengths(n: int, sp: int) -> tuple[int, int]:
    """(global length, chunk size) with exactly ``n`` chunks; odd counts get a shorter last chunk."""
    chunk = 4 * sp
    return n * chunk - (2 * sp if n % 2 else 0), chunk


def _run(rank: int, world: int, seed: int, copy_delay: float) -> list[dict]:
    group = dist.group.WORLD if world > 1 else None
    out = []
    for n in CHUNKS:
        seq, chunk = _lengths(n, world)
        for causal in (True, False):
            g = torch.Generator().manual_seed(seed + n)
            full = [torch.randn(2, seq, 4, 8, generator=g, dtype=torch.float64) for _ in range(4)]
            q, k, v, dout = (shard_sequence(x, world, rank, chunk) for x in full)
            k, v = k[:, :, :2], v[:, :, :2]  # GQA
            res = {}
            for offload in (False, True):
                xs = [x.clone().requires_grad_() for x in (q, k, v)]
                stats: list[OffloadStats] = []
                with slow_copies(copy_delay):  # without offload there are no copies to slow down
                    o = fpdt_attention(*xs, group=group, chunk_size=chunk, causal=causal, backend="math",
                                       offload=offload, stats_sink=stats)
                    o.backward(dout)
                res[offload] = ([o.detach(), *(x.grad for x in xs)], stats[0])
            out.append({"n": n, "chunk": chunk, "causal": causal, "res": res})
    return out


def _check(per_rank: list[list[dict]]) -> None:
    for rank_results in per_rank:
        for case in rank_results:
            (plain, plain_stats), (off, off_stats) = case["res"][False], case["res"][True]
            label = f"chunks={case['n']} (C={case['chunk']}) causal={case['causal']}"
            for a, b in zip(off, plain):
                assert torch.equal(a, b), f"{label}: offload changed the result"
            n_chunks = case["n"]
            # offload: at most two k/v chunks and two query-side sets on the device, whatever the count
            assert off_stats.peak_resident_chunks["kv"] <= 2, label
            assert off_stats.peak_resident_chunks["query"] <= 2, label
            assert off_stats.bytes_to_host > 0 and off_stats.bytes_to_device > 0
            assert off_stats.stalls == 0, f"{label}: a chunk was used without a prefetch"
            # without offload everything saved stays: the residency grows with the chunk count
            assert plain_stats.peak_resident_chunks["kv"] == n_chunks, label
            assert plain_stats.bytes_to_host == 0
            assert off_stats.peak_device_bytes < plain_stats.peak_device_bytes or n_chunks <= 2


@pytest.mark.parametrize("sp", [1, pytest.param(2, marks=pytest.mark.distributed),
                                pytest.param(4, marks=pytest.mark.distributed)])
@pytest.mark.parametrize("copy_delay", [0.0, 0.002], ids=["no-delay", "slow-copies"])
def test_offload_is_bitwise_identical(sp: int, copy_delay: float, fresh_seed: int) -> None:
    seed = fresh_seed
    per_rank = run_on_ranks(_run, sp, seed, copy_delay) if sp > 1 else [_run(0, 1, seed, copy_delay)]
    _check(per_rank)


def test_store_life_cycle_and_errors() -> None:
    store = ChunkStore(torch.device("cpu"), offload=True)
    x = torch.randn(4, 4)
    with slow_copies(0.01):
        store.put(("k", 0), x)
        assert store.stats.device_bytes == 0  # offloaded: nothing left on the device
        store.prefetch(("k", 0))
        y = store.get(("k", 0))
        assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()  # a real copy through a host buffer
        store.evict(("k", 0))
        z = store.get(("k", 0))  # without a prefetch: fetched now, counted as a stall
        assert torch.equal(z, x) and store.stats.stalls == 1
    store.delete(("k", 0))
    with pytest.raises(KeyError, match=r"no chunk \('k', 0\)"):
        store.get(("k", 0))
    store.close()


def test_put_on_a_live_key_is_an_error() -> None:
    store = ChunkStore(torch.device("cpu"), offload=True)
    x = torch.randn(4, 4)
    store.put(("input", 0), x)
    with pytest.raises(ValueError, match=r"chunk \('input', 0\) is already stored.*new_key"):
        store.put(("input", 0), torch.zeros(4, 4))
    assert torch.equal(store.get(("input", 0)), x)  # the first chunk is untouched
    keys = {store.new_key("input") for _ in range(3)}
    assert len(keys) == 3 and all(kind == "input" for kind, _ in keys)
    store.delete_later(("input", 0))  # deferred: applied at the next look at the keys
    assert ("input", 0) not in store and not list(store.keys())
    store.close()


def _attention_inputs(seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 24, 4, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 24, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))  # GQA
    return q, k, v


@pytest.mark.parametrize("offload", [False, True], ids=["on-device", "offloaded"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("mode", ["no_grad", "inputs-without-grad"])
def test_forward_without_gradients_saves_nothing_for_backward(
    offload: bool, causal: bool, mode: str, fresh_seed: int
) -> None:
    q, k, v = _attention_inputs(fresh_seed)
    options = {"chunk_size": 8, "causal": causal, "backend": "math", "offload": offload}
    expected = fpdt_attention(*(x.clone().requires_grad_() for x in (q, k, v)), **options).detach()
    stats: list[OffloadStats] = []
    if mode == "no_grad":
        with torch.no_grad():
            out = fpdt_attention(*(x.clone().requires_grad_() for x in (q, k, v)), **options, stats_sink=stats)
    else:
        out = fpdt_attention(q, k, v, **options, stats_sink=stats)
    assert torch.equal(out, expected)
    # only k/v pass through the store (the forward itself reads them again); no query-side chunk is kept
    assert "query" not in stats[0].peak_resident_chunks
    assert stats[0].bytes_to_host == (2 * k.numel() * k.element_size() if offload else 0)


def test_block_forward_without_gradients_saves_nothing_for_backward() -> None:
    attn = FPDTAttention(32, 4, 2, rope=RotaryEmbedding(8)).double()  # q/k/v projected per chunk
    attn.bind(SequenceParallelContext(chunk_size=8, attention_backend="math", offload=True))
    x = torch.randn(2, 24, 32, dtype=torch.float64)
    pos = torch.arange(24).expand(2, 24)
    expected = attn(x, pos)
    expected.sum().backward()
    assert "query" in attn.record.stats.peak_resident_chunks  # with a backward to come, they are kept
    with torch.no_grad():
        out = attn(x, pos)
    stats = attn.record.stats
    assert torch.equal(out, expected.detach())
    assert "query" not in stats.peak_resident_chunks
    assert stats.bytes_to_host == 2 * 2 * 24 * 2 * 8 * 8  # k and v: [batch, seq, kv_heads, head_dim] float64
