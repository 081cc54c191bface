"""``chunk_size="auto"`` (the largest chunk that fits a budget, from :func:`~lightning_fpdt.memory.estimator.estimate`)
and the printed report of ``python -m lightning_fpdt.memory``."""

from __future__ import annotations

import dataclasses

from lightning_fpdt.errors import FPDTError
from lightning_fpdt.memory.estimate_options import EstimateOptions
from lightning_fpdt.memory.estimator import GIB, estimate, format_bytes
from lightning_fpdt.memory.shape import ModelShape
from lightning_fpdt.parallel.layout import layout_multiple


def auto_chunk_size(
    shape: ModelShape, seq_len: int, budget_bytes: int, options: EstimateOptions | None = None
) -> int | None:
    """The largest chunk size (a multiple of :func:`~lightning_fpdt.parallel.layout.layout_multiple` of the
    sequence-parallel and ring sizes, halving from the whole sequence) whose estimated device peak fits
    ``budget_bytes``; ``None`` means no chunking fits best (one chunk). ``options.chunk_size`` is not read.

    Raises:
        ValueError: when not even the smallest chunk fits, naming the estimate and the budget.
    """
    options = options or EstimateOptions()
    # every chunk is cut into one sub-chunk per rank and, with a ring, 2 x ring pieces (lightning_fpdt.parallel.layout)
    multiple = layout_multiple(options.sequence_parallel_size, options.ring_size)
    s_pad = -(-seq_len // multiple) * multiple
    candidates: list[int | None] = [None]  # no chunking first, then halving chunks (multiples of the layout's)
    size = s_pad // 2 // multiple * multiple
    while size >= multiple:
        candidates.append(size)
        size = size // 2 // multiple * multiple
    smallest = None
    for candidate in candidates:
        smallest = estimate(shape, seq_len, options.replace(chunk_size=candidate))
        if smallest.device_peak <= budget_bytes:
            return candidate
    assert smallest is not None
    raise FPDTError(
        f"chunk_size='auto': nothing fits a budget of {format_bytes(budget_bytes)} per rank at {seq_len} tokens; the"
        f" smallest chunk ({candidates[-1]}) still needs {format_bytes(smallest.device_peak)} (saved activations"
        f" {format_bytes(smallest.saved_activations)}, parameters+gradients+optimizer"
        f" {format_bytes(smallest.parameters + smallest.gradients + smallest.optimizer)})."
        " Turn on activation_checkpointing / offload / shard_parameters, raise sequence_parallel_size, shorten the"
        " sequence, or raise memory_budget."
    )


def report(shape: ModelShape, seq_len: int, options: EstimateOptions, budget_gib: float | None = None) -> str:
    """The estimate as printed by ``python -m lightning_fpdt.memory`` and by ``fpdt-train fit``: a header
    line with the run's options, then :meth:`MemoryEstimate.table`. ``chunk_size="auto"`` is resolved
    against ``budget_gib`` when given, else estimated as one chunk with a note."""
    lines = []
    if options.chunk_size == "auto":
        if budget_gib is not None:
            options = options.replace(chunk_size=auto_chunk_size(shape, seq_len, int(budget_gib * GIB), options))
            lines.append(f"chunk_size='auto' with a budget of {budget_gib} GiB per rank picks"
                         f" {chunk_words(options.chunk_size)}")
        else:
            options = options.replace(chunk_size=None)
            lines.append("chunk_size='auto' is picked at the first batch from the device's free memory;"
                         " estimated here as one chunk (give a budget to resolve it)")
    settings = ", ".join(f"{f.name}={getattr(options, f.name)}" for f in dataclasses.fields(options))
    lines.insert(0, f"memory estimate per rank: {shape.num_params / 1e6:.1f}M parameters, seq_len {seq_len},"
                    f" {settings}")
    lines.append(estimate(shape, seq_len, options).table())
    return "\n".join(lines)


def chunk_words(chunk_size: int | None) -> str:
    """A chunk size as the planner's lines say it: ``None`` is one chunk, the whole sequence (plain Ulysses)."""
    return "None (one chunk: the whole sequence)" if chunk_size is None else str(chunk_size)

