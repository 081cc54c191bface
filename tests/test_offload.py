"""Host offload: bitwise the same results, at most two chunks resident, a correct store life cycle."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_fpdt.attention import fpdt_attention
from lightning_fpdt.layout import shard_sequence
from lightning_fpdt.offload import ChunkStore, OffloadStats
from tests.distributed import run_distributed

CHUNKS = range(2, 9)  # every chunk count from 2 to 8


def _layout(n: int, sp: int) -> tuple[int, int]:
    """(global length, chunk size) with exactly ``n`` chunks; odd counts get a shorter last chunk."""
    chunk = 4 * sp
    return n * chunk - (2 * sp if n % 2 else 0), chunk


def _run(rank: int, world: int, seed: int, copy_delay: float) -> list[dict]:
    group = dist.group.WORLD if world > 1 else None
    out = []
    for n in CHUNKS:
        seq, chunk = _layout(n, world)
        for causal in (True, False):
            g = torch.Generator().manual_seed(seed + n)
            full = [torch.randn(2, seq, 4, 8, generator=g, dtype=torch.float64) for _ in range(4)]
            q, k, v, dout = (shard_sequence(x, world, rank, chunk) for x in full)
            k, v = k[:, :, :2], v[:, :, :2]  # GQA
            res = {}
            for offload in (False, True):
                xs = [x.clone().requires_grad_() for x in (q, k, v)]
                stats: list[OffloadStats] = []
                o = fpdt_attention(*xs, group=group, chunk_size=chunk, causal=causal, backend="math",
                                   offload=offload, stats_sink=stats, copy_delay=copy_delay if offload else 0.0)
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
            # without offload everything saved stays: the residency grows with the chunk count
            assert plain_stats.peak_resident_chunks["kv"] == n_chunks, label
            assert plain_stats.bytes_to_host == 0
            assert off_stats.peak_device_bytes < plain_stats.peak_device_bytes or n_chunks <= 2


@pytest.mark.parametrize("sp", [1, 2, 4])
@pytest.mark.parametrize("copy_delay", [0.0, 0.002], ids=["no-delay", "slow-copies"])
def test_offload_is_bitwise_identical(sp: int, copy_delay: float) -> None:
    seed = int(torch.randint(0, 2**30, ()).item())
    per_rank = run_distributed(_run, sp, seed, copy_delay) if sp > 1 else [_run(0, 1, seed, copy_delay)]
    _check(per_rank)


def test_store_life_cycle_and_errors() -> None:
    store = ChunkStore(torch.device("cpu"), offload=True, copy_delay=0.01)
    x = torch.randn(4, 4)
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
