"""A run's checkpoint as a Hugging Face model directory (``fpdt-export``, :class:`HFExport`).

``transformers.AutoModelForCausalLM.from_pretrained(OUT)`` loads what :func:`export` writes: safetensors shards
of bounded size (with ``model.safetensors.index.json`` when there are several), ``config.json`` with the
settings the model was trained with, ``generation_config.json``, and the tokenizer files of the model's source
directory (or of ``--tokenizer``).

It streams: each Hugging Face tensor is read from the checkpoint alone (a ``.ckpt`` file memory-mapped, a
sharded torch.distributed.checkpoint directory one key at a time), cast to the export dtype, and written with
its shard; at most one shard is held at a time. Names: ``HFCausalLM``'s parameters are ``model.<transformers
name>``; ``LlamaLM`` and ``GPTLM`` go through the weight-name tables of :mod:`lightning_fpdt.models.convert`,
row by row (GPT-2's fused ``c_attn`` is assembled from our q, k and v). Tied embeddings are written once. A LoRA
run's adapted layers are merged (``W + scaling * B @ A``); ``--adapter`` writes the adapter alone
(:mod:`lightning_fpdt.export.adapter`). The command line is :mod:`lightning_fpdt.export.command`.
"""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import lightning.pytorch as pl
import torch
from safetensors.torch import save_file
from torch import Tensor
from transformers import AutoModelForCausalLM, GenerationConfig, PretrainedConfig, PreTrainedModel

from lightning_fpdt.errors import FPDTError, WrongType
from lightning_fpdt.export.adapter import adapted_module, write_adapter
from lightning_fpdt.export.checks import (
    OWNER,
    TOKENIZER_FILES,
    check_out,
    check_plan,
    export_dtype,
    module_for_export,
    open_checkpoint,
    replace_into,
    shard_bytes,
    staging_dir,
)
from lightning_fpdt.export.tokenizer_files import check_tokenizer_fits
from lightning_fpdt.hf.causal_lm import HFCausalLM
from lightning_fpdt.hf.lora import export_sources
from lightning_fpdt.models.bundled import BundledLM
from lightning_fpdt.models.convert import hf_config_of
from lightning_fpdt.models.family import Weight
from lightning_fpdt.parallel.dtensors import full_tensor


class Part(NamedTuple):
    """Where (part of) a Hugging Face tensor comes from: the LightningModule's ``key``, placed through ``weight``'s
    view (a transposed or fused tensor) or, when ``weight`` is ``None``, the whole tensor as it is."""

    key: str
    weight: Weight | None = None


class ExportPlan(NamedTuple):
    """What to write: the transformers ``config``, each tensor's ``parts`` (in file order) and ``shapes``, the
    directory to copy tokenizer files from (``None``: none), and ``merges`` (a LoRA layer's merged weight's maker)."""

    config: PretrainedConfig
    parts: dict[str, list[Part]]
    shapes: dict[str, torch.Size]
    tokenizer_dir: str | None
    merges: dict[str, Callable[[list[Tensor]], Tensor]] | None = None


def plan_for(module: pl.LightningModule, tokenizer_dir: str | None = None) -> ExportPlan:
    """The export plan of a (real, sharded or meta-device) ``HFCausalLM``, ``LlamaLM`` or ``GPTLM``; the tokenizer
    files come from ``tokenizer_dir``, else from the directory the model was read from (``HFCausalLM``'s path,
    ``LlamaLM``/``GPTLM``'s ``hf_checkpoint``).

    Raises:
        TypeError: another LightningModule.
    """
    if isinstance(module, HFCausalLM):
        return hf_plan(module.model, "model.", tokenizer_dir or _source_dir(_source_of(module)))
    if not isinstance(module, BundledLM):
        raise WrongType(f"{OWNER}HFCausalLM, LlamaLM or GPTLM can be exported, not {type(module).__name__}.")
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
    config.architectures = [type(hf).__name__]  # what save_pretrained of the model writes: serving tools read it
    # a model read from a pretrained directory (hf_checkpoint) keeps its tokenizer there
    return ExportPlan(config, parts, shapes, tokenizer_dir or _source_dir(_source_of(module)))


def hf_plan(model: PreTrainedModel, prefix: str, tokenizer_dir: str | None) -> ExportPlan:
    """The plan of a transformers model whose tensors are ``prefix + <its name>``: its parameters (tied ones once)
    and persistent buffers; with LoRA adapters, each adapted layer's weight merged from its base and its adapter."""
    params = dict(model.named_parameters())  # a tied tensor appears once, under its first name
    tensors = {**params, **{n: b for n, b in model.named_buffers() if n in model.state_dict()}}
    config = copy.deepcopy(model.config)
    config._attn_implementation = None  # FPDT's attention is this run's; the export loads with transformers' own
    config.architectures = [type(model).__name__]  # as the model's save_pretrained writes it (a built config has none)
    sources, merges = export_sources(model, list(tensors))  # without adapters: each name its own
    return ExportPlan(config, {n: [Part(prefix + k) for k in keys] for n, keys in sources.items()},
                      {n: tensors[keys[0]].shape for n, keys in sources.items()}, tokenizer_dir, merges)


def write(plan: ExportPlan, read: Callable[[str], Tensor], out: str | Path, dtype: torch.dtype | None = None,
          max_shard_size: int | str = "5GB", writer: bool = True) -> None:
    """Write ``plan``'s tensors, read by LightningModule key with ``read``, to ``out`` as a Hugging Face directory.

    Args:
        read: the tensor of a key, whole (a collective when it gathers shards: every rank calls it in the same
            order, so every rank runs this function; only ``writer`` writes).
        dtype: the export dtype (``None``: each tensor's own).
        max_shard_size: bytes per safetensors file (``"5GB"``, ``"500MB"`` or an int); one larger tensor gets a
            file of its own.

    The files are written into a directory beside ``out`` and moved in at the end, replacing ``out``'s model files
    (:func:`~lightning_fpdt.export.checks.replace_into`): a failure leaves ``out`` as it was, and no file of an
    earlier export stays beside the new ones.

    Raises:
        FileExistsError: ``out`` is a file or the model's source directory.
    """
    out = Path(out)
    limit = shard_bytes(max_shard_size)
    dtype = export_dtype(dtype)
    check_tokenizer_fits(plan.tokenizer_dir, plan.config)  # every rank, before any gather: refused alike
    if writer:
        check_out(out, True, [plan.tokenizer_dir])
    staging = staging_dir(out) if writer else out
    try:
        _write_files(plan, read, staging, dtype, limit, writer)
        if writer:
            replace_into(staging, out)
    finally:
        if writer and staging.exists():
            shutil.rmtree(staging)


def _write_files(plan: ExportPlan, read: Callable[[str], Tensor], out: Path, dtype: torch.dtype | None, limit: int,
                 writer: bool) -> None:
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


def export(ckpt: str | Path, out: str | Path, config: str | Path | None = None,
           dtype: str | torch.dtype | None = None, max_shard_size: int | str = "5GB", tokenizer: str | None = None,
           overwrite: bool = False) -> Path:
    """Turn a run's checkpoint (a ``.ckpt`` file or a sharded directory) into a Hugging Face directory ``out``.

    Everything is checked before anything is written (:mod:`lightning_fpdt.export.checks`): the arguments, the
    checkpoint (complete and readable), the model (buildable, and its export plan matching the checkpoint's tensors,
    names and shapes, both ways), and ``out``.

    Args:
        ckpt: the checkpoint (an interrupted swap's ``<ckpt>.old`` is taken, as when resuming).
        config: the fit's LightningCLI YAML (its ``model`` section); ``None``: the checkpoint's hyper-parameters.
        dtype: the export dtype, float32, bfloat16, float16 or float64 (or ``fp32``, ``bf16``, ``fp16``, ``fp64``;
            ``None``: the trained one).
        tokenizer: the directory to copy tokenizer files from (``None``: the model's source directory, ``HFCausalLM``'s
            path or ``hf_checkpoint``, or the YAML's ``data.init_args.tokenizer``).
        overwrite: replace the model files ``out`` holds (else such a directory is refused); no file of the old
            model stays.

    Returns:
        ``out``.

    Raises:
        checkpoint_files.CheckpointError: a missing, incomplete or unreadable checkpoint, or one whose tensors are not
            the model's (the first mismatches named).
        ValueError: no way to know the model (neither ``config`` nor saved hyper-parameters), a model that cannot be
            built (its source directory moved), a dtype or shard size refused.
        FileExistsError: ``out`` holds a model (and not ``overwrite``), is a file or is the model's source directory.
    """
    dtype, limit = export_dtype(dtype), shard_bytes(max_shard_size)
    path, meta, stored, read = open_checkpoint(ckpt)
    out = Path(out)
    if tokenizer is not None and not Path(tokenizer).is_dir():
        raise FPDTError(f"{OWNER}--tokenizer {tokenizer} is not a directory; give the directory that holds the"
                        " tokenizer files (tokenizer.json, tokenizer_config.json, ...).")
    if config is None and not meta.get("hyper_parameters"):
        raise FPDTError(
            f"{OWNER}{path} has no saved hyper-parameters, so the model it holds is unknown. Pass the fit's YAML:"
            f" fpdt-export {ckpt} {out} --config FIT_YAML."
        )
    module, yaml_tokenizer = module_for_export(config, meta.get("hyper_parameters"), tokenizer)
    plan = plan_for(module, tokenizer or yaml_tokenizer)
    check_out(out, overwrite, [plan.tokenizer_dir, _source_dir(_source_of(module))])
    tensors = module.state_dict(keep_vars=True)
    aliases: dict[int, list[str]] = {}
    for key, tensor in tensors.items():
        aliases.setdefault(id(tensor), []).append(key)
    reads = {part.key: tuple(tensors[part.key].shape) for name in plan.shapes for part in plan.parts[name]}
    kind = type(module).__name__
    if config is not None:
        what = f"the {kind} of --config {config}"
        fix = ("Pass the YAML of the run that wrote this checkpoint (--config)"
               + (", or leave --config out to export the model its saved hyper-parameters name." if
                  meta.get("hyper_parameters") else "."))
    else:
        what = f"the {kind} the checkpoint's saved hyper-parameters build"
        fix = ("Its source files changed since the run (an HFCausalLM reads its config.json from its model directory);"
               " pass the fit's YAML (--config) naming the model the run trained.")
    check_plan(reads, {key: aliases[id(tensors[key])] for key in tensors}, stored, what, path, fix)
    write(plan, read, out, dtype, limit)
    return out


class HFExport(pl.Callback):
    """Write :func:`export`'s Hugging Face directory at the end of ``fit`` (and every ``every_n_steps`` optimizer
    steps into ``<dirpath>/step=N``), from the module in memory: sharded parameters are gathered tensor by tensor
    (every rank takes part; rank 0 writes).

    Args:
        dirpath: the output directory; ``None``: ``hf/`` in the run's log directory (``trainer.log_dir``, beside
            the checkpoints of a ``ModelCheckpoint`` without its own ``dirpath``).
        every_n_steps: also export every this many steps (``None``: only at the end).
        dtype: the export dtype (float32, bfloat16, float16, float64 or an alias such as ``bf16``, or the torch
            dtype; ``None``: the trained one).
        max_shard_size: bytes per safetensors file.
        tokenizer: where to copy tokenizer files from (``None``: the model's source directory, ``HFCausalLM``'s path
            or ``hf_checkpoint``).
        adapter: write a LoRA run's adapter in peft's format, not the merged model
        (:mod:`~lightning_fpdt.export.adapter`).

    Each export replaces the model files of its directory (the callback's own: a resumed run writes there again);
    the model's source directory is refused when ``fit`` starts.

    Raises:
        ValueError: a dtype or shard size refused (at construction).
    """

    def __init__(self, dirpath: str | None = None, every_n_steps: int | None = None,
                 dtype: str | torch.dtype | None = None, max_shard_size: int | str = "5GB",
                 tokenizer: str | None = None, adapter: bool = False) -> None:
        self.dirpath, self.every_n_steps, self.tokenizer, self.adapter = dirpath, every_n_steps, tokenizer, adapter
        self.out = Path(dirpath) if dirpath is not None else None  # the run's log directory's hf/ once fit starts
        shard_bytes(max_shard_size)
        self.max_shard_size = max_shard_size
        self.dtype = export_dtype(dtype)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Refuse a directory that is the model's source (or ``adapter`` without LoRA) and a tokenizer larger than the
        model's vocabulary, before training, not after."""
        # every rank asks: trainer.log_dir is rank 0's, broadcast
        self.out = Path(self.dirpath or Path(trainer.log_dir or trainer.default_root_dir) / "hf")
        check_out(self.out, True, [self.tokenizer, _source_dir(_source_of(pl_module))])
        if self.adapter:
            adapted_module(pl_module)
        else:  # a tokenizer the export would refuse, refused before training
            plan = plan_for(pl_module, self.tokenizer)
            check_tokenizer_fits(plan.tokenizer_dir, plan.config)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if self.every_n_steps and step % self.every_n_steps == 0 and step != getattr(self, "_last", None):
            self._last = step
            self.write(trainer, pl_module, self.out / f"step={step}")

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.write(trainer, pl_module, self.out)

    def write(self, trainer: pl.Trainer, pl_module: pl.LightningModule, out: Path) -> None:
        """Every rank: gather and (rank 0) write ``pl_module``'s export to ``out``."""
        trainer.strategy.barrier("fpdt_hf_export")
        tensors = dict(pl_module.state_dict(keep_vars=True))

        def read(key: str) -> Tensor:
            tensor = tensors[key].detach()
            return full_tensor(tensor)

        plan = plan_for(pl_module, self.tokenizer)
        if self.adapter:
            write_adapter(pl_module, read, out, self.dtype, trainer.is_global_zero, plan.tokenizer_dir)
        else:
            write(plan, read, out, self.dtype, self.max_shard_size, writer=trainer.is_global_zero)
        trainer.strategy.barrier("fpdt_hf_export_written")


# ---- helpers --------------------------------------------------------------------------------------------------


def _assemble(plan: ExportPlan, name: str, read: Callable[[str], Tensor], dtype: torch.dtype | None) -> Tensor:
    """The Hugging Face tensor ``name``, in ``dtype``: one source tensor, or rows placed into a new tensor."""
    parts = plan.parts[name]
    if plan.merges and name in plan.merges:  # a LoRA layer's weight: its base plus scaling * B @ A
        merged = plan.merges[name]([read(part.key) for part in parts])
        return merged.to(dtype or merged.dtype, copy=True).contiguous()
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


def _source_of(module: pl.LightningModule) -> Any:
    """The directory (or name) ``module`` was read from: ``HFCausalLM``'s ``model``, a bundled model's
    ``hf_checkpoint``."""
    hparams = getattr(module, "hparams", {})
    return hparams.get("model") if isinstance(module, HFCausalLM) else hparams.get("hf_checkpoint")


def _source_dir(model: Any) -> str | None:
    """``model`` when it names a local directory (a model loaded from a path keeps its tokenizer there)."""
    return str(model) if isinstance(model, (str, Path)) and Path(model).is_dir() else None

