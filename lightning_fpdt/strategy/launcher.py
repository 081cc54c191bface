"""How ``FPDTStrategy``'s processes are launched, and what a survivor says when one of them dies.

Lightning's multiprocessing launcher sends rank 0's ``state_dict()`` back to the parent, which loads
it into the user's module. With sharded parameters (FSDP2) rank 0 holds only its shards, so
:class:`ShardAwareLauncher` gathers the full tensors first (a collective on every rank, received on
rank 0's CPU).

When one rank dies (``kill -9``, the kernel's out-of-memory killer, a crash in native code) the others
fail in their next collective with the backend's own words (gloo: ``Connection reset by peer``), which
say neither that a process died nor which. Every rank gathers each rank's host and process id once at
setup (:func:`gather_peers`); :func:`explain_peer_failure` turns such an error into one that names the
ranks whose processes are gone on this host, those still running, and where to look.
"""

from __future__ import annotations

import atexit
import functools
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule
from typing_extensions import override

from lightning_fpdt.errors import PREFIX, FPDTError, said_by_every_rank

# what gloo, NCCL and the TCP store say when the process at the other end of a connection is gone
_PEER_GONE = re.compile(
    r"Connection reset by peer|Connection closed by peer|Broken pipe|Connection refused|NCCL communicator was aborted"
    r"|remote process exited|ncclRemoteError",
    re.IGNORECASE,
)

_EXIT_WAIT_S = 2.0  # how long a survivor waits for a dying peer to show as dead in /proc


@dataclass(frozen=True)
class Peer:
    """One rank's process: its global ``rank``, the ``host`` it runs on and its process id."""

    rank: int
    host: str
    pid: int


def gather_peers() -> tuple[Peer, ...]:
    """Every rank's :class:`Peer`, gathered with one ``all_gather_object`` (call it once, on every rank,
    right after the process group is made); empty without a process group."""
    if not dist.is_available() or not dist.is_initialized():
        return ()
    peers: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(peers, (socket.gethostname(), os.getpid()))
    return tuple(Peer(rank, host, pid) for rank, (host, pid) in enumerate(peers))


def process_state(pid: int) -> str:
    """``"running"``, ``"gone"``, or ``"killed by SIGKILL"`` (the signal or exit status of a process that died
    but was not yet reaped by its parent), read from ``/proc``; ``"running"`` where ``/proc`` does not say."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after "pid (command)"
    except FileNotFoundError:
        return "gone"
    except OSError:
        return "running"
    if fields[0] not in "ZX":
        return "running"
    status = int(fields[-1]) if len(fields) >= 50 else 0  # exit_code, as waitpid reports it (Linux >= 3.5)
    if status & 0x7F:
        return f"killed by {signal.Signals(status & 0x7F).name}"
    return f"exited with status {status >> 8}"


@functools.cache  # registered once per process
def destroy_group_at_exit() -> None:
    """Destroy the default process group when the interpreter exits, once registered (call it on every rank once
    the group exists). Left to the interpreter's shutdown, gloo's connection threads are torn down in no set order
    with the objects they use, and a process that finishes its last step while a peer is still closing its side
    sometimes aborts at exit ("terminate called without an active exception", SIGABRT) after a correct run; torch
    asks for the group to be destroyed before exit for the same reason. Lightning does not do it in ``teardown``
    (a Trainer may ``fit`` and then ``test`` in the same group)."""
    atexit.register(_destroy_process_group)


def _destroy_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def peer_failure_message(error: BaseException, peers: tuple[Peer, ...], rank: int) -> str | None:
    """The message for ``error`` raised on ``rank`` when it says a peer process is gone; ``None`` otherwise."""
    text = str(error)
    if not peers or not _PEER_GONE.search(text):
        return None
    here = socket.gethostname()
    deadline = time.monotonic() + _EXIT_WAIT_S
    while True:  # a killed process closes its sockets before /proc shows it dead: give it a moment
        states = {p.rank: process_state(p.pid) for p in peers if p.host == here and p.rank != rank}
        dead = {r: s for r, s in states.items() if s != "running"}
        if dead or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    running = [r for r, s in states.items() if s == "running"]
    elsewhere = [p.rank for p in peers if p.host != here]
    if dead:
        what = ", ".join(f"rank {r} (pid {peers[r].pid}, {s})" for r, s in dead.items())
        head = f"the process of {what} died, so this collective cannot complete."
        if not any(s.startswith("killed") for s in dead.values()):  # maybe a survivor that raised and exited first
            head += " A rank that exits with an error may have lost a peer itself: its own error names that peer."
    else:
        head = "another rank's process died or closed its connection (none of the ranks on this host is gone)."
    alive = f"Still running on {here}: rank(s) {sorted([rank, *running])}"
    alive += f"; ranks on other hosts (not checked): {elsewhere}." if elsewhere else "."
    return (
        f"FPDTStrategy: rank {rank} lost a peer: {head} {alive} Look at the dead rank's own output for its error;"
        " a process killed with no error of its own (SIGKILL) was usually stopped by the kernel's out-of-memory"
        " killer (`dmesg | grep -i 'killed process'`) or by a scheduler (kill -9, a job time limit)."
        f" The backend said: {text.strip()}"
    )


def explain_peer_failure(error: BaseException, peers: tuple[Peer, ...], rank: int) -> None:
    """Rewrite ``error``'s message in place with :func:`peer_failure_message` when a peer process is gone
    (the exception keeps its type and traceback, as Lightning's own ``on_exception`` messages do)."""
    with _sigterm_deferred():
        message = peer_failure_message(error, peers, rank)
        if message is not None:
            error.args = (message,)


@contextmanager
def _sigterm_deferred() -> Iterator[None]:
    """SIGTERM held back until the message is made, then raised again. A launcher stops the rest of a node's
    processes once one has exited (torchrun), often while the others wait for a dead peer to show in /proc; Lightning's
    SIGTERM handler then runs a broadcast, which fails with the backend's words in place of this message."""
    previous = signal.getsignal(signal.SIGTERM)
    if threading.current_thread() is not threading.main_thread() or previous is None:  # not set from Python
        yield
        return
    received: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if received:
            signal.raise_signal(signal.SIGTERM)  # handled now as it would have been then


def refuse_before_launch(strategy: Any) -> None:
    """The refusals that need the user's module and the run's sequence-parallel size but no process group, made
    once in the launching process before any other rank starts (the ranks make them again in ``setup``, where a
    module gets its layers in ``configure_model``): a module that mixes tokens outside attention, or whose recurrent
    layers the installed transformers release left unrecognised (``CausalLM.refuse_token_mixers``)."""
    refuse = getattr(strategy.lightning_module, "refuse_token_mixers", None)
    if refuse is not None:
        refuse(strategy.sequence_parallel_size)


def check_external_world(environment: ClusterEnvironment, devices: int, num_nodes: int) -> None:
    """Refuse, on every rank and before any collective, a world that a launcher outside Lightning (torchrun, srun)
    made with another number of processes than the trainer's ``devices x num_nodes`` (Lightning says the same inside
    two tracebacks); the message names both and the settings that agree."""
    if not environment.creates_processes_externally or environment.world_size() == devices * num_nodes:
        return
    launcher = {"TorchElasticEnvironment": "torchrun", "SLURMEnvironment": "srun"}.get(
        type(environment).__name__, type(environment).__name__)
    per_node = os.environ.get("LOCAL_WORLD_SIZE")
    agree = (f" (--trainer.devices={per_node} --trainer.num_nodes={environment.world_size() // int(per_node)})"
             if per_node and per_node.isdigit() and int(per_node) > 0 else "")
    raise said_by_every_rank(FPDTError(
        f"{PREFIX}{launcher} started {environment.world_size()} processes, but the trainer asks for devices={devices}"
        f" x num_nodes={num_nodes} = {devices * num_nodes}. Set trainer.devices to the processes per node and"
        f" trainer.num_nodes to the nodes{agree}, or start {devices * num_nodes} processes."))


class CheckedScriptLauncher(_SubprocessScriptLauncher):
    """Lightning's ``popen`` launcher, which first makes :func:`refuse_before_launch`'s refusals: under it the
    launching process is rank 0 and starts the other ranks' scripts (unless a launcher such as torchrun made them)."""

    def __init__(self, strategy: Any) -> None:
        super().__init__(strategy.cluster_environment, strategy.num_processes, strategy.num_nodes)
        self._strategy = strategy

    @override
    def launch(self, function: Any, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        check_external_world(self.cluster_environment, self.num_processes, self.num_nodes)
        refuse_before_launch(self._strategy)
        return super().launch(function, *args, trainer=trainer, **kwargs)


def fpdt_launcher(strategy: Any, start_method: str) -> CheckedScriptLauncher | ShardAwareLauncher:
    """The launcher of ``FPDTStrategy`` for a ``start_method``, as ``DDPStrategy`` chooses Lightning's:
    :class:`CheckedScriptLauncher` for ``"popen"``, :class:`ShardAwareLauncher` for the others."""
    if start_method == "popen":
        return CheckedScriptLauncher(strategy)
    return ShardAwareLauncher(strategy, start_method=start_method)


class ShardAwareLauncher(_MultiProcessingLauncher):
    """:class:`_MultiProcessingLauncher` that makes :func:`refuse_before_launch`'s refusals before it starts any
    process, whose result for the parent holds full, not sharded, weights after ``fit`` (gathered on rank 0: with
    ``start_method="fork"``/``"spawn"`` only; ``"popen"`` sends nothing), and whose ranks name a dead peer
    (:func:`explain_peer_failure`) in the error they send to the parent."""

    @override
    def launch(self, function: Any, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        refuse_before_launch(self._strategy)
        return super().launch(function, *args, trainer=trainer, **kwargs)

    @override
    def _wrapping_function(self, process_idx: int, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        try:
            super()._wrapping_function(process_idx, trainer, *args, **kwargs)
        except BaseException as err:
            trainer.strategy.on_exception(err)  # Lightning calls it only in the parent, which has no peers
            raise

    @override
    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> Any:
        module = trainer.lightning_module
        # Lightning sends weights back only after fit: validate/test/predict never gather the whole model
        if not isinstance(module, FSDPModule) or trainer.state.fn != TrainerFn.FITTING:
            return super()._collect_rank_zero_results(trainer, results)
        full = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        module.state_dict = lambda *args, **kwargs: full  # what the base launcher sends to the parent
        try:
            return super()._collect_rank_zero_results(trainer, results)
        finally:
            del module.state_dict
