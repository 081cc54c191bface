"""The LightningModule that trains any of the project's decoders on dict batches."""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torchmetrics import Metric

from lightning_fpdt.layout import shard_batch
from lightning_fpdt.loss import cross_entropy_sum, tiled_cross_entropy_sum, token_weighted_loss


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
        self.val_answer_accuracy = AnswerAccuracy()

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None) -> Tensor:
        return self.model(input_ids, position_ids)

    def prepared(self, batch: dict[str, Any]) -> dict[str, Any]:
        """The batch as ``FPDTStrategy`` hands it over: pre-shifted targets, position ids, documents.

        A batch that did not come through the strategy (one process, another strategy) gets the same
        preparation here (:func:`lightning_fpdt.layout.shard_batch` with one rank), so packed documents,
        ``attention_mask`` and ``loss_mask`` mean the same with and without sequence parallelism.
        """
        if not isinstance(batch, dict) or "input_ids" not in batch:
            keys = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
            raise ValueError(
                f"{type(self).__name__} expects dict batches with 'input_ids' [batch, seq]; got {keys}."
            )
        if "shift_labels" in batch and "documents" in batch:
            return batch
        return shard_batch(batch, 1, 0, owner=type(self).__name__)

    def targets(self, batch: dict[str, Tensor]) -> Tensor:
        """Pre-shifted targets of a batch (``shift_labels``; see :meth:`prepared`)."""
        return self.prepared(batch)["shift_labels"]

    def hidden_states(self, batch: dict[str, Any]) -> Tensor:
        """Final hidden states ``[batch, seq, hidden]`` of this rank's part of a dict batch."""
        batch = self.prepared(batch)
        return self.model.hidden_states(batch["input_ids"], batch["position_ids"], batch["documents"])

    def loss_terms(self, batch: dict[str, Any], hidden: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``(loss_sum, num_tokens)`` of this rank's part of the batch."""
        batch = self.prepared(batch)  # once: hidden_states and targets then find it prepared
        hidden = self.hidden_states(batch) if hidden is None else hidden
        tiles = getattr(getattr(self.model, "config", None), "loss_tiles", None)
        if tiles == 1:  # no tiling: full logits, kept for backward by autograd
            return cross_entropy_sum(self.model.lm_head(hidden), self.targets(batch))
        return tiled_cross_entropy_sum(hidden, self.model.lm_head.weight, self.targets(batch), tiles)

    def answer_predictions(self, batch: dict[str, Any], hidden: Tensor) -> tuple[Tensor, Tensor]:
        """Greedy predictions and targets where ``answer_mask`` is set (the next token is an answer)."""
        mask = batch["answer_mask"].bool()
        logits = self.model.lm_head(hidden[mask])  # only the answer positions: [n_answer, vocab]
        return logits.argmax(-1), self.targets(batch)[mask]

    def sequence_parallel_size(self) -> int:
        mesh = self.device_mesh
        return 1 if mesh is None else mesh["sequence_parallel"].size()

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        if hasattr(self.model, "flops_per_token"):  # read by ThroughputMonitor for FLOP/s and MFU
            ids = batch["input_ids"]
            global_seq = ids.shape[1] * self.sequence_parallel_size()
            self.flops_per_batch = self.model.flops_per_token(global_seq) * ids.numel()
        loss, mean = token_weighted_loss(*self.loss_terms(batch))
        self.log("train/loss", mean, prog_bar=True, batch_size=batch["input_ids"].shape[0])
        return loss

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        batch = self.prepared(batch)
        hidden = self.hidden_states(batch)
        _, mean = token_weighted_loss(*self.loss_terms(batch, hidden))
        # identical on every rank already; sync_dist only averages equal values
        self.log("val/loss", mean, prog_bar=True, batch_size=batch["input_ids"].shape[0], sync_dist=True)
        if "answer_mask" in batch:
            self.val_answer_accuracy.update(*self.answer_predictions(batch, hidden))
            self.log("val/answer_accuracy", self.val_answer_accuracy, on_epoch=True, prog_bar=True)
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
