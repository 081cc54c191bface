"""Checkpoints that survive crashes and layout changes.

- Replicated weights: one Lightning checkpoint file, written by rank 0 to a temporary file in the
  same directory and renamed over the target (``os.replace`` is atomic): a crash mid-save leaves the
  previous file intact and at most a ``*.tmp-*`` file behind.
- Sharded weights (``shard_parameters=True``): a torch distributed checkpoint (DCP) directory,
  every rank writing its shards into ``<path>.tmp-<id>``; rank 0 adds the rest of the Lightning
  checkpoint (``meta.pt``) last and then swaps the directory in. A directory without ``meta.pt``
  is never a checkpoint (:func:`is_complete`).

Model and optimizer states are stored by parameter name (fully qualified names, not parameter ids),
so a checkpoint loads into any data x sequence layout, chunk size, sharded or not.
"""

from __future__ import annotations

import os
import random
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch

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
            " an earlier one (lightning_fpdt.checkpoint.latest_checkpoint finds the newest complete one)."
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


# ---- random number generators ------------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    """This process's random number generator states (Python, torch CPU and CUDA, numpy if present)."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # this rank's device only: resumable with other GPU counts
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "numpy" in state:
        try:
            import numpy as np

            np.random.set_state(state["numpy"])
        except ImportError:
            pass
