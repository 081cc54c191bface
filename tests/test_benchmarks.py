"""The benchmark scripts run (tiny sizes), so they cannot rot. Their figures are not asserted here:
speed and memory are measured by the benchmarks themselves, not by timed unit tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], capture_output=True, text=True,
                          timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def test_offload_gpu_cpu_smoke() -> None:
    out = _run("offload_gpu.py", "--cpu", "--repeats", "1")
    assert "offload bitwise equal=True" in out and ": ok" in out
    assert "| 512 " in out  # the table has a row for the longest smoke length


def test_attention_benchmark_smoke() -> None:
    out = _run("attention.py", "--seq", "256", "--chunks", "2", "--repeats", "1", "--hidden", "64", "--heads", "4")
    assert "| 256 | fpdt x2 |" in out.replace("  ", " ") or "fpdt x2" in out


def test_training_benchmark_smoke() -> None:
    out = _run("training.py", "--seq", "128", "256", "--hidden", "64", "--heads", "4", "--layers", "1",
               "--vocab", "256", "--repeats", "1", "--variants", "single", "fpdt_full", "--find-longest",
               "--longest-limit", "512")
    assert "correctness on CPU" in out
    for variant in ("single", "fpdt_full"):
        assert f"| {variant}" in out
    assert "| fpdt_full | 2     | 512 " in out  # the longest-sequence search reached its limit
