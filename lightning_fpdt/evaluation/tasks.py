"""The pass-key task, and tasks by name.

Contract: :class:`PasskeyTask` is the :class:`~lightning_fpdt.evaluation.samples.EvalTask` of the pass-key data
(:func:`lightning_fpdt.data.passkey.passkey_sample`, the one generator both use); :func:`task_named` turns a name
(``"passkey"``, one of RULER's ``"niah_single_2"``, ...) into a task. The needle-in-a-haystack tasks are in
:mod:`lightning_fpdt.evaluation.needle`.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from lightning_fpdt.data.passkey import passkey_sample
from lightning_fpdt.errors import FPDTError, WrongType
from lightning_fpdt.evaluation.needle import RULER_TASKS, NeedleTask
from lightning_fpdt.evaluation.samples import EvalSample, EvalTask


class PasskeyTask:
    """The pass-key task of :class:`~lightning_fpdt.data.PasskeyDataset`, in any tokenizer: a number in filler
    text, asked for at the end (``... What is the pass key? #48213``). With the byte tokenizer, a sample is
    token for token the data set's sample at the same length, depth and random draws.

    Args:
        digits: the key's length; ``None``: the attached :class:`~lightning_fpdt.data.PasskeyDataModule`'s (the
            task the model trained on), else 5.
        key_repeats: times the key is written in the needle; ``None``: the data module's, else 1.
        seed: samples are a pure function of ``(seed, length, depth, index)``.
        name: the name results are logged under.

    Raises:
        ValueError: ``digits`` or ``key_repeats`` below 1.
    """

    def __init__(self, digits: int | None = None, key_repeats: int | None = None, seed: int = 0,
                 name: str = "passkey") -> None:
        for field, value in (("digits", digits), ("key_repeats", key_repeats)):
            if value is not None and value < 1:
                raise FPDTError(f"PasskeyTask: {field}={value} must be at least 1 (or None: the data module's).")
        self.digits, self.key_repeats, self.seed, self.name = digits, key_repeats, seed, name

    def resolved(self, datamodule: Any) -> PasskeyTask:
        """This task with ``None`` fields taken from ``datamodule``'s hyper-parameters (a ``PasskeyDataModule``),
        else the data set's defaults."""
        hparams = getattr(datamodule, "hparams", {}) if type(datamodule).__name__ == "PasskeyDataModule" else {}
        digits = self.digits if self.digits is not None else hparams.get("digits", 5)
        repeats = self.key_repeats if self.key_repeats is not None else hparams.get("key_repeats", 1)
        return PasskeyTask(digits, repeats, self.seed, self.name)

    def sample(self, encode: Callable[[str], list[int]], length: int, depth: float, index: int) -> EvalSample:
        task = self.resolved(None) if self.digits is None or self.key_repeats is None else self
        rng = random.Random(f"{self.name}/{self.seed}/{length}/{depth}/{index}")
        try:
            ids, answer_len, _, key = passkey_sample(encode, length, rng, depth, task.digits, task.key_repeats)
        except ValueError as err:
            raise FPDTError(f"PasskeyTask: {err}".replace("passkey_sample: ", "")) from None
        return EvalSample(self.name, length, depth, index, tuple(ids), length - answer_len, key, depth)

    def __repr__(self) -> str:
        return f"PasskeyTask(digits={self.digits}, key_repeats={self.key_repeats}, seed={self.seed})"


def task_named(task: str | EvalTask) -> EvalTask:
    """A task from its name: ``"passkey"`` (:class:`PasskeyTask`) or one of RULER's needle tasks
    (:data:`~lightning_fpdt.evaluation.needle.RULER_TASKS`: ``niah_single_1`` ... ``niah_multiquery``); a task
    object is returned as it is.

    Raises:
        ValueError: an unknown name (the known ones listed).
        TypeError: neither a name nor an object with ``name`` and ``sample``.
    """
    if isinstance(task, str):
        if task == "passkey":
            return PasskeyTask()
        if task in RULER_TASKS:
            return NeedleTask(name=task, **RULER_TASKS[task])
        known = ", ".join(["passkey", *RULER_TASKS])
        raise FPDTError(f"LongContextEvaluation: unknown task {task!r}; use one of {known}, or a task object.")
    if not isinstance(task, EvalTask):
        raise WrongType(f"LongContextEvaluation: a task must be a name or an object with `name` and"
                        f" `sample(encode, length, depth, index)`, got {type(task).__name__}.")
    return task
