"""What ``fpdt-export`` checks before it writes anything (:mod:`lightning_fpdt.export.hf_directory`), and how it
replaces an output directory whole.

- The arguments: a floating export dtype (:func:`export_dtype`, with the aliases ``bf16``, ``fp16``, ``fp32``,
  ``fp64``), a shard size (:func:`shard_bytes`).
- The checkpoint: there and complete (:func:`resolve`; a sharded directory with every file that holds a model
  tensor, each as long as its metadata says: :func:`check_dcp_files`), and holding exactly what the export plan
  reads (:func:`check_plan`): every tensor the plan reads, in the model's shape, and no trained tensor left out
  (a ``--config`` of another model would otherwise write a model that silently lacks layers).
- The output directory: refused when it holds model files (weights, an index, a config, tokenizer files) unless
  ``overwrite`` (:func:`check_out`), and never the model's own source directory; the export is written into a
  staging directory beside it and moved in (:func:`replace_into`), so a failed export leaves the old one as it was
  and a finished one leaves no file of the old one (an old ``model.safetensors`` beside a new index would be the
  one ``from_pretrained`` loads).
"""

from __future__ import annotations

import os
import shutil
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed.checkpoint as dcp
import yaml
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from lightning_fpdt.checkpoints import files as checkpoint_files
from lightning_fpdt.checkpoints.files import CheckpointError
from lightning_fpdt.errors import FPDTError, one_line
from lightning_fpdt.models.from_config import module_from_hyperparameters, module_from_yaml

OWNER = "fpdt-export: "
# what a tokenizer directory may hold (transformers' fast and slow tokenizers, chat templates)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja",
                   "chat_template.json")
# adapter_config.json too: from_pretrained of a directory holding one loads it as a peft adapter of another model
CONFIG_FILES = ("config.json", "generation_config.json", "adapter_config.json")
WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".h5", ".msgpack", ".gguf")

# the floating dtypes an export can hold, by name and alias (an integer dtype would truncate every weight to 0)
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "f32": torch.float32, "float": torch.float32,
          "float16": torch.float16, "fp16": torch.float16, "f16": torch.float16, "half": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float64": torch.float64, "fp64": torch.float64, "f64": torch.float64, "double": torch.float64}


def export_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """The export dtype of a name, an alias (``bf16``, ``fp16``, ``fp32``, ``fp64``; a ``torch.`` prefix is
    allowed) or a torch dtype; ``None``: the trained one.

    Raises:
        ValueError: anything but float32, float16, bfloat16 or float64.
    """
    if dtype is None or dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.strip().lower().removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.strip().lower().removeprefix("torch.")]
    raise FPDTError(f"{OWNER}dtype {str(dtype)!r} is not an export dtype; use float32 (fp32), bfloat16 (bf16),"
                    " float16 (fp16) or float64 (fp64), or leave it out for the trained dtype.")


def shard_bytes(size: int | str) -> int:
    """Bytes of ``size``: an int, or ``"5GB"``, ``"500MB"``, ``"2GiB"``, ``"1000"``.

    Raises:
        ValueError: anything else.
    """
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
             "TIB": 2**40, "B": 1}
    text = size.strip().upper() if isinstance(size, str) else ""
    for unit, factor in units.items():
        number = text[: -len(unit)].strip()
        if text.endswith(unit) and number.replace(".", "", 1).isdigit() and float(number) > 0:
            return int(float(number) * factor)
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise FPDTError(f"{OWNER}max shard size {size!r} is not a size; give e.g. 5GB, 500MB, 2GiB or a number of bytes.")


def resolve(ckpt: str | Path) -> Path:
    """The complete checkpoint at ``ckpt`` (:func:`~lightning_fpdt.checkpoints.files.resolve`).

    Raises:
        CheckpointError: nothing at ``ckpt``, or a sharded directory without ``meta.pt``.
    """
    try:
        return checkpoint_files.resolve(ckpt)
    except FileNotFoundError:
        pass
    if Path(ckpt).is_dir():
        raise CheckpointError(
            f"{OWNER}{ckpt} is an incomplete sharded checkpoint (no {checkpoint_files.META_FILE}: its save was"
            " interrupted, or it was copied in part); export an earlier checkpoint"
            " (lightning_fpdt.checkpoints.files.latest_checkpoint(dir) finds the newest complete one)."
        )
    raise CheckpointError(f"{OWNER}no checkpoint at {ckpt} (no such file or directory); pass the .ckpt file or the"
                          " sharded checkpoint directory the run wrote, e.g. runs/ckpt/last.ckpt.")


def read_file(path: Path, mmap: bool = False) -> dict:
    """:func:`~lightning_fpdt.checkpoints.files.read`, its refusal of a truncated or corrupt file worded for export.

    Raises:
        CheckpointError: a file that cannot be read or is no Lightning checkpoint.
    """
    try:
        return checkpoint_files.read(path, mmap=mmap)
    except CheckpointError as err:
        if "truncated or corrupt" not in str(err):
            raise CheckpointError(f"{OWNER}{str(err).removeprefix('FPDTStrategy: ')}") from None
        raise CheckpointError(
            f"{OWNER}the checkpoint {path} is truncated or corrupt ({path.stat().st_size} bytes; torch.load cannot"
            " read it); export an earlier checkpoint (lightning_fpdt.checkpoints.files.latest_checkpoint(dir) finds"
            " the newest complete one), or copy this one again."
        ) from None


def module_for_export(config: str | Path | None, hparams: dict[str, Any] | None,
                      tokenizer: str | None) -> tuple[pl.LightningModule, str | None]:
    """The model to export, on the meta device: of the fit's YAML ``config`` (with its data section's tokenizer
    directory, if it names one), else of the checkpoint's saved ``hparams``.

    Raises:
        ValueError: a YAML that is missing or unreadable; hyper-parameters naming a model directory that no longer
            exists (``HFCausalLM``'s ``model``: its config is there; ``hf_checkpoint`` without ``tokenizer``: its
            tokenizer would be missing); a model that cannot be built, with the reason.
    """
    data_tokenizer = None
    if config is not None:
        if not Path(config).is_file():
            raise FPDTError(f"{OWNER}--config {config}: no such file; pass the fit's LightningCLI YAML (the"
                            " config.yaml the run saved beside its checkpoints).")
        try:
            fit = yaml.safe_load(Path(config).read_text()) or {}
        except yaml.YAMLError as err:
            raise FPDTError(f"{OWNER}--config {config} is not valid YAML ({one_line(err)}).") from None
        if not isinstance(fit, dict):
            raise FPDTError(f"{OWNER}--config {config} is not a LightningCLI config (a mapping with a model section).")
        data_tokenizer = ((fit.get("data") or {}).get("init_args") or {}).get("tokenizer")
        source, fix = f"--config {config}", f"set where it is now in {config}"
        section = fit.get("model")
        _check_sources((section.get("init_args") or {}) if isinstance(section, dict) else {}, tokenizer, source, fix)
    else:
        source = "the checkpoint's hyper-parameters"
        fix = "pass the fit's YAML (--config FIT_YAML) with where it is now"
        _check_sources(hparams or {}, tokenizer, source, fix)
    try:
        if config is not None:
            module = module_from_yaml(fit.get("model"), on_meta=True)
        else:
            module = module_from_hyperparameters(hparams or {}, on_meta=True)
    except OSError as err:  # transformers' config lookup: a path that is not there, a hub name not reachable
        raise FPDTError(f"{OWNER}the model of {source} cannot be built: {one_line(err)} If it names a directory that"
                        f" moved, {fix}.") from None
    except (ValueError, TypeError, NotImplementedError) as err:
        raise FPDTError(f"{OWNER}the model of {source} cannot be built: {one_line(err)}") from None
    local = data_tokenizer if isinstance(data_tokenizer, str) and Path(data_tokenizer).is_dir() else None
    return module, local


def _check_sources(args: dict[str, Any], tokenizer: str | None, source: str, fix: str) -> None:
    """Refuse a model's arguments (``source``'s) that name a local model directory that is not there any more."""
    model, pretrained = args.get("model"), args.get("hf_checkpoint")
    if isinstance(model, str) and not Path(model).is_dir() and _is_local_path(model):
        raise FPDTError(
            f"{OWNER}the model directory {model}, named by {source}, does not exist (moved or deleted?): the"
            f" model's config.json is read from there. Put the directory back, or {fix} (model.init_args.model)."
        )
    if isinstance(pretrained, str) and not Path(pretrained).is_dir() and tokenizer is None:
        raise FPDTError(
            f"{OWNER}the pretrained directory {pretrained} (hf_checkpoint), named by {source}, does not exist"
            " (moved or deleted?): its tokenizer files would be missing from the export. Pass --tokenizer DIR (where"
            " they are now), or put the directory back."
        )


def _is_local_path(name: str) -> bool:
    """Whether ``name`` can only be a local path (a hub name is ``name`` or ``org/name``)."""
    return os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1


def open_checkpoint(ckpt: str | Path) -> tuple[Path, dict[str, Any], dict[str, tuple[int, ...]],
                                               Callable[[str], Tensor]]:
    """The checkpoint at ``ckpt``: its path, what it holds besides the tensors (a file's, or a sharded directory's
    ``meta.pt``), the shape of each model tensor, and a reader of one model tensor by key (a file memory-mapped:
    its tensors stay on disk until read one by one; a sharded directory: one ``dcp.load`` per key).

    Raises:
        CheckpointError: nothing at ``ckpt``, or a checkpoint that is incomplete, truncated or corrupt.
    """
    path = resolve(ckpt)
    if path.is_dir():
        meta = read_file(path / checkpoint_files.META_FILE)
        metadata = _dcp_metadata(path)
        check_dcp_files(path, metadata)
        return path, meta, dcp_shapes(metadata), _dcp_reader(path, metadata)
    meta = read_file(path, mmap=True)
    state = meta["state_dict"]
    return path, meta, stored_shapes(state), state.__getitem__


def _dcp_metadata(path: Path) -> Metadata:
    try:
        return dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as err:  # (a missing or corrupt .metadata: pickle, OSError, EOFError, ...)
        raise CheckpointError(
            f"{OWNER}the sharded checkpoint {path} has no readable .metadata ({type(err).__name__}: {err}): it was"
            " copied or written in part. Copy the whole directory again, or export an earlier checkpoint."
        ) from None


def _dcp_reader(path: Path, metadata: Metadata) -> Callable[[str], Tensor]:
    """Read one model tensor at a time from a sharded checkpoint (``state_dict.<key>`` in DCP's flat names)."""
    stored = metadata.state_dict_metadata

    def read(key: str) -> Tensor:
        info = stored[f"state_dict.{key}"]
        tensor = torch.empty(info.size, dtype=info.properties.dtype)
        try:
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load({"state_dict": {key: tensor}}, checkpoint_id=path, no_dist=True)
        except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
            files = sorted({i.relative_path for x, i in metadata.storage_data.items() if x.fqn == f"state_dict.{key}"})
            if isinstance(err, CheckpointException) and err.failures:  # (exception, traceback) per rank
                err = next(iter(err.failures.values()))[0]
            reason = f"{type(err).__name__}: {one_line(err).split('. ')[0]}"  # its first sentence
            raise CheckpointError(f"{OWNER}the sharded checkpoint {path} cannot give {key} ({', '.join(files)}:"
                                  f" {reason}): a file is corrupt. Copy the whole directory again, or export an"
                                  " earlier checkpoint.") from None
        return tensor

    return read



def stored_shapes(state: dict) -> dict[str, tuple[int, ...]]:
    """The shape of each tensor of a checkpoint file's ``state_dict``."""
    return {key: tuple(value.shape) for key, value in state.items() if isinstance(value, Tensor)}


def dcp_shapes(metadata: Metadata) -> dict[str, tuple[int, ...]]:
    """The shape of each model tensor of a sharded checkpoint (``state_dict.<key>`` in DCP's flat names)."""
    prefix = "state_dict."
    return {name[len(prefix):]: tuple(info.size) for name, info in metadata.state_dict_metadata.items()
            if name.startswith(prefix) and hasattr(info, "size")}


def check_dcp_files(path: Path, metadata: Metadata) -> None:
    """Refuse a sharded checkpoint whose files that hold model tensors are missing or shorter than its metadata
    says (a copy in part); optimizer files are not needed.

    Raises:
        CheckpointError: the files named, with the fix.
    """
    needed: dict[str, int] = {}  # file -> the bytes the model's tensors need of it
    for index, info in metadata.storage_data.items():
        if index.fqn.startswith("state_dict."):
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    missing = sorted(file for file in needed if not (path / file).is_file())
    short = sorted(f"{file} ({(path / file).stat().st_size} of {size} bytes)" for file, size in needed.items()
                   if file not in missing and (path / file).stat().st_size < size)
    if missing or short:
        what = [f"lacks files that hold model tensors ({_first(missing)})" if missing else "",
                f"has files shorter than its .metadata says ({_first(short)})" if short else ""]
        raise CheckpointError(f"{OWNER}the sharded checkpoint {path} {' and '.join(w for w in what if w)}: it was"
                              " copied or written in part. Copy the whole directory again, or export an earlier"
                              " checkpoint.")


def check_plan(reads: dict[str, tuple[int, ...]], aliases: dict[str, list[str]], stored: dict[str, tuple[int, ...]],
               what: str, ckpt: Path, fix: str) -> None:
    """Refuse an export plan that does not match the checkpoint's tensors.

    Args:
        reads: each key the plan reads -> the shape the model has for it.
        aliases: each key of the model's state dict -> every name of its tensor (tied weights have two).
        stored: each tensor of the checkpoint's state dict -> its shape.
        what: the model, for the message (``"the LlamaLM of --config fit.yaml"``).
        fix: how to give the right model.

    Raises:
        CheckpointError: tensors of the plan not in the checkpoint or in another shape, or trained tensors the plan
            would not write; the first of each named.
    """
    absent = [key for key in reads if key not in stored]
    shapes = [f"{key} (checkpoint {list(stored[key])}, model {list(shape)})" for key, shape in reads.items()
              if key in stored and tuple(stored[key]) != tuple(shape)]
    left = [key for key in stored if not any(name in reads for name in aliases.get(key, [key]))]
    if not (absent or shapes or left):
        return
    problems = [f"{len(absent)} tensors of the model are not in the checkpoint ({_first(absent)})" if absent else "",
                f"{len(shapes)} have another shape ({_first(shapes)})" if shapes else "",
                f"{len(left)} tensors of the checkpoint would not be exported ({_first(left)})" if left else ""]
    raise CheckpointError(f"{OWNER}{what} does not match the checkpoint {ckpt}: "
                          f"{'; '.join(p for p in problems if p)}. {fix} Nothing was written.")


def model_files(directory: Path) -> list[Path]:
    """The files of a Hugging Face model directory that an export writes or would leave stale beside its own: weights
    (safetensors, ``.bin``, ...) and their indexes, ``config.json``, ``generation_config.json``, tokenizer files."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.is_file() and (
        p.name in CONFIG_FILES or p.name in TOKENIZER_FILES or p.name.endswith(WEIGHT_SUFFIXES)))


def check_out(out: Path, overwrite: bool, sources: list[str | None]) -> None:
    """Refuse an output directory that is a file, the model's own source directory, or (unless ``overwrite``) holds
    model files.

    Raises:
        FileExistsError: the reason, with the fix (another directory, or ``--overwrite``).
    """
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{OWNER}{out} is a file, not a directory; give a directory to write the export to.")
    for source in sources:
        if source is not None and out.is_dir() and Path(source).is_dir() and os.path.samefile(out, source):
            raise FileExistsError(f"{OWNER}{out} is the model's source directory (its weights, config and tokenizer"
                                  " are read from there); write the export to another directory.")
    found = model_files(out)
    if found and not overwrite:
        raise FileExistsError(
            f"{OWNER}{out} already holds a model ({_first([p.name for p in found])}); from_pretrained would mix its"
            " files with the new ones. Export to an empty or new directory, or pass --overwrite (export(...,"
            " overwrite=True)) to replace that model's files."
        )


def staging_dir(out: Path) -> Path:
    """A new, empty directory beside ``out`` to write the export into (the same file system: moved in by rename)."""
    out = out.resolve()  # "." has no name to put the staging directory beside
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(f".{out.name}.tmp-export-{uuid.uuid4().hex[:8]}")
    staging.mkdir()
    return staging


def replace_into(staging: Path, out: Path) -> None:
    """Make ``out`` hold the export written to ``staging``: its model files first removed (:func:`model_files`:
    nothing stale stays beside the new ones), its other files and subdirectories kept; ``staging`` is removed."""
    if not out.exists():
        os.replace(staging, out)
        return
    for path in model_files(out):
        path.unlink()
    for path in staging.iterdir():
        os.replace(path, out / path.name)
    shutil.rmtree(staging)


def _first(names: list[str], count: int = 3) -> str:
    return ", ".join(names[:count]) + (f" and {len(names) - count} more" if len(names) > count else "")
