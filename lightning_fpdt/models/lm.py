"""The LightningModule that trains any of the project's decoders on dict batches."""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from lightning_fpdt.layout import IGNORE_INDEX, shift_labels
from lightning_fpdt.loss import cross_entropy_sum, token_weighted_loss


class CausalLM(pl.LightningModule):
    """Next-token training for a decoder ``model`` with ``hidden_states`` and ``lm_head``.

    Batches are dicts with ``input_ids`` ``[batch, seq]`` and optionally ``labels`` (Hugging Face
    convention: unshifted, -100 ignored), ``shift_labels`` (already shifted, as ``FPDTStrategy``
    produces them) and ``position_ids``. The loss is token-weighted across every rank, so
    sequence and data parallel training give the single-process gradient.

    Args:
        learning_rate: peak AdamW learning rate.
        weight_decay: AdamW weight decay for matrices (not for norms, biases and embeddings).
        betas: AdamW betas.
        warmup_steps: linear warm-up steps.
        min_lr_ratio: the cosine schedule decays to ``learning_rate * min_lr_ratio``.
    """

    def __init__(
        self,
        learning_rate: float = 3e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 10,
        min_lr_ratio: float = 0.1,
    ) -> None:
        super().__init__()
        self.learning_rate = learning_rate
        self.weight_decay = weight_decay
        self.betas = tuple(betas)
        self.warmup_steps = warmup_steps
        self.min_lr_ratio = min_lr_ratio
        self.model: nn.Module

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None) -> Tensor:
        return self.model(input_ids, position_ids)

    @staticmethod
    def targets(batch: dict[str, Tensor]) -> Tensor:
        """Pre-shifted targets of a batch: ``shift_labels``, else shifted ``labels``, else shifted ids."""
        if "shift_labels" in batch:
            return batch["shift_labels"]
        return shift_labels(batch.get("labels", batch["input_ids"]), IGNORE_INDEX)

    def loss_terms(self, batch: dict[str, Any]) -> tuple[Tensor, Tensor]:
        """``(loss_sum, num_tokens)`` of this rank's part of the batch."""
        if not isinstance(batch, dict) or "input_ids" not in batch:
            keys = list(batch) if isinstance(batch, dict) else type(batch).__name__
            raise ValueError(
                f"{type(self).__name__} expects dict batches with 'input_ids' [batch, seq]; got {keys}."
            )
        hidden = self.model.hidden_states(batch["input_ids"], batch.get("position_ids"))
        logits = self.model.lm_head(hidden)
        return cross_entropy_sum(logits, self.targets(batch))

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        loss, mean = token_weighted_loss(*self.loss_terms(batch))
        self.log("train/loss", mean, prog_bar=True, batch_size=batch["input_ids"].shape[0])
        return loss

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        _, mean = token_weighted_loss(*self.loss_terms(batch))
        self.log("val/loss", mean, prog_bar=True, batch_size=batch["input_ids"].shape[0])
        return mean

    def configure_optimizers(self) -> Any:
        decay, no_decay = [], []
        for name, p in self.named_parameters():
            if not p.requires_grad:
                continue
            (decay if p.dim() >= 2 and "embed" not in name else no_decay).append(p)
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.learning_rate,
            betas=self.betas,
        )
        total = max(1, int(self.trainer.estimated_stepping_batches)) if self._trainer is not None else 1000
        warmup, floor = self.warmup_steps, self.min_lr_ratio

        def schedule(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
