"""Configuration checks that :class:`~lightning_fpdt.FPDTStrategy` runs at setup.

:func:`validate_setup` runs on every rank, first thing in ``setup_environment``, before the process
group exists. Every check depends only on values that are the same on all ranks (the strategy's
arguments, the world size, the precision, the device type, the model's structure), so a bad
configuration raises the same ``ValueError`` everywhere instead of leaving some ranks waiting in a
collective. Each message names the numbers and the fix.

The one check that needs data, a sequence shorter than the sequence-parallel group, is made per batch
in :func:`lightning_fpdt.layout.shard_batch`.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from lightning_fpdt.attention.kernels import flash_attn_available
from lightning_fpdt.comm import check_heads
from lightning_fpdt.layout import validate_chunk_size

OffloadOption = bool | Literal["emulate"]

# Lightning precision strings whose attention inputs are float16/bfloat16
HALF_PRECISIONS = ("bf16-mixed", "16-mixed", "bf16-true", "16-true")

_PREFIX = "FPDTStrategy: "


def check_offload_value(name: str, value: Any) -> None:
    """Raise unless ``value`` is ``True``, ``False`` or ``"emulate"`` (argument ``name``)."""
    if isinstance(value, bool) or (isinstance(value, str) and value == "emulate"):
        return
    raise ValueError(f"{_PREFIX}{name} must be True, False or 'emulate', got {value!r}.")


def check_world_layout(world_size: int, num_nodes: int, num_processes: int, sequence_parallel_size: int) -> None:
    """Raise if the world (nodes x devices) does not split into whole sequence-parallel groups."""
    if world_size % sequence_parallel_size != 0:
        options = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(
            f"{_PREFIX}sequence_parallel_size={sequence_parallel_size} does not divide the world size {world_size}"
            f" ({num_nodes} node(s) x {num_processes} device(s)); use one of {options}."
        )


def check_chunk_size(chunk_size: int | Literal["auto"] | None, sequence_parallel_size: int) -> None:
    """Raise if ``chunk_size`` is not a multiple of the SP size (``None`` and ``"auto"`` pass: "auto"
    is resolved per batch to a valid size)."""
    if chunk_size is None or chunk_size == "auto":
        return
    try:
        validate_chunk_size(chunk_size, sequence_parallel_size)
    except ValueError as err:
        raise ValueError(f"{_PREFIX}{err}") from None


def check_offload(
    offload: OffloadOption, offload_checkpoints: OffloadOption, device_type: str, offload_optimizer: bool = False
) -> None:
    """Raise for ``offload=True`` / ``offload_checkpoints=True`` / ``offload_optimizer=True`` on a device
    without its own memory.

    ``"emulate"`` runs the same offload schedule (a background worker copying between host buffers)
    and is allowed on any device; it exists so that CPU runs can exercise the offload path on purpose.
    """
    check_offload_value("offload", offload)
    check_offload_value("offload_checkpoints", offload_checkpoints)
    if device_type == "cuda":
        return
    if offload is True:
        raise ValueError(
            f"{_PREFIX}offload=True moves saved attention chunks from device to pinned host memory; on"
            f" {device_type} there is no device memory to save. Use offload=False, or offload='emulate' to"
            " run the offload schedule on CPU (as the tests do)."
        )
    if offload_checkpoints is True:
        raise ValueError(
            f"{_PREFIX}offload_checkpoints=True moves checkpointed block inputs from device to pinned host"
            f" memory; on {device_type} there is no device memory to save. Use offload_checkpoints=False, or"
            " offload_checkpoints='emulate' to run the offload schedule on CPU (as the tests do)."
        )
    if offload_optimizer:
        raise ValueError(
            f"{_PREFIX}offload_optimizer=True moves the sharded optimizer state from the device to host memory;"
            f" on {device_type} it is there already. Use offload_optimizer=False."
        )


def check_attention_backend(attention_backend: str, device_type: str, precision: str) -> None:
    """Raise if the attention backend cannot run on this device type at this precision.

    ``flash_attn`` needs CUDA, the flash-attn package and half precision. ``sdpa``, ``math`` and
    ``auto`` run everywhere (``sdpa`` computes float64 on CUDA with the ``math`` kernel, as torch's
    fused kernels stop at float32).
    """
    if attention_backend == "flash_attn":
        if device_type != "cuda":
            raise ValueError(
                f"{_PREFIX}attention_backend='flash_attn' needs a CUDA device, but this run is on {device_type}."
                " Use attention_backend='sdpa' or 'auto'."
            )
        if not flash_attn_available():
            raise ValueError(
                f"{_PREFIX}attention_backend='flash_attn' but the flash-attn package is not installed; install"
                " the 'flash' extra (pip install 'lightning-fpdt[flash]') or use attention_backend='sdpa' or 'auto'."
            )
        if precision not in HALF_PRECISIONS:
            raise ValueError(
                f"{_PREFIX}attention_backend='flash_attn' needs float16/bfloat16 attention inputs, but"
                f" precision={precision!r}. Use precision='bf16-mixed' (or one of {list(HALF_PRECISIONS)}),"
                " or attention_backend='sdpa' or 'auto'."
            )


def _builds_layers_later(model: torch.nn.Module) -> bool:
    """Whether the model may create its layers in ``LightningModule.configure_model`` (after setup_environment)."""
    import lightning.pytorch as pl

    return isinstance(model, pl.LightningModule) and type(model).configure_model is not pl.LightningModule.configure_model


def check_has_blocks(model: torch.nn.Module, num_blocks: int, sequence_parallel_size: int) -> None:
    """Raise if ``sequence_parallel_size > 1`` and ``model`` has no FPDT block (``num_blocks == 0``)."""
    if num_blocks == 0 and sequence_parallel_size > 1:
        raise ValueError(
            f"{_PREFIX}sequence_parallel_size={sequence_parallel_size} but {type(model).__name__} has no"
            " FPDTBlock; without one, attention would only see this rank's shard of the sequence. Build the"
            " model from lightning_fpdt.FPDTBlock (see docs/own-model.md) or use sequence_parallel_size=1."
        )


def check_model(model: torch.nn.Module | None, sequence_parallel_size: int) -> None:
    """Raise if the model's FPDT blocks cannot be sharded over ``sequence_parallel_size`` ranks, or if
    ``sequence_parallel_size > 1`` and the model has no FPDT block at all.

    A model that builds its layers in ``configure_model`` may have no block yet; then the strategy's
    block binding in ``setup`` makes the same checks (also on every rank).
    """
    from lightning_fpdt.block import fpdt_blocks  # block imports the attention stack: keep this module light

    if model is None:
        return
    blocks = fpdt_blocks(model)
    if not blocks:
        if not _builds_layers_later(model):
            check_has_blocks(model, 0, sequence_parallel_size)
        return
    seen: set[tuple[int, int]] = set()
    for name, block in blocks:
        heads = (block.attention.n_heads, block.attention.n_kv_heads)
        if heads in seen:
            continue
        seen.add(heads)
        try:
            check_heads(*heads, sequence_parallel_size)
        except ValueError as err:
            raise ValueError(f"{_PREFIX}{err} (FPDTBlock '{name}' of {type(model).__name__})") from None


def validate_setup(
    *,
    world_size: int,
    num_nodes: int,
    num_processes: int,
    sequence_parallel_size: int,
    chunk_size: int | Literal["auto"] | None,
    attention_backend: str,
    precision: str,
    device_type: str,
    offload: OffloadOption = False,
    offload_checkpoints: OffloadOption = False,
    model: torch.nn.Module | None = None,
    offload_optimizer: bool = False,
) -> None:
    """Run every setup-time check; raise the first ``ValueError`` found.

    Args:
        world_size: processes in the run (``num_nodes * num_processes``).
        num_nodes: nodes, for the message.
        num_processes: devices per node, for the message.
        sequence_parallel_size: the resolved SP size (``"auto"`` already turned into a number).
        chunk_size: global tokens per chunk, ``None`` or ``"auto"``.
        attention_backend: ``"auto"``, ``"math"``, ``"sdpa"`` or ``"flash_attn"``.
        precision: Lightning's precision string (``"32-true"``, ``"bf16-mixed"``, ``"64-true"``, ...).
        device_type: the root device's type (``"cpu"``, ``"cuda"``, ...).
        offload: the strategy's ``offload`` argument.
        offload_checkpoints: the strategy's ``offload_checkpoints`` argument.
        offload_optimizer: the strategy's ``offload_optimizer`` argument.
        model: the module whose FPDT blocks get bound (``None`` skips the model checks).
    """
    check_world_layout(world_size, num_nodes, num_processes, sequence_parallel_size)
    check_chunk_size(chunk_size, sequence_parallel_size)
    check_offload(offload, offload_checkpoints, device_type, offload_optimizer)
    check_attention_backend(attention_backend, device_type, precision)
    check_model(model, sequence_parallel_size)
