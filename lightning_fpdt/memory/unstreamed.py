"""The decoder layers that, checkpointed, are recomputed whole instead of streaming chunk by chunk
(:mod:`lightning_fpdt.layers.streaming`), named once when a model is bound, with what the memory model says they cost:
a layer recomputed whole holds its activations for the whole local sequence during its backward, where a streamed
layer holds two hidden vectors per token and one chunk's work.

The cost is the memory model's own (:func:`~lightning_fpdt.memory.estimate`): the growth of the estimated device peak
per token with the layers as they are, less its growth were they streamed, in hidden vectors per token of a rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_fpdt.errors import PREFIX, FPDTError
from lightning_fpdt.memory.estimate_options import PRECISION_BYTES, EstimateOptions
from lightning_fpdt.memory.estimator import estimate
from lightning_fpdt.memory.planning import run_options
from lightning_fpdt.memory.shape import LayerKind, ModelShape
from lightning_fpdt.parallel.binding import DecoderLayer, decoder_layers

_RING = ("its token mixers' state cannot be carried from chunk to chunk under a ring (ring_size > 1: the zigzag"
         " layout's chunks are not in sequence order)")


def unstreamed_layers(layers: list[DecoderLayer], ring_size: int = 1) -> list[tuple[str, str]]:
    """``(name, why)`` of each of ``layers`` that cannot stream whatever its arguments (and, under a ring of
    ``ring_size``, each layer whose token mixers carry state), in layer order."""
    found = []
    for layer in layers:
        why = layer.stream_refusal or (_RING if ring_size > 1 and layer.mixers else None)
        if why is not None:
            found.append((layer.name, why))
    return found


def unstreamed_cost(shape: ModelShape, options: EstimateOptions) -> float:
    """Hidden vectors per token of a rank that the estimated device peak grows by because ``shape``'s layers that
    cannot stream (a token mixer besides attention, or a refusal) are recomputed whole, against the same layers
    streaming as an attention layer with its MLP does (0 where every layer streams, or none could: no chunking, no
    checkpointing).

    Raises:
        FPDTError: ``options.chunk_size`` is ``"auto"`` or ``None`` (the cost depends on the chunk).
    """
    chunk = options.chunk_size
    if not isinstance(chunk, int):
        raise FPDTError(f"unstreamed_cost needs a chunk size in tokens, got {chunk!r}")
    # each layer that cannot stream as one that streams: attention and its MLP, no other mixer
    streamed = dataclasses.replace(shape, layers=tuple(
        k if k.can_stream(options.ring_size) else LayerKind(attention=True, mlp=k.mlp) for k in shape.layer_kinds()))
    short, long = 4 * chunk, 8 * chunk  # four and eight chunks per rank: every layer that can stream does

    def growth(s: ModelShape) -> float:  # bytes per global token
        return (estimate(s, long, options).device_peak - estimate(s, short, options).device_peak) / (long - short)

    per_local_token = (growth(shape) - growth(streamed)) * options.sequence_parallel_size / options.batch_size
    return per_local_token / (shape.hidden_size * PRECISION_BYTES[options.precision][1])


def _names(names: list[str]) -> str:
    return ", ".join(names) if len(names) <= 4 else f"{', '.join(names[:3])}, ... {names[-1]} ({len(names)} layers)"


def report_unstreamed(module: pl.LightningModule, options: EstimateOptions,
                      log: Callable[[str], None] = rank_zero_info) -> str | None:
    """Name, in one line (logged once with ``log``, and returned), the decoder layers of ``module`` that a checkpointed
    run recomputes whole, why, and their cost (:func:`unstreamed_cost`, where the chunk size is known and the memory
    model can size the model); ``None`` (nothing logged) where every layer streams or nothing is checkpointed."""
    layers = decoder_layers(module)
    refused = unstreamed_layers(layers, options.ring_size)
    if not refused or not options.activation_checkpointing or not options.streaming:
        return None
    reasons: dict[str, list[str]] = {}
    for name, why in refused:
        reasons.setdefault(why, []).append(name)
    total = len(layers)
    why = "; ".join(f"{_names(names)}: {reason}" for reason, names in reasons.items())
    line = (f"{PREFIX}{len(refused)} of {total} decoder layers are recomputed whole under activation checkpointing,"
            f" not streamed chunk by chunk ({why})")
    try:
        shape, sized = run_options(options, module, batch_size=1)
        cost = unstreamed_cost(shape, sized)
    except (FPDTError, ValueError):  # chunk_size 'auto' or None, or a model the memory model cannot size
        cost = None
    if cost is not None:
        line += (f"; the memory model counts them whole: {cost:+.1f} hidden vectors per token of a rank at the"
                 " peak against streaming them")
    log(line)
    return line


__all__ = ["report_unstreamed", "unstreamed_cost", "unstreamed_layers"]
