"""The safetensors files of a model directory, read tensor by tensor or slice by slice, and the rows of a
sharded parameter this rank owns: the one reader of pretrained weights, shared by ``HFCausalLM``
(:mod:`lightning_fpdt.hf.weights`) and the bundled models' ``hf_checkpoint`` (:mod:`lightning_fpdt.models.pretrained`).

Each read opens its file, reads one tensor or one slice, and closes it: the memory map of a file is never held
beyond one read, so the pages read do not accumulate in the process's resident memory. Every rank reads its own
slices (no collective): a rank's peak is its shards plus the slice being read.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard

from lightning_fpdt.errors import FPDTError, first_line

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclass(frozen=True)
class SafetensorsFiles:
    """The safetensors files of a model directory (``save_pretrained``'s).

    Every file is opened through :meth:`open`, so a missing, truncated or corrupt one is an error that names it.

    Attributes:
        directory: the model directory.
        files: each tensor's key -> the file (in ``directory``) that holds it.
        owner: the LightningModule reading them, for messages.
    """

    directory: Path
    files: dict[str, str]
    owner: str = "HFCausalLM"

    @classmethod
    def find(cls, directory: str | Path, owner: str = "HFCausalLM") -> SafetensorsFiles | None:
        """The files in ``directory`` (``model.safetensors.index.json`` or ``model.safetensors``), or
        ``None`` when it has neither (a hub name, ``pytorch_model.bin`` files).

        Raises:
            ValueError: an index that is not JSON with a ``weight_map``, or a ``model.safetensors`` that cannot be
                read (truncated or corrupt), named.
        """
        directory = Path(directory)
        if (directory / INDEX_FILE).is_file():
            try:
                weight_map = json.loads((directory / INDEX_FILE).read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as err:
                raise FPDTError(f"{owner}: {directory / INDEX_FILE} is not a safetensors index ({type(err).__name__}:"
                                f" {err}); save the model again with save_pretrained, or download it again.") from None
            return cls(directory, dict(weight_map), owner)
        if (directory / SINGLE_FILE).is_file():
            files = cls(directory, {}, owner)
            with files.open(SINGLE_FILE) as f:
                return cls(directory, {key: SINGLE_FILE for key in f.keys()}, owner)
        return None

    @contextmanager
    def open(self, file: str) -> Iterator[Any]:
        """``safe_open`` of ``file`` (in the directory), closed on exit.

        Raises:
            FileNotFoundError: no such file (the index names a file the directory lacks).
            ValueError: a file safetensors cannot read (a truncated copy, another format).
        """
        path = self.directory / file
        try:
            handle = safe_open(str(path), framework="pt")
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.owner}: {path} does not exist, but {INDEX_FILE} names it; copy or download"
                                    " the whole checkpoint directory again.") from None
        except (SafetensorError, OSError) as err:
            size = f"; {path.stat().st_size} bytes" if path.is_file() else ""
            raise FPDTError(f"{self.owner}: the safetensors file {path} cannot be read ({first_line(err)}{size}): it is"
                            " truncated or corrupt. Copy or download it again, or save the model again with"
                            " save_pretrained.") from None
        with handle as f:
            yield f

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape, from the file headers (no tensor is read)."""
        shapes: dict[str, tuple[int, ...]] = {}
        for file in sorted(set(self.files.values())):
            with self.open(file) as f:
                for key in f.keys():
                    shapes[key] = tuple(f.get_slice(key).get_shape())
        return shapes

    def read(self, key: str, rows: tuple[int, int] | None = None, columns: tuple[int, int] | None = None) -> Tensor:
        """Tensor ``key`` in its stored dtype on the CPU: whole, rows ``start:end`` of dim 0 only, or columns
        ``start:end`` of dim 1 only (a transposed ``[in, out]`` weight's output rows: GPT-2's ``Conv1D``). A slice
        is a view of the memory-mapped file: only the pages that hold it are read, when it is copied.

        Raises:
            ValueError: both ``rows`` and ``columns``.
        """
        if rows is not None and columns is not None:
            raise FPDTError(f"SafetensorsFiles.read({key!r}): give rows or columns, not both.")
        with self.open(self.files[key]) as f:
            if rows is not None:
                return f.get_slice(key)[rows[0]:rows[1]]
            if columns is not None:
                return f.get_slice(key)[:, columns[0]:columns[1]]
            return f.get_tensor(key)


def tensor_names(model: nn.Module) -> dict[str, list[str]]:
    """What a weights directory must hold for ``model``: its first name -> all names, for each parameter (tied ones
    once, under every name they have) and each persistent buffer."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    for prefix, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and name not in module._non_persistent_buffers_set:
                names.setdefault(id(buffer), []).append(f"{prefix}.{name}" if prefix else name)
    return {group[0]: group for group in names.values()}


def fill_shard(target: Tensor, name: str, read: Callable[[tuple[int, int] | None], Tensor],
               owner: str) -> None:
    """Copy into this rank's shard of ``target`` (a DTensor sharded on dim 0, or a plain tensor: all of it) what
    ``read(rows)`` returns for the rows it owns (``None``: all rows); a rank that owns no rows reads nothing."""
    local = target.to_local() if isinstance(target, DTensor) else target
    rows = owned_rows(target, name, owner)
    if rows is None:
        local.copy_(read(None))
    elif rows[1] > rows[0]:  # a rank past the end of a short dim 0 owns no rows
        local.copy_(read(rows))


def owned_rows(tensor: Tensor, name: str, owner: str) -> tuple[int, int] | None:
    """The rows ``start, end`` of dim 0 this rank's shard of ``tensor`` holds (``None``: not a DTensor, so all).

    FSDP2 shards dim 0 as ``torch.chunk`` does: chunks of ``ceil(rows / world)``, the last ones shorter or empty.

    Raises:
        ValueError: another placement than ``Shard(0)`` on a one-dimensional mesh.
    """
    if not isinstance(tensor, DTensor):
        return None
    if tensor.device_mesh.ndim != 1 or tensor.placements != (Shard(0),):
        raise FPDTError(f"{owner}: {name} is sharded as {tensor.placements} over a mesh of shape"
                        f" {tuple(tensor.device_mesh.shape)}; loading reads shards of dim 0 on one mesh dimension"
                        " (FSDP2's fully_shard) only.")
    rows, world = tensor.shape[0], tensor.device_mesh.size()
    rank = tensor.device_mesh.get_local_rank()
    per_rank = -(-rows // world)
    start, end = min(rank * per_rank, rows), min((rank + 1) * per_rank, rows)
    if tensor.to_local().shape[0] != end - start:
        raise FPDTError(f"{owner}: {name}: this rank's shard has {tensor.to_local().shape[0]} rows, but"
                        f" ceil({rows} / {world}) chunks give rank {rank} rows {start}:{end}.")
    return start, end
