"""``chunk_size="auto"``: the per-rank memory budget and the chunk size picked for each batch shape.

The decision is the memory model's (:func:`lightning_fpdt.memory.auto_chunk_size`: the largest chunk
whose estimated device peak fits the budget). This module owns what the strategy needs around it:

- the budget, resolved once at setup: the user's ``memory_budget`` in GiB, or 90% of the free device
  memory (CUDA) or of the host's available memory shared by the node's processes (CPU), the minimum
  over all ranks so that every rank picks the same chunk size (the layout must agree across the
  sequence-parallel group, or the all-to-alls would not match);
- one decision per ``(batch, seq_len)`` shape, made at that shape's first batch and logged.

``keep_attention="auto"`` is planned the same way (:class:`AnswerPlanner`): per batch shape, the recomputed layers
keep their attention answers (:mod:`lightning_fpdt.attention.kept_answers`) where the memory model says they fit
where they live (host memory with ``offload=True``, else the device), against room resolved once at setup.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_fpdt.errors import PREFIX, FPDTError
from lightning_fpdt.memory import GIB, EstimateOptions, ModelShape, auto_chunk_size, estimate, format_bytes
from lightning_fpdt.memory.sizing import chunk_words

BUDGET_FRACTION = 0.9  # of the free memory: the rest is the allocator's fragmentation and the CUDA context


def optimizer_kind(optimizer: Any) -> str:
    """``"adamw"`` (two moments per parameter), ``"sgd"`` (one momentum buffer) or ``"none"``."""
    return _kind(type(optimizer).__name__, optimizer.defaults.get("momentum", 0))


def optimizer_spec_kind(spec: dict[str, Any] | None) -> str:
    """:func:`optimizer_kind` of the optimizer a ``CausalLM``'s ``optimizer`` spec will make (``{"class_path",
    "init_args"}``; ``None``: its default AdamW), before it is made: for the estimate printed before a run starts."""
    if spec is None:
        return "adamw"
    return _kind(spec["class_path"].rsplit(".", 1)[-1], (spec.get("init_args") or {}).get("momentum", 0))


def _kind(class_name: str, momentum: float) -> str:
    name = class_name.lower()
    if "adam" in name or "lamb" in name:
        return "adamw"
    if name == "sgd" and momentum:
        return "sgd"
    return "none" if name == "sgd" else "adamw"  # unknown optimizers: assume two states (conservative)


def available_memory(device: Any, local_processes: int = 1) -> int:
    """Bytes this rank may use: the CUDA device's free memory, or on CPU the host's available memory
    (``MemAvailable``) shared by the ``local_processes`` ranks on this host."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024 // max(1, local_processes)


def resolve_budget(memory_budget_gib: float | None, device: torch.device, local_processes: int, world_size: int) -> int:
    """Bytes per rank that ``chunk_size="auto"`` plans for; a collective when ``world_size > 1`` and no
    explicit budget is given (every rank must plan for the tightest rank)."""
    if memory_budget_gib is not None:
        return int(memory_budget_gib * GIB)
    free = available_memory(device, local_processes)
    budget = torch.tensor([int(BUDGET_FRACTION * free)], dtype=torch.int64, device=device)
    if world_size > 1:
        torch.distributed.all_reduce(budget, op=torch.distributed.ReduceOp.MIN)
    return int(budget.item())


def batch_shape(batch: Any) -> tuple[int, int] | None:
    """``(batch size, sequence length)`` of a dict batch with ``input_ids`` ``[batch, seq]``; ``None`` for any other
    batch."""
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    return (ids.shape[0], ids.shape[-1]) if isinstance(ids, torch.Tensor) else None


def run_options(options: EstimateOptions, module: pl.LightningModule, batch_size: int, **changes: Any
                ) -> tuple[ModelShape, EstimateOptions]:
    """The shape of ``module`` and ``options`` for a run of it on batches of ``batch_size``: its trainer's precision
    and optimizer, its tiling, and ``changes``.

    Raises:
        ValueError: a model the memory model cannot size (``ModelShape.from_module``).
    """
    shape, tiling = ModelShape.from_module(module)
    trainer = module._trainer
    optimizers = trainer.optimizers if trainer is not None else []
    return shape, options.replace(
        batch_size=batch_size, precision=str(trainer.precision) if trainer is not None else "32-true",
        optimizer=optimizer_kind(optimizers[0]) if optimizers else "none", **tiling, **changes,
    )


class ChunkPlanner:
    """Picks and remembers the chunk size for each batch shape under ``chunk_size="auto"``.

    Args:
        budget_bytes: the per-rank budget (:func:`resolve_budget`).
        options: the strategy's estimate options (:meth:`EstimateOptions.from_strategy`); the batch size,
            precision, optimizer and tiling are filled in per batch shape from the module and its trainer.
    """

    def __init__(self, budget_bytes: int, options: EstimateOptions) -> None:
        self.budget_bytes = budget_bytes
        self._options = options
        self._chosen: dict[tuple[int, int], int | None] = {}

    @property
    def planned(self) -> bool:
        """Whether a chunk size was picked for any batch shape yet."""
        return bool(self._chosen)

    def chunk_size_for(self, module: pl.LightningModule, batch: Any, current: int | None) -> int | None:
        """The chunk size for a dict batch with ``input_ids`` ``[batch, seq]`` (:meth:`chunk_size`); ``current``
        for any other batch (sharding refuses it or passes it through)."""
        found = batch_shape(batch)
        return current if found is None else self.chunk_size(module, *found)

    def chunk_size(self, module: pl.LightningModule, batch_size: int, seq_len: int) -> int | None:
        """The chunk size for batches of ``batch_size x seq_len`` tokens (``None``: one chunk fits).

        Raises:
            ValueError: when not even the smallest chunk fits the budget (the same on every rank).
        """
        key = (batch_size, seq_len)
        if key in self._chosen:
            return self._chosen[key]
        shape, options = run_options(self._options, module, batch_size)
        try:
            chunk = auto_chunk_size(shape, seq_len, self.budget_bytes, options)
        except ValueError as err:
            raise FPDTError(f"{PREFIX}{err}") from None
        peak = estimate(shape, seq_len, options.replace(chunk_size=chunk)).device_peak
        self._chosen[key] = chunk
        rank_zero_info(
            f"{PREFIX}chunk_size='auto' picked {chunk_words(chunk)} for batches of {batch_size} x {seq_len} tokens"
            f" (estimated device peak {format_bytes(peak)} per rank, budget {format_bytes(self.budget_bytes)})"
        )
        return chunk


def resolve_room(offload_on: bool, device: torch.device, local_processes: int, world_size: int) -> int:
    """Bytes per rank the kept attention answers may fill up to, with everything else the memory model counts:
    90% of the host's available memory shared by this node's processes (``offload_on``: they live there), else of
    the device's free memory; the smallest over all ranks (a collective when ``world_size > 1``)."""
    where = torch.device("cpu") if offload_on else device
    room = torch.tensor([int(BUDGET_FRACTION * available_memory(where, local_processes))], dtype=torch.int64,
                        device=device)
    if world_size > 1:
        torch.distributed.all_reduce(room, op=torch.distributed.ReduceOp.MIN)
    return int(room.item())


class AnswerPlanner:
    """``keep_attention="auto"``: whether recomputed layers keep their attention answers, per batch shape.

    On where the memory model's estimate with the answers kept fits ``room_bytes`` (:func:`resolve_room`): its host
    bytes with ``offload=True`` (the answers' home then), else its device peak. Turned off, it says so once, with
    the numbers and the fix.
    """

    def __init__(self, room_bytes: int, options: EstimateOptions) -> None:
        self.room_bytes = room_bytes
        self._options = options.replace(keep_attention=True)
        self._chosen: dict[tuple[int, int, int | None], bool] = {}
        self._said = False

    def keep_for(self, module: pl.LightningModule, batch: Any, chunk_size: int | None, current: bool) -> bool:
        """The decision for a dict batch with ``input_ids`` ``[batch, seq]`` in chunks of ``chunk_size``; ``current``
        for any other batch."""
        found = batch_shape(batch)
        if found is None:
            return current
        key = (*found, chunk_size)
        if key not in self._chosen:
            self._chosen[key] = self._decide(module, *key)
        return self._chosen[key]

    def _decide(self, module: pl.LightningModule, batch_size: int, seq_len: int, chunk_size: int | None) -> bool:
        try:
            shape, options = run_options(self._options, module, batch_size, chunk_size=chunk_size)
        except ValueError as err:
            self._say(f"keep_attention='auto' cannot size this model ({err}), so recomputed layers compute attention"
                      " again; set keep_attention=True to keep it anyway")
            return False
        found = estimate(shape, seq_len, options)
        needed = found.host if options.offload else found.device_peak
        if needed <= self.room_bytes:
            return True
        where = "host memory" if options.offload else "device memory"
        self._say(f"keep_attention='auto': for batches of {batch_size} x {seq_len} tokens the kept attention answers"
                  f" ({format_bytes(found.kept_answers)} per rank) would take the estimate to {format_bytes(needed)} of"
                  f" {where}, over the {format_bytes(self.room_bytes)} there is, so recomputed layers compute attention"
                  " again (about a quarter of a long step); free memory, or set keep_attention=True to keep it anyway")
        return False

    def _say(self, message: str) -> None:
        if not self._said:
            self._said = True
            rank_zero_info(f"{PREFIX}{message}")


@dataclass
class RunPlans:
    """A run's planners (:func:`run_planners`), each ``None`` where it is not asked for: the chunk size with
    ``chunk_size="auto"``, whether recomputed layers keep their attention answers with ``keep_attention="auto"``."""

    chunks: ChunkPlanner | None = None
    answers: AnswerPlanner | None = None

    def for_batch(self, module: pl.LightningModule, batch: Any, chunk: int | None,
                  keep: bool) -> tuple[int | None, bool]:
        """The chunk size and the answers' keeping for ``batch``'s shape (``chunk`` and ``keep`` where not planned)."""
        if self.chunks is not None:
            chunk = self.chunks.chunk_size_for(module, batch, chunk)
        if self.answers is not None:
            keep = self.answers.keep_for(module, batch, chunk, keep)
        return chunk, keep


def run_planners(
    chunk_auto: bool, keep_auto: bool, memory_budget_gib: float | None, offload_on: bool, options: EstimateOptions,
    device: torch.device, local_processes: int, world_size: int,
) -> RunPlans:
    """A run's planners, made once its process group is up (each resolves its room by a collective when
    ``world_size > 1``): the chunk planner with ``chunk_size="auto"`` (``chunk_auto``), the kept-answers planner with
    ``keep_attention="auto"`` under activation checkpointing (``keep_auto``)."""
    plans = RunPlans()
    if chunk_auto:
        plans.chunks = ChunkPlanner(resolve_budget(memory_budget_gib, device, local_processes, world_size), options)
    if keep_auto:
        plans.answers = AnswerPlanner(resolve_room(offload_on, device, local_processes, world_size), options)
    return plans
