"""The CPU examples of the README and docs/data.md run as shipped (a few steps each, from the repository root, so
their relative data and tokenizer paths are the ones a fresh clone has)."""

from __future__ import annotations

import math
import re
import subprocess

import pytest

from tests.test_cli import ROOT, fpdt_train_side_by_side

CONFIGS = ["hf_sft_cpu.yaml", "hf_text_cpu.yaml"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess]:
    """Each example's run, both started together (a run mostly imports, on one core), each with a port of its own."""
    # fresh interpreters, whose second rank the launcher the shipped configs use (popen) starts as a fresh interpreter
    # too: nothing of this process is inherited. Forked from the pytest process (threads and locks of earlier tests:
    # gloo, TCPStore, datasets' tqdm monitor), the CLI deadlocked in 2 of 3 clean-clone suite runs; forked from a CLI
    # process that has tokenized its data, a rank did (23f8d08).
    jobs = {}
    for config in CONFIGS:
        tmp_path = tmp_path_factory.mktemp(config.removesuffix(".yaml"))
        jobs[config] = ([
            "fit", "--config", str(ROOT / "examples" / "configs" / config), "--trainer.max_steps=5",
            "--trainer.val_check_interval=5", "--trainer.limit_val_batches=1", f"--trainer.default_root_dir={tmp_path}",
            f"--data.init_args.cache_dir={tmp_path / 'cache'}",
        ], ROOT)
    return fpdt_train_side_by_side(jobs)


@pytest.mark.distributed
@pytest.mark.parametrize("config", CONFIGS)
def test_hugging_face_data_examples_train(config: str, runs: dict[str, subprocess.CompletedProcess]) -> None:
    proc = runs[config]
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    losses = {int(m[1]): float(m[2]) for m in re.finditer(r"step +(\d+) +loss ([-\w.]+)", out)}
    assert set(losses) >= {5} and all(math.isfinite(v) for v in losses.values()), out[-4000:]
    assert re.search(r"val/loss +[0-9.]+", out), out[-4000:]
