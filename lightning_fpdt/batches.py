"""Each batch checked where it enters, and refused together on every rank, never half-way.

A batch is sharded on each rank by pure local code (:func:`lightning_fpdt.layout.shard_batch`); the
first collective it meets is an all-to-all inside attention. If the ranks of one sequence-parallel
group hold different batches (different lengths: a hang until the process-group timeout; the same
length and different tokens: silently wrong training), or one rank refuses its batch while the
others go on, some ranks wait forever. :class:`BatchGate` prevents both with one small collective per
batch, before anything else communicates:

1. locally, never raising: a summary of the batch (rank of ``input_ids``, its shape, a fingerprint
   of the token ids), then the checks of :func:`check_tokens` and the sharding, errors kept;
2. one ``all_gather`` of a ``[world, 6]`` int64 table (summary + "refused" flag);
3. every rank reads the same table: a sequence-parallel group whose ranks disagree raises on all of
   its ranks, naming the ranks and the shapes; a refused batch raises its own error on its ranks and
   "another group's batch was refused" everywhere else.

Cost: the fingerprint is one multiply-add pass over the token ids (``batch x seq`` int64) and the
all_gather moves 48 bytes per rank; benchmarks/batch_gate.py measures it against a training step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightning_fpdt.errors import PREFIX
from lightning_fpdt.layout import IGNORE_INDEX

_NOT_A_TENSOR = -1  # summary entry when 'input_ids' is missing or not a tensor
_MIX = 0x9E3779B1  # odd multiplier: the fingerprint weighs each position differently


def input_vocab_size(module: nn.Module) -> int | None:
    """Tokens the module embeds: its ``get_input_embeddings()`` (Hugging Face models) or its first
    ``nn.Embedding`` in module order (the token embedding of the bundled models); ``None`` if none."""
    get = getattr(module, "get_input_embeddings", None)
    embedding = get() if callable(get) else None
    if not isinstance(embedding, nn.Embedding):
        embedding = next((m for m in module.modules() if isinstance(m, nn.Embedding)), None)
    return None if embedding is None else embedding.num_embeddings


def target_tokens(batch: Any) -> int | None:
    """Target tokens in this rank's shard of a batch (``shift_labels`` other than -100); ``None`` when the
    batch does not say (not a sharded dict batch)."""
    labels = batch.get("shift_labels") if isinstance(batch, Mapping) else None
    if not isinstance(labels, Tensor):
        return None
    return int((labels != IGNORE_INDEX).sum())


def summary(batch: Any) -> list[int]:
    """``[ndim, batch, seq, fingerprint, n_elements]`` of ``batch["input_ids"]``; never raises."""
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    if not isinstance(ids, Tensor):
        return [_NOT_A_TENSOR, 0, 0, 0, 0]
    shape = list(ids.shape[:2]) + [0] * (2 - min(ids.dim(), 2))
    flat = ids.detach().reshape(-1)
    if flat.numel() == 0 or ids.is_floating_point() or ids.is_complex():
        fingerprint = 0  # refused by check_tokens; the shape still tells the ranks apart
    else:
        weights = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.int64) * _MIX
        fingerprint = int((flat.to(torch.int64) * weights).sum())  # wraps around in int64: fine for a hash
    return [ids.dim(), *shape, fingerprint, flat.numel()]


def check_tokens(batch: Any, vocab_size: int | None) -> None:
    """Refuse ``input_ids``/``labels`` that are empty, not integers, or outside the vocabulary.

    Raises:
        ValueError: an empty batch, or ids/labels out of range (the key, the values and the fix).
        TypeError: ids/labels of a floating-point or bool dtype.
    """
    if not isinstance(batch, Mapping):
        return  # shard_batch says what it needs
    for key in ("input_ids", "labels", "shift_labels"):
        x = batch.get(key)
        if not isinstance(x, Tensor):
            continue
        if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            raise TypeError(
                f"{PREFIX}batch[{key!r}] has dtype {x.dtype}; token ids must be integers. Return"
                f" torch.long tensors from your dataset (e.g. torch.tensor(ids, dtype=torch.long))."
            )
        if x.numel() == 0:
            raise ValueError(
                f"{PREFIX}batch[{key!r}] is empty (shape {tuple(x.shape)}). Drop empty samples in your dataset or"
                " collate function; a batch needs at least one token per sequence-parallel rank."
            )
        if vocab_size is None:
            continue
        valid = x if key == "input_ids" else x[x != IGNORE_INDEX]
        if valid.numel() == 0:
            continue
        low, high = int(valid.min()), int(valid.max())
        if low < 0 or high >= vocab_size:
            allowed = f"[0, {vocab_size})" + ("" if key == "input_ids" else f" or {IGNORE_INDEX} (ignored)")
            raise ValueError(
                f"{PREFIX}batch[{key!r}] holds values from {low} to {high}, but the model's vocabulary has"
                f" {vocab_size} tokens: allowed are {allowed}. Check the tokenizer against the model's vocab_size."
            )


class BatchGate:
    """Checks and shards every batch, refusing it on every rank together (see the module docstring).

    Args:
        world_size: processes in the run.
        sequence_parallel_size: ranks per sequence-parallel group (consecutive global ranks).
        rank: this process's global rank.
        device: where the collective's tensor lives (the root device).
        vocab_size: the model's vocabulary (:func:`input_vocab_size`), ``None`` to skip the range check.
    """

    def __init__(self, world_size: int, sequence_parallel_size: int, rank: int, device: torch.device,
                 vocab_size: int | None) -> None:
        self.world_size, self.sp, self.rank = world_size, sequence_parallel_size, rank
        self.device, self.vocab_size = device, vocab_size

    def __call__(self, batch: Any, shard: Callable[[Any], Any]) -> Any:
        """``shard(batch)`` once every rank agrees; raises on every rank otherwise."""
        row = summary(batch)
        error: Exception | None = None
        try:
            check_tokens(batch, self.vocab_size)
            batch = shard(batch)
        except Exception as err:
            error = err
        if self.world_size == 1:
            if error is not None:
                raise error
            return batch
        mine = torch.tensor([*row, int(error is not None)], dtype=torch.int64, device=self.device)
        rows = [torch.empty_like(mine) for _ in range(self.world_size)]
        torch.distributed.all_gather(rows, mine)
        table = torch.stack(rows).tolist()
        first = self.rank // self.sp * self.sp
        self._check_group(table, first)
        if error is not None:
            raise error
        if any(r[-1] for r in table):
            raise ValueError(
                f"{PREFIX}another data-parallel group's batch was refused (its ranks raised the reason); stopping"
                " every rank."
            )
        if any(self._disagrees(table, start) for start in range(0, self.world_size, self.sp)):
            raise ValueError(
                f"{PREFIX}the ranks of another sequence-parallel group hold different batches (its ranks raised the"
                " reason); stopping every rank."
            )
        return batch

    def _disagrees(self, table: list[list[int]], first: int) -> bool:
        group = [r[:5] for r in table[first:first + self.sp]]
        return any(r != group[0] for r in group)

    def _check_group(self, table: list[list[int]], first: int) -> None:
        if not self._disagrees(table, first):
            return
        ranks = range(first, first + self.sp)
        shapes = ", ".join(f"rank {r}: {table[r][1:3] if table[r][0] >= 0 else 'no input_ids tensor'}" for r in ranks)
        same_shape = len({tuple(table[r][:3]) for r in ranks}) == 1
        what = "different token ids (same shape)" if same_shape else "different input_ids shapes"
        raise ValueError(
            f"{PREFIX}the ranks {list(ranks)} of one sequence-parallel group hold {what} ({shapes}). Every rank"
            " of a group must get the same batch: shard the data by data_parallel_rank only (Lightning's"
            " DistributedSampler does this with this strategy; a custom sampler or an IterableDataset must use"
            " trainer.strategy.distributed_sampler_kwargs), with the same seed and order on every rank."
        )
