"""Long-context evaluation at the training length, through the FPDT pipeline (docs/evaluation.md).

- :class:`LongContextEvaluation` (``callback.py``): a Lightning callback for ``fit``'s validation and ``validate``;
  ``fpdt-eval`` (``command.py``) runs it on a checkpoint;
- :func:`evaluate` (``evaluate.py``): one evaluation, a collective on every rank;
- tasks: :class:`NeedleTask` (``needle.py``, RULER's needle-in-a-haystack tasks, :data:`RULER_TASKS`) over a
  haystack (``haystack.py``), :class:`PasskeyTask` (``tasks.py``); samples and the grid (``samples.py``);
- scoring (``scoring.py``: per-rank sums of answer log-likelihood, teacher-forced exact match and position loss,
  added over the ranks), the forward passes (``runner.py``), results and files (``results.py``), pictures
  (``images.py``), the tokenizer (``tokenizer.py``).
"""

from lightning_fpdt.evaluation.callback import LongContextEvaluation
from lightning_fpdt.evaluation.evaluate import DEFAULT_DEPTHS, evaluate
from lightning_fpdt.evaluation.haystack import ESSAY, Haystack, haystack_text
from lightning_fpdt.evaluation.needle import RULER_TASKS, NeedleTask
from lightning_fpdt.evaluation.results import EvaluationResult, PositionLoss, TaskResult
from lightning_fpdt.evaluation.samples import EvalSample, EvalTask, sample_grid
from lightning_fpdt.evaluation.tasks import PasskeyTask, task_named

__all__ = [
    "DEFAULT_DEPTHS",
    "ESSAY",
    "RULER_TASKS",
    "EvalSample",
    "EvalTask",
    "EvaluationResult",
    "Haystack",
    "LongContextEvaluation",
    "NeedleTask",
    "PasskeyTask",
    "PositionLoss",
    "TaskResult",
    "evaluate",
    "haystack_text",
    "sample_grid",
    "task_named",
]
