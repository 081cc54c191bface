"""Every refusal said once: the console scripts print the package's own errors as one last line, from global rank 0
when every rank makes the refusal alike (the others quiet, with the same exit status), a lost peer as one line
instead of a traceback, and torchrun's world against the trainer's as one line in the workers and in torchrun's
failure summary (issue 45, items 5 and 9)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lightning_fpdt.cli import console_main
from lightning_fpdt.errors import FPDTError, Unsupported, WrongType, is_said_by_every_rank, said_by_every_rank
from lightning_fpdt.testing import RENDEZVOUS_VARIABLES, free_port

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "configs" / "tiny_cpu.yaml"


def _console(error: BaseException, rank: int, monkeypatch: pytest.MonkeyPatch) -> SystemExit:
    monkeypatch.setattr(rank_zero_only, "rank", rank)

    def run() -> None:
        raise error

    with pytest.raises(SystemExit) as stopped:
        console_main("fpdt-train", run)
    return stopped.value


def test_the_package_s_errors_share_one_base_and_keep_their_builtin_kinds() -> None:
    from lightning_fpdt.checkpoints.files import CheckpointError
    from lightning_fpdt.data.packing import DataError

    for kind in (CheckpointError, DataError, Unsupported, WrongType):
        assert issubclass(kind, FPDTError) and issubclass(kind, ValueError), kind
    assert issubclass(Unsupported, NotImplementedError) and issubclass(WrongType, TypeError)


def test_a_refusal_every_rank_makes_is_printed_by_rank_zero_only(monkeypatch: pytest.MonkeyPatch) -> None:
    refusal = "FPDTStrategy: sequence_parallel_size=3 does not divide the world size 2"
    assert _console(said_by_every_rank(FPDTError(refusal)), 0, monkeypatch).code == f"fpdt-train: error: {refusal}"
    assert _console(said_by_every_rank(FPDTError(refusal)), 1, monkeypatch).code == 1  # quiet, the same status
    # a refusal not known to be every rank's (a batch seen by one rank): each rank says its own
    assert _console(FPDTError(refusal), 1, monkeypatch).code == f"fpdt-train: error: {refusal}"
    lost = RuntimeError("FPDTStrategy: rank 1 lost a peer: the process of rank 0 (pid 7, killed by SIGKILL) died")
    assert _console(lost, 1, monkeypatch).code == f"fpdt-train: error: {lost}"
    assert not is_said_by_every_rank(lost)
    monkeypatch.setattr(rank_zero_only, "rank", 0)
    with pytest.raises(RuntimeError, match="a bug"):  # not the package's words: the traceback stays
        console_main("fpdt-train", lambda: (_ for _ in ()).throw(RuntimeError("a bug")))


def _environment(**variables: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_VARIABLES}
    return {**env, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore", "MASTER_PORT": str(free_port()), **variables}


def _own_lines(text: str, program: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(f"{program}: error:")]


@pytest.mark.distributed
def test_a_setup_refusal_of_two_ranks_is_one_line(tmp_path: Path) -> None:
    """fpdt-eval at 2 processes with a task name that does not exist: refused where the evaluation is set up on
    each rank, printed once."""
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_fpdt.evaluation", "--config", str(TINY), "--trainer.logger=false",
         "--evaluation.tasks=[niah_single]", "--evaluation.lengths=[300]"],
        cwd=tmp_path, env=_environment(), capture_output=True, text=True, timeout=200)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output[-3000:]
    assert _own_lines(output, "fpdt-eval") == [
        "fpdt-eval: error: LongContextEvaluation: unknown task 'niah_single'; use one of passkey, niah_single_1,"
        " niah_single_2, niah_single_3, niah_multikey_1, niah_multikey_2, niah_multikey_3, niah_multivalue,"
        " niah_multiquery, or a task object."], output[-3000:]
    assert "Traceback" not in output, output[-3000:]


@pytest.mark.distributed
def test_a_batch_every_rank_refuses_alike_is_one_line(tmp_path: Path) -> None:
    """fpdt-train at 2 processes with chunk_size='auto' and a budget nothing fits: both ranks refuse the same first
    batch for the same reason, printed once (it was printed by each rank, the lines now and then run together)."""
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_fpdt.cli", "fit", "--config", str(TINY), "--trainer.logger=false",
         "--trainer.max_steps=1", "--trainer.strategy.init_args.chunk_size=auto",
         "--trainer.strategy.init_args.memory_budget=0.0001"],
        cwd=tmp_path, env=_environment(), capture_output=True, text=True, timeout=200)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output[-3000:]
    lines = _own_lines(output, "fpdt-train")
    assert len(lines) == 1, output[-3000:]
    assert "chunk_size='auto': nothing fits a budget of 105 KiB per rank" in lines[0], output[-3000:]


@pytest.mark.distributed
def test_a_peer_killed_under_ring_and_streaming_is_one_line(tmp_path: Path) -> None:
    """Rank 1 of fpdt-train (ring of 2, streamed layers with checkpoints kept on the host) is SIGKILLed at its
    second batch: rank 0 says which rank died in one last line, with no traceback before it."""
    overlay = tmp_path / "killed.yaml"
    overlay.write_text(yaml.safe_dump({"trainer": {
        "max_steps": 4, "logger": False, "enable_checkpointing": False, "val_check_interval": None,
        "limit_val_batches": 0,
        "callbacks": [{"class_path": "tests.helpers.KillRank", "init_args": {"rank": 1, "batch": 1}}],
        "strategy": {"class_path": "lightning_fpdt.FPDTStrategy", "init_args": {
            "sequence_parallel_size": 2, "ring_size": 2, "chunk_size": 64, "activation_checkpointing": True,
            "offload_checkpoints": "emulate"}}}}))
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "lightning_fpdt.cli", "fit", "--config", str(TINY), "--config",
                           str(overlay)], cwd=tmp_path, env=_environment(), capture_output=True, text=True,
                          timeout=200)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output[-3000:]
    lines = _own_lines(output, "fpdt-train")
    assert len(lines) == 1 and lines[0].startswith(
        "fpdt-train: error: FPDTStrategy: rank 0 lost a peer: the process of rank 1 (pid"), output[-3000:]
    assert "killed by SIGKILL" in lines[0] and output.rstrip().endswith(lines[0].rstrip())
    assert "Traceback" not in output, output[-3000:]
    assert time.monotonic() - start < 120


@pytest.mark.distributed
@pytest.mark.skipif(shutil.which("torchrun") is None and not (Path(sys.executable).parent / "torchrun").exists(),
                    reason="torchrun is not installed beside this interpreter")
def test_torchrun_s_world_against_the_trainer_s_is_one_line(tmp_path: Path) -> None:
    """torchrun starts 2 processes for a trainer of devices=4: one line from rank 0, before any collective, and the
    same line in torchrun's failure summary (from each worker's error file), not the workers' tracebacks."""
    torchrun = Path(sys.executable).parent / "torchrun"
    proc = subprocess.run(
        [str(torchrun if torchrun.exists() else "torchrun"), "--nproc-per-node=2", "-m", "lightning_fpdt.cli", "fit",
         "--config", str(TINY), "--trainer.devices=4", "--trainer.max_steps=1", "--trainer.logger=false"],
        cwd=tmp_path, env=_environment(), capture_output=True, text=True, timeout=200)
    output = proc.stdout + proc.stderr
    want = ("fpdt-train: error: FPDTStrategy: torchrun started 2 processes, but the trainer asks for devices=4 x"
            " num_nodes=1 = 4. Set trainer.devices to the processes per node and trainer.num_nodes to the nodes"
            " (--trainer.devices=2 --trainer.num_nodes=1), or start 4 processes.")
    assert proc.returncode == 1, output[-3000:]
    assert _own_lines(output, "fpdt-train") == [want], output[-3000:]
    assert f"traceback : {want}" in output, output[-3000:]  # torchrun's summary reads the error files
    assert "lightning_fpdt/" not in output, output[-3000:]  # no frame of the workers


def test_the_torchrun_error_file_holds_the_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    code = _console(said_by_every_rank(FPDTError("FPDTStrategy: no")), 1, monkeypatch).code
    assert code == 1
    record = json.loads(error_file.read_text())["message"]
    assert record["message"] == record["extraInfo"]["py_callstack"] == "fpdt-train: error: FPDTStrategy: no"


@pytest.mark.distributed
def test_the_quick_start_s_console_holds_no_warning_and_shows_progress(tmp_path: Path) -> None:
    """The quick start (2 processes, warnings on): no warning, deprecation or advertisement on the console, the
    progress bar with the loss and the tokens per second, and last.ckpt written."""
    env = _environment()
    env.pop("PYTHONWARNINGS")
    proc = subprocess.run([sys.executable, "-m", "lightning_fpdt.cli", "fit", "--config", str(TINY),
                           "--trainer.max_steps=6", "--trainer.val_check_interval=6", "--trainer.limit_val_batches=1",
                           "--trainer.logger.init_args.save_dir=runs"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=200)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    noise = [line for line in output.replace("\r", "\n").splitlines()
             if re.search(r"warn|deprecat|\N{ELECTRIC LIGHT BULB}|Tip:|Total FLOPs|Traceback", line, re.IGNORECASE)]
    assert not noise, noise
    bar = output.replace("\r", "\n")  # Lightning's bar (rich's where it is installed, else tqdm's)
    assert re.search(r"Epoch 0\b.*it/s", bar) and re.search(r"train/loss[:=] ?[0-9.]+", bar), output[-3000:]
    assert re.search(r"tok/s[:=] ?[0-9.e+]+", bar), output[-3000:]
    assert (tmp_path / "runs" / "tiny_cpu" / "version_0" / "checkpoints" / "last.ckpt").is_file()
