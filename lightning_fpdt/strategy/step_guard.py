"""The step guard: no optimizer step is ever taken from a NaN/inf loss or gradient, or from no data.

:class:`StepGuard` sees every training loss of an accumulation window and its number of target tokens
(``observe``, local, no communication, kept on the device) and, just before the optimizer step, checks those
losses and this rank's gradients with one all-reduce of a ``[world, 3]`` tensor, which the host reads once
(:meth:`StepGuard.allows_step`), so every rank takes the same decision (a rank that skipped alone would hang
the next gradient collective). Non-finite values follow the ``nonfinite_loss`` policy:

- ``"raise"``: stop before the damaged update, naming the step, the ranks, and loss versus gradients;
- ``"skip"``: drop the window's update on every rank (gradients zeroed, no step) and warn.

A window without a single target token on any rank (every label ignored) reports a loss of 0 and has
zero gradients; an optimizer would still apply weight decay and momentum. Its update is always
skipped, with a warning the first time.

With ``16-mixed`` precision the gradient scaler already skips steps with non-finite gradients, so only
the losses are checked there.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_fpdt.errors import PREFIX, FPDTError
from lightning_fpdt.parallel.dtensors import local_tensor

Policy = Literal["raise", "skip"]


def any_nonfinite(tensors: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Whether any element of any tensor (this rank's shard of a DTensor) is NaN or infinite: a 0-dim bool tensor on
    ``device``, not read by the host."""
    per_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        local = local_tensor(t)
        if local.numel():
            per_device.setdefault(local.device, []).append(~torch.isfinite(local).all())
    # one copy per device (host gradients under optimizer offload: one, not one per parameter)
    flags = [torch.stack(found).any().to(device) for found in per_device.values()]
    return torch.stack(flags).any() if flags else torch.zeros((), dtype=torch.bool, device=device)


class StepGuard:
    """Checks an accumulation window's losses and gradients before the optimizer step.

    Args:
        policy: ``"raise"`` or ``"skip"``.
        check_gradients: ``False`` when a gradient scaler handles non-finite gradients itself.
    """

    def __init__(self, policy: Policy, check_gradients: bool = True) -> None:
        self.policy = policy
        self.check_gradients = check_gradients
        # the window so far, as tensors on the loss's device: read once, in allows_step (no host wait per micro-batch)
        self._nonfinite_loss: torch.Tensor | bool = False
        self._tokens: torch.Tensor | int = 0
        self._warned_empty = False
        self._automatic = True  # manual optimization steps inside training_step, before observe() could run

    def setup(self, automatic_optimization: bool, precision: str) -> None:
        """Check the policy against the module and precision of the run (in the strategy's ``setup``).

        Raises:
            ValueError: ``"skip"`` with manual optimization.
        """
        if self.policy == "skip" and not automatic_optimization:
            raise FPDTError(
                f"{PREFIX}nonfinite_loss='skip' needs automatic optimization (with manual optimization your"
                " training_step steps the optimizer before the strategy sees the loss). Check the loss yourself"
                " or use nonfinite_loss='raise'."
            )
        self.check_gradients = precision != "16-mixed"  # the gradient scaler skips non-finite gradients itself
        self._automatic = automatic_optimization

    def observe(self, loss: torch.Tensor, tokens: torch.Tensor | int | None) -> None:
        """Record one training loss of the current window and its target tokens on this rank (``None``:
        unknown, counted as some); no communication, and nothing the host waits for."""
        self._nonfinite_loss = ~torch.isfinite(loss.detach()).all() | self._nonfinite_loss
        self._tokens = self._tokens + (1 if tokens is None else tokens)

    def allows_step(
        self, gradients: Iterable[torch.Tensor], step: int, rank: int, world_size: int, device: torch.device
    ) -> bool:
        """Whether the optimizer may step; a collective when ``world_size > 1``.

        Raises:
            FloatingPointError: with ``"raise"``, when any rank saw a non-finite loss or gradient.
        """
        flags = torch.zeros(world_size, 3, dtype=torch.float64, device=device)
        flags[rank, 0] = self._nonfinite_loss  # tensors are written on the device: the host reads flags once, below
        if self.check_gradients:
            flags[rank, 1] = any_nonfinite(gradients, device)
        # manual optimization: the window's loss reaches the strategy only after this step, so the step is judged by
        # its gradients alone, and its tokens are unknown (counted as some)
        flags[rank, 2] = self._tokens if self._automatic else 1
        self._nonfinite_loss, self._tokens = False, 0  # the next window starts clean
        if world_size > 1:
            torch.distributed.all_reduce(flags)
        read = flags.tolist()
        loss_ranks = [r for r, row in enumerate(read) if row[0]]
        grad_ranks = [r for r, row in enumerate(read) if row[1]]
        if not loss_ranks and not grad_ranks:
            if sum(row[2] for row in read) > 0:
                return True
            if not self._warned_empty:
                rank_zero_warn(
                    f"{PREFIX}no target token in the batches of global step {step} on any rank (every label is"
                    " -100, or masked): the loss is 0 and the update is skipped (without this the optimizer would"
                    " still apply weight decay). Check the labels / loss_mask of your data. Warned once."
                )
                self._warned_empty = True
            return False
        what = []
        if loss_ranks:
            what.append(f"non-finite loss at global step {step} on rank(s) {loss_ranks}")
        if grad_ranks:
            what.append(f"non-finite gradients at global step {step} on rank(s) {grad_ranks}")
        message = PREFIX + "; ".join(what)
        if not loss_ranks:
            message += " (the loss was finite: the backward overflowed)"
        if self.policy == "raise":
            raise FloatingPointError(
                message + ". The update was not applied. Lower the learning rate, check the data, or pass"
                " nonfinite_loss='skip' to skip such steps."
            )
        rank_zero_warn(message + ": the update is skipped on every rank (nonfinite_loss='skip').")
        return False
