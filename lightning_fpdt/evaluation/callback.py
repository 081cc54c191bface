"""``LongContextEvaluation``: the long-context evaluation at the end of every validation, in ``fit`` and ``validate``.

Contract: at ``on_validation_epoch_end`` (not in the sanity check) every rank runs
:func:`~lightning_fpdt.evaluation.evaluate.evaluate` through the trainer's strategy (under ``FPDTStrategy``:
sequence-parallel, chunked, offloaded, no gradients), at the lengths given or the data module's training length;
then it logs and writes:

- scalars ``eval/<task>/exact_match``, ``eval/<task>/log_likelihood`` and, with held-out documents,
  ``eval/position_loss/first`` and ``.../last`` (the first and last bucket's mean loss), through ``pl_module.log``;
- images (rank zero, every logger whose experiment has ``add_image``: TensorBoard's): ``eval/<task>/heatmap``
  (exact match by depth and length) and ``eval/position_loss`` (the loss-by-position curve);
- files (rank zero) in ``<output_dir>/<stage>-step<N>/`` (``N``: the trainer's global step in ``fit``, the
  checkpoint's in ``validate``): :meth:`EvaluationResult.write`'s JSON and CSV files and
  the images as PNG (``<task>_heatmap.png``, ``position_loss.png``).

The last result is kept on every rank as :attr:`LongContextEvaluation.result`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import numpy as np
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_fpdt.errors import FPDTError
from lightning_fpdt.evaluation.evaluate import DEFAULT_DEPTHS, evaluate
from lightning_fpdt.evaluation.grid import check_grid, check_positions, position_limit
from lightning_fpdt.evaluation.images import curve_image, heatmap_image, save_png
from lightning_fpdt.evaluation.results import EvaluationResult
from lightning_fpdt.evaluation.samples import EvalTask
from lightning_fpdt.evaluation.tasks import task_named
from lightning_fpdt.evaluation.tokenizer import encoder, find_tokenizer


class LongContextEvaluation(pl.Callback):
    """Needle-in-a-haystack, pass-key and loss-by-position evaluation at the training length, after each validation.

    Args:
        tasks: task names (``"passkey"``, RULER's ``"niah_single_1"`` ... ``"niah_multiquery"``) or task objects
            (:class:`~lightning_fpdt.evaluation.PasskeyTask`, :class:`~lightning_fpdt.evaluation.NeedleTask`).
        lengths: sample lengths in tokens (global); ``None``: a quarter, half and all of the data module's
            ``seq_len`` (its training length), those every task can make (a needle task needs a few hundred tokens
            for its header, needles and question: shorter ones are left out, and said so).
        depths: where the answer's needle sits, fractions of the haystack (the heatmap's rows).
        samples_per_cell: samples per (length, depth) cell.
        tokenizer: the model's tokenizer (an object with ``encode``, or a local directory); ``None``: the data
            module's, or bytes for a 256-token vocabulary.
        position_data: held-out documents for the loss by position: ``"validation"`` (the first validation
            dataloader's data set), a data set of dict items with ``input_ids`` ``[seq]``, or ``None`` (off).
        position_samples: documents used (the first ones; ``None``: all).
        position_buckets: buckets of the loss-by-position curve.
        position_targets: ``"all"`` (every next token) or ``"labels"`` (the items' own labels).
        batch_size: samples per forward.
        output_dir: where the files go; ``None``: ``<trainer.log_dir>/evaluation``.
        every_n_validations: run at every n-th validation.
        tile_tokens: tokens whose logits exist at once.

    Raises:
        ValueError: a count below 1, an unknown ``position_data`` name.
    """

    def __init__(
        self,
        tasks: Sequence[str | EvalTask] = ("niah_single_2",),
        lengths: Sequence[int] | None = None,
        depths: Sequence[float] = DEFAULT_DEPTHS,
        samples_per_cell: int = 4,
        tokenizer: Any = None,
        position_data: Any = "validation",
        position_samples: int | None = 8,
        position_buckets: int = 16,
        position_targets: Literal["all", "labels"] = "all",
        batch_size: int = 1,
        output_dir: str | None = None,
        every_n_validations: int = 1,
        tile_tokens: int = 1024,
    ) -> None:
        if every_n_validations < 1:
            raise FPDTError(f"LongContextEvaluation: every_n_validations={every_n_validations} must be at least 1.")
        if isinstance(position_data, str) and position_data != "validation":
            raise FPDTError(f"LongContextEvaluation: position_data={position_data!r}; use 'validation', a data set"
                            " or None.")
        check_grid(lengths, depths, "LongContextEvaluation")  # before any process or forward
        self.tasks, self.lengths, self.depths = list(tasks), lengths, list(depths)
        self.samples_per_cell, self.tokenizer, self.batch_size = samples_per_cell, tokenizer, batch_size
        self.position_data, self.position_samples, self.position_buckets = position_data, position_samples, \
            position_buckets
        self.position_targets, self.output_dir, self.tile_tokens = position_targets, output_dir, tile_tokens
        self.every_n_validations = every_n_validations
        self.result: EvaluationResult | None = None
        self._validations = 0
        self._checkpoint_step: int | None = None  # the global step of the checkpoint validate loaded
        self._fitted: list[int] | None = None  # the default lengths every task can make (setup)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Before the first forward: the grid's lengths against the model's positions, and each task's shortest
        sample made once (a length too short for a task is refused now, not after a whole validation pass)."""
        self._fitted = None
        lengths = self._lengths(trainer)
        encode = encoder(find_tokenizer(self.tokenizer, trainer.datamodule, pl_module))
        if self.lengths is None:  # the defaults: those every task can make (a needle task needs a few hundred)
            fitting = [n for n in lengths if all(self._fits(task, encode, n) for task in self.tasks)]
            longer, limit = lengths[-1], position_limit(pl_module) or 16 * lengths[-1]
            while not fitting and 2 * longer <= limit:  # seq_len too short for the tasks: the shortest that fits
                longer *= 2
                fitting = [longer] if all(self._fits(task, encode, longer) for task in self.tasks) else []
            if fitting and fitting != lengths:
                rank_zero_info(f"LongContextEvaluation: lengths {sorted(set(lengths) - set(fitting))} are too short"
                               f" for the tasks; evaluating at {fitting} (give lengths=[...] to choose)")
            self._fitted = lengths = fitting or lengths[-1:]
        check_positions(pl_module, lengths, "LongContextEvaluation")
        for task in self.tasks:
            task_named(task).sample(encode, min(lengths), self.depths[0], 0)

    def _fits(self, task: str | EvalTask, encode: Any, length: int) -> bool:
        """Whether ``task`` makes every sample of a cell of ``length`` tokens (each depth's first samples)."""
        try:
            for depth in self.depths:
                for index in range(self.samples_per_cell):
                    task_named(task).sample(encode, length, depth, index)
        except FPDTError:
            return False
        return True

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        step = checkpoint.get("global_step")
        self._checkpoint_step = step if isinstance(step, int) else None

    def _lengths(self, trainer: pl.Trainer) -> list[int]:
        if self.lengths is not None:
            return list(self.lengths)
        if self._fitted:
            return list(self._fitted)
        seq_len = getattr(trainer.datamodule, "seq_len", None)
        if not isinstance(seq_len, int):
            which = "the trainer has no data module" if trainer.datamodule is None else \
                f"{type(trainer.datamodule).__name__} has none"
            raise FPDTError(f"LongContextEvaluation: lengths=None takes the data module's seq_len, but {which}; give"
                            " lengths=[...] (tokens).")
        return sorted({max(1, seq_len // 4), max(1, seq_len // 2), seq_len})

    def _documents(self, trainer: pl.Trainer) -> Any:
        if not isinstance(self.position_data, str):
            return self.position_data
        loaders = trainer.val_dataloaders
        loader = loaders[0] if isinstance(loaders, (list, tuple)) else loaders
        return getattr(loader, "dataset", None)

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        self._validations += 1
        if (self._validations - 1) % self.every_n_validations:
            return
        # validate does not restore the training loop: the step is the checkpoint's (on_load_checkpoint)
        fitting = trainer.state.fn is not None and trainer.state.fn.value == "fit"
        step = trainer.global_step if fitting or self._checkpoint_step is None else self._checkpoint_step
        result = evaluate(
            pl_module, self.tasks, self._lengths(trainer), self.depths, self.samples_per_cell, self.tokenizer,
            self._documents(trainer), self.position_samples, self.position_buckets, self.position_targets,
            self.batch_size, trainer, self.tile_tokens, step,
        )
        self.result = result
        self._log_scalars(pl_module, result)
        directory = self._directory(trainer, result.step)  # on every rank: trainer.log_dir is a broadcast
        if trainer.is_global_zero:
            images = self.images(result, self.position_targets)
            self._log_images(trainer, images, result.step)
            paths = result.write(directory)
            paths += [save_png(image, directory / f"{stem}.png") for stem, image in images.items()]
            rank_zero_info(f"LongContextEvaluation: wrote {len(paths)} files to {directory}")

    @staticmethod
    def images(result: EvaluationResult, position_targets: str = "all") -> dict[str, np.ndarray]:
        """The result's pictures by file stem: ``<task>_heatmap`` per task, ``position_loss`` with documents (its
        subtitle says which targets it scores)."""
        out = {f"{name}_heatmap": heatmap_image(r.grid("exact_match"), r.depths, r.lengths,
                                                f"{name}: exact match (teacher forcing), step {result.step}")
               for name, r in result.tasks.items()}
        p = result.position_loss
        if p is not None and p.starts:
            targets = {"all": "targets: every next token (a model trained on answers only was not trained on them)",
                       "labels": "targets: the documents' own labels"}.get(position_targets, "")
            out["position_loss"] = curve_image(p.starts, p.ends, p.loss,
                                               f"loss by position, held-out documents, step {result.step}", targets)
        return out

    @staticmethod
    def _log_scalars(pl_module: pl.LightningModule, result: EvaluationResult) -> None:
        metrics = {}
        for name, r in result.tasks.items():
            metrics[f"eval/{name}/exact_match"] = r.mean("exact_match")
            metrics[f"eval/{name}/log_likelihood"] = r.mean("log_likelihood")
        p = result.position_loss
        finite = [v for v in (p.loss if p is not None else []) if v == v]
        if finite:
            metrics["eval/position_loss/first"], metrics["eval/position_loss/last"] = finite[0], finite[-1]
        if metrics:  # identical on every rank already; sync_dist only averages equal values
            pl_module.log_dict(metrics, on_step=False, on_epoch=True, sync_dist=True)

    @staticmethod
    def _log_images(trainer: pl.Trainer, images: dict[str, np.ndarray], step: int) -> None:
        for logger in trainer.loggers:
            experiment = getattr(logger, "experiment", None)
            if not callable(getattr(experiment, "add_image", None)):
                continue
            for stem, image in images.items():
                tag = "eval/position_loss" if stem == "position_loss" else f"eval/{stem[:-len('_heatmap')]}/heatmap"
                experiment.add_image(tag, image, global_step=step, dataformats="HWC")
            flush = getattr(experiment, "flush", None)
            if callable(flush):
                flush()

    def _directory(self, trainer: pl.Trainer, step: int) -> Path:
        """``<output_dir>/<stage>-step<N>``; a collective without ``output_dir`` (``trainer.log_dir`` broadcasts)."""
        root = Path(self.output_dir) if self.output_dir is not None else Path(trainer.log_dir or
                                                                               trainer.default_root_dir) / "evaluation"
        stage = trainer.state.fn.value if trainer.state.fn is not None else "run"
        return root / f"{stage}-step{step}"
