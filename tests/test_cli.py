"""The fpdt-train CLI end to end: TensorBoard scalars, profiler traces, and clear errors."""

from __future__ import annotations

import glob
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "configs" / "tiny_cpu.yaml"


def fpdt_train(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "lightning_fpdt.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _scalars(log_dir: str) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir)
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_fit_logs_to_tensorboard_and_profiles(tmp_path: Path) -> None:
    proc = fpdt_train(
        "fit", "--config", str(TINY), "--trainer.max_steps=8", "--trainer.val_check_interval=8",
        "--trainer.limit_val_batches=1", "--trainer.log_every_n_steps=1", f"--trainer.logger.init_args.save_dir={tmp_path}",
        "--data.init_args.seq_len=256", "--trainer.profiler=pytorch", cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "step     1  loss" in proc.stdout + proc.stderr
    event_dirs = {os.path.dirname(p) for p in glob.glob(str(tmp_path / "tiny_cpu" / "*" / "events.out.tfevents.*"))}
    assert len(event_dirs) == 1, event_dirs
    scalars = _scalars(event_dirs.pop())
    expected = ["train/loss", "train/items_per_sec", "fpdt/seq_len", "fpdt/chunks", "fpdt/offload_bytes_to_host",
                "fpdt/prefetch_wait_s", "fpdt/pipeline_peak_device_mib", "val/loss", "val/answer_accuracy"]
    for tag in expected:
        assert tag in scalars, f"{tag} missing from {sorted(scalars)}"
        assert scalars[tag] and all(math.isfinite(v) for v in scalars[tag]), (tag, scalars[tag])
    assert scalars["fpdt/seq_len"][-1] == 256 and scalars["fpdt/chunks"][-1] == 2
    assert scalars["train/items_per_sec"][-1] > 0
    traces = glob.glob(str(tmp_path / "**" / "*.pt.trace.json"), recursive=True)
    assert traces, f"no profiler traces under {tmp_path}"
    text = "".join(Path(t).read_text() for t in traces)
    for name in ("fpdt/all_to_all", "fpdt/attention_chunk", "fpdt/attention_chunk_backward", "fpdt/loss_tile"):
        assert name in text, f"{name} not in the profiler traces"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--trainer.strategy.init_args.chunk_sise=64"], "chunk_sise"),
        (["--data=lightning_fpdt.data.TokenFileDataModule", "--data.path=/nonexistent.u16"], "no token file at '/nonexistent.u16'"),
    ],
    ids=["unknown-strategy-option", "missing-data-file"],
)
def test_bad_configuration_is_reported(tmp_path: Path, args: list[str], message: str) -> None:
    proc = fpdt_train("fit", "--config", str(TINY), *args, cwd=tmp_path, timeout=120)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr[-3000:]


def test_bad_yaml_is_reported(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  max_steps: [1, 2\n")
    proc = fpdt_train("fit", "--config", str(bad), cwd=tmp_path, timeout=120)
    assert proc.returncode != 0
    assert "bad.yaml' is not valid YAML" in proc.stderr and "line 2" in proc.stderr, proc.stderr[-3000:]


def test_print_config(tmp_path: Path) -> None:
    proc = fpdt_train("fit", "--config", str(TINY), "--print_config", cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "class_path: lightning_fpdt.FPDTStrategy" in proc.stdout and "chunk_size: 128" in proc.stdout


def test_fit_prints_the_memory_estimate_and_resolves_auto_chunks(tmp_path: Path) -> None:
    proc = fpdt_train(
        "fit", "--config", str(TINY), "--trainer.max_steps=1", "--trainer.limit_val_batches=0", "--trainer.logger=false",
        "--trainer.strategy.init_args.chunk_size=auto", "--trainer.strategy.init_args.memory_budget=1.0",
        "--data.init_args.seq_len=256", cwd=tmp_path,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "memory estimate per rank: 0.1M parameters, seq_len 256, batch_size=4" in out
    assert "chunk_size='auto' with a budget of 1.0 GiB per rank picks None" in out
    assert "device peak" in out
    assert "FPDTStrategy: chunk_size='auto' picked None for batches of 4 x 256 tokens" in out
