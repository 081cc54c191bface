"""A LightningModule whose model is built on the meta device and reads its weights where they are needed.

A model read from a pretrained directory (``HFCausalLM(path)``, ``LlamaLM(hf_checkpoint=...)``,
``GPTLM(hf_checkpoint=...)``) is built on the meta device: no memory, any size. Its :class:`PendingWeights` are read
once, where they are needed: whole in :meth:`PendingWeightsModule.configure_model` (on the strategy's device, in a
``*-true`` precision's dtype), each rank only its FSDP2 shards' rows
(:meth:`~PendingWeightsModule.load_sharded_weights`, called by ``FPDTStrategy(shard_parameters=True)``), not at
all when a state dict brings every tensor (:meth:`~PendingWeightsModule.load_state_dict`), or at the first forward
of a module used without a Trainer.
"""

from __future__ import annotations

from typing import Any, Protocol

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method


class PendingWeights(Protocol):
    """The weights a :class:`CausalLM`'s model, built on the meta device, still has to read (a checkpoint on
    disk: ``HFCausalLM(path)``, ``LlamaLM(hf_checkpoint=...)``, ``GPTLM(hf_checkpoint=...)``). ``CausalLM``
    reads them where they are needed (:meth:`CausalLM.configure_model`, :meth:`CausalLM.load_sharded_weights`,
    :meth:`CausalLM.load_state_dict`, the first forward)."""

    def tensor_names(self) -> list[str]:
        """The names (in the model) of the tensors it fills: every parameter (a tied one once) and persistent
        buffer."""
        ...

    def materialize(self, device: torch.device | str) -> None:
        """Give the model uninitialised tensors on ``device`` (tied weights tied again) and its computed buffers
        (RoPE's inverse frequencies), without reading anything."""
        ...

    def load_whole(self, device: torch.device | str) -> None:
        """Materialise the model on ``device`` and read every tensor into it: one copy, in the model's dtypes."""
        ...

    def load_shards(self, root: nn.Module, device: torch.device | str) -> None:
        """After FSDP2's ``fully_shard`` (``root``: the module the root ``fully_shard`` was applied to, holding the
        model): materialise ``root`` on ``device`` and read into each parameter's local shard only the rows of
        dim 0 this rank owns."""
        ...


class PendingWeightsModule(pl.LightningModule):
    """The reading of a meta-device model's weights where they are needed (the base of
    :class:`~lightning_fpdt.models.causal_lm.CausalLM`). A subclass whose model is built on the meta device sets
    ``self._pending_weights`` to what it still has to read, and calls :meth:`load_weights` before a forward."""

    def __init__(self) -> None:
        super().__init__()
        self._pending_weights: PendingWeights | None = None

    # ---- weights of a model built on the meta device, read where they are needed ----------------------------

    @property
    def weights_pending(self) -> bool:
        """Whether the model is still on the meta device, its checkpoint's weights not yet read (see
        :meth:`load_weights`, :meth:`configure_model`, :meth:`load_sharded_weights`)."""
        return self._pending_weights is not None

    def load_weights(self, device: torch.device | str = "cpu") -> None:
        """Read the checkpoint's weights into the meta-device model: one copy on ``device``, in the dtypes the
        model has now (nothing happens when no weights are pending). The first forward does this on the input's
        device when nothing did before."""
        pending = self._pending_weights
        if pending is None:
            return
        pending.load_whole(device)
        self._pending_weights = None
        self._weights_loaded()

    def load_sharded_weights(self, device: torch.device | str) -> None:
        """Read into each FSDP2 shard the rows of its checkpoint tensor this rank owns, after ``fully_shard`` was
        applied to the meta-device model (``FPDTStrategy(shard_parameters=True)`` calls this in ``setup`` on every
        rank together), so that no rank ever holds the whole model."""
        pending = self._pending_weights
        if pending is None:
            return
        pending.load_shards(self, device)
        self._pending_weights = None
        self._weights_loaded()

    def _call_with_whole_weights(self, method: str) -> None:
        """``self.<method>()``, which runs the model: when sharded (FSDP2), through the root's hooks (every layer's
        weights gathered once, in turn; every rank takes part), then every module sharded again."""
        sharded = isinstance(self, FSDPModule)
        if sharded:  # through the root's hooks: FSDP2 initialises from its first forward
            register_fsdp_forward_method(self, method)
        try:
            getattr(self, method)()
        finally:
            if sharded:  # every module sharded again (FSDP2 keeps the last layer gathered after a forward)
                for module in self.modules():
                    if isinstance(module, FSDPModule):
                        module.reshard()

    def _weights_loaded(self) -> None:
        """Called once the pending weights are in (whole or sharded): what a subclass checks on real tensors."""

    def configure_model(self) -> None:
        """Read pending weights (Lightning calls this on every rank before the strategy's setup): on the
        strategy's device, converted to a ``*-true`` precision's dtype first (so a ``bf16-true`` run reads bf16
        straight); left to the strategy when it shards the parameters (``shard_parameters``:
        :meth:`load_sharded_weights`). A subclass that overrides this calls it."""
        if self._pending_weights is None or getattr(self.trainer.strategy, "shard_parameters", False):
            return
        self.trainer.precision_plugin.convert_module(self.model)  # on the meta device: no copy
        self.load_weights(self.trainer.strategy.root_device)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """As ``nn.Module.load_state_dict``. Pending weights are not read when ``state_dict`` holds every tensor
        (or ``strict`` makes sure it does): the model is only materialised on the CPU; otherwise they are read
        first (Lightning's fork/spawn launcher loads the workers' full weights into the parent non-strictly)."""
        pending = self._pending_weights
        if pending is not None:
            names = [f"model.{name}" for name in pending.tensor_names()]
            if strict or all(name in state_dict for name in names):
                pending.materialize("cpu")
                self._pending_weights = None
        self.load_weights()
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        """``to``/``cpu``/``cuda``/``double``... as usual; while the weights are pending, a tensor on the meta
        device that ``fn`` cannot move (a device move) stays there, to be read later (dtype changes apply), so
        Lightning's teardown of a launching process that never read them, or a user's ``.to(device)`` before
        the first forward, does not fail on the meta device."""
        if self._pending_weights is None:
            return super()._apply(fn, recurse)

        def on_meta(tensor: Tensor) -> Tensor:
            if not tensor.is_meta:
                return fn(tensor)
            try:
                return fn(tensor)
            except NotImplementedError:  # "Cannot copy out of meta tensor": a device move, no data to move
                try:  # the dtype it would have, read from an empty tensor
                    return tensor.to(fn(torch.empty(0, dtype=tensor.dtype)).dtype)
                except (NotImplementedError, RuntimeError, AssertionError):  # a device this build has not
                    return tensor

        return super()._apply(on_meta, recurse)
