"""The evaluation's results: per sample, per (depth, length) cell, per position bucket; and their files.

Contract: :class:`EvaluationResult` holds everything one evaluation measured, as plain Python numbers (the same
on every rank); :meth:`EvaluationResult.write` writes, into one directory:

- ``results.json``: the whole result (``to_dict``), floats written exactly (``repr``);
- ``<task>_samples.csv``: one row per sample (length, depth, index, needle_depth, exact_match, log_likelihood,
  correct_tokens, answer_tokens, answer);
- ``<task>_cells.csv``: one row per cell (length, depth, samples, exact_match, log_likelihood, token_accuracy:
  means over the cell's samples);
- ``position_loss.csv``: one row per bucket (start, end, mean_loss, tokens).

Scores: ``exact_match`` is 1 when every answer token is the argmax given the true prefix (teacher forcing), else
0; ``log_likelihood`` is the answer's summed log-probability in nats; ``token_accuracy`` the fraction of answer
tokens that are the argmax.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torch import Tensor

from lightning_fpdt.evaluation.samples import EvalSample

METRICS = ("exact_match", "log_likelihood", "token_accuracy")


@dataclass
class TaskResult:
    """One task's scores on its grid.

    Attributes:
        task: the task's name.
        lengths / depths: the grid's axes.
        samples: one dict per sample (the columns of ``<task>_samples.csv``).
    """

    task: str
    lengths: list[int]
    depths: list[float]
    samples: list[dict[str, Any]] = field(default_factory=list)

    def cell(self, length: int, depth: float, metric: str = "exact_match") -> float:
        """The mean of ``metric`` over the cell's samples (NaN for an empty cell)."""
        values = [s[metric] for s in self.samples if s["length"] == length and s["depth"] == depth]
        return sum(values) / len(values) if values else math.nan

    def grid(self, metric: str = "exact_match") -> list[list[float]]:
        """``[depth][length]`` cell means of ``metric`` (the heatmap's values)."""
        return [[self.cell(length, depth, metric) for length in self.lengths] for depth in self.depths]

    def mean(self, metric: str = "exact_match") -> float:
        """The mean of ``metric`` over every sample."""
        return sum(s[metric] for s in self.samples) / max(len(self.samples), 1)

    def cells(self) -> list[dict[str, Any]]:
        """One dict per cell: length, depth, samples and the mean of every metric."""
        return [{"length": length, "depth": depth,
                 "samples": sum(s["length"] == length and s["depth"] == depth for s in self.samples),
                 **{m: self.cell(length, depth, m) for m in METRICS}}
                for length in self.lengths for depth in self.depths]


def task_result(task: str, samples: Sequence[EvalSample], scores: Tensor, lengths: Sequence[int],
                depths: Sequence[float]) -> TaskResult:
    """A task's result from its samples and their summed scores (``[n, 3]``: log-likelihood, correct, tokens; see
    :func:`~lightning_fpdt.evaluation.scoring.answer_scores`)."""
    result = TaskResult(task, list(lengths), list(depths))
    for s, (log_likelihood, correct, tokens) in zip(samples, scores.tolist()):
        result.samples.append({
            "length": s.length, "depth": s.depth, "index": s.index, "needle_depth": s.needle_depth,
            "exact_match": float(tokens > 0 and correct == tokens), "log_likelihood": log_likelihood,
            "token_accuracy": correct / max(tokens, 1), "correct_tokens": int(correct),
            "answer_tokens": int(tokens), "answer": s.answer,
        })
    return result


@dataclass
class PositionLoss:
    """Mean next-token loss per position bucket of held-out documents.

    Attributes:
        starts / ends: each bucket's positions ``[start, end)`` (of the predicting token in its document).
        loss: the bucket's mean loss in nats (NaN for a bucket without targets).
        tokens: the bucket's targets.
    """

    starts: list[int]
    ends: list[int]
    loss: list[float]
    tokens: list[int]


def bucketed(sums: Tensor, num_buckets: int) -> PositionLoss:
    """``num_buckets`` equal buckets over the positions of ``sums`` (``[2, positions]``: loss sums and counts, see
    :func:`~lightning_fpdt.evaluation.scoring.position_sums`); fewer when there are fewer positions."""
    n = sums.shape[1]
    width = max(1, -(-n // max(num_buckets, 1)))
    out = PositionLoss([], [], [], [])
    for start in range(0, n, width):
        end = min(start + width, n)
        total, count = (float(x) for x in sums[:, start:end].sum(1))
        out.starts.append(start)
        out.ends.append(end)
        out.loss.append(total / count if count else math.nan)
        out.tokens.append(int(count))
    return out


@dataclass
class EvaluationResult:
    """Everything one evaluation measured.

    Attributes:
        step: the trainer's global step when it ran.
        tasks: each task's :class:`TaskResult`, by name.
        position_loss: the loss-by-position curve, or ``None`` when not measured.
    """

    step: int
    tasks: dict[str, TaskResult] = field(default_factory=dict)
    position_loss: PositionLoss | None = None

    def to_dict(self) -> dict[str, Any]:
        """The result as JSON-ready dicts (NaN as ``None``)."""
        return _no_nan({
            "step": self.step,
            "tasks": {name: {"lengths": r.lengths, "depths": r.depths, "exact_match": r.mean("exact_match"),
                             "log_likelihood": r.mean("log_likelihood"), "cells": r.cells(), "samples": r.samples}
                      for name, r in self.tasks.items()},
            "position_loss": None if self.position_loss is None else asdict(self.position_loss),
        })

    def write(self, directory: str | Path) -> list[Path]:
        """Write the files of the module docstring into ``directory`` (made if missing); returns their paths."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        paths = [directory / "results.json"]
        paths[0].write_text(json.dumps(self.to_dict(), indent=1))
        for name, r in self.tasks.items():
            paths.append(_csv(directory / f"{name}_samples.csv", r.samples))
            paths.append(_csv(directory / f"{name}_cells.csv", r.cells()))
        if self.position_loss is not None:
            p = self.position_loss
            rows = [{"start": s, "end": e, "mean_loss": v, "tokens": t}
                    for s, e, v, t in zip(p.starts, p.ends, p.loss, p.tokens)]
            paths.append(_csv(directory / "position_loss.csv", rows))
        return paths


def _csv(path: Path, rows: list[dict[str, Any]]) -> Path:
    with path.open("w", newline="") as f:
        if rows:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return path


def _no_nan(x: Any) -> Any:
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _no_nan(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_no_nan(v) for v in x]
    return x
