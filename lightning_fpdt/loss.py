"""Cross-entropy for sequence-sharded batches, weighted by tokens across the whole world."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from lightning_fpdt.layout import IGNORE_INDEX


def cross_entropy_sum(logits: Tensor, shift_labels: Tensor, ignore_index: int = IGNORE_INDEX) -> tuple[Tensor, Tensor]:
    """Summed token cross-entropy and the number of valid tokens.

    Args:
        logits: ``[batch, seq, vocab]`` (any float dtype; computed in float32 or wider).
        shift_labels: ``[batch, seq]``, already shifted: ``shift_labels[t]`` is the target of token ``t``.

    Returns:
        ``(loss_sum, num_tokens)``: a scalar in the logits' accumulation dtype and an int64 scalar.
    """
    acc = torch.promote_types(logits.dtype, torch.float32)
    # log-softmax inside cross_entropy: exact even when target probabilities underflow float32
    loss_sum = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).to(acc), shift_labels.reshape(-1), ignore_index=ignore_index, reduction="sum"
    )
    return loss_sum, (shift_labels != ignore_index).sum()


def token_weighted_loss(loss_sum: Tensor, num_tokens: Tensor) -> tuple[Tensor, Tensor]:
    """Turn this rank's summed loss into the one to back-propagate, plus the true mean for logging.

    Every rank holds a different number of valid tokens (its sequence shard, its data shard). The
    loss of the whole global batch is ``sum over ranks of loss_sum / N`` with ``N`` the global valid
    token count. Gradient synchronisation (DDP, FSDP) *averages* over the ``W`` ranks of the
    world, so each rank back-propagates ``W * loss_sum / N``: the average of those gradients is
    exactly the single-process gradient of the global mean. In one process this is
    ``loss_sum / num_tokens``.

    Returns:
        ``(loss_for_backward, mean_loss)``; ``mean_loss`` is detached and identical on every rank.
    """
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        world = dist.get_world_size()
        totals = torch.stack([loss_sum.detach(), num_tokens.to(loss_sum.dtype)])
        dist.all_reduce(totals)
        total_loss, total_tokens = totals[0], totals[1].clamp_min(1)
        return loss_sum * (world / total_tokens), total_loss / total_tokens
    count = num_tokens.clamp_min(1).to(loss_sum.dtype)
    return loss_sum / count, (loss_sum / count).detach()
