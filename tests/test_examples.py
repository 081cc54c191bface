"""The CPU examples of the README and docs/data.md run as shipped (a few steps each, from the repository root, so
their relative data and tokenizer paths are the ones a fresh clone has)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from tests.test_cli import ROOT, fpdt_train_forked


@pytest.mark.distributed
@pytest.mark.parametrize("config", ["hf_sft_cpu.yaml", "hf_text_cpu.yaml"])
def test_hugging_face_data_examples_train(config: str, tmp_path: Path) -> None:
    proc = fpdt_train_forked(
        "fit", "--config", str(ROOT / "examples" / "configs" / config), "--trainer.max_steps=5",
        "--trainer.val_check_interval=5", "--trainer.limit_val_batches=1", f"--trainer.default_root_dir={tmp_path}",
        f"--data.init_args.cache_dir={tmp_path / 'cache'}", "--trainer.strategy.init_args.start_method=fork",
        cwd=ROOT,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    losses = {int(m[1]): float(m[2]) for m in re.finditer(r"step +(\d+) +loss ([-\w.]+)", out)}
    assert set(losses) >= {5} and all(math.isfinite(v) for v in losses.values()), out[-4000:]
    assert re.search(r"val/loss +[0-9.]+", out), out[-4000:]
