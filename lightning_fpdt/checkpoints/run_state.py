"""What a training checkpoint keeps of the run besides Lightning's own state: every rank's random number
generator states and the parallelism the run had, under the checkpoint's ``"fpdt"`` key.

Saving gathers every rank's states (a collective); resuming restores this rank's, taking those of
``rank % saved ranks`` when the run has more ranks than the checkpoint, and logs a change of parallelism
(the model and optimizer states load by name into any parallelism: :mod:`lightning_fpdt.checkpoints.files`).
Only tensors and plain Python values, so the checkpoint loads with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

KEY = "fpdt"  # the checkpoint's entry
_PARALLELISM = "layout"  # on disk since the first release: checkpoints written before keep loading
_RNG = "rng"


def parallelism_state(
    data_parallel: int, sequence_parallel: int, chunk_size: Any, shard_parameters: bool
) -> dict[str, Any]:
    """The data x sequence parallelism a checkpoint is saved with (plain types)."""
    return {"data_parallel": data_parallel, "sequence_parallel": sequence_parallel, "chunk_size": chunk_size,
            "shard_parameters": shard_parameters}


def add_run_state(checkpoint: dict[str, Any], world_size: int, parallelism: dict[str, Any]) -> None:
    """Every rank: put every rank's RNG states and ``parallelism`` (:func:`parallelism_state`) into
    ``checkpoint``'s ``"fpdt"`` entry (a collective when the process group exists)."""
    checkpoint[KEY] = {_PARALLELISM: parallelism, _RNG: gather_rng_states(world_size)}


def restore_run_state(checkpoint: dict[str, Any], rank: int, parallelism_now: dict[str, Any]) -> None:
    """Restore this rank's RNG states from ``checkpoint``'s ``"fpdt"`` entry and log the parallelism change.

    A run with more ranks than the checkpoint's takes the states of ``rank % saved ranks``; a checkpoint
    without the entry (not written by this strategy) changes nothing.
    """
    saved = checkpoint.get(KEY, {})
    if saved.get(_PARALLELISM):
        rank_zero_info(f"FPDTStrategy: resuming a checkpoint saved at {_describe(saved[_PARALLELISM])} as"
                       f" {_describe(parallelism_now)}")
    rngs = saved.get(_RNG)
    if rngs:
        set_rng_state(rngs[rank % len(rngs)])


def _describe(parallelism: dict[str, Any]) -> str:
    return (f"data_parallel={parallelism['data_parallel']} x sequence_parallel={parallelism['sequence_parallel']}"
            f" (chunk_size={parallelism['chunk_size']!r}, shard_parameters={parallelism['shard_parameters']})")


def gather_rng_states(world_size: int) -> list[dict[str, Any]]:
    """Every rank's :func:`rng_state`, in rank order (a collective when the process group exists)."""
    if world_size == 1 or not torch.distributed.is_initialized():
        return [rng_state()]
    states: list[Any] = [None] * world_size
    torch.distributed.all_gather_object(states, rng_state())
    return states


def rng_state() -> dict[str, Any]:
    """This process's random number generator states (Python, torch CPU and CUDA, numpy), as tensors and
    plain Python values, so that a checkpoint holding them loads with ``torch.load(weights_only=True)``."""
    version, words, gauss = random.getstate()
    state: dict[str, Any] = {"python": [version, list(words), gauss], "torch": torch.get_rng_state()}
    # not is_available(): on a CUDA build without a driver it starts the CUDA runtime's count, and no process forked
    # afterwards can launch ranks with Lightning's fork launcher
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # this rank's device only: resumable with other GPU counts
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the states :func:`rng_state` returned."""
    version, words, gauss = state["python"]
    random.setstate((version, tuple(words), gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "numpy" in state:
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.int64).astype(np.uint32), pos, has_gauss, cached))
