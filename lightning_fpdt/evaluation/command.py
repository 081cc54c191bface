"""``fpdt-eval``: ``fpdt-train validate`` with the long-context evaluation on (docs/evaluation.md).

    fpdt-eval --config run.yaml --ckpt_path runs/.../last.ckpt --evaluation.tasks=[passkey]

It takes everything ``fpdt-train validate`` takes (the run's config, ``--ckpt_path``, ``--trainer.*``,
``--model.*``, ``--data.*``: the same :class:`~lightning_fpdt.cli.FPDTCLI`, so a checkpoint brings its own
model) and adds :class:`~lightning_fpdt.evaluation.LongContextEvaluation`'s arguments under ``--evaluation.*``.
The evaluation runs once, at the end of the validation, on the run's strategy and processes.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from lightning_fpdt.cli import FPDTCLI, check_config_files, console_main
from lightning_fpdt.errors import FPDTError
from lightning_fpdt.evaluation.callback import LongContextEvaluation
from lightning_fpdt.models import CausalLM


class EvaluationCLI(FPDTCLI):
    """:class:`~lightning_fpdt.cli.FPDTCLI` with :class:`LongContextEvaluation` under the ``evaluation`` key."""

    def add_arguments_to_parser(self, parser: Any) -> None:
        super().add_arguments_to_parser(parser)
        parser.add_lightning_class_args(LongContextEvaluation, "evaluation")

    def before_instantiate_classes(self) -> None:
        """With ``--ckpt_path`` inside a TensorBoard run (``<save_dir>/<name>/<version>/checkpoints/``) and a
        TensorBoard logger of no set version: log into that run, so the evaluation's files, images and scalars sit
        beside its checkpoints and training curves instead of in a new ``version_N``."""
        config = self.config.get("validate", self.config)
        logger, ckpt_path = config.trainer.get("logger"), config.get("ckpt_path")
        if not isinstance(ckpt_path, str) or not _is_tensorboard(logger) or logger.init_args.get("version"):
            return
        checkpoints = Path(ckpt_path).resolve().parent
        if checkpoints.name != "checkpoints" or not list(checkpoints.parent.glob("events.out.tfevents.*")):
            return
        run = checkpoints.parent
        logger.init_args.save_dir, logger.init_args.name, logger.init_args.version = (
            str(run.parent.parent), run.parent.name, run.name)

    def before_validate(self) -> None:
        """Refuse, before any process starts, a run whose validation would not run: the evaluation runs at its end.
        A checkpoint callback's warning that its directory changed since the checkpoint is silenced: a validation
        saves nothing, so the best and last paths it would not reload are never used."""
        warnings.filterwarnings("ignore", message="The dirpath has changed from")
        limit = self.trainer.limit_val_batches
        if limit == 0:
            raise FPDTError(
                f"fpdt-eval: trainer.limit_val_batches={limit} runs no validation, so the evaluation (run at its end)"
                " would never run and nothing would be written; remove limit_val_batches from the config or pass"
                " --trainer.limit_val_batches=1.0."
            )


def _is_tensorboard(logger: Any) -> bool:
    """Whether a parsed ``trainer.logger`` is one TensorBoard logger given by class path."""
    return getattr(logger, "class_path", None) in ("lightning.pytorch.loggers.TensorBoardLogger",
                                                     "lightning.pytorch.loggers.tensorboard.TensorBoardLogger")


def run(args: list[str] | None = None) -> EvaluationCLI:
    """Run ``fpdt-eval`` on ``args`` (default ``sys.argv[1:]``): the ``validate`` subcommand, evaluation on."""
    args = sys.argv[1:] if args is None else list(args)
    check_config_files(args)
    return EvaluationCLI(CausalLM, pl.LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                         save_config_kwargs={"overwrite": True, "config_filename": "evaluation.yaml"},
                         # --help: what this tool does, not what fpdt-train's validate subcommand does
                         parser_kwargs={"validate": {"description": DESCRIPTION}},
                         args=["validate", *args])


DESCRIPTION = ("Long-context evaluation of a trained model: the run's validation with LongContextEvaluation on (its"
               " arguments under --evaluation.*: tasks, lengths, depths, samples per cell), on the run's strategy and"
               " processes; results, heatmaps and curves are written beside the checkpoint's run (docs/evaluation.md)."
               " Example: fpdt-eval --config run.yaml --ckpt_path runs/.../last.ckpt --evaluation.tasks=[passkey]")


def main(args: list[str] | None = None) -> None:
    """The ``fpdt-eval`` console script; the errors of the objects it builds printed as their own last line
    (:func:`~lightning_fpdt.cli.console_main`)."""
    console_main("fpdt-eval", lambda: run(args))


if __name__ == "__main__":
    main()
