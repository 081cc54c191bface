"""Metrics the LightningModules log."""

from __future__ import annotations

import torch
from torch import Tensor
from torchmetrics import Metric


class AnswerAccuracy(Metric):
    """Fraction of answer tokens predicted exactly (greedy), summed over every rank that holds some."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("correct", default=torch.tensor(0), dist_reduce_fx="sum")
        self.add_state("total", default=torch.tensor(0), dist_reduce_fx="sum")

    def update(self, predictions: Tensor, targets: Tensor) -> None:
        self.correct += (predictions == targets).sum()
        self.total += targets.numel()

    def compute(self) -> Tensor:
        return self.correct.float() / self.total.clamp_min(1)
