"""Run functions in child processes for the tests and the benchmarks: one launcher for both.

- :func:`run_on_ranks`: ``fn(rank, world, *args)`` on ``world`` fresh processes joined in one process
  group (gloo on CPU; NCCL, one GPU per rank, for GPU benchmarks), the results in rank order.
- :func:`run_in_fork`: a script-like ``target()`` in a forked child, its output captured, as
  ``subprocess.run`` would report a script run in a fresh interpreter.

Every child starts its own session. A timeout, Ctrl-C or pytest-timeout in the parent SIGKILLs each
child's whole process group (whatever it started, forked ranks included), never the parent's, and
a child may SIGKILL its own group to simulate a crash. Children inherit the parent's file
descriptors unless captured, so under pytest a rank's output lands in the test's captured output.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from multiprocessing.connection import wait as wait_for_sentinels
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# after the first rank fails, how long the others get to finish or fail on their own before they are
# killed: a rank blocked in a collective with the failed one never returns on NCCL
FAILURE_GRACE_S = 2.0


class RankFailed(RuntimeError):
    """A rank of :func:`run_on_ranks` raised (``exit_code`` 1, its traceback in the message) or ended
    without a result (``exit_code``: its exit status, ``-signal`` when killed)."""

    def __init__(self, message: str, rank: int, exit_code: int | None) -> None:
        super().__init__(message)
        self.rank, self.exit_code = rank, exit_code


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for ``MASTER_PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_on_ranks(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    start_method: Literal["fork", "spawn"] | None = None,
    backend: Literal["gloo", "nccl"] = "gloo",
    threads: int | None = 1,
    timeout: float | None = 120.0,
) -> list[Any]:
    """``fn(rank, world, *args)`` in ``world`` fresh processes of one process group; each rank's result.

    Each rank sets ``MASTER_ADDR``/``MASTER_PORT`` (a :func:`free_port`), joins the group, runs ``fn``,
    saves its result (``torch.save``: tensors travel), waits for every rank at a barrier (no rank tears
    the group down while another still talks to it) and destroys the group.

    Args:
        fn: a module-level function (``spawn`` pickles it by name); its result must be picklable.
        world: the number of ranks.
        start_method: ``"fork"`` (no re-import of torch and Lightning: seconds saved per launch) or
            ``"spawn"``; default fork for gloo and spawn for NCCL (a CUDA context does not survive a fork).
        backend: ``"gloo"``, or ``"nccl"`` with rank ``r`` on GPU ``r``.
        threads: intra-op threads per rank; ``None`` shares the CPU cores evenly between the ranks.
        timeout: seconds before every rank is killed and :class:`TimeoutError` raised; ``None``: no limit.

    Returns:
        The results of ranks ``0 .. world - 1``, in rank order.

    Raises:
        RankFailed: a rank raised or ended without a result; the others are killed after
            ``FAILURE_GRACE_S`` seconds. A rank that ended without a Python exception (killed, out of
            memory) is reported before ranks that raised, often only because it was gone; of the ranks
            that raised, the first to.
        TimeoutError: ranks still ran after ``timeout`` seconds (a hang?); they are killed.
    """
    method = start_method or ("spawn" if backend == "nccl" else "fork")
    ctx = mp.get_context(method)
    with tempfile.TemporaryDirectory() as out_dir:
        port = free_port()
        procs = [ctx.Process(target=_rank_main, args=(rank, world, port, backend, threads, fn, args, out_dir))
                 for rank in range(world)]
        if method == "fork":
            gc.collect()  # before the fork: see _after_fork
        try:
            for p in procs:
                p.start()
            ended_badly = _wait_for_ranks(procs, timeout)
        except BaseException:  # a timeout, pytest-timeout's or Ctrl-C: no rank outlives its caller
            _end(procs)
            raise
        _end(procs)  # processes the ranks left behind in their sessions
        results = [_load(out_dir, rank) for rank in range(world)]
    if any("ok" not in res for res in results):
        raise _failure([r for r in ended_badly if "ok" not in results[r]], results, procs)
    return [res["ok"] for res in results]


def _rank_main(rank: int, world: int, port: int, backend: str, threads: int | None, fn: Callable, args: tuple,
               out_dir: str) -> None:
    os.setsid()
    _after_fork()
    path = os.path.join(out_dir, f"{rank}.pt")
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // world))
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world)
        torch.save({"ok": fn(rank, world, *args)}, path)
    except BaseException:  # report to the parent, which raises it with the rank named
        torch.save({"error": traceback.format_exc(), "time": time.time()}, path)
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.exit(1)
    try:
        dist.barrier()  # no rank tears the group down while another still talks to it
    finally:
        dist.destroy_process_group()


def _wait_for_ranks(procs: list[Any], timeout: float | None) -> list[int]:
    """Wait until every rank has ended, or until ``FAILURE_GRACE_S`` after the first failure; the ranks
    that ended with a non-zero status, in the order they were seen to."""
    deadline = math.inf if timeout is None else time.monotonic() + timeout
    running = {p.sentinel: rank for rank, p in enumerate(procs)}
    failed: list[int] = []
    while running:
        left = deadline - time.monotonic()
        ready = wait_for_sentinels(list(running), timeout=None if left == math.inf else max(left, 0.0))
        if not ready:
            if failed:  # the others are blocked on the failed ranks: the caller kills them
                return failed
            raise TimeoutError(f"rank(s) {sorted(running.values())} did not finish within {timeout}s (a hang?)")
        for sentinel in ready:
            rank = running.pop(sentinel)
            procs[rank].join()
            if procs[rank].exitcode != 0:
                if not failed:
                    deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
                failed.append(rank)
    return failed


def _end(procs: list[Any]) -> None:
    """SIGKILL every rank's session (and a rank that has not ended yet), then reap the ranks."""
    for p in procs:
        if p.pid is not None:
            _kill_session(p.pid, leader_too=p.exitcode is None)
    for p in procs:
        if p.pid is not None:
            p.join()


def _load(out_dir: str, rank: int) -> dict[str, Any]:
    path = os.path.join(out_dir, f"{rank}.pt")
    return torch.load(path, weights_only=False) if os.path.exists(path) else {}


def _failure(failed: list[int], results: list[dict[str, Any]], procs: list[Any]) -> RankFailed:
    """The error to raise: a rank that died (no traceback: killed, out of memory) before ranks that raised,
    which were often only told that it had gone; of those, the first to raise."""
    died = [r for r in failed if "error" not in results[r]]
    raised = sorted((r for r in failed if "error" in results[r]), key=lambda r: results[r]["time"])
    killed = [r for r, res in enumerate(results) if not res and r not in failed]
    rank = (died + raised + killed)[0]
    code = procs[rank].exitcode
    if "error" in results[rank]:
        message = f"rank {rank} failed:\n{results[rank]['error']}"
    else:
        message = f"rank {rank} died without a result (exit code {code})"
    others = [r for r in died + raised if r != rank]
    if others:
        message += f"\n(rank(s) {others} failed too)"
    if [r for r in killed if r != rank]:
        message += f"\n(rank(s) {[r for r in killed if r != rank]} were still running and were killed)"
    return RankFailed(message, rank, code)


def run_in_fork(target: Callable[[], Any], args: list[str], timeout: float) -> subprocess.CompletedProcess:
    """``target()`` in a forked child of this process, as if ``args`` ran as a script in a fresh interpreter,
    without paying the interpreter's imports again (about 9 s of torch, Lightning and transformers each).

    The child starts its own session, so it may SIGKILL its whole process group (its own forked ranks
    included) without touching the parent, and finds its own rendezvous: the ``MASTER_PORT`` and friends an
    earlier run left in this process's environment are dropped (the parent's TCPStore may still listen there).
    Its output (file descriptors 1 and 2, ``sys.stdout``/``sys.stderr``
    and every logging stream handler) goes to files returned as ``stdout``/``stderr``; warnings are printed
    as a script prints them. The return code is the exit status, ``-signal`` when killed, 1 for an uncaught
    exception (its traceback in ``stderr``).

    Raises:
        subprocess.TimeoutExpired: the child ran past ``timeout`` seconds (its process group is killed).
    """
    with tempfile.TemporaryDirectory() as tmp:
        out_path, err_path = Path(tmp) / "stdout", Path(tmp) / "stderr"
        gc.collect()  # before the fork: see _after_fork
        pid = os.fork()
        if pid == 0:  # the child: never returns into the caller
            code = 1
            try:
                os.setsid()
                _after_fork()
                code = _run_as_script(target, out_path, err_path)
            finally:
                os._exit(code)
        deadline = time.monotonic() + timeout
        try:
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    break
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(args, timeout, output=out_path.read_text(),
                                                    stderr=err_path.read_text())
                time.sleep(0.05)
        except BaseException:  # a timeout here, pytest-timeout's or Ctrl-C: no run outlives its caller
            _kill_session(pid, leader_too=True)  # not reaped yet: its pid cannot have been reused
            os.waitpid(pid, 0)
            raise
        _kill_session(pid)  # ranks the child left behind in its session
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        return subprocess.CompletedProcess(args, code, stdout=out_path.read_text(), stderr=err_path.read_text())


# what Lightning's cluster environment leaves in os.environ after a run in this process (its rendezvous: a port whose
# TCPStore may still listen here); a fresh script has none of it, so a forked run finds its own
RENDEZVOUS_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "NODE_RANK", "LOCAL_RANK", "RANK",
                        "LOCAL_WORLD_SIZE")


def _after_fork() -> None:
    """In a forked child: never collect what it inherited. Garbage of earlier runs in the parent may hold a
    process group; freeing a gloo group whose threads did not survive the fork blocks forever (seen: a rank of a
    forked fit in ``~ProcessGroupGloo``, from a garbage collection inside ``torch.save``). The parent collects its
    garbage just before it forks, where the destructors can run; what is left is frozen here (``gc.freeze``), so
    no child ever collects it (nor do the ranks a forked child forks in turn)."""
    gc.freeze()


def _run_as_script(target: Callable[[], Any], out_path: Path, err_path: Path) -> int:
    """``target()`` with its output in the two files and no rendezvous of earlier runs in its environment; the exit
    status a script would have."""
    for name in RENDEZVOUS_VARIABLES:
        os.environ.pop(name, None)
    out, err = open(out_path, "w", buffering=1), open(err_path, "w", buffering=1)
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    sys.stdout, sys.stderr = out, err
    for logger in [logging.getLogger(), *map(logging.getLogger, list(logging.root.manager.loggerDict))]:
        for handler in logger.handlers:
            if type(handler) is logging.StreamHandler:
                handler.stream = err  # not setStream: it flushes the old stream, which may be closed (pytest's capture)
    warnings.showwarning = _print_warning  # pytest records warnings; a script prints them
    code = 1
    try:
        target()
        code = 0
    except SystemExit as exit_:
        code = 0 if exit_.code is None else exit_.code if isinstance(exit_.code, int) else 1
        if exit_.code is not None and not isinstance(exit_.code, int):
            print(exit_.code, file=sys.stderr)  # as the interpreter reports sys.exit("message")
    except BaseException:
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def _kill_session(pid: int, leader_too: bool = False) -> None:
    """SIGKILL the process group ``pid`` started; with ``leader_too`` (``pid`` not reaped yet) also ``pid``
    itself, in case it had not called ``setsid`` yet."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        if leader_too:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _print_warning(message: Any, category: type[Warning], filename: str, lineno: int, file: Any = None,
                   line: str | None = None) -> None:
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))
