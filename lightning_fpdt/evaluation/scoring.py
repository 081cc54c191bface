"""Scores of this rank's tokens, as sums the ranks add up exactly.

Contract: under sequence parallelism a rank holds a shard of each sample (the FPDT layout of
:func:`lightning_fpdt.parallel.batches.shard_batch`), so it can score only the targets of its own tokens. Every function
here returns *sums* over this rank's tokens (float64, whatever the model's dtype), never means: adding them over
the ranks of the sequence-parallel group (:func:`sum_over_world`, one all-reduce) gives each sample's score
exactly as one process would compute it on the whole sequence, up to the summation order's rounding.

- :func:`answer_scores`: per sample, the answer's log-likelihood, how many answer tokens are the argmax given
  the true prefix (teacher forcing: what greedy decoding would write), and how many answer tokens there are.
  Exact match is ``correct == tokens``.
- :func:`position_sums`: per position (``position_ids``: a token's place in its document), the summed
  next-token loss and the target count, for the loss-by-position curve.

Logits come from :func:`head_logits` (the module's ``logits``, e.g. ``HFCausalLM``'s family transform, else its
model's ``lm_head``), in token tiles, so no full ``[tokens, vocab]`` tensor exists; their log-softmax runs in
float32 or wider (float64 for float64 models), as the training loss's does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_fpdt.errors import WrongType
from lightning_fpdt.parallel.layout import IGNORE_INDEX

SCORES = ("log_likelihood", "correct", "tokens")  # the columns of answer_scores


def head_logits(module: nn.Module, hidden: Tensor) -> Tensor:
    """``hidden`` ``[..., hidden]`` to logits ``[..., vocab]``: ``module.logits`` where it has one (the family's own
    logit transform), else ``module.model.lm_head`` (the :class:`~lightning_fpdt.models.CausalLM` contract).

    Raises:
        TypeError: a module with neither.
    """
    logits = getattr(module, "logits", None)
    if callable(logits):
        return logits(hidden)
    head = getattr(getattr(module, "model", None), "lm_head", None)
    if not callable(head):
        raise WrongType(f"LongContextEvaluation: {type(module).__name__} has no logits(hidden) and no model.lm_head;"
                        " evaluate a CausalLM or HFCausalLM, or give the module a logits(hidden) method.")
    return head(hidden)


def _target_log_probs(module: nn.Module, hidden: Tensor, targets: Tensor, tile_tokens: int) -> tuple[Tensor, Tensor]:
    """Log-probability of each target and whether it is the argmax, for ``hidden`` ``[n, hidden]`` and ``targets``
    ``[n]`` (no ignored ones), ``tile_tokens`` rows at a time: ``([n] float64, [n] bool)``."""
    log_probs, correct = [], []
    for start in range(0, hidden.shape[0], tile_tokens):
        logits = head_logits(module, hidden[start:start + tile_tokens])  # [tile, vocab]: one tile at a time
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        t = targets[start:start + tile_tokens]
        # log-softmax at the targets only: logsumexp, never softmax().log() (exact where probabilities underflow)
        target_logits = logits.gather(1, t.unsqueeze(1)).squeeze(1)
        log_probs.append((target_logits - torch.logsumexp(logits, -1)).double())
        correct.append(logits.argmax(-1) == t)
    if not log_probs:
        return hidden.new_zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.bool, device=hidden.device)
    return torch.cat(log_probs), torch.cat(correct)


def answer_scores(module: nn.Module, hidden: Tensor, targets: Tensor, tile_tokens: int = 1024) -> Tensor:
    """Per-sample answer sums over this rank's tokens.

    Args:
        module: the LightningModule (for :func:`head_logits`).
        hidden: final hidden states ``[batch, s_local, hidden]`` of this rank's shard.
        targets: pre-shifted targets ``[batch, s_local]`` (``shift_labels``), ``IGNORE_INDEX`` except where the
            next token is an answer token.
        tile_tokens: answer tokens whose logits exist at once.

    Returns:
        ``[batch, 3]`` float64: :data:`SCORES` (log-likelihood, argmax-correct tokens, answer tokens) of this
        rank's answer tokens; zeros for a sample with none here.
    """
    b = hidden.shape[0]
    valid = targets != IGNORE_INDEX
    rows = valid.nonzero()[:, 0]  # the sample of each answer token held here
    log_probs, correct = _target_log_probs(module, hidden[valid], targets[valid], tile_tokens)
    out = torch.zeros(b, len(SCORES), dtype=torch.float64, device=hidden.device)
    out[:, 0].index_add_(0, rows, log_probs)
    out[:, 1].index_add_(0, rows, correct.double())
    out[:, 2].index_add_(0, rows, torch.ones_like(log_probs))
    return out


def position_sums(module: nn.Module, hidden: Tensor, targets: Tensor, position_ids: Tensor,
                  tile_tokens: int = 1024) -> Tensor:
    """Summed next-token loss and target count per position, over this rank's tokens.

    Args:
        hidden: final hidden states ``[batch, s_local, hidden]``.
        targets: pre-shifted targets ``[batch, s_local]`` (``IGNORE_INDEX`` where none: padding, document ends).
        position_ids: ``[batch, s_local]``: each token's place in its document (the strategy's global
            ``position_ids``, restarting per packed document). Bucket ``p`` holds the loss of predicting the
            token after position ``p``, from ``p + 1`` tokens of its document.
        tile_tokens: targets whose logits exist at once.

    Returns:
        ``[2, max_position + 1]`` float64: loss sums and target counts (``[2, 0]`` when no target is here).
    """
    valid = targets != IGNORE_INDEX
    positions = position_ids[valid].long()
    log_probs, _ = _target_log_probs(module, hidden[valid], targets[valid], tile_tokens)
    size = int(positions.max()) + 1 if positions.numel() else 0
    out = torch.zeros(2, size, dtype=torch.float64, device=hidden.device)
    out[0].index_add_(0, positions, -log_probs)
    out[1].index_add_(0, positions, torch.ones_like(log_probs))
    return out


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def sum_over_world(x: Tensor) -> Tensor:
    """``x`` summed over every rank (one all-reduce; ``x`` itself in one process). Every rank must call it with a
    tensor of the same shape: samples that are not this rank's hold zeros."""
    if _world() > 1:
        x = x.clone()
        dist.all_reduce(x)
    return x


def max_over_world(n: int, device: torch.device) -> int:
    """The largest ``n`` of any rank (one all-reduce): the common length of the per-position sums."""
    if _world() == 1:
        return n
    t = torch.tensor([n], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t)
