"""Cross-entropy for sequence-sharded batches, weighted by tokens across the whole world."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from lightning_fpdt.autocast_state import AutocastState
from lightning_fpdt.layout import IGNORE_INDEX
from lightning_fpdt.profiling import record
from lightning_fpdt.tiling import MIN_TILE_TOKENS, tile_bounds


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
        logits.reshape(-1, logits.shape[-1]).to(acc),
        shift_labels.reshape(-1),
        ignore_index=ignore_index,
        reduction="sum",
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


def auto_loss_tiles(num_tokens: int) -> int:
    """Tiles of ``MIN_TILE_TOKENS`` (1024) tokens: a tile's logits (``1024 x vocab`` float32) do not grow
    with the sequence, and each tile is a large enough matrix multiply."""
    return max(1, -(-num_tokens // MIN_TILE_TOKENS))


class _TiledCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of ``hidden @ weight.T`` computed tile by tile, recomputed in backward."""

    @staticmethod
    def forward(
        ctx: Any, hidden: Tensor, weight: Tensor, targets: Tensor, num_tiles: int, ignore_index: int
    ) -> Tensor:
        b, s, h = hidden.shape  # s = this rank's tokens
        flat_h, flat_t = hidden.reshape(b * s, h), targets.reshape(b * s)
        acc = torch.promote_types(hidden.dtype, torch.float32)
        total = torch.zeros((), dtype=acc, device=hidden.device)
        for lo, hi in tile_bounds(b * s, num_tiles):
            with record("fpdt/loss_tile"):
                logits = F.linear(flat_h[lo:hi], weight).to(acc)  # [tile, vocab]: never all tokens at once
                total = total + F.cross_entropy(logits, flat_t[lo:hi], ignore_index=ignore_index, reduction="sum")
                del logits  # else it lives on while the next tile's logits are computed
        ctx.save_for_backward(hidden, weight, targets)
        ctx.num_tiles, ctx.ignore_index = num_tiles, ignore_index
        ctx.autocast = AutocastState.capture(hidden.device.type)
        return total

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None, None, None]:
        hidden, weight, targets = ctx.saved_tensors
        b, s, h = hidden.shape
        flat_h, flat_t = hidden.reshape(b * s, h), targets.reshape(b * s)
        acc = torch.promote_types(hidden.dtype, torch.float32)
        d_hidden = torch.empty_like(flat_h)
        d_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        for lo, hi in tile_bounds(b * s, ctx.num_tiles):
            with ctx.autocast.restore(), record("fpdt/loss_tile_backward"):
                logits = F.linear(flat_h[lo:hi], weight).to(acc)
                # d(sum of -log softmax[target]) / d logits = softmax - onehot(target), 0 on ignored rows
                d_logits = torch.softmax(logits, dim=-1)
                del logits  # at most two [tile, vocab] tensors are alive: this and the next tile's
                t = flat_t[lo:hi]
                valid = t != ctx.ignore_index
                d_logits[valid, t[valid]] -= 1
                d_logits[~valid] = 0
                d_logits *= grad
                if ctx.needs_input_grad[0]:
                    d_hidden[lo:hi] = d_logits.to(weight.dtype) @ weight
                d_weight.addmm_(d_logits.T, flat_h[lo:hi].to(acc))  # in place: no [vocab, hidden] temporary
                del d_logits
        return (
            d_hidden.view(b, s, h) if ctx.needs_input_grad[0] else None,
            d_weight.to(weight.dtype) if ctx.needs_input_grad[1] else None,
            None,
            None,
            None,
        )


def tiled_cross_entropy_sum(
    hidden: Tensor, weight: Tensor, shift_labels: Tensor, num_tiles: int | None = None, ignore_index: int = IGNORE_INDEX
) -> tuple[Tensor, Tensor]:
    """Summed cross-entropy of the output projection, without a full ``[tokens, vocab]`` logits tensor.

    Args:
        hidden: final hidden states ``[batch, seq, hidden]`` (this rank's shard under SP).
        weight: the output embedding ``[vocab, hidden]``.
        shift_labels: pre-shifted targets ``[batch, seq]``.
        num_tiles: token tiles; ``None`` uses :func:`auto_loss_tiles` of this rank's tokens.

    Returns:
        ``(loss_sum, num_tokens)`` like :func:`cross_entropy_sum`; logits are float32 (float64 for
        float64 models) per tile and go through log-softmax, never ``softmax().log()``.
    """
    tiles = auto_loss_tiles(hidden.shape[0] * hidden.shape[1]) if num_tiles is None else num_tiles
    if tiles < 1:
        raise ValueError(f"tiled_cross_entropy_sum: num_tiles must be >= 1, got {tiles}.")
    loss_sum = _TiledCrossEntropy.apply(hidden, weight, shift_labels, tiles, ignore_index)
    return loss_sum, (shift_labels != ignore_index).sum()
