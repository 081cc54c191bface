"""The launcher of the tests and benchmarks (lightning_fpdt.testing): results in rank order, a failed rank named,
nothing left running after a failure, a timeout or a killed script."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_fpdt.testing import FAILURE_GRACE_S, RankFailed, free_port, run_in_fork, run_on_ranks

pytestmark = pytest.mark.distributed  # every test here starts processes


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed but not reaped by its new parent, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def _sum_of_ranks(rank: int, world: int, base: torch.Tensor) -> tuple[int, torch.Tensor]:
    total = base + rank
    dist.all_reduce(total)
    print(f"rank {rank} of {world} says hello", flush=True)
    return rank, total


def test_results_come_back_in_rank_order_with_the_output_captured(capfd) -> None:
    results = run_on_ranks(_sum_of_ranks, 3, torch.tensor([1.0, 2.0], dtype=torch.float64))
    assert [r for r, _ in results] == [0, 1, 2]
    for _, total in results:
        assert torch.equal(total, torch.tensor([6.0, 9.0], dtype=torch.float64))  # 3 * base + 0 + 1 + 2
    out = capfd.readouterr().out
    assert all(f"rank {r} of 3 says hello" in out for r in range(3)), out


def _one_rank_raises(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 refuses")
    dist.barrier()  # never completes: rank 1 is gone


def test_an_exception_names_its_rank_and_ends_the_others_quickly() -> None:
    began = time.monotonic()
    with pytest.raises(RankFailed, match=r"(?s)^rank 1 failed:\n.*ValueError: rank 1 refuses") as info:
        run_on_ranks(_one_rank_raises, 2, timeout=60)
    assert info.value.rank == 1 and info.value.exit_code == 1
    assert time.monotonic() - began < 30  # not the timeout: rank 0 ended within the grace period


def _one_rank_dies(rank: int, world: int, pid_dir: str) -> None:
    Path(pid_dir, str(rank)).write_text(str(os.getpid()))
    if rank == 0:
        os._exit(75)  # as a benchmark rank that ran out of memory
    dist.all_reduce(torch.ones(1))  # rank 0 never joins: gloo raises, or the launcher kills this rank


def test_a_rank_that_died_is_reported_before_the_ranks_it_left_behind(tmp_path: Path) -> None:
    with pytest.raises(RankFailed, match=r"^rank 0 died without a result \(exit code 75\)") as info:
        run_on_ranks(_one_rank_dies, 2, str(tmp_path))
    assert info.value.rank == 0 and info.value.exit_code == 75
    assert not any(_alive(int(p.read_text())) for p in tmp_path.iterdir())


def _hang(rank: int, world: int, pid_dir: str) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    Path(pid_dir, f"{rank}-child").write_text(str(child.pid))
    Path(pid_dir, str(rank)).write_text(str(os.getpid()))
    time.sleep(120)


def test_a_timeout_kills_every_rank_and_what_it_started(tmp_path: Path) -> None:
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[0, 1\] did not finish within 3s \(a hang\?\)"):
        run_on_ranks(_hang, 2, str(tmp_path), timeout=3)
    pids = [int(p.read_text()) for p in tmp_path.iterdir()]
    assert len(pids) == 4  # both ranks and their children had started
    deadline = time.monotonic() + FAILURE_GRACE_S
    while any(map(_alive, pids)) and time.monotonic() < deadline:  # the orphans' new parent reaps them
        time.sleep(0.05)
    assert not any(map(_alive, pids)), [p for p in pids if _alive(p)]


def test_free_port_is_bindable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))


def _script(pid_file: str) -> None:
    print("to stdout")
    logging.getLogger("lightning_fpdt").warning("a logged warning")
    warnings.warn("a Python warning", UserWarning, stacklevel=1)
    if pid_file:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        Path(pid_file).write_text(str(child.pid))
        time.sleep(120)
    sys.exit("the script's last words")


def test_run_in_fork_reports_as_a_script_run() -> None:
    logging.getLogger("lightning_fpdt").addHandler(handler := logging.StreamHandler())
    try:
        proc = run_in_fork(lambda: _script(""), ["script.py"], timeout=60)
    finally:
        logging.getLogger("lightning_fpdt").removeHandler(handler)
    assert proc.returncode == 1 and proc.args == ["script.py"]
    assert proc.stdout == "to stdout\n"
    assert "a logged warning" in proc.stderr and "UserWarning: a Python warning" in proc.stderr
    assert proc.stderr.endswith("the script's last words\n"), proc.stderr


def _fork_launch_allowed() -> None:
    from lightning.fabric.strategies.launchers.multiprocessing import _check_bad_cuda_fork

    _check_bad_cuda_fork()  # what Lightning's fork launcher runs first; raises in a process CUDA was poisoned for


def test_a_fork_after_an_in_process_trainer_can_still_launch_ranks_by_fork() -> None:
    """Constructing a Trainer asks how many GPUs there are; on a CUDA build of torch without a driver that question
    marked every later fork as unable to use CUDA, and each test that forks a run with Lightning's fork launcher
    failed (seen on torch 2.15.0+cu132; tests/conftest.py sets the device count's rules). On a CPU build of torch
    it holds whatever the settings."""
    import lightning as L

    L.Trainer(accelerator="auto", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False)
    torch.cuda.is_available()
    proc = run_in_fork(_fork_launch_allowed, ["fork-launch"], timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_run_in_fork_survives_a_handler_on_a_closed_stream(tmp_path: Path) -> None:
    """A logging handler left on a stream that is closed by now (an earlier test's capture) is redirected, not
    flushed: flushing it raised before the script ran, an exit status 1 with nothing in its output."""
    closed = open(tmp_path / "gone", "w")
    closed.close()
    logging.getLogger("lightning_fpdt").addHandler(handler := logging.StreamHandler(closed))
    try:
        proc = run_in_fork(lambda: _script(""), ["script.py"], timeout=60)
    finally:
        logging.getLogger("lightning_fpdt").removeHandler(handler)
    assert proc.returncode == 1 and "a logged warning" in proc.stderr, proc.stderr


def test_run_in_fork_timeout_kills_the_session(tmp_path: Path) -> None:
    pid_file = tmp_path / "child"
    with pytest.raises(subprocess.TimeoutExpired) as info:
        run_in_fork(lambda: _script(str(pid_file)), ["script.py"], timeout=2)
    assert info.value.output == "to stdout\n"
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + FAILURE_GRACE_S
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)


def test_a_forked_run_finds_its_own_rendezvous(monkeypatch) -> None:
    """An earlier run in this process left MASTER_PORT (whose TCPStore may still listen here): a forked run does
    not inherit it, as a fresh script would not."""
    monkeypatch.setenv("MASTER_PORT", "12345")
    monkeypatch.setenv("WORLD_SIZE", "7")
    proc = run_in_fork(lambda: print(os.environ.get("MASTER_PORT"), os.environ.get("WORLD_SIZE")), ["env"], 60)
    assert proc.returncode == 0 and proc.stdout.split() == ["None", "None"], proc.stderr
    assert os.environ["MASTER_PORT"] == "12345"  # the parent's own environment is untouched
