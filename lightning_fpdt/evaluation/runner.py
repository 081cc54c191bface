"""Forward-only passes of evaluation batches through the module, the way its trainer's strategy runs them.

Contract: every batch goes through ``trainer.strategy.batch_to_device`` (under ``FPDTStrategy``: checked, agreed on
by the sequence-parallel group, and cut to this rank's shard in the FPDT layout), then the module's own
``hidden_states`` under ``torch.no_grad``: the same sequence-parallel, chunked, offloaded pipeline that trains it,
at the training length, keeping nothing for backward. Without a trainer (one process, a notebook) the module's
``prepared`` makes the same batch for one rank.

Batches are split over the data-parallel groups (the strategy's ``distributed_sampler_kwargs``); every rank runs
the same number of batches (a group with fewer runs repeats of its first, whose scores are dropped), because
every forward holds collectives of the whole world (the batch gate's all-gather; FSDP's). The scores are then
summed over the world once (:func:`~lightning_fpdt.evaluation.scoring.sum_over_world`), so every rank ends with
every sample's exact score.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch import Tensor, nn

from lightning_fpdt.errors import WrongType
from lightning_fpdt.evaluation.samples import EvalSample
from lightning_fpdt.evaluation.scoring import SCORES, answer_scores, max_over_world, position_sums, sum_over_world

# the keys of a held-out document that say what its targets are; "all" keeps only those that say where its
# documents and padding are
_TARGET_KEYS = ("labels", "shift_labels", "loss_mask")
_DOCUMENT_KEYS = ("input_ids", "position_ids", "attention_mask")


def data_parallel_coordinates(trainer: pl.Trainer | None) -> tuple[int, int]:
    """``(groups, this rank's group)``: the data-parallel split the strategy's sampler uses (``(1, 0)`` alone)."""
    if trainer is None:
        return 1, 0
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
    return int(kwargs.get("num_replicas", 1)), int(kwargs.get("rank", 0))


def schedule(groups: Sequence[Sequence[int]], batch_size: int, dp_size: int, dp_rank: int
             ) -> list[tuple[list[int], bool]]:
    """This data-parallel group's batches: ``(indices, scored)`` per batch.

    Args:
        groups: indices that may share a batch (one list per sequence length).
        batch_size: samples per batch.
        dp_size / dp_rank: the data-parallel split.

    Returns:
        every ``dp_size``-th batch from ``dp_rank``; the same count on every group, padded with unscored repeats.
    """
    batches = [list(g[i:i + batch_size]) for g in groups for i in range(0, len(g), batch_size)]
    if not batches:
        return []
    mine = [(b, True) for b in batches[dp_rank::dp_size]]
    if len(mine) < -(-len(batches) // dp_size):  # this group's last turn falls in the padding
        mine.append((batches[0], False))
    return mine


def forward(module: nn.Module, trainer: pl.Trainer | None, batch: dict[str, Any]) -> tuple[Tensor, dict[str, Any]]:
    """``(hidden [batch, s_local, hidden], the prepared batch)`` of one batch of whole sequences, without gradients.

    Raises:
        TypeError: a module without ``hidden_states(batch)`` and ``prepared(batch)`` (a ``CausalLM``'s).
    """
    for method in ("hidden_states", "prepared"):
        if not callable(getattr(module, method, None)):
            raise WrongType(f"LongContextEvaluation: {type(module).__name__} has no {method}(batch); evaluate a"
                            " CausalLM or HFCausalLM (or a module with their hidden_states/prepared methods).")
    if trainer is not None:  # FPDTStrategy: the batch gate and this rank's shard
        batch = trainer.strategy.batch_to_device(batch)
    else:
        device = next(module.parameters()).device
        complete = getattr(module, "complete_batch", None)
        batch = move_data_to_device(complete(batch) if complete is not None else batch, device)
    batch = module.prepared(batch)  # one process: the one-rank shard; already sharded batches pass through
    with torch.no_grad():
        return module.hidden_states(batch), batch


@torch.no_grad()
def score_samples(module: nn.Module, samples: Sequence[EvalSample], batch_size: int = 1,
                  trainer: pl.Trainer | None = None, tile_tokens: int = 1024) -> Tensor:
    """Every sample's answer scores (:data:`~lightning_fpdt.evaluation.scoring.SCORES`), the same on every rank.

    Args:
        module: the LightningModule, bound by its strategy.
        samples: identical on every rank (generated from the same seeds).
        batch_size: samples per forward (of one length).
        trainer: the trainer whose strategy runs the batches, or ``None`` (one process).
        tile_tokens: answer tokens whose logits exist at once.

    Returns:
        ``[len(samples), 3]`` float64 on the module's device.
    """
    dp_size, dp_rank = data_parallel_coordinates(trainer)
    by_length: dict[int, list[int]] = {}
    for i, s in enumerate(samples):
        by_length.setdefault(len(s.input_ids), []).append(i)
    device = next(module.parameters()).device
    scores = torch.zeros(len(samples), len(SCORES), dtype=torch.float64, device=device)
    for indices, scored in schedule(list(by_length.values()), batch_size, dp_size, dp_rank):
        batch = {"input_ids": torch.tensor([samples[i].input_ids for i in indices], dtype=torch.long),
                 "labels": torch.tensor([samples[i].labels() for i in indices], dtype=torch.long)}
        hidden, batch = forward(module, trainer, batch)
        if scored:
            scores[indices] += answer_scores(module, hidden, batch["shift_labels"], tile_tokens).to(device)
    return sum_over_world(scores)


def document_items(data: Any, limit: int | None, targets: Literal["all", "labels"] = "all") -> list[dict[str, Tensor]]:
    """The first ``limit`` items of ``data`` (a map-style or iterable dataset of dict items with ``input_ids``
    ``[seq]``), with only the keys that say what is scored: ``"all"``: every next token of each document
    (``input_ids``, ``position_ids``, ``attention_mask``), ``"labels"``: the item's own ``labels``/``loss_mask`` too.

    Raises:
        TypeError: an item that is not a dict with a one-dimensional ``input_ids``.
    """
    keep = _DOCUMENT_KEYS + (_TARGET_KEYS if targets == "labels" else ())
    items = []
    for item in _first(data, limit):
        ids = item.get("input_ids") if isinstance(item, Mapping) else None
        if ids is None or torch.as_tensor(ids).dim() != 1:
            raise WrongType("LongContextEvaluation: position_data must yield dict items with 'input_ids' [seq] (a"
                            f" data set's items, before batching); got {type(item).__name__}.")
        items.append({k: torch.as_tensor(v) for k, v in item.items() if k in keep})
    return items


def _first(data: Any, limit: int | None) -> Iterator[Any]:
    if hasattr(data, "__getitem__") and hasattr(data, "__len__"):
        for i in range(len(data) if limit is None else min(limit, len(data))):
            yield data[i]
        return
    if not isinstance(data, Iterable):
        raise WrongType(f"LongContextEvaluation: position_data is a {type(data).__name__}; give a data set.")
    for i, item in enumerate(data):
        if limit is not None and i >= limit:
            return
        yield item


@torch.no_grad()
def position_loss_sums(module: nn.Module, items: Sequence[dict[str, Tensor]], batch_size: int = 1,
                       trainer: pl.Trainer | None = None, tile_tokens: int = 1024) -> Tensor:
    """Summed next-token loss and target count per position over ``items`` (:func:`document_items`), the same on
    every rank.

    Returns:
        ``[2, positions]`` float64 (see :func:`~lightning_fpdt.evaluation.scoring.position_sums`).
    """
    dp_size, dp_rank = data_parallel_coordinates(trainer)
    by_shape: dict[tuple[Any, ...], list[int]] = {}
    for i, item in enumerate(items):
        by_shape.setdefault((item["input_ids"].shape[0], tuple(sorted(item))), []).append(i)
    device = next(module.parameters()).device
    parts = []
    for indices, scored in schedule(list(by_shape.values()), batch_size, dp_size, dp_rank):
        batch = {k: torch.stack([items[i][k] for i in indices]) for k in items[indices[0]]}
        hidden, batch = forward(module, trainer, batch)
        if scored:
            parts.append(position_sums(module, hidden, batch["shift_labels"], batch["position_ids"], tile_tokens))
    size = max_over_world(max((p.shape[1] for p in parts), default=0), device)
    total = torch.zeros(2, size, dtype=torch.float64, device=device)
    for p in parts:
        total[:, : p.shape[1]] += p.to(device)
    return sum_over_world(total)
