"""docs/walkthrough.md, run as a user would: every shell command and Python block of the page, in order, from a
directory holding the repository's examples, on 2 CPU processes; then what each step should have left: the
mixture's counts, labels on assistant turns only, the YAML's optimizer and schedule in the checkpoint, last.ckpt,
the export transformers reloads, the evaluation's files and the LoRA adapter peft loads."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml

from lightning_fpdt.data.hf_datamodule import HFDataModule, load_tokenizer
from lightning_fpdt.data.packing import chat_tokens
from lightning_fpdt.data.sources import DataSource, chosen
from lightning_fpdt.testing import RENDEZVOUS_VARIABLES, free_port
from tests.hf.test_hf_mixture import _documents, as_messages_alpaca, as_messages_sharegpt

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "walkthrough.md"
NOT_RUN = ("tensorboard ",)  # a server that runs until stopped


def blocks() -> list[tuple[str, str]]:
    """The page's ``bash`` and ``python`` fenced blocks, in order."""
    return re.findall(r"^```(bash|python)\n(.*?)^```", PAGE.read_text(), flags=re.M | re.S)


def _run(command: list[str], cwd: Path, env: dict[str, str]) -> str:
    proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{shlex.join(command)}\n{output[-4000:]}"
    return output


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_the_walkthrough_runs_as_written(tmp_path: Path) -> None:
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_VARIABLES}
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}", PYTHONPATH=str(ROOT))
    outputs = []
    for lang, text in blocks():
        if lang == "python":
            outputs.append(_run([sys.executable, "-c", text], tmp_path, env))
            continue
        for line in text.replace("\\\n", " ").splitlines():
            if line.strip() and not line.startswith("#") and not line.startswith(NOT_RUN):
                env["MASTER_PORT"] = str(free_port())
                outputs.append(_run(["bash", "-c", line], tmp_path, env))
    assert len(outputs) >= 9, len(outputs)
    # the resume says it skips what the checkpoint trained on; Lightning's warning that it cannot is not shown
    assert sum("resuming inside an epoch: the training loader's first" in o for o in outputs) == 1
    assert not any("dataloader is not resumable" in o for o in outputs)
    fit = next(o for o in outputs if "HFDataModule: mixture:" in o)
    assert ("HFDataModule: mixture: sharegpt.jsonl (sharegpt, train): 90 documents from its 90; alpaca.jsonl"
            " (alpaca, train): 30 documents from its 60") in fit

    # the samples: exactly the chosen rows' conversations, labels on their assistant turns only
    config = yaml.safe_load((ROOT / "examples" / "configs" / "walkthrough_sft.yaml").read_text())
    data_args = {**config["data"]["init_args"], "tokenizer": str(tmp_path / "tiny-chat"),
                 "cache_dir": str(tmp_path / "cache")}
    data_args["mixture"] = [{**m, "path": str(tmp_path / m["path"])} for m in data_args["mixture"]]
    data = HFDataModule(**data_args)
    data.setup("fit")
    rows = {name: [json.loads(line) for line in (tmp_path / "data" / f"{name}.jsonl").read_text().splitlines()]
            for name in ("sharegpt", "alpaca")}
    tokenizer = load_tokenizer(str(tmp_path / "tiny-chat"))
    expected = [chat_tokens(tokenizer, as_messages_sharegpt(rows["sharegpt"][i]))
                for i in chosen(90, DataSource("s"), 0, 0)]
    expected += [chat_tokens(tokenizer, as_messages_alpaca(rows["alpaca"][i]))
                 for i in chosen(60, DataSource("a", samples=30), 0, 1)]
    got = _documents(data, "train") + _documents(data, "val")
    as_key = [(tuple(ids), tuple(labels)) for ids, labels in got]
    assert Counter(as_key) == Counter((tuple(ids), tuple(labels)) for ids, labels in expected)

    # the optimizer and schedule of the YAML, kept in last.ckpt
    run = tmp_path / "runs" / "walkthrough" / "version_0"
    checkpoint = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert checkpoint["hyper_parameters"]["optimizer"]["class_path"] == "torch.optim.Adam"
    assert checkpoint["global_step"] == 20 and "amsgrad" in checkpoint["optimizer_states"][0]["param_groups"][0]
    assert checkpoint["lr_schedulers"][0]["start_factor"] == 0.2

    # what the run and the commands after it left
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (run / "hf").iterdir()}
    assert json.loads((tmp_path / "export" / "walkthrough" / "config.json").read_text())["dtype"] == "bfloat16"
    results = json.loads((run / "evaluation" / "validate-step20" / "results.json").read_text())
    assert results["tasks"]["niah_single_2"]["lengths"] == [512]
    adapter = json.loads((tmp_path / "export" / "adapter" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str((tmp_path / "tiny-chat").resolve()) and adapter["r"] == 8
