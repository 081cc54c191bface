"""The most common long-context workflow end to end: a local Llama checkpoint fine-tuned through ``fpdt-train`` at 4x
its context with a YaRN schedule, exported with ``fpdt-export ... --config`` (the run's saved YAML), and loaded
by plain transformers, which gives the trained module's logits at a length beyond the original maximum; for
``HFCausalLM`` (``config_overrides`` with ``rope_parameters``) and ``LlamaLM(hf_checkpoint=...)``
(``config_overrides`` with ``rope_scaling``). The export's ``config.json`` holds the schedule the run trained
with (YaRN, its factor and original context) and the new ``max_position_embeddings``."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

transformers = pytest.importorskip("transformers")

from lightning_fpdt.export import main as export_main  # noqa: E402
from lightning_fpdt.models.from_config import module_from_hyperparameters  # noqa: E402
from tests.reference import rel_error  # noqa: E402
from tests.test_cli import ROOT, fpdt_train_side_by_side  # noqa: E402

pytestmark = pytest.mark.distributed  # the fine-tune forks 2 ranks

ORIGINAL = 64  # the checkpoint's max_position_embeddings
FACTOR = 4
LENGTH = 192  # beyond the original context, inside the extended one
YARN = {"rope_type": "yarn", "factor": float(FACTOR)}
OVERRIDES = {  # per LightningModule: HFCausalLM takes transformers' names, LlamaLM its config's
    "hf": {"rope_parameters": YARN, "max_position_embeddings": FACTOR * ORIGINAL},
    "llama": {"rope_scaling": {**YARN, "original_max_position_embeddings": ORIGINAL},
              "max_position_embeddings": FACTOR * ORIGINAL},
}


def _checkpoint(directory: Path) -> Path:
    torch.manual_seed(7)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=ORIGINAL,
                                      tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # weights of std ~1/sqrt(fan_in): a wrong schedule cannot hide in small logits
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, p.shape[1] ** -0.5)
    model.save_pretrained(directory)
    return directory


def _run_yaml(tmp_path: Path, kind: str, checkpoint: Path) -> Path:
    """An ``fpdt-train`` YAML over hf_tiny_cpu.yaml: the local checkpoint with the YaRN overrides, 256-token
    samples at sp=2 in 32-token chunks, a ``last.ckpt`` at the end."""
    document = yaml.safe_load((ROOT / "examples" / "configs" / "hf_tiny_cpu.yaml").read_text())
    if kind == "hf":
        document["model"]["init_args"].update(model=str(checkpoint), config_overrides=OVERRIDES["hf"])
    else:
        document["model"] = {"class_path": "lightning_fpdt.models.LlamaLM",
                             "init_args": {"hf_checkpoint": str(checkpoint), "config_overrides": OVERRIDES["llama"],
                                           "learning_rate": 3e-3, "warmup_steps": 1}}
    trainer = document["trainer"]
    # spawned from a fresh interpreter: no rank forked from a process with threads (tests/test_examples.py says what
    # hung when one was)
    trainer["strategy"]["init_args"].update(chunk_size=32, start_method="spawn")
    trainer.update(max_steps=3, limit_val_batches=0, default_root_dir=str(tmp_path / "run"),
                   enable_checkpointing=True, logger=False)  # the template's HFExport writes to run/hf
    trainer["callbacks"] = [c for c in trainer["callbacks"] if not c["class_path"].endswith(".ModelCheckpoint")]
    trainer["callbacks"].append({"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                                 "init_args": {"dirpath": str(tmp_path / "ckpt"), "save_last": True}})
    document["data"]["init_args"].update(seq_len=FACTOR * ORIGINAL, batch_size=2)
    path = tmp_path / "fit.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


@pytest.fixture(scope="module")
def fine_tunes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path, subprocess.CompletedProcess]]:
    """Per LightningModule: its directory, the local checkpoint and the ``fpdt-train`` run fine-tuning it; both runs
    started together (a run mostly imports, on one core)."""
    jobs, made = {}, {}
    for kind in OVERRIDES:
        tmp_path = tmp_path_factory.mktemp(f"context_extension_{kind}")
        made[kind] = (tmp_path, _checkpoint(tmp_path / "tiny-llama"))
        jobs[kind] = (["fit", "--config", str(_run_yaml(tmp_path, kind, made[kind][1]))], tmp_path)
    runs = fpdt_train_side_by_side(jobs)
    return {kind: (*made[kind], runs[kind]) for kind in OVERRIDES}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["hf", "llama"])
def test_a_context_extended_fine_tune_exports_with_its_schedule(
    kind: str, fresh_seed: int, fine_tunes: dict[str, tuple[Path, Path, subprocess.CompletedProcess]],
) -> None:
    tmp_path, checkpoint, proc = fine_tunes[kind]
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    saved_yaml, last = tmp_path / "run" / "config.yaml", tmp_path / "ckpt" / "last.ckpt"
    assert saved_yaml.is_file() and last.is_file()

    out = tmp_path / "export"
    export_main([str(last), str(out), "--config", str(saved_yaml)])
    exported = json.loads((out / "config.json").read_text())
    assert exported["max_position_embeddings"] == FACTOR * ORIGINAL
    rope = exported["rope_parameters"]
    assert (rope["rope_type"], rope["factor"], rope["original_max_position_embeddings"]) == ("yarn", FACTOR, ORIGINAL)

    # the trained module, rebuilt from its checkpoint in this process (one rank: every position), and the export
    state = torch.load(last, weights_only=True)
    trained = module_from_hyperparameters(state["hyper_parameters"])
    trained.load_state_dict(state["state_dict"])
    trained.eval()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (1, LENGTH))
    with torch.no_grad():
        theirs = reloaded(input_ids=ids).logits
        ours = trained(ids)
    assert theirs.shape == ours.shape == (1, LENGTH, 256)
    assert rel_error(ours, theirs) <= 1e-6
    # the schedule matters at this length: the original one gives other logits
    with torch.no_grad():
        unscaled = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
        unscaled.load_state_dict(reloaded.state_dict())
        assert rel_error(unscaled(input_ids=ids).logits, theirs) > 1e-3
