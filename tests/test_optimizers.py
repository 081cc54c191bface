"""The optimizer and schedule of a CausalLM: AdamW with warm-up and cosine by default, any torch optimizer and
scheduler by class path (the model's arguments, or fpdt-train's top-level ``optimizer:`` and ``lr_scheduler:``
keys), made on the parameters the strategy set up, kept in the checkpoint and made again on resume."""

from __future__ import annotations

import glob
import math
from pathlib import Path

import pytest
import torch
import yaml

from lightning_fpdt.cli import run
from lightning_fpdt.errors import FPDTError
from lightning_fpdt.models import LlamaConfig, LlamaLM
from lightning_fpdt.models.optimizers import make_optimizers, warmup_cosine

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "configs" / "tiny_cpu.yaml"
ONE_PROCESS = ["--trainer.devices=1", "--trainer.strategy.init_args.sequence_parallel_size=1",
               "--trainer.logger=false", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
               "--trainer.enable_model_summary=false"]


def _model(**kwargs) -> LlamaLM:
    return LlamaLM(LlamaConfig.tiny(vocab_size=64, num_hidden_layers=1), **kwargs)


def test_the_default_is_adamw_with_decay_groups_warmup_and_cosine() -> None:
    module = _model(learning_rate=0.01, weight_decay=0.1, warmup_steps=2, min_lr_ratio=0.1)
    made = module.configure_optimizers()
    optimizer, config = made["optimizer"], made["lr_scheduler"]
    assert isinstance(optimizer, torch.optim.AdamW) and config["interval"] == "step"
    decayed, plain = optimizer.param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    embeddings = {id(p) for name, p in module.named_parameters() if "embed" in name}
    assert all(p.dim() >= 2 and id(p) not in embeddings for p in decayed["params"])
    assert all(p.dim() < 2 or id(p) in embeddings for p in plain["params"]) and embeddings
    factor = warmup_cosine(2, 10, 0.1)
    assert [factor(s) for s in (0, 1, 2)] == [0.5, 1.0, 1.0] and math.isclose(factor(10), 0.1)


def test_any_torch_optimizer_and_scheduler_by_class_path() -> None:
    module = _model(optimizer={"class_path": "torch.optim.SGD", "init_args": {"lr": 0.1, "momentum": 0.9,
                                                                               "weight_decay": 0.01}},
                    lr_scheduler={"class_path": "torch.optim.lr_scheduler.StepLR", "init_args": {"step_size": 3}})
    made = module.configure_optimizers()
    optimizer, scheduler = made["optimizer"], made["lr_scheduler"]["scheduler"]
    assert isinstance(optimizer, torch.optim.SGD) and isinstance(scheduler, torch.optim.lr_scheduler.StepLR)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.01, 0.0]  # norms and embeddings undecayed
    assert [g["lr"] for g in optimizer.param_groups] == [0.1, 0.1] and optimizer.param_groups[0]["momentum"] == 0.9
    only_optimizer = make_optimizers(module, {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.2}}, None,
                                     {}, 4, 0.0, 8)
    assert isinstance(only_optimizer["lr_scheduler"]["scheduler"], torch.optim.lr_scheduler.LambdaLR)
    assert [g["lr"] for g in only_optimizer["optimizer"].param_groups] == [0.05, 0.05]  # the warm-up's first step
    plateau = make_optimizers(module, None, {"class_path": "torch.optim.lr_scheduler.ReduceLROnPlateau"},
                              {"lr": 0.1, "betas": (0.9, 0.95), "weight_decay": 0.0}, 1, 0.1, 8)
    assert plateau["lr_scheduler"]["monitor"] == "train/loss"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"optimizer": "torch.optim.NotAnOptimizer"}, r"optimizer class_path 'torch.optim.NotAnOptimizer' cannot be"),
    ({"optimizer": "torch.nn.Linear"}, r"optimizer class_path 'torch.nn.Linear' is not a Optimizer class"),
    ({"optimizer": {"init_args": {"lr": 1}}}, r"optimizer=\{'init_args': \{'lr': 1\}\} must be a class path"),
    ({"lr_scheduler": {"class_path": "torch.optim.SGD"}}, r"lr_scheduler class_path 'torch.optim.SGD' is not a"),
    ({"optimizer": {"class_path": "torch.optim.SGD", "init_args": [1]}}, r"optimizer.init_args=\[1\] must be"),
])
def test_a_bad_optimizer_or_scheduler_is_refused_at_construction(kwargs: dict, message: str) -> None:
    with pytest.raises(FPDTError, match="LlamaLM: " + message):
        _model(**kwargs)


def _overlay(tmp_path: Path, name: str, optimizer: str, scheduler: str | None) -> str:
    spec = {"optimizer": {"class_path": optimizer, "init_args": {"lr": 0.05}}}
    if scheduler:
        spec["lr_scheduler"] = {"class_path": scheduler, "init_args": {"step_size": 2, "gamma": 0.5}}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def test_fpdt_train_s_optimizer_keys_reach_the_model_and_a_resume(tmp_path: Path, monkeypatch, capsys) -> None:
    """fpdt-train's top-level optimizer and lr_scheduler keys (LightningCLI's own) make the run's optimizer and
    schedule; the checkpoint keeps them, a resume without them makes them again, a resume with another class stops."""
    monkeypatch.chdir(tmp_path)
    sgd = _overlay(tmp_path, "sgd.yaml", "torch.optim.SGD", "torch.optim.lr_scheduler.StepLR")
    cli = run(["fit", "--config", str(TINY), "--config", sgd, "--trainer.max_steps=2",
               f"--trainer.default_root_dir={tmp_path / 'a'}", *ONE_PROCESS])
    optimizer = cli.trainer.optimizers[0]
    assert isinstance(optimizer, torch.optim.SGD)
    assert type(cli.trainer.lr_scheduler_configs[0].scheduler).__name__ == "StepLR"
    assert [g["lr"] for g in optimizer.param_groups] == [0.025, 0.025]  # halved after 2 steps
    checkpoint = glob.glob(str(tmp_path / "a" / "checkpoints" / "*.ckpt"))[0]
    resumed = run(["fit", "--config", str(TINY), "--trainer.max_steps=4", "--ckpt_path", checkpoint,
                   f"--trainer.default_root_dir={tmp_path / 'b'}", *ONE_PROCESS])
    assert isinstance(resumed.trainer.optimizers[0], torch.optim.SGD)
    assert [g["lr"] for g in resumed.trainer.optimizers[0].param_groups] == [0.0125, 0.0125]
    adam = _overlay(tmp_path, "adam.yaml", "torch.optim.Adam", None)
    with pytest.raises(SystemExit, match=r"was trained with optimizer torch.optim.SGD, whose state it holds; the"
                                         r" config gives torch.optim.Adam"):
        run(["fit", "--config", str(TINY), "--config", adam, "--trainer.max_steps=4", "--ckpt_path", checkpoint,
             *ONE_PROCESS])
