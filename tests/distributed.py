"""Run a function in several gloo processes from inside pytest (fork: no re-import, no re-run of pytest)."""

from __future__ import annotations

import os
import socket
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

from lightning_fpdt.attention import fpdt_attention
from lightning_fpdt.layout import shard_sequence, unshard_sequence

ATTENTION_STEP = ("out", "lse", "dq", "dk", "dv")  # what sharded_attention_step returns, in order


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save({"ok": result}, os.path.join(out_dir, f"{rank}.pt"))
    except BaseException:  # report to the parent, which fails the test with the traceback
        torch.save({"error": traceback.format_exc()}, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """``fn(rank, world_size, *args)`` in ``world_size`` forked processes; returns each rank's result."""
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.get_context("fork")
        port = free_port()
        procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, out_dir)) for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        for p in procs:
            if p.is_alive():
                p.kill()
                raise TimeoutError(f"rank process {p.pid} did not finish within {timeout}s (a hang?)")
        results = []
        for r in range(world_size):
            path = os.path.join(out_dir, f"{r}.pt")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {r} died without a result (exit code {procs[r].exitcode})")
            res = torch.load(path, weights_only=False)
            if "error" in res:
                raise RuntimeError(f"rank {r} failed:\n{res['error']}")
            results.append(res["ok"])
        return results


def sharded_attention_step(
    rank: int, world: int, chunk: int | None, q: Tensor, k: Tensor, v: Tensor, dout: Tensor, **options: Any
) -> list[Tensor]:
    """One ``fpdt_attention`` forward and backward (``math`` kernel) on this rank's shard of whole ``q``, ``k``,
    ``v`` and ``dout`` ``[batch, seq, heads, head_dim]`` in the FPDT layout of ``chunk``; ``options`` go to
    ``fpdt_attention`` (``causal``, ``offload``, ``documents``, ...). Returns this rank's
    :data:`ATTENTION_STEP`, detached."""
    group = dist.group.WORLD if world > 1 else None
    shards = [shard_sequence(x, world, rank, chunk).requires_grad_() for x in (q, k, v)]
    out, lse = fpdt_attention(*shards, group=group, chunk_size=chunk, backend="math", return_lse=True, **options)
    out.backward(shard_sequence(dout, world, rank, chunk))
    return [t.detach() for t in (out, lse, *(x.grad for x in shards))]


def unsharded_attention_step(per_rank: list[list[Tensor]], chunk: int | None) -> list[Tensor]:
    """The whole-sequence :data:`ATTENTION_STEP` from every rank's :func:`sharded_attention_step`."""
    return [unshard_sequence([r[t] for r in per_rank], chunk) for t in range(len(ATTENTION_STEP))]
