"""A LoRA run's adapter in peft's format: ``fpdt-export CKPT OUT --adapter`` and ``HFExport(adapter=True)``.

``peft.PeftModel.from_pretrained(base_model, OUT)`` loads what :func:`write_adapter` writes:
``adapter_model.safetensors`` (each adapter tensor under peft's key, ``base_model.model.<layer>.lora_A.weight``:
:func:`~lightning_fpdt.hf.lora.adapter_keys`),
``adapter_config.json`` (the run's ``LoraConfig``, its targets resolved, naming the base model when the run read it
from a directory or the hub) and the tokenizer files of the model's source directory (or of ``--tokenizer``). The
merged model (the base weights with ``scaling * B @ A`` added: ``from_pretrained`` loads it alone) is ``fpdt-export``'s
default (:mod:`lightning_fpdt.export.hf_directory`, through :func:`~lightning_fpdt.hf.lora.export_sources`).

The checkpoint is checked as for the merged export (:mod:`lightning_fpdt.export.checks`): complete, and holding
exactly the tensors of the model its hyper-parameters (or ``--config``) build, in their shapes; ``OUT`` is written
into a staging directory and moved in whole.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl
import torch
from safetensors.torch import save_file
from torch import Tensor

from lightning_fpdt.errors import FPDTError
from lightning_fpdt.export.checks import (
    OWNER,
    TOKENIZER_FILES,
    check_out,
    check_plan,
    export_dtype,
    module_for_export,
    open_checkpoint,
    replace_into,
    staging_dir,
)
from lightning_fpdt.hf.causal_lm import HFCausalLM
from lightning_fpdt.hf.lora import adapter_config, adapter_keys

ADAPTER_FILE = "adapter_model.safetensors"


def adapted_module(module: pl.LightningModule) -> HFCausalLM:
    """``module``, an ``HFCausalLM`` trained with adapters.

    Raises:
        ValueError: another module, or one without adapters (its export is the whole model: leave ``--adapter`` out).
    """
    if not isinstance(module, HFCausalLM) or module.lora is None:
        what = type(module).__name__ if not isinstance(module, HFCausalLM) else "an HFCausalLM without lora"
        raise FPDTError(f"{OWNER}--adapter exports LoRA adapters, but the checkpoint holds {what}; leave --adapter out"
                        " to export the whole model.")
    return module


def base_model_of(module: HFCausalLM) -> str | None:
    """The base model's name or directory, as ``adapter_config.json`` names it (``None``: built from a config): a
    directory as an absolute path, so the adapter finds its base from any working directory; a hub name as given."""
    model = module.hparams.get("model")
    if not isinstance(model, (str, Path)):
        return None
    return str(Path(model).resolve()) if Path(model).is_dir() else str(model)


def write_adapter(module: HFCausalLM, read: Callable[[str], Tensor], out: str | Path, dtype: torch.dtype | None = None,
                  writer: bool = True, tokenizer_dir: str | None = None, overwrite: bool = True) -> None:
    """Write ``module``'s adapter, its tensors read by LightningModule key with ``read``, to ``out`` in peft's format.

    Args:
        read: the whole tensor of a key (a collective when it gathers shards: every rank calls this function).
        dtype: the export dtype (``None``: the trained one).
        writer: whether this rank writes.
        tokenizer_dir: the directory to copy tokenizer files from (``None``: none).
        overwrite: replace the model or adapter files ``out`` holds (else such a directory is refused).

    Raises:
        ValueError: ``module`` has no adapters (:func:`adapted_module`).
        FileExistsError: ``out`` is a file, the model's source directory, or holds a model (without ``overwrite``).
    """
    out, module = Path(out), adapted_module(module)
    tensors = {key: _cast(read(f"model.{name}"), dtype) for key, name in adapter_keys(module.model).items()}
    if not writer:
        return
    base = base_model_of(module)
    check_out(out, overwrite, [tokenizer_dir, base if base and Path(base).is_dir() else None])
    staging = staging_dir(out)
    try:
        save_file(tensors, str(staging / ADAPTER_FILE), metadata={"format": "pt"})
        adapter_config(module.model, base).save_pretrained(str(staging))
        if tokenizer_dir is not None:
            for name in TOKENIZER_FILES:
                if (Path(tokenizer_dir) / name).is_file():
                    shutil.copy2(Path(tokenizer_dir) / name, staging / name)
        replace_into(staging, out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)


def export_adapter(ckpt: str | Path, out: str | Path, config: str | Path | None = None,
                   dtype: str | torch.dtype | None = None, tokenizer: str | None = None,
                   overwrite: bool = False) -> Path:
    """The adapter of a LoRA run's checkpoint (a ``.ckpt`` file or a sharded directory) as peft's directory ``out``.

    Args: as :func:`~lightning_fpdt.export.hf_directory.export`'s.

    Returns:
        ``out``.

    Raises:
        checkpoint_files.CheckpointError: a missing, incomplete or unreadable checkpoint, or one whose tensors are not
            the model's.
        ValueError: a model without adapters, no way to know the model, a dtype refused.
        FileExistsError: ``out`` holds a model (and not ``overwrite``), is a file or is the base model's directory.
    """
    dtype = export_dtype(dtype)
    path, meta, stored, read = open_checkpoint(ckpt)
    if config is None and not meta.get("hyper_parameters"):
        raise FPDTError(f"{OWNER}{path} has no saved hyper-parameters, so the model it holds is unknown. Pass the"
                        f" fit's YAML: fpdt-export {ckpt} {out} --adapter --config FIT_YAML.")
    module, yaml_tokenizer = module_for_export(config, meta.get("hyper_parameters"), tokenizer)
    module = adapted_module(module)
    tensors = module.state_dict(keep_vars=True)
    aliases: dict[int, list[str]] = {}
    for key, tensor in tensors.items():
        aliases.setdefault(id(tensor), []).append(key)
    # every tensor of the model, in its shape: the checkpoint is this model's (the adapter alone is written)
    check_plan({key: tuple(t.shape) for key, t in tensors.items()}, {key: aliases[id(tensors[key])] for key in tensors},
               stored, "the HFCausalLM " + (f"of --config {config}" if config else "of the saved hyper-parameters"),
               path, "Pass the YAML of the run that wrote this checkpoint (--config).")
    base = base_model_of(module)
    source = tokenizer or yaml_tokenizer or (base if base and Path(base).is_dir() else None)
    write_adapter(module, read, out, dtype, tokenizer_dir=source, overwrite=overwrite)
    return Path(out)


def _cast(tensor: Tensor, dtype: torch.dtype | None) -> Tensor:
    return tensor.detach().to(dtype or tensor.dtype, copy=True).contiguous()
