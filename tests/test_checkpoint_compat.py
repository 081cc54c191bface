"""A checkpoint written before the package's modules moved into folders (issue 41) loads after it.

``tests/data/checkpoint_before_the_move.ckpt`` was written by the code at commit 8458161 (``tests/data/
make_checkpoint.py`` says how). It names its model by the public path (``lightning_fpdt.models.LlamaLM``) and holds
no object of the package (it loads with ``weights_only=True``); here its class is found again from its
hyper-parameters, and a ``Trainer.fit`` resumed from it restores the model's weights and optimizer state exactly.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_fpdt import FPDTStrategy
from lightning_fpdt.errors import FPDTError
from lightning_fpdt.models import GPTLM, LlamaLM
from lightning_fpdt.models.class_paths import check_saved_class
from lightning_fpdt.models.from_config import module_from_hyperparameters, saved_class
from tests.helpers import TokenDataset

OLD = Path(__file__).resolve().parent / "data" / "checkpoint_before_the_move.ckpt"


class Capture(L.Callback):
    """The model's state and the optimizer's number of parameter states as the first resumed step starts, and the
    step the fit ended at, written to ``out/restored.pt``."""

    def __init__(self, out: Path) -> None:
        self.out, self.restored = out, {}

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: object) -> None:
        if not self.restored:
            self.restored = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
            self.restored["_steps"] = torch.tensor(len(trainer.optimizers[0].state))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        torch.save({**self.restored, "_global_step": torch.tensor(trainer.global_step)}, self.out / "restored.pt")


def test_a_checkpoint_from_before_the_move_names_a_class_that_still_resolves() -> None:
    checkpoint = torch.load(OLD, map_location="cpu", weights_only=True)  # no object of the package inside
    assert checkpoint["hyper_parameters"]["_class_path"] == "lightning_fpdt.models.LlamaLM"
    assert saved_class(checkpoint["hyper_parameters"]) is LlamaLM
    assert isinstance(module_from_hyperparameters(checkpoint["hyper_parameters"]), LlamaLM)


def test_a_fit_resumes_from_a_checkpoint_from_before_the_move(tmp_path: Path) -> None:
    checkpoint = torch.load(OLD, map_location="cpu", weights_only=True)
    module = module_from_hyperparameters(checkpoint["hyper_parameters"])
    # a forked rank (the house's way to fit in a test: no launcher thread or process group left in pytest's process);
    # it writes what it restored, and the step it reached, to a file
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path,
                        strategy=FPDTStrategy(chunk_size=8, start_method="fork"), callbacks=[Capture(tmp_path)])
    trainer.fit(module, DataLoader(TokenDataset(2, 16, 32, seed=1), batch_size=2), ckpt_path=str(OLD))
    restored = torch.load(tmp_path / "restored.pt")
    assert int(restored["_global_step"]) == 2  # one step after the checkpoint's
    for name, value in checkpoint["state_dict"].items():
        assert torch.equal(restored[name], value), name
    assert int(restored["_steps"]) == len(checkpoint["optimizer_states"][0]["state"]) > 0


def test_load_from_checkpoint_takes_the_class_the_checkpoint_names() -> None:
    """Lightning's ``load_from_checkpoint`` hands the saved hyper-parameters back to the class, ``_class_path`` (which
    fpdt-train reads) included: it rebuilds the checkpoint's class with its weights, and another class is refused
    naming the checkpoint's (it failed with "unexpected keyword argument '_class_path'" for every bundled model)."""
    checkpoint = torch.load(OLD, map_location="cpu", weights_only=True)
    module = LlamaLM.load_from_checkpoint(OLD)
    assert type(module) is LlamaLM
    for name, value in checkpoint["state_dict"].items():
        assert torch.equal(module.state_dict()[name], value), name
    with pytest.raises(FPDTError, match=r"GPTLM: the checkpoint holds a lightning_fpdt.models.LlamaLM; load it with"
                                        r" that class \(LlamaLM.load_from_checkpoint\)"):
        GPTLM.load_from_checkpoint(OLD)
    check_saved_class("torch.distributed.fsdp.FSDPModule", LlamaLM)  # an older save's FSDP2 mixin: no LightningModule
    check_saved_class("no.such.Module", LlamaLM)  # a class that moved away: not held against it
