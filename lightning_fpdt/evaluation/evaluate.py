"""One evaluation: every task's grid of samples scored, and the loss by position, through the module's pipeline.

Contract: :func:`evaluate` is a collective when it runs under a trainer of several processes: every rank calls it
with the same arguments, and every rank returns the same :class:`~lightning_fpdt.evaluation.results.EvaluationResult`.
It changes nothing in the module (without a trainer it sets eval mode for the pass and restores the mode).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_fpdt.errors import FPDTError
from lightning_fpdt.evaluation.grid import check_grid, check_positions
from lightning_fpdt.evaluation.results import EvaluationResult, bucketed, task_result
from lightning_fpdt.evaluation.runner import document_items, position_loss_sums, score_samples
from lightning_fpdt.evaluation.samples import EvalTask, sample_grid
from lightning_fpdt.evaluation.tasks import task_named
from lightning_fpdt.evaluation.tokenizer import encoder, find_tokenizer

DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def evaluate(
    module: nn.Module,
    tasks: Sequence[str | EvalTask],
    lengths: Sequence[int],
    depths: Sequence[float] = DEFAULT_DEPTHS,
    samples_per_cell: int = 4,
    tokenizer: Any = None,
    position_data: Any = None,
    position_samples: int | None = 8,
    position_buckets: int = 16,
    position_targets: Literal["all", "labels"] = "all",
    batch_size: int = 1,
    trainer: pl.Trainer | None = None,
    tile_tokens: int = 1024,
    step: int = 0,
) -> EvaluationResult:
    """Score ``tasks`` on the ``depths x lengths`` grid and measure the loss by position of ``position_data``.

    Args:
        module: a :class:`~lightning_fpdt.models.CausalLM` or :class:`~lightning_fpdt.hf.HFCausalLM` (under a
            trainer: the one its strategy has bound).
        tasks: task objects or names (:func:`~lightning_fpdt.evaluation.tasks.task_named`).
        lengths: sample lengths in tokens (global, before sequence sharding).
        depths: where the answer's needle sits, fractions of the haystack.
        samples_per_cell: samples per (length, depth) cell.
        tokenizer: the model's tokenizer (see :func:`~lightning_fpdt.evaluation.tokenizer.find_tokenizer`).
        position_data: held-out documents (a data set of dict items with ``input_ids`` ``[seq]``), or ``None``.
        position_samples: documents of ``position_data`` used (its first ones; ``None``: all).
        position_buckets: buckets of the loss-by-position curve.
        position_targets: ``"all"`` (every next token of each document) or ``"labels"`` (the items' own labels).
        batch_size: samples per forward.
        trainer: the trainer whose strategy runs the forwards (``None``: one process, no strategy).
        tile_tokens: tokens whose logits exist at once.
        step: recorded in the result.

    Raises:
        ValueError: an empty grid, a count below 1, a length too short for a task (naming the minimum).
    """
    if not lengths or not depths:
        raise FPDTError(f"evaluate: lengths={list(lengths)} and depths={list(depths)} must both be non-empty.")
    check_grid(lengths, depths, "evaluate")
    check_positions(module, lengths, "evaluate")
    for name, value in (("samples_per_cell", samples_per_cell), ("batch_size", batch_size),
                        ("position_buckets", position_buckets), ("tile_tokens", tile_tokens)):
        if value < 1:
            raise FPDTError(f"evaluate: {name}={value} must be at least 1.")
    if position_targets not in ("all", "labels"):
        raise FPDTError(f"evaluate: position_targets={position_targets!r} must be 'all' or 'labels'.")
    datamodule = getattr(trainer, "datamodule", None) if trainer is not None else None
    encode = encoder(find_tokenizer(tokenizer, datamodule, module))
    training = module.training
    module.eval()
    try:
        result = EvaluationResult(step)
        resolved_tasks = []
        for task in (task_named(t) for t in tasks):
            resolved = getattr(task, "resolved", None)
            resolved_tasks.append(resolved(datamodule) if callable(resolved) else task)  # PasskeyTask: the data's
        for task in resolved_tasks:  # before the first forward: a length too short for any task is refused now
            sample_grid(task, encode, [min(lengths)], depths, samples_per_cell)
        for task in resolved_tasks:  # one task's grid at a time (a million-token grid is large)
            start = time.perf_counter()
            samples = sample_grid(task, encode, lengths, depths, samples_per_cell)
            scores = score_samples(module, samples, batch_size, trainer, tile_tokens)
            result.tasks[task.name] = task_result(task.name, samples, scores.cpu(), lengths, depths)
            rank_zero_info(f"LongContextEvaluation: {task.name}: exact match {result.tasks[task.name].mean():.3f} over"
                           f" {len(samples)} samples ({time.perf_counter() - start:.1f} s)")
        if position_data is not None:
            items = document_items(position_data, position_samples, position_targets)
            sums = position_loss_sums(module, items, batch_size, trainer, tile_tokens)
            result.position_loss = bucketed(sums.cpu(), position_buckets)
    finally:
        module.train(training)
    return result
