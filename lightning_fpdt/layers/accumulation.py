"""Gradient accumulation weighted by tokens: the loss of an accumulation window is one mean.

With ``accumulate_grad_batches = N`` Lightning runs N micro-batches (``training_step`` and backward each),
divides each micro-batch's loss by N (its ``ClosureResult``) and steps the optimizer once. A token mean per
micro-batch would hand the optimizer the mean of N means, which is not the gradient of the window's tokens
when the micro-batches hold different numbers of target tokens (always, in chat fine-tuning).
:class:`TokenWindow` makes it the gradient of the one big batch, whatever the count in each micro-batch:

1. Micro-batch ``k`` all-reduces its ``(loss_sum, target count)`` over the world (two scalars, as the
   token-weighted loss always did) and back-propagates ``loss_sum * W / u``: the SUM of its token losses,
   divided by one constant ``u`` for the whole window and every rank, the first non-zero global target
   count of the window (so the gradients keep the size of a mean, which fp16 loss scaling needs). ``W``, the
   world size, cancels the average over the world that DDP and FSDP2 take.
2. At the optimizer step (``FPDTStrategy.optimizer_step``, before the step guard, the
   ``on_before_optimizer_step`` hooks and gradient clipping) every gradient is multiplied by ``u * N / T``,
   ``T`` the window's global target count (known on every rank: the sum of the micro-batches' all-reduced
   counts, no further collective); ``N`` undoes Lightning's division. The optimizer gets
   ``d(sum of the window's token losses) / d(parameters) / T``.

With one micro-batch per window the factor is exactly 1 and nothing is multiplied: the gradient is bitwise
the token-weighted one of :func:`lightning_fpdt.layers.loss.token_weighted_loss`. A window without any target has
zero gradients and is left alone (the step guard skips its update). The logged loss of each micro-batch is
the window's token mean so far, so the value standing at the optimizer step is the window's mean.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from lightning_fpdt.layers.loss import world_totals
from lightning_fpdt.parallel.dtensors import local_tensor


class TokenWindow:
    """The target-token account of one accumulation window (see the module docstring).

    A LightningModule holds one as its ``token_window`` attribute (``CausalLM`` does) and returns
    :meth:`add`'s loss from ``training_step``; :func:`scale_window_gradients` then finishes the window's
    gradient. A window belongs to one ``trainer.global_step``: the first micro-batch of the next step starts a
    new one, so a window never leaks into the next, whatever happened to the step (skipped or not).
    """

    def __init__(self) -> None:
        self._step: int | None = None
        self._normalize = 1  # what Lightning divides each micro-batch's loss by (accumulate_grad_batches)
        self._micro_batches = 0
        self._loss: Tensor | None = None  # the window's summed token losses over the world (detached)
        self._tokens: Tensor | None = None  # the window's target tokens over the world
        self._unit: Tensor | None = None  # u: the first non-zero global target count of the window
        self._applied = False

    def add(self, loss_sum: Tensor, num_tokens: Tensor, step: int, normalize: int) -> tuple[Tensor, Tensor]:
        """Account one micro-batch; a collective (all-reduce of two scalars) when the world has several ranks.

        Args:
            loss_sum: this rank's summed token loss of the micro-batch (a scalar with its graph).
            num_tokens: this rank's target tokens of the micro-batch (an integer scalar).
            step: ``trainer.global_step``: the window this micro-batch belongs to.
            normalize: what Lightning divides the returned loss by (``trainer.accumulate_grad_batches``).

        Returns:
            ``(loss_for_backward, window_mean)``: ``loss_sum * W / u`` (``loss_sum / u`` in one process), and
            the detached token mean of the window's micro-batches so far, identical on every rank.
        """
        total_loss, total_tokens, world = world_totals(loss_sum, num_tokens)
        if step != self._step or self._applied or self._unit is None:
            self._step, self._normalize, self._micro_batches, self._applied = step, normalize, 0, False
            self._loss = self._tokens = self._unit = torch.zeros_like(total_tokens)
        assert self._loss is not None and self._tokens is not None
        self._micro_batches += 1
        # tensors, not Python numbers: no host synchronisation per micro-batch
        self._unit = torch.where(self._unit > 0, self._unit, total_tokens)
        self._loss = self._loss + total_loss
        self._tokens = self._tokens + total_tokens
        unit = self._unit.clamp_min(1)  # a micro-batch without targets has loss 0 and zero gradients, not NaN
        backward = loss_sum * (world / unit) if world > 1 else loss_sum / unit
        return backward, self._loss / self._tokens.clamp_min(1)

    def gradient_factor(self) -> float | None:
        """What the window's accumulated gradients must be multiplied by (``u * N / T``); ``None`` when
        nothing is to be done: the factor is 1, the window is empty, has no target, or was finished."""
        if self._applied or self._micro_batches == 0 or self._tokens is None or self._unit is None:
            return None
        if self._micro_batches == 1 and self._normalize == 1:
            return None  # u == T and N == 1: exactly 1, known without a host synchronisation
        tokens = float(self._tokens)
        if tokens == 0:
            return None  # zero gradients; the step guard skips the update
        factor = float(self._unit) * self._normalize / tokens
        return None if factor == 1.0 else factor

    def scale_gradients(self, gradients: Iterable[Tensor]) -> None:
        """Turn the window's accumulated gradients into the one-big-batch gradient, in place (this rank's
        shard of a ``DTensor``); once per window: a second call does nothing."""
        factor = self.gradient_factor()
        self._applied = True
        if factor is None:
            return
        for grad in gradients:
            local_tensor(grad).mul_(factor)


def optimizer_parameters(optimizer: Any) -> list[Tensor]:
    """Every parameter ``optimizer`` updates, its groups in order."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def optimizer_gradients(optimizer: Any) -> list[Tensor]:
    """The gradients ``optimizer`` steps with: those of its parameters that have one."""
    return [p.grad for p in optimizer_parameters(optimizer) if p.grad is not None]


def scale_window_gradients(module: nn.Module, gradients: Iterable[Tensor]) -> None:
    """Finish the accumulation window of ``module``'s ``token_window`` (a :class:`TokenWindow`), if it has
    one, on ``gradients`` (the optimizer's parameters' gradients); nothing otherwise.

    Called on every rank after the window's last backward and before anything reads the gradients.
    """
    window = getattr(module, "token_window", None)
    if isinstance(window, TokenWindow):
        window.scale_gradients(gradients)
