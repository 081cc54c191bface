"""``fpdt-train``: the LightningCLI entry point.

    fpdt-train fit --config examples/configs/tiny_cpu.yaml
    fpdt-train validate --config ... --ckpt_path ...
    fpdt-train fit --config ... --print_config

The strategy is given by name (``strategy: fpdt``) or by ``class_path: lightning_fpdt.FPDTStrategy``
with its options; the model and data by ``class_path``.
"""

from __future__ import annotations

import os
import pickle
import re
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import yaml
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.rank_zero import rank_zero_info

import lightning_fpdt  # noqa: F401  (registers the "fpdt" strategy names)
from lightning_fpdt import FPDTStrategy, checkpoint_files
from lightning_fpdt.data import PasskeyDataModule
from lightning_fpdt.memory import ModelShape, report
from lightning_fpdt.models import CausalLM, LlamaLM
from lightning_fpdt.models.from_config import MODEL_DEFAULT


class FPDTCLI(LightningCLI):
    """LightningCLI with the project's models and data modules as defaults."""

    def add_arguments_to_parser(self, parser: Any) -> None:
        # the model key as lightning_fpdt.models.from_config.model_parser builds it (fpdt-export and the memory CLI)
        parser.set_defaults({"model": MODEL_DEFAULT,
                             "data": {"class_path": "lightning_fpdt.data.PasskeyDataModule"}})

    def _parse_ckpt_path(self) -> None:
        """LightningCLI reads the hyperparameters of ``--ckpt_path`` with ``torch.load``; a file it cannot
        read is reported by :func:`lightning_fpdt.checkpoint_files.read` (naming the file and what is wrong), one
        that does not exist here, before any process is launched."""
        ckpt_path = self.config[self.config.subcommand].get("ckpt_path") if self.config.get("subcommand") else None
        if isinstance(ckpt_path, str) and not _names_a_checkpoint_elsewhere(ckpt_path) and not Path(ckpt_path).exists():
            raise SystemExit(
                f"fpdt-train: --ckpt_path {ckpt_path!r} does not exist (no such file or directory). Give the path of"
                " a saved checkpoint (a .ckpt file, or a sharded checkpoint's directory); the newest complete one in"
                " a directory is lightning_fpdt.checkpoint_files.latest_checkpoint(dirpath). Drop --ckpt_path to"
                " start from scratch."
            )
        try:
            super()._parse_ckpt_path()
        except (RuntimeError, EOFError, OSError, pickle.UnpicklingError):
            ckpt_path = self.config[self.config.subcommand].get("ckpt_path")
            checkpoint_files.read(Path(ckpt_path))  # raises CheckpointError with the reason
            raise

    def before_fit(self) -> None:
        """Print the memory estimate of the run (rank 0, before any process is launched or model moved)."""
        table = memory_report(self.model, self.datamodule, self.trainer)
        if table is not None:
            rank_zero_info(table)


def _names_a_checkpoint_elsewhere(ckpt_path: str) -> bool:
    """Lightning's names for checkpoints it finds itself ("last", "best", "hpc", "registry:...") and remote URLs."""
    return ckpt_path in ("last", "best", "hpc", "registry") or ckpt_path.startswith("registry:") or "://" in ckpt_path


def memory_report(model: pl.LightningModule, datamodule: Any, trainer: pl.Trainer) -> str | None:
    """:func:`lightning_fpdt.memory.report` for this model, the data module's ``seq_len`` and
    ``batch_size`` and an :class:`FPDTStrategy`; ``None`` when one of them is missing (a custom model
    the memory model cannot read, a data module without ``seq_len``, another strategy)."""

    seq_len = getattr(datamodule, "seq_len", None)
    if not isinstance(trainer.strategy, FPDTStrategy) or not isinstance(seq_len, int):
        return None
    try:
        shape, tiling = ModelShape.from_module(model)
    except ValueError:
        return None
    strategy = trainer.strategy
    options = strategy.estimate_options.replace(batch_size=getattr(datamodule, "batch_size", 1),
                                                precision=str(trainer.precision), **tiling)
    try:
        return report(shape, seq_len, options, budget_gib=strategy.options.memory_budget)
    except ValueError as err:  # nothing fits the budget: the strategy raises the same at the first batch
        return f"memory estimate: {err}"


def check_config_files(args: list[str]) -> None:
    """Fail with the file's name when a ``--config`` file is missing or is not valid YAML.

    jsonargparse reports YAML errors without saying which file they come from.
    """
    paths = [a.split("=", 1)[1] for a in args if a.startswith("--config=")]
    paths += [args[i + 1] for i, a in enumerate(args[:-1]) if a in ("--config", "-c")]
    for path in paths:
        if not os.path.isfile(path):
            raise SystemExit(f"fpdt-train: config file {path!r} does not exist.")
        try:
            with open(path) as f:
                yaml.safe_load(f)
        except yaml.YAMLError as err:
            raise SystemExit(f"fpdt-train: {path!r} is not valid YAML: {err}") from None


def run(args: list[str] | None = None) -> FPDTCLI:
    """Run the CLI (``args`` defaults to ``sys.argv[1:]``) and return it."""
    check_config_files(sys.argv[1:] if args is None else args)
    return FPDTCLI(
        CausalLM,
        pl.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
    )


# messages of this package's classes start with the class (or command) name
_OWN_ERROR = re.compile(r"^(FPDTStrategy|fpdt-train|[A-Za-z]*Config|[A-Za-z]*DataModule|[A-Za-z]*LM|shard_batch): ")


def own_message(err: BaseException) -> str | None:
    """The message a user must read in an error raised while the CLI builds its objects: a strategy's or
    model's own ``ValueError``/``TypeError`` (jsonargparse wraps those in a usage dump and, for the
    strategy's ``str | Strategy`` type, in a list of the union's subtypes); ``None`` for other errors."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        text = str(err)
        if "Does not validate against any of the Union subtypes" in text:
            reasons = [line.strip()[2:] for line in text.splitlines()
                       if line.strip().startswith("- ") and not line.strip().startswith("- Expected a")]
            if reasons:
                return reasons[-1]
        for line in text.splitlines():
            if _OWN_ERROR.match(line.strip()):
                return line.strip()
        err = err.__cause__ or err.__context__
    return None


def main() -> None:
    """The ``fpdt-train`` console script: LightningCLI on ``sys.argv``, with the errors of the objects it
    builds (strategy, model, data) printed as their own last line instead of behind a usage dump."""
    try:
        run()
    except (ValueError, TypeError) as err:
        message = own_message(err)
        if message is None:
            raise
        raise SystemExit(f"fpdt-train: error: {message}") from None


__all__ = ["FPDTCLI", "LlamaLM", "PasskeyDataModule", "main", "run"]

if __name__ == "__main__":
    main()
