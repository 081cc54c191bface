"""What an evaluation sample is, and the grid of samples a task is measured on.

Contract: a task is an object with a ``name`` and ``sample(encode, length, depth, index) -> EvalSample`` (the
:class:`EvalTask` protocol) that is a pure function of its arguments and the task's seed: every rank writes the
same samples without communicating. A sample is exactly ``length`` token ids ending with its answer
(``input_ids[answer_start:]``), right after the question; the answer is what is scored, token by token, under
teacher forcing. :func:`sample_grid` writes ``samples_per_cell`` samples for every (length, depth) cell.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from lightning_fpdt.parallel.layout import IGNORE_INDEX


@dataclass(frozen=True)
class EvalSample:
    """One scored sample.

    Attributes:
        task: the task's name.
        length: tokens in the sample (global, before sequence sharding).
        depth: the cell's depth: where the answer's needle was asked to sit, a fraction of the haystack.
        index: the sample's number within its cell.
        input_ids: ``length`` token ids: the context, the question and, last, the answer.
        answer_start: position of the answer's first token (``length - answer tokens``).
        answer: the answer's text.
        needle_depth: where the needle landed (needles sit between sentences): tokens of haystack before it
            over the haystack's tokens.
    """

    task: str
    length: int
    depth: float
    index: int
    input_ids: tuple[int, ...]
    answer_start: int
    answer: str
    needle_depth: float

    def labels(self) -> list[int]:
        """Unshifted labels (Hugging Face convention): the answer's ids, ``IGNORE_INDEX`` elsewhere, ``[length]``."""
        n = self.answer_start
        return [IGNORE_INDEX] * n + list(self.input_ids[n:])


@runtime_checkable
class EvalTask(Protocol):
    """A generator of scored samples (see the module docstring)."""

    name: str

    def sample(self, encode: Callable[[str], list[int]], length: int, depth: float, index: int) -> EvalSample:
        """The ``index``-th sample of the cell (``length`` tokens, the answer's needle at ``depth``)."""
        ...


def sample_grid(task: EvalTask, encode: Callable[[str], list[int]], lengths: Sequence[int], depths: Sequence[float],
                samples_per_cell: int) -> list[EvalSample]:
    """Every sample of the grid, length-major: for each length, each depth, ``samples_per_cell`` samples.

    Raises:
        ValueError: a length too short for the task (from the task, naming the minimum).
    """
    return [task.sample(encode, length, depth, i) for length in lengths for depth in depths
            for i in range(samples_per_cell)]
