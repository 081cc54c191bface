"""Cross-entropy for sequence-sharded batches, weighted by tokens across the whole world."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_fpdt.errors import FPDTError
from lightning_fpdt.offload.tiling import tiled_call
from lightning_fpdt.offload.weight_casts import autocast_weight
from lightning_fpdt.parallel.layout import IGNORE_INDEX


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


def world_totals(loss_sum: Tensor, num_tokens: Tensor) -> tuple[Tensor, Tensor, int]:
    """This rank's summed loss and target count, summed over every rank of the world; a collective (one
    all-reduce of two scalars) when there are several ranks.

    Returns:
        ``(total_loss, total_tokens, world)``: detached scalars in ``loss_sum``'s dtype (identical on every
        rank) and the world size (1 without a process group).
    """
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        totals = torch.stack([loss_sum.detach(), num_tokens.to(loss_sum.dtype)])
        dist.all_reduce(totals)
        return totals[0], totals[1], dist.get_world_size()
    return loss_sum.detach(), num_tokens.to(loss_sum.dtype), 1


def token_weighted_loss(loss_sum: Tensor, num_tokens: Tensor) -> tuple[Tensor, Tensor]:
    """Turn this rank's summed loss into the one to back-propagate, plus the true mean for logging.

    Every rank holds a different number of valid tokens (its sequence shard, its data shard). The
    loss of the whole global batch is ``sum over ranks of loss_sum / N`` with ``N`` the global valid
    token count. Gradient synchronisation (DDP, FSDP) *averages* over the ``W`` ranks of the
    world, so each rank back-propagates ``W * loss_sum / N``: the average of those gradients is
    exactly the single-process gradient of the global mean. In one process this is
    ``loss_sum / num_tokens``. Training steps that accumulate gradients over several micro-batches
    use :class:`lightning_fpdt.layers.accumulation.TokenWindow`, which divides by the window's count instead.

    Returns:
        ``(loss_for_backward, mean_loss)``; ``mean_loss`` is detached and identical on every rank.
    """
    total_loss, total_tokens, world = world_totals(loss_sum, num_tokens)
    count = total_tokens.clamp_min(1)  # no target anywhere: loss 0 and zero gradients, not 0 / 0
    if world > 1:
        return loss_sum * (world / count), total_loss / count
    return loss_sum / count, total_loss / count


def _softmax_in_place(logits: Tensor) -> Tensor:
    """``softmax(logits, -1)`` written over ``logits`` (``exp(x - max) / sum``, as ``torch.softmax`` computes it)."""
    logits.sub_(logits.amax(-1, keepdim=True)).exp_()
    return logits.div_(logits.sum(-1, keepdim=True))


def _cross_entropy_sum_in_place(logits: Tensor, targets: Tensor, ignore_index: int) -> Tensor:
    """``F.cross_entropy(logits, targets, reduction="sum")`` without a second ``[tokens, vocab]`` tensor (its
    log-softmax): ``logsumexp(x) - x[target]`` over the rows whose target is not ``ignore_index``, the logits
    overwritten by ``exp(x - max)`` on the way. For a forward that keeps nothing for backward.

    Args:
        logits: ``[tokens, vocab]``, float32 or wider (overwritten).
        targets: ``[tokens]``.
    """
    valid = targets != ignore_index
    target_logit = logits.gather(1, torch.where(valid, targets, 0).unsqueeze(1)).squeeze(1)  # before overwriting
    top = logits.amax(-1, keepdim=True)
    logsumexp = logits.sub_(top).exp_().sum(-1).log_().add_(top.squeeze(1))
    return torch.where(valid, logsumexp - target_logit, 0).sum()  # no boolean indexing: no host synchronisation


def tiled_cross_entropy_sum(
    hidden: Tensor, weight: Tensor, shift_labels: Tensor, num_tiles: int | None = None,
    ignore_index: int = IGNORE_INDEX, norm: nn.Module | None = None,
) -> tuple[Tensor, Tensor]:
    """Summed cross-entropy of the output projection, without a full ``[tokens, vocab]`` logits tensor.

    The tokens of every sample run in tiles (:func:`~lightning_fpdt.offload.tiling.tiled_call`): each tile's logits
    are computed, reduced and dropped, and recomputed in backward, whose gradient is written in closed form
    (softmax minus one-hot), with the output embedding's gradient accumulated in place in float32 or wider.

    Args:
        hidden: final hidden states ``[batch, seq, hidden]`` (this rank's shard under SP).
        weight: the output embedding ``[vocab, hidden]``.
        shift_labels: pre-shifted targets ``[batch, seq]``.
        num_tiles: token tiles over ``batch x seq``, read as :func:`~lightning_fpdt.offload.tiling.tiled_call` reads
            it (``None``: tiles of 1024 tokens; ``1``: off, full logits kept for backward).
        norm: the model's final norm, applied here tile by tile to ``hidden`` (then the states before it): no
            normed ``[batch, seq, hidden]`` tensor nor its gradient exists beside ``hidden`` and its gradient.

    Returns:
        ``(loss_sum, num_tokens)`` like :func:`cross_entropy_sum`; logits are float32 (float64 for
        float64 models) per tile and go through log-softmax, never ``softmax().log()``.

    Raises:
        ValueError: ``num_tiles`` below 1.
    """
    if num_tiles is not None and num_tiles < 1:
        raise FPDTError(f"tiled_cross_entropy_sum: num_tiles must be >= 1 or None, got {num_tiles}.")
    b, s, h = hidden.shape  # s = this rank's tokens
    acc = torch.promote_types(hidden.dtype, torch.float32)

    norm_params = [] if norm is None else [p for p in norm.parameters() if p.requires_grad]

    def tile_loss(h_tile: Tensor, t_tile: Tensor) -> Tensor:  # [1, tile, hidden], [1, tile] -> a scalar
        if norm is not None:
            h_tile = norm(h_tile)
        logits = F.linear(h_tile[0], autocast_weight(weight)).to(acc)  # [tile, vocab]: never all tokens at once
        if torch.is_grad_enabled() and logits.requires_grad:  # one tile (num_tiles=1): autograd keeps what it needs
            return F.cross_entropy(logits, t_tile[0], ignore_index=ignore_index, reduction="sum")
        return _cross_entropy_sum_in_place(logits, t_tile[0], ignore_index)

    def tile_grad(grad: Tensor, tile: Sequence[Tensor], d_params: list[Tensor | None]) -> list[Tensor | None]:
        if norm is None:
            return head_grad(grad, tile[0], tile[1][0], d_params)
        x = tile[0]
        with torch.enable_grad():  # the norm by autograd, the head in closed form (no graph)
            normed = norm(x)
        d_normed = head_grad(grad, normed.detach().requires_grad_(normed.requires_grad), tile[1][0],
                             d_params)
        wanted = [t for t in (x, *norm_params) if t.requires_grad]
        found = torch.autograd.grad(normed, wanted, d_normed) if wanted and d_normed is not None else ()
        found_iter = iter(found)
        d_x = next(found_iter) if x.requires_grad else None
        first = 1 if weight.requires_grad else 0  # d_params: the parameters that need a gradient, head first
        for n, d in enumerate(found_iter, start=first):
            d_params[n] = d if d_params[n] is None else d_params[n].add_(d)
        return [d_x, None]

    def head_grad(grad: Tensor, h: Tensor, t: Tensor, d_params: list[Tensor | None]) -> Tensor | None:
        """The tile's ``d hidden`` ``[1, tile, hidden]`` (``None`` unless ``h`` needs one); the head weight's
        gradient added into ``d_params[0]``."""
        h_tile = h[0]
        w = autocast_weight(weight)  # cast once for every tile under mixed precision (offload.weight_casts)
        logits = F.linear(h_tile, w)  # [tile, vocab] in the compute dtype (autocast's under mixed precision)
        compute = logits.dtype
        # d(sum of -log softmax[target]) / d logits = softmax - onehot(target), 0 on ignored rows; the softmax
        # overwrites the logits, so one [tile, vocab] tensor is alive (not the logits beside their softmax)
        d_logits = _softmax_in_place(logits.to(acc))
        del logits
        # one subtracted at each valid target and ignored rows zeroed, in place and without boolean indexing (whose
        # nonzero() makes the host wait for the device at every tile)
        valid = (t != ignore_index).unsqueeze(1)
        d_logits.scatter_add_(1, torch.where(valid, t.unsqueeze(1), 0), valid.to(d_logits.dtype).neg())
        d_logits.masked_fill_(~valid, 0)
        d_logits *= grad
        # the products in the compute dtype (a float32 product under bf16-mixed runs without tensor cores), the
        # head's gradient accumulated in float32 or wider; in float32 and float64 exactly as before
        d_compute = d_logits if compute == acc else d_logits.to(compute)
        d_hidden = (d_compute @ w.to(compute)).to(h.dtype).unsqueeze(0) if h.requires_grad else None
        if weight.requires_grad:
            if d_params[0] is None:
                d_params[0] = torch.zeros(weight.shape, dtype=acc, device=weight.device)
            if compute == acc:  # in place, no [vocab, hidden] temporary per tile
                d_params[0].addmm_(d_logits.T, h_tile.detach().to(acc))
            else:  # a [vocab, hidden] product in the compute dtype, added into the accumulator
                d_params[0].add_(d_compute.T @ h_tile.detach().to(compute))
        return d_hidden

    # every token is one position of one long sequence: the tiles run over batch x seq
    loss_sum = tiled_call(tile_loss, hidden.reshape(1, b * s, h), shift_labels.reshape(1, b * s),
                          num_tiles=num_tiles, params=[weight, *norm_params], tile_grad=tile_grad, name="loss_tile")
    return loss_sum, (shift_labels != ignore_index).sum()
