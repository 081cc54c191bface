"""A run's checkpoint as a Hugging Face model directory (``fpdt-export``, :class:`HFExport`).

``transformers.AutoModelForCausalLM.from_pretrained(OUT)`` loads what :func:`export` writes: safetensors shards
of bounded size (with ``model.safetensors.index.json`` when there are several), ``config.json`` with the
settings the model was trained with, ``generation_config.json``, and the tokenizer files of the model's source
directory (or of ``--tokenizer``).

It streams: each Hugging Face tensor is read from the checkpoint alone (a ``.ckpt`` file memory-mapped, a
sharded torch.distributed.checkpoint directory one key at a time), cast to the export dtype, and written with
its shard; at most one shard is held at a time. Names: ``HFCausalLM``'s parameters are ``model.<transformers
name>``; ``LlamaLM`` and ``GPTLM`` go through the weight-name tables of :mod:`lightning_fpdt.models.convert`,
row by row (GPT-2's fused ``c_attn`` is assembled from our q, k and v). Tied embeddings are written once.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import lightning.pytorch as pl
import torch
import torch.distributed.checkpoint as dcp
import yaml
from safetensors.torch import save_file
from torch import Tensor
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, GenerationConfig, PretrainedConfig, PreTrainedModel

from lightning_fpdt import checkpoint_files
from lightning_fpdt.hf.causal_lm import HFCausalLM
from lightning_fpdt.models.bundled import BundledLM
from lightning_fpdt.models.convert import hf_config_of
from lightning_fpdt.models.family import Weight
from lightning_fpdt.models.from_config import module_from_hyperparameters, module_from_yaml

# what a tokenizer directory may hold (transformers' fast and slow tokenizers, chat templates)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja",
                   "chat_template.json")
OWNER = "fpdt-export: "


class Part(NamedTuple):
    """Where (part of) a Hugging Face tensor comes from: the LightningModule's ``key``, placed through ``weight``'s
    view (a transposed or fused tensor) or, when ``weight`` is ``None``, the whole tensor as it is."""

    key: str
    weight: Weight | None = None


class ExportPlan(NamedTuple):
    """What to write: the transformers ``config``, each tensor's ``parts`` (in file order) and ``shapes``, and the
    directory to copy tokenizer files from (``None``: none)."""

    config: PretrainedConfig
    parts: dict[str, list[Part]]
    shapes: dict[str, torch.Size]
    tokenizer_dir: str | None


def plan_for(module: pl.LightningModule, tokenizer_dir: str | None = None) -> ExportPlan:
    """The export plan of a (real, sharded or meta-device) ``HFCausalLM``, ``LlamaLM`` or ``GPTLM``; the tokenizer
    files come from ``tokenizer_dir``, else from the directory the model was read from (``HFCausalLM``'s path,
    ``LlamaLM``/``GPTLM``'s ``hf_checkpoint``).

    Raises:
        TypeError: another LightningModule.
    """
    if isinstance(module, HFCausalLM):
        return hf_plan(module.model, "model.", tokenizer_dir or _source_dir(module.hparams.get("model")))
    if not isinstance(module, BundledLM):
        raise TypeError(f"{OWNER}HFCausalLM, LlamaLM or GPTLM can be exported, not {type(module).__name__}.")
    ours = module.model
    table = module.family.weights(ours)
    names = {id(p): name for name, p in module.named_parameters(remove_duplicate=False)}
    config = hf_config_of(ours)
    with torch.device("meta"):  # only its tensor names and shapes
        hf = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    parts: dict[str, list[Part]] = {}
    for row in table:
        parts.setdefault(row.name, []).append(Part(names[id(row.ours)], row if row.transposed or row.rows else None))
    shapes = {name: p.shape for name, p in hf.named_parameters() if name in parts}
    config.dtype = next(ours.parameters()).dtype
    # a model read from a pretrained directory (hf_checkpoint) keeps its tokenizer there
    return ExportPlan(config, parts, shapes, tokenizer_dir or _source_dir(module.hparams.get("hf_checkpoint")))


def hf_plan(model: PreTrainedModel, prefix: str, tokenizer_dir: str | None) -> ExportPlan:
    """The plan of a transformers model whose tensors are ``prefix + <its name>``: its parameters (tied ones once)
    and persistent buffers."""
    params = dict(model.named_parameters())  # a tied tensor appears once, under its first name
    tensors = {**params, **{n: b for n, b in model.named_buffers() if n in model.state_dict()}}
    config = copy.deepcopy(model.config)
    config._attn_implementation = None  # FPDT's attention is this run's; the export loads with transformers' own
    return ExportPlan(config, {n: [Part(prefix + n)] for n in tensors}, {n: t.shape for n, t in tensors.items()},
                      tokenizer_dir)


def write(plan: ExportPlan, read: Callable[[str], Tensor], out: str | Path, dtype: torch.dtype | None = None,
          max_shard_size: int | str = "5GB", writer: bool = True) -> None:
    """Write ``plan``'s tensors, read by LightningModule key with ``read``, to ``out`` as a Hugging Face directory.

    Args:
        read: the tensor of a key, whole (a collective when it gathers shards: every rank calls it in the same
            order, so every rank runs this function; only ``writer`` writes).
        dtype: the export dtype (``None``: each tensor's own).
        max_shard_size: bytes per safetensors file (``"5GB"``, ``"500MB"`` or an int); one larger tensor gets a
            file of its own.
    """
    out = Path(out)
    limit = _bytes(max_shard_size)
    dtype_of = dtype
    shards = _shards(plan, limit, dtype)
    weight_map, total = {}, 0
    for index, names in enumerate(shards):
        tensors = {}
        for name in names:
            tensor = _assemble(plan, name, read, dtype)
            tensors[name] = tensor
            total += tensor.numel() * tensor.element_size()
            dtype_of = tensor.dtype
        file = "model.safetensors" if len(shards) == 1 else f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        weight_map.update(dict.fromkeys(names, file))
        if writer:
            out.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(out / file), metadata={"format": "pt"})
        del tensors
    if not writer:
        return
    if len(shards) > 1:
        index_file = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index_file, indent=2) + "\n")
    config = copy.deepcopy(plan.config)
    config.dtype = dtype_of
    config.save_pretrained(out)
    source = Path(plan.tokenizer_dir) if plan.tokenizer_dir else None
    if source is not None and (source / "generation_config.json").is_file():
        shutil.copy2(source / "generation_config.json", out / "generation_config.json")
    else:
        GenerationConfig.from_model_config(config).save_pretrained(out)
    if source is not None:
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, out / name)


def export(ckpt: str | Path, out: str | Path, config: str | Path | None = None, dtype: torch.dtype | None = None,
           max_shard_size: int | str = "5GB", tokenizer: str | None = None) -> Path:
    """Turn a run's checkpoint (a ``.ckpt`` file or a sharded directory) into a Hugging Face directory ``out``.

    Args:
        ckpt: the checkpoint (an interrupted swap's ``<ckpt>.old`` is taken, as when resuming).
        config: the fit's LightningCLI YAML (its ``model`` section); ``None``: the checkpoint's hyper-parameters.
        dtype: the export dtype (``None``: the trained one).
        tokenizer: the directory to copy tokenizer files from (``None``: the model's source directory, ``HFCausalLM``'s
            path or ``hf_checkpoint``, or the YAML's ``data.init_args.tokenizer``).

    Returns:
        ``out``.

    Raises:
        checkpoint_files.CheckpointError: an unreadable checkpoint, or one that does not hold the model's tensors.
        ValueError: no way to know the model (neither ``config`` nor saved hyper-parameters).
    """
    path = checkpoint_files.resolve(ckpt)
    if path.is_dir():
        meta = checkpoint_files.read(path / checkpoint_files.META_FILE)
        read = _dcp_reader(path)
    else:
        meta = checkpoint_files.read(path, mmap=True)  # tensors stay on disk until read one by one
        state = meta["state_dict"]

        def read(key: str) -> Tensor:
            return state[key]

    if config is not None:
        fit = yaml.safe_load(Path(config).read_text()) or {}
        tokenizer = tokenizer or _source_dir(((fit.get("data") or {}).get("init_args") or {}).get("tokenizer"))
        module = module_from_yaml(fit.get("model"), on_meta=True)
    elif meta.get("hyper_parameters"):
        module = module_from_hyperparameters(meta["hyper_parameters"], on_meta=True)
    else:
        raise ValueError(
            f"{OWNER}{path} has no saved hyper-parameters, so the model it holds is unknown. Pass the fit's YAML:"
            f" fpdt-export {ckpt} {out} --config FIT_YAML."
        )
    plan = plan_for(module, tokenizer)
    try:
        write(plan, read, out, dtype, max_shard_size)
    except KeyError as err:
        raise checkpoint_files.CheckpointError(
            f"{OWNER}{path} has no tensor {err}: it does not hold a {type(module).__name__} of the configuration"
            " given. Pass the fit's own YAML (--config) or the checkpoint that run wrote."
        ) from None
    return Path(out)


class HFExport(pl.Callback):
    """Write :func:`export`'s Hugging Face directory at the end of ``fit`` (and every ``every_n_steps`` optimizer
    steps into ``<dirpath>/step=N``), from the module in memory: sharded parameters are gathered tensor by tensor
    (every rank takes part; rank 0 writes).

    Args:
        dirpath: the output directory.
        every_n_steps: also export every this many steps (``None``: only at the end).
        dtype: the export dtype (a torch dtype or its name; ``None``: the trained one).
        max_shard_size: bytes per safetensors file.
        tokenizer: where to copy tokenizer files from (``None``: the model's source directory, ``HFCausalLM``'s path
            or ``hf_checkpoint``).
    """

    def __init__(self, dirpath: str, every_n_steps: int | None = None, dtype: str | torch.dtype | None = None,
                 max_shard_size: int | str = "5GB", tokenizer: str | None = None) -> None:
        self.dirpath, self.every_n_steps, self.tokenizer = dirpath, every_n_steps, tokenizer
        self.max_shard_size = max_shard_size
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if self.every_n_steps and step % self.every_n_steps == 0 and step != getattr(self, "_last", None):
            self._last = step
            self.write(trainer, pl_module, Path(self.dirpath) / f"step={step}")

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.write(trainer, pl_module, Path(self.dirpath))

    def write(self, trainer: pl.Trainer, pl_module: pl.LightningModule, out: Path) -> None:
        """Every rank: gather and (rank 0) write ``pl_module``'s export to ``out``."""
        trainer.strategy.barrier("fpdt_hf_export")
        tensors = dict(pl_module.state_dict(keep_vars=True))

        def read(key: str) -> Tensor:
            tensor = tensors[key].detach()
            return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor

        write(plan_for(pl_module, self.tokenizer), read, out, self.dtype, self.max_shard_size,
              writer=trainer.is_global_zero)
        trainer.strategy.barrier("fpdt_hf_export_written")


def main(argv: list[str] | None = None) -> None:
    """``fpdt-export CKPT OUT [--config FIT_YAML] [--dtype bfloat16] [--max-shard-size 5GB] [--tokenizer DIR]``."""
    parser = argparse.ArgumentParser(prog="fpdt-export", description="A run's checkpoint as a Hugging Face directory.")
    parser.add_argument("ckpt", help="a .ckpt file or a sharded checkpoint directory")
    parser.add_argument("out", help="the Hugging Face directory to write")
    parser.add_argument("--config", default=None, help="the fit's LightningCLI YAML (default: saved hyper-parameters)")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16, ... (default: the trained dtype)")
    parser.add_argument("--max-shard-size", default="5GB", help="bytes per safetensors file: 5GB, 500MB, ...")
    parser.add_argument("--tokenizer", default=None, help="copy the tokenizer files of this directory")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    if dtype is not None and not isinstance(dtype, torch.dtype):
        parser.error(f"--dtype {args.dtype!r} is not a torch dtype (float32, bfloat16, float16, float64).")
    out = export(args.ckpt, args.out, args.config, dtype, args.max_shard_size, args.tokenizer)
    print(f"fpdt-export: wrote {out}")


# ---- helpers --------------------------------------------------------------------------------------------------


def _assemble(plan: ExportPlan, name: str, read: Callable[[str], Tensor], dtype: torch.dtype | None) -> Tensor:
    """The Hugging Face tensor ``name``, in ``dtype``: one source tensor, or rows placed into a new tensor."""
    parts = plan.parts[name]
    if len(parts) == 1 and parts[0].weight is None:
        source = read(parts[0].key)
        return source.to(dtype or source.dtype, copy=True).contiguous()
    result = None
    for part in parts:
        source = read(part.key)
        if result is None:
            result = torch.empty(plan.shapes[name], dtype=dtype or source.dtype)
        part.weight.theirs(result).copy_(source)
    return result


def _shards(plan: ExportPlan, limit: int, dtype: torch.dtype | None) -> list[list[str]]:
    """Tensor names grouped into files of at most ``limit`` bytes, in plan order (sizes from the shapes)."""
    itemsize = torch.empty(0, dtype=dtype or plan.config.dtype or torch.float32).element_size()
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in plan.shapes.items():
        nbytes = shape.numel() * itemsize
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _bytes(size: int | str) -> int:
    if isinstance(size, int):
        return size
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}
    text = size.strip().upper()
    for unit, factor in units.items():
        if text.endswith(unit) and text[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(text[: -len(unit)]) * factor)
    if text.isdigit():
        return int(text)
    raise ValueError(f"{OWNER}max shard size {size!r} is not a size; give e.g. 5GB, 500MB or a number of bytes.")


def _dcp_reader(path: Path) -> Callable[[str], Tensor]:
    """Read one model tensor at a time from a sharded checkpoint (``state_dict.<key>`` in DCP's flat names)."""
    stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata

    def read(key: str) -> Tensor:
        info = stored[f"state_dict.{key}"]
        tensor = torch.empty(info.size, dtype=info.properties.dtype)
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({"state_dict": {key: tensor}}, checkpoint_id=path, no_dist=True)
        return tensor

    return read


def _source_dir(model: Any) -> str | None:
    """``model`` when it names a local directory (a model loaded from a path keeps its tokenizer there)."""
    return str(model) if isinstance(model, (str, Path)) and Path(model).is_dir() else None


if __name__ == "__main__":
    main()
