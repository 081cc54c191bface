"""Training checkpoints that survive crashes and changes of parallelism.

- Replicated weights: one Lightning checkpoint file, written by rank 0 to a temporary file in the
  same directory and renamed over the target (``os.replace`` is atomic): a crash mid-save leaves the
  previous file intact and at most a ``*.tmp-*`` file behind.
- Sharded weights (``shard_parameters=True``): a torch distributed checkpoint (DCP) directory,
  every rank writing its shards into ``<path>.tmp-<id>``; rank 0 adds the rest of the Lightning
  checkpoint (``meta.pt``) last and then swaps the directory in. A directory without ``meta.pt``
  is never a checkpoint (:func:`is_complete`).

Model and optimizer states are stored by parameter name (fully qualified names, not parameter ids),
so a checkpoint loads into any data x sequence parallelism, chunk size, sharded or not. What a checkpoint
keeps of the run besides (RNG states, the parallelism it was saved with): :mod:`lightning_fpdt.checkpoints.run_state`.
"""

from __future__ import annotations

import os
import pickle
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from lightning_fpdt.errors import FPDTError, described, first_line
from lightning_fpdt.layers.accumulation import optimizer_parameters

META_FILE = "meta.pt"


def is_remote(path: str) -> bool:
    """``s3://...``, ``gs://...``: a path for fsspec, not for this module's local renames."""
    return "://" in path and not path.startswith("file://")


def atomic_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` to ``path`` so that readers see the old file or the complete new one, never a part.

    A directory at ``path`` (a sharded checkpoint of the same name) is replaced the same way.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        if path.is_dir():
            swap_in(tmp, path)
        else:
            os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_dir(path.parent)


def remove(path: Path) -> None:
    """Delete a checkpoint file or directory; a directory is renamed first, so a crash mid-delete
    leaves ``*.tmp-del-*`` (never loaded) rather than a checkpoint with missing shards."""
    if path.is_dir():
        doomed = path.with_name(f"{path.name}.tmp-del-{uuid.uuid4().hex[:8]}")
        os.replace(path, doomed)
        shutil.rmtree(doomed)
    elif path.exists():
        path.unlink()


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_complete(path: str | os.PathLike) -> bool:
    """A checkpoint file, or a DCP directory whose ``meta.pt`` (written last) exists."""
    path = Path(path)
    return path.is_file() or (path.is_dir() and (path / META_FILE).is_file())


def temporary_path(path: str | os.PathLike, token: str) -> Path:
    """Where the shards of ``path`` are written before the swap (``token`` is the same on all ranks)."""
    path = Path(path)
    return path.with_name(f"{path.name}.tmp-{token}")


def swap_in(tmp: Path, path: Path) -> None:
    """Rank 0, after every rank wrote into ``tmp``: make ``tmp`` the checkpoint at ``path``.

    A previous checkpoint at ``path`` is renamed to ``<path>.old`` first and removed after the swap;
    :func:`resolve` falls back to it when a crash came between the two renames.
    """
    old = path.with_name(f"{path.name}.old")
    remove(old)
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    remove(old)


def resolve(path: str | os.PathLike) -> Path:
    """The complete checkpoint to load for ``path`` (``<path>.old`` if a swap was interrupted).

    Raises:
        FileNotFoundError: nothing complete at ``path``, naming what was found instead.
    """
    path = Path(path)
    if is_complete(path):
        return path
    old = path.with_name(f"{path.name}.old")
    if not path.exists() and is_complete(old):
        return old
    if path.is_dir():
        raise FileNotFoundError(
            f"{path} is an incomplete sharded checkpoint (no {META_FILE}: its save was interrupted); resume from"
            " an earlier one (lightning_fpdt.checkpoints.files.latest_checkpoint finds the newest complete one)."
        )
    raise FileNotFoundError(f"no checkpoint at {path}")


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The most recently written complete checkpoint (``*.ckpt`` file or directory) in ``directory``,
    skipping temporary and interrupted ones; ``None`` if there is none."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    done = [p for p in directory.iterdir() if p.name.endswith(".ckpt") and is_complete(p)]
    # a swap interrupted between its two renames left only `<name>.old`: still the latest of that name
    names = {p.name for p in directory.iterdir()}
    done += [p for p in directory.iterdir()
             if p.name.endswith(".ckpt.old") and p.name[: -len(".old")] not in names and is_complete(p)]
    if not done:
        return None

    def written(p: Path) -> float:
        return (p / META_FILE).stat().st_mtime if p.is_dir() else p.stat().st_mtime

    return max(done, key=written)


def new_token() -> str:
    return uuid.uuid4().hex[:12]


# ---- saving and loading ----------------------------------------------------------------------------


def model_state(module: torch.nn.Module) -> dict[str, Any]:
    """The model state of a module sharded with FSDP2, by name: this rank's shards (DTensors)."""
    return get_model_state_dict(module)


def optimizer_state(module: torch.nn.Module, optimizer: Any, sharded: bool) -> dict[str, Any]:
    """``optimizer``'s state keyed by parameter name (loads into any parallelism): this rank's shards when
    ``sharded``, else the full state."""
    optimizer = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer
    return get_optimizer_state_dict(module, optimizer, options=StateDictOptions(full_state_dict=not sharded))


def on_rank_zero(fn: Callable[[], None], what: str, is_global_zero: bool, broadcast: Callable[[Any], Any]) -> None:
    """Run ``fn`` on rank 0; if it fails, every rank raises (instead of waiting in the next barrier)."""
    error = None
    if is_global_zero:
        try:
            fn()
        except Exception as err:
            error = f"{type(err).__name__}: {err}"
    error = broadcast(error)
    if error is not None:
        raise RuntimeError(f"FPDTStrategy: {what} failed on rank 0: {error}")


def save_sharded(
    checkpoint: dict[str, Any],
    target: str,
    token: str,
    barrier: Callable[[str], None],
    on_rank_zero: Callable[[Callable[[], None], str], None],
) -> None:
    """Every rank: write this rank's shards of the model and optimizer states into ``<path>.tmp-<token>``;
    then rank 0 writes the rest of ``checkpoint`` as ``meta.pt`` (last: it marks the directory complete)
    and swaps the directory in.

    Args:
        checkpoint: Lightning's checkpoint dict, with ``state_dict`` and ``optimizer_states`` of this
            rank's shards (popped from it here).
        target: the checkpoint directory, a path every rank can see.
        token: the same on every rank (names the temporary directory).
        barrier: the strategy's barrier.
        on_rank_zero: runs a function on rank 0 and makes every rank raise if it fails.
    """
    if is_remote(target):
        raise FPDTError(
            f"FPDTStrategy: sharded checkpoints are written with torch.distributed.checkpoint to a path every rank"
            f" can see; {target!r} is not a local or shared-filesystem path. Mount it, or save replicated"
            " checkpoints (shard_parameters=False)."
        )
    path = Path(target)
    tmp = temporary_path(path, token)
    states = {"state_dict": checkpoint.pop("state_dict")}
    states.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
    dcp.save(states, checkpoint_id=tmp)
    barrier("fpdt_checkpoint_shards_written")

    def commit() -> None:
        atomic_save(checkpoint, tmp / META_FILE)
        swap_in(tmp, path)

    on_rank_zero(commit, f"saving {path}")


class CheckpointError(FPDTError):
    """A checkpoint that cannot be read or does not fit this run; the message names the file and why."""


def read(path: Path, mmap: bool = False) -> dict[str, Any]:
    """``torch.load`` of a checkpoint file (or a sharded directory's ``meta.pt``) with ``weights_only=True``
    (``mmap``: its tensors memory-mapped, read from disk when used).

    Checkpoints written by lightning-fpdt hold only tensors and plain Python values, so the safe loader
    reads them (as LightningCLI's does). Anything else is an error that names the file and what is wrong.

    Raises:
        CheckpointError: the file is truncated or corrupt, or holds objects the safe loader refuses.
    """
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        detail = next((line.strip() for line in str(err).splitlines() if "Unsupported global" in line
                       or "not an allowed global" in line), first_line(err))
        raise CheckpointError(
            f"FPDTStrategy: the checkpoint {path} holds objects that are not tensors or plain Python values"
            f" ({detail}). lightning-fpdt writes only those; this file was written by other code. Load it with the"
            " code that wrote it and save it again with lightning-fpdt, or add the class to"
            " torch.serialization.add_safe_globals if you trust the file."
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as err:
        raise CheckpointError(
            f"FPDTStrategy: the checkpoint {path} is truncated or corrupt ({first_line(err)}). Resume from an earlier"
            " checkpoint (lightning_fpdt.checkpoints.files.latest_checkpoint(dir) finds the newest complete one)."
        ) from None
    if not isinstance(checkpoint, dict) or ("state_dict" not in checkpoint and path.name != META_FILE):
        kind = (
            type(checkpoint).__name__ if not isinstance(checkpoint, dict)
            else f"a dict with keys {sorted(checkpoint)[:8]}"
        )
        raise CheckpointError(
            f"FPDTStrategy: {path} is not a Lightning checkpoint (it holds {kind}, without 'state_dict'). Pass the"
            " .ckpt file (or directory) that Trainer.fit wrote."
        )
    return checkpoint


def load_into(path: Path, module: torch.nn.Module, optimizers: list[Any], strict: bool = True) -> dict[str, Any]:
    """Load the checkpoint at ``path`` (a file or a sharded directory, see :func:`resolve`) into
    ``module`` and ``optimizers`` by parameter name, whatever parallelism it was saved with and however
    ``module`` is held now (sharded with FSDP2 or whole). Returns the rest of the checkpoint (loops,
    callbacks, the ``fpdt`` run state) for Lightning.
    """
    if path.is_dir():
        checkpoint = read(path / META_FILE)
        # the targets are held as in this run: shards (sharded) or full tensors (whole); DCP reshards
        states: dict[str, Any] = {"state_dict": get_model_state_dict(module)}
        for i, optimizer in enumerate(optimizers):
            states[f"optimizer_{i}"] = get_optimizer_state_dict(module, optimizer)
        try:
            dcp.load(states, checkpoint_id=path)
        except Exception as err:
            raise CheckpointError(
                f"FPDTStrategy: the sharded checkpoint {path} does not fit this model and its optimizers"
                f" ({described(err)}). Resume it with the"
                " model and optimizer configuration it was saved with."
            ) from None
        set_model_state_dict(module, states["state_dict"], options=StateDictOptions(strict=strict))
        for i, optimizer in enumerate(optimizers):
            set_optimizer_state_dict(module, optimizer, states[f"optimizer_{i}"])
        # what a checkpoint file holds, for Lightning (it checks that optimizer states exist) and the hooks
        checkpoint["state_dict"] = states["state_dict"]
        checkpoint["optimizer_states"] = [states[f"optimizer_{i}"] for i in range(len(optimizers))]
        return checkpoint
    checkpoint = read(path)
    apply_states(checkpoint, path, module, optimizers, strict)
    return checkpoint


def apply_states(checkpoint: dict[str, Any], source: Any, module: torch.nn.Module, optimizers: list[Any],
                 strict: bool = True) -> None:
    """Load a checkpoint dict's full model and optimizer states into ``module`` (whole or sharded with
    FSDP2) and ``optimizers``, by name. ``source`` names the checkpoint in errors."""
    try:
        if _is_sharded(module):  # full tensors by name -> this rank's shards
            set_model_state_dict(module, checkpoint["state_dict"],
                                 options=StateDictOptions(full_state_dict=True, strict=strict))
        else:
            module.load_state_dict(checkpoint["state_dict"], strict=strict)
    except RuntimeError as err:  # missing/unexpected keys or shapes: another model
        raise CheckpointError(
            f"FPDTStrategy: the checkpoint {source} does not fit {type(module).__name__}: {err}"
        ) from None
    for optimizer, state in zip(optimizers, checkpoint.get("optimizer_states", [])):
        set_optimizer_state(module, optimizer, state)


def _is_sharded(module: torch.nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in module.parameters())


def set_optimizer_state(module: torch.nn.Module, optimizer: Any, state: dict[str, Any]) -> None:
    """Load an optimizer state saved by name (lightning-fpdt) or by position (plain Lightning/DDP)."""
    if state.get("state") and all(isinstance(k, int) for k in state["state"]):  # `optimizer.state_dict()` (ids)
        if any(isinstance(p, DTensor) for p in optimizer_parameters(optimizer)):
            raise FPDTError(
                "FPDTStrategy: this checkpoint's optimizer state is keyed by parameter position (a plain"
                " Lightning/DDP checkpoint), which cannot be sharded by name. Resume it once with"
                " shard_parameters=False and save again (lightning-fpdt saves optimizer states by name),"
                " or load only the weights."
            )
        optimizer.load_state_dict(state)
    else:
        # an optimizer that keeps None in a state (SGD without momentum: momentum_buffer) makes it again when it is
        # missing; torch's loader by name places no None, and no state at all ("Expected device to be set"): then
        # only the groups' hyper-parameters (the learning rate the schedule reached) are loaded
        saved = state.get("state", {})
        kept = {name: {k: v for k, v in entry.items() if v is not None} for name, entry in saved.items()}
        state = {**state, "state": {name: entry for name, entry in kept.items() if entry}}
        if not state["state"] and len(state.get("param_groups", [])) == len(optimizer.param_groups):
            for group, saved_group in zip(optimizer.param_groups, state["param_groups"]):  # nothing per parameter
                group.update({k: v for k, v in saved_group.items() if k != "params"})
            return
        set_optimizer_state_dict(module, optimizer, state, options=StateDictOptions(full_state_dict=True))


def load_states(target: str, module: torch.nn.Module, optimizers: list[Any], read_remote: Callable[[], dict]) -> dict:
    """The checkpoint at ``target`` loaded into ``module`` and ``optimizers`` by name: a local file or directory
    (:func:`load_into`), or a remote one that ``read_remote`` reads (through fsspec) and :func:`apply_states` loads."""
    strict = getattr(module, "strict_loading", True)
    if is_remote(target):
        checkpoint = read_remote()
        apply_states(checkpoint, target, module, optimizers, strict=strict)
        return checkpoint
    return load_into(resolve(target), module, optimizers, strict=strict)
