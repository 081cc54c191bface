"""Parameter sharding: FSDP2 ``fully_shard`` over every rank, applied to a plain model from outside.

With ``shard_parameters=True`` every rank holds ``1 / world`` of each parameter, gradient and optimizer
state instead of all of it (DDP). The mesh is the whole world, data x sequence parallel flattened: the
sequence-parallel ranks of one sample compute gradients of the same parameters from different tokens,
so they reduce exactly like data-parallel ranks do.

Order matters: each decoder layer (FPDT block, or Hugging Face decoder layer of ``HFCausalLM``) is
sharded first (its parameters are gathered just before the layer runs and freed after it, so one
layer's full weights live at a time), the LightningModule last (the rest: embeddings, final norm,
output projection). Activation checkpointing and block binding happen
before (in ``FPDTStrategy.setup``), so each layer's recomputation runs inside the block's FSDP
hooks and re-gathers its parameters in backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torchmetrics import Metric

from lightning_fpdt.errors import PREFIX, FPDTError
from lightning_fpdt.parallel.binding import decoder_layers

# Lightning calls these instead of forward: FSDP must gather the root's parameters around them
STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


def setup_sharded(strategy: Any, trainer: pl.Trainer, offload_optimizer: bool) -> None:
    """``DDPStrategy.setup`` with FSDP2 in place of DDP, in every stage (fit, validate, test, predict):
    the module on its device, sharded over a mesh of every rank, then the optimizers (built on the
    shards) when fitting.

    Args:
        strategy: the :class:`~lightning_fpdt.FPDTStrategy` being set up.
        trainer: the Trainer.
        offload_optimizer: keep the shards and the optimizer step in pinned host memory (CUDA).
    """
    strategy.accelerator.setup(trainer)
    strategy.precision_plugin.convert_module(strategy.model)  # on the meta device too: a dtype, no copy
    on_meta = any(p.is_meta for p in strategy.model.parameters())
    if not on_meta:
        strategy.model_to_device()
    mesh = init_device_mesh(strategy.root_device.type, (strategy.world_size,), mesh_dim_names=("data_sequence",))
    precision = str(strategy.precision_plugin.precision)
    shard_module(strategy.lightning_module, mesh, precision, offload_optimizer)
    if on_meta:
        load_shards_of(strategy.lightning_module, strategy.root_device, on_host=offload_optimizer)
    fitting = trainer.state.fn == TrainerFn.FITTING
    if fitting:
        strategy.setup_optimizers(trainer)
    strategy.setup_precision_plugin()
    if fitting:
        _optimizers_to_device(strategy.optimizers, strategy.root_device)


def load_shards_of(module: pl.LightningModule, device: torch.device, on_host: bool = False) -> None:
    """Fill the shards of a module built on the meta device (``HFCausalLM`` of a local safetensors directory)
    through its ``load_sharded_weights(device)``: each rank reads only the rows it owns.

    ``on_host`` (``offload_optimizer``): the shards are made in host memory and only the buffers (RoPE's
    frequencies) moved to ``device``: FSDP2's CPU offload wants sharded parameters whose DTensor is on the CPU,
    and a DTensor made on the device keeps saying so after FSDP2 moves its local shard to the host.

    Raises:
        ValueError: a module on the meta device without ``load_sharded_weights``, or with parameters still on
            the meta device after it (named).
    """
    load = getattr(module, "load_sharded_weights", None)
    if load is None:
        raise FPDTError(
            f"{PREFIX}{type(module).__name__} has parameters on the meta device and no load_sharded_weights(device)"
            " to fill its shards with; build it with real tensors (or give it that method)."
        )
    with metrics_aside(module, device):  # to_empty of the root would give a metric's states empty memory
        load(torch.device("cpu") if on_host else device)
    if on_host:
        buffers_to(module, device)
    left = [name for name, p in module.named_parameters() if p.is_meta]
    if left:
        raise FPDTError(f"{PREFIX}{type(module).__name__}.load_sharded_weights left {len(left)} parameter(s) on the"
                        f" meta device, e.g. {left[:3]}.")


@contextlib.contextmanager
def metrics_aside(module: torch.nn.Module, device: torch.device) -> Iterator[None]:
    """Take ``module``'s torchmetrics metrics out of it inside (a sharded load's ``to_empty`` of the root replaced
    their states and the defaults ``reset`` restores with uninitialised memory: the validation's answer accuracy read
    garbage), then put them back on ``device``, where the steps update them (with ``offload_optimizer`` too)."""
    taken = [(parent, name, child) for parent in module.modules() for name, child in parent.named_children()
             if isinstance(child, Metric)]
    for parent, name, _ in taken:
        delattr(parent, name)
    try:
        yield
    finally:
        for parent, name, child in taken:
            setattr(parent, name, child.to(device))


def host_shards_backend(device: torch.device, offload_optimizer: bool) -> str | None:
    """The process group's backends where ``offload_optimizer`` keeps FSDP2's shards and gradients on the host of a
    CUDA run: NCCL for device tensors and gloo for host ones (gradient clipping's all-reduce, a full state dict's
    all-gather), which an NCCL-only group cannot serve; ``None`` (the device's default) otherwise."""
    return "cuda:nccl,cpu:gloo" if offload_optimizer and device.type == "cuda" else None


def buffers_to(module: torch.nn.Module, device: torch.device) -> None:
    """Move ``module``'s buffers, and only them, to ``device`` (its parameters stay where they are)."""
    for sub in module.modules():
        for name, buffer in sub._buffers.items():
            if buffer is not None and buffer.device != device:
                sub._buffers[name] = buffer.to(device)


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy:
    """FSDP2's policy for a Lightning precision string: low-precision compute, float32 gradient reduction
    for the ``*-mixed`` precisions; nothing to convert for the ``*-true`` ones."""
    low = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    if low is None:  # true precisions: the parameters already have the compute dtype
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)


def shard_module(module: pl.LightningModule, mesh: DeviceMesh, precision: str, offload_optimizer: bool) -> None:
    """Apply ``fully_shard`` to every decoder layer of ``module`` and then to ``module`` itself.

    A module sharded by an earlier fit/validate in the same process is left as it is.

    Args:
        module: the LightningModule, on its device.
        mesh: a one-dimensional mesh of every rank.
        precision: Lightning's precision string.
        offload_optimizer: keep the shards (and so the optimizer step) in pinned host memory (CUDA).
    """
    if isinstance(module, FSDPModule):
        return
    options: dict[str, Any] = dict(
        mesh=mesh, mp_policy=mixed_precision_policy(precision),
        offload_policy=CPUOffloadPolicy() if offload_optimizer else OffloadPolicy(),
    )
    for layer in decoder_layers(module):
        fully_shard(layer.module, **options)
    fully_shard(module, **options)
    for name in STEP_METHODS:
        register_fsdp_forward_method(module, name)


def check_replicated_gradients(module: torch.nn.Module, step: int, replicated: bool) -> None:
    """Refuse a step whose backward left a trainable parameter without a gradient, under DDP (``replicated``:
    parameters replicated over more than one rank; otherwise nothing is checked).

    DDP all-reduces gradients in buckets once every parameter of a bucket has its gradient; a bucket holding a
    parameter the forward never used (a vision or audio tower in text-only training: Fuyu, Phi-4-multimodal) is
    never reduced, so every rank would step with its own shard's gradients (off by ~1 against one process) and DDP
    would fail only in the next step. Checked after the backward, before the optimizer step, the same on every rank
    (the same parameters go unused on every rank).

    Raises:
        RuntimeError: naming the parameters and the fix.
    """
    if not replicated:
        return
    unused = [name for name, p in module.named_parameters() if p.requires_grad and p.grad is None]
    if unused:
        raise RuntimeError(
            f"FPDTStrategy: {len(unused)} trainable parameter(s) got no gradient in step {step}"
            f" ({', '.join(unused[:3])}{', ...' if len(unused) > 3 else ''}): the forward does not use them. DDP"
            " reduces gradients in buckets and never reduces a bucket with an unused parameter, so this step's"
            " gradients would differ per rank. Freeze them before fit (param.requires_grad_(False)), which keeps"
            " the optimizer off them as in one process."
        )
