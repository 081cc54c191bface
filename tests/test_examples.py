"""The CPU examples of the README and docs/data.md run as shipped (a few steps each, from the repository root, so
their relative data and tokenizer paths are the ones a fresh clone has)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from lightning_fpdt.testing import free_port
from tests.test_cli import ROOT, fpdt_train


@pytest.mark.distributed
@pytest.mark.parametrize("config", ["hf_sft_cpu.yaml", "hf_text_cpu.yaml"])
def test_hugging_face_data_examples_train(config: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a fresh interpreter that spawns its ranks: nothing of this process is inherited. Forked from the pytest
    # process (threads and locks of earlier tests: gloo, TCPStore, datasets' tqdm monitor), the CLI deadlocked
    # in 2 of 3 clean-clone suite runs; forked from a CLI process that has tokenized its data, a rank did (23f8d08).
    # A port of its own: an earlier test's Trainer leaves MASTER_PORT in this process's environment (309573f).
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    proc = fpdt_train(
        "fit", "--config", str(ROOT / "examples" / "configs" / config), "--trainer.max_steps=5",
        "--trainer.val_check_interval=5", "--trainer.limit_val_batches=1", f"--trainer.default_root_dir={tmp_path}",
        f"--data.init_args.cache_dir={tmp_path / 'cache'}", "--trainer.strategy.init_args.start_method=spawn",
        f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}", cwd=ROOT,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    losses = {int(m[1]): float(m[2]) for m in re.finditer(r"step +(\d+) +loss ([-\w.]+)", out)}
    assert set(losses) >= {5} and all(math.isfinite(v) for v in losses.values()), out[-4000:]
    assert re.search(r"val/loss +[0-9.]+", out), out[-4000:]
    run = tmp_path / "runs" / config.removesuffix(".yaml") / "version_0"  # the template ends in files to go on from
    assert (run / "checkpoints" / "last.ckpt").is_file(), sorted(map(str, run.rglob("*")))
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {f.name for f in (run / "hf").iterdir()}
