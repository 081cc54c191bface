"""Overlap: every chunk after a pass's first is prefetched one compute ahead, one copy engine per device,
host buffers reused across calls (safely), asynchronous all-to-alls.

What CPU can show: the schedule (the order of prefetch, compute and use, recorded), the CPU emulation's
workers and pool, the registry logic of the CUDA engine (with a stand-in for ``torch.cuda.Stream``), and
the arithmetic of the CUDA wait figure (with stand-in events). Not shown here: that CUDA copies really
overlap kernels; ``benchmarks/gpu_check.py`` measures that on a GPU.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_fpdt.attention import fpdt_attention
from lightning_fpdt.attention.kernels import MathKernel
from lightning_fpdt.attention.pipeline import PipelineOptions, run_pipeline
from lightning_fpdt.attention.sources import TensorEnds
from lightning_fpdt.offload.chunk_store import ChunkStore, slow_copies
from lightning_fpdt.offload.copy_engine import copy_engine, release_copy_engines
from lightning_fpdt.offload.stats import OffloadStats
from lightning_fpdt.parallel.comm import Exchange, head_to_seq, seq_to_head
from lightning_fpdt.parallel.layout import shard_sequence
from lightning_fpdt.testing import run_on_ranks

CPU = torch.device("cpu")
KERNEL_SECONDS = 0.05  # each attention block "computes" this long: 25x a copy
COPY_DELAY = 0.002


class TracingKernel:
    """``math`` attention that records each compute in a trace and takes ``KERNEL_SECONDS``."""

    name = "tracing"

    def __init__(self, trace: list[tuple]) -> None:
        self.trace, self.math = trace, MathKernel()

    def forward(self, *args: Any) -> Any:
        self.trace.append(("compute", "forward"))
        time.sleep(KERNEL_SECONDS)
        return self.math.forward(*args)

    def backward(self, *args: Any) -> Any:
        self.trace.append(("compute", "backward"))
        time.sleep(KERNEL_SECONDS)
        return self.math.backward(*args)


def _traced_store(trace: list[tuple], monkeypatch: pytest.MonkeyPatch) -> None:
    """Record every copy a prefetch starts and the state of every offloaded chunk a ``get`` meets."""
    prefetch, get = ChunkStore.prefetch, ChunkStore.get

    def traced_prefetch(self: ChunkStore, key: Any) -> None:
        entry = self._entry(key)
        if entry.device is None and entry.to_device is None:
            trace.append(("prefetch", key))
        prefetch(self, key)

    def traced_get(self: ChunkStore, key: Any) -> Any:
        entry = self._entry(key)
        if entry.device is None:
            state = "not-prefetched" if entry.to_device is None else "ready" if entry.to_device.done() else "in-flight"
            trace.append(("get", key, state))
        return get(self, key)

    monkeypatch.setattr(ChunkStore, "prefetch", traced_prefetch)
    monkeypatch.setattr(ChunkStore, "get", traced_get)


def _passes(trace: list[tuple]) -> tuple[list[tuple], list[tuple]]:
    """The trace cut into the forward and the backward pass (after the forward's last compute)."""
    last_forward = max(k for k, e in enumerate(trace) if e == ("compute", "forward"))
    return trace[: last_forward + 1], trace[last_forward + 1 :]


def _check_pass(events: list[tuple], label: str) -> None:
    computes, issued_at, exempt = 0, {}, 0
    for event in events:
        if event[0] == "compute":
            computes += 1
        elif event[0] == "prefetch":
            issued_at[event[1]] = computes
        else:
            _, key, state = event
            assert state != "not-prefetched", f"{label}: {key} used without a prefetch (a stall)"
            if computes == 0:  # the pass's first chunks: nothing ran before them to hide the copy behind
                exempt += 1
                continue
            assert issued_at[key] < computes, f"{label}: {key} prefetched only after the compute before its use"
            assert state == "ready", f"{label}: {key} still copying when needed ({state})"
    assert exempt <= 5, f"{label}: {exempt} chunks waited for at the start (at most k, v and q, out, lse)"


def _traced_run(rank: int, world: int, seed: int, n: int, causal: bool) -> tuple[list[tuple], OffloadStats]:
    monkeypatch = pytest.MonkeyPatch()
    trace: list[tuple] = []
    _traced_store(trace, monkeypatch)
    try:
        group = dist.group.WORLD if world > 1 else None
        chunk = 4 * world
        g = torch.Generator().manual_seed(seed)
        q, k, v, dout = (shard_sequence(torch.randn(1, n * chunk, 4, 8, generator=g, dtype=torch.float64), world,
                                        rank, chunk) for _ in range(4))
        stats: list[OffloadStats] = []
        opt = PipelineOptions.for_chunk_size(group, chunk, causal=causal, scale=8**-0.5, kernel=TracingKernel(trace),
                                             offload=True, stats_sink=stats)
        xs = [x.requires_grad_() for x in (q, k, v)]
        with slow_copies(COPY_DELAY):
            out, _ = run_pipeline(TensorEnds(kv_heads=4), opt, *xs)
            out.backward(dout)
        return trace, stats[0]
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("sp", [1, pytest.param(2, marks=pytest.mark.distributed)])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_every_chunk_after_the_first_is_prefetched_one_compute_ahead(sp: int, causal: bool, n: int,
                                                                     fresh_seed: int) -> None:
    if sp > 1:
        per_rank = run_on_ranks(_traced_run, sp, fresh_seed, n, causal)
    else:
        per_rank = [_traced_run(0, 1, fresh_seed, n, causal)]
    for rank, (trace, stats) in enumerate(per_rank):
        label = f"sp={sp} rank={rank} chunks={n} causal={causal}"
        forward, backward = _passes(trace)
        assert sum(e[0] == "compute" for e in forward) == (n * (n + 1) // 2 if causal else n * n), label
        _check_pass(forward, f"{label} forward")
        _check_pass(backward, f"{label} backward")
        assert stats.stalls == 0, label  # what fpdt/prefetch_stalls reports
        starting_waits = sum(1 for e in backward[: next(k for k, e in enumerate(backward) if e[0] == "compute")]
                             if e[0] == "get")
        assert stats.late <= starting_waits, f"{label}: {stats.late} waits, {starting_waits} at the start"


def test_one_copy_engine_per_device_for_the_whole_process(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[Any] = []

    class FakeStream:  # stands in for torch.cuda.Stream: CPU cannot make one
        def __init__(self, device: torch.device) -> None:
            self.device = device
            made.append(self)

        def synchronize(self) -> None:
            pass

    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    release_copy_engines()
    try:
        first = copy_engine(torch.device("cuda", 0))
        assert copy_engine(torch.device("cuda", 0)) is first  # every later store on cuda:0 gets the same
        other = copy_engine(torch.device("cuda", 1))
        assert other is not first and len(made) == 4
        # a stream per direction, so device-to-host and host-to-device copies run at once
        assert first.to_host is not first.to_device
        assert {s.device for s in (first.to_host, first.to_device)} == {torch.device("cuda", 0)}
        assert first.pool._pin and not copy_engine(CPU).pool._pin  # pinned host memory for CUDA only
    finally:
        release_copy_engines()
    assert copy_engine(torch.device("cuda", 0)) is not first  # released: a fresh one next time
    release_copy_engines()


def _offloaded_call(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(2, 32, 4, 8, generator=g, dtype=torch.float64) for _ in range(4))
    xs = [x.requires_grad_() for x in (q, k, v)]
    with slow_copies(0.001):
        fpdt_attention(*xs, chunk_size=8, backend="math", offload=True).backward(dout)


def test_host_buffers_and_workers_are_reused_across_calls(fresh_seed: int) -> None:
    release_copy_engines()
    engine = copy_engine(CPU)
    _offloaded_call(fresh_seed)
    allocations = engine.pool.allocations
    assert allocations > 0
    for _ in range(2):
        _offloaded_call(fresh_seed + 1)
    assert copy_engine(CPU) is engine
    assert engine.pool.allocations == allocations, "a later call allocated host buffers instead of reusing the pool"
    workers = [t for t in threading.enumerate() if t.name.startswith("fpdt-to-")]
    assert len(workers) <= 2, [t.name for t in workers]  # one per direction, not one per call
    release_copy_engines()
    assert engine.pool.free_bytes() == 0


def test_a_pooled_buffer_is_not_overwritten_while_a_copy_still_reads_it() -> None:
    release_copy_engines()
    slow, fast = ChunkStore(CPU, offload=True), ChunkStore(CPU, offload=True)
    x = torch.randn(64)
    with slow_copies(0.1):  # the copies of the slow store only
        slow.put(("k", 0), x)
        slow.prefetch(("k", 0))  # reads the host buffer ~0.2 s from now
    reading = slow._entries[("k", 0)].to_device
    slow.delete(("k", 0))  # the buffer goes back to the pool while that read is queued
    y = torch.zeros(64)
    fast.put(("k", 0), y)  # takes the same buffer: its copy must wait for the read
    assert copy_engine(CPU).pool.allocations == 1
    assert torch.equal(reading.result(), x)
    assert torch.equal(fast.get(("k", 0)), y)
    fast.close()
    release_copy_engines()


class FakeEvent:
    def __init__(self, t_ms: float) -> None:
        self.t = t_ms

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: FakeEvent) -> float:
        return other.t - self.t


def test_cuda_wait_is_the_time_the_compute_stream_sat_idle() -> None:
    stats = OffloadStats()
    stats.add_timed_wait(FakeEvent(10.0), FakeEvent(4.0))  # the copy was done before compute got there
    stats.add_timed_wait(FakeEvent(10.0), FakeEvent(13.5))  # compute waited 3.5 ms
    total = OffloadStats()
    total.merge(stats)  # per-step totals keep the unread events
    assert total.wait_seconds == pytest.approx(3.5e-3) and total.late == 1
    assert stats.wait_seconds == pytest.approx(3.5e-3)


def _exchange_run(rank: int, world: int, seed: int) -> list[torch.Tensor]:
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(seed + rank)
    xs = [torch.randn(2, 6, 4, 3, generator=g, dtype=torch.float64) for _ in range(3)]
    exchange = Exchange(group)
    pending = [exchange.seq_to_head(x) for x in xs]  # three in flight at once
    heads = [p.wait() for p in pending]
    back = exchange.head_to_seq(heads[0])
    results = [torch.equal(h, seq_to_head(x, group)) for h, x in zip(heads, xs, strict=True)]
    results.append(torch.equal(back.wait(), xs[0]) and torch.equal(head_to_seq(heads[1], group), xs[1]))
    # several tensors of other shapes (a chunk's q, k and v; v narrower) in one collective, both ways; and tensors
    # of two dtypes, which go one by one
    shapes = [(2, 6, 4, 3), (2, 6, 2, 3), (2, 6, 2, 5)]
    parts = [torch.randn(*shape, generator=g, dtype=torch.float64) for shape in shapes]
    together = exchange.seq_to_head_many(parts, "qkv")
    heads = [p.wait() for p in reversed(together)][::-1]  # any order of waits
    results += [torch.equal(h, seq_to_head(x, group)) for h, x in zip(heads, parts, strict=True)]
    back = [p.wait() for p in exchange.head_to_seq_many(heads[1:], "dkv")]
    results += [torch.equal(b, x) for b, x in zip(back, parts[1:], strict=True)]
    mixed = exchange.seq_to_head_many([parts[0], parts[1].float()])
    results += [torch.equal(mixed[0].wait(), heads[0]), torch.equal(mixed[1].wait(), seq_to_head(parts[1].float(),
                                                                                                   group))]
    exchange.close()
    return results


@pytest.mark.distributed
def test_async_exchange_equals_the_blocking_all_to_all(fresh_seed: int) -> None:
    """One by one, and several tensors in one collective (what a chunk's q/k/v and dk/dv travel as)."""
    for rank_results in run_on_ranks(_exchange_run, 2, fresh_seed):
        assert len(rank_results) == 11 and all(rank_results), rank_results


def test_exchange_misuse_is_an_error() -> None:
    exchange = Exchange(None)
    pending = exchange.seq_to_head(torch.ones(1, 2, 2, 1))
    pending.wait()
    with pytest.raises(RuntimeError, match="already waited for"):
        pending.wait()
    exchange.head_to_seq(torch.ones(1, 2, 2, 1), "dq3")
    with pytest.raises(RuntimeError, match="never waited for: dq3"):
        exchange.close()
    with pytest.raises(RuntimeError, match="after close"):
        exchange.seq_to_head(torch.ones(1, 2, 2, 1))


@pytest.mark.distributed
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_overlap_off_gives_the_same_bits(causal: bool, fresh_seed: int) -> None:
    per_rank = run_on_ranks(_overlap_pair, 2, fresh_seed, causal)
    for on, off in per_rank:
        assert all(torch.equal(a, b) for a, b in zip(on, off, strict=True))


def _overlap_pair(rank: int, world: int, seed: int, causal: bool) -> tuple[list, list]:
    g = torch.Generator().manual_seed(seed)
    full = [torch.randn(1, 48, 4, 8, generator=g, dtype=torch.float64) for _ in range(4)]
    q, k, v, dout = (shard_sequence(x, world, rank, 8) for x in full)
    results = []
    for overlap in (True, False):
        opt = PipelineOptions.for_chunk_size(dist.group.WORLD, 8, causal=causal, scale=8**-0.5, kernel=MathKernel(),
                                             overlap_comm=overlap)
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        out, lse = run_pipeline(TensorEnds(kv_heads=4), opt, *xs)
        out.backward(dout)
        results.append([out.detach(), lse, *(x.grad for x in xs)])
    return results[0], results[1]
