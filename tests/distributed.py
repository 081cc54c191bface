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
