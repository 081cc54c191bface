"""The checkpoint hooks of ``FPDTStrategy``: every state saved and restored by name, so a checkpoint of any
parallelism (replicated weights in one file, or a distributed-checkpoint directory with ``shard_parameters``) loads
into any other, with each rank's RNG states and the data position (``lightning_fpdt.checkpoints``: the files, the run
state, resume).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_fpdt.checkpoints import files as ckpt
from lightning_fpdt.checkpoints.resume import warn_if_saved_at_epoch_end
from lightning_fpdt.checkpoints.run_state import add_run_state, parallelism_state, restore_run_state
from lightning_fpdt.options import FPDTOptions


class CheckpointHooks(DDPStrategy):
    """``DDPStrategy``'s checkpoint hooks, by name and atomic; the base of ``FPDTStrategy``, which provides the
    validated options (``_options``) and the mesh's sizes (``data_parallel_size``, ``sequence_parallel_size``) and
    the chunk size in use (``chunk_size``) that a checkpoint records."""

    _options: FPDTOptions

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if not self._options.shard_parameters:
            return super().lightning_module_state_dict()
        return ckpt.model_state(self.lightning_module)  # this rank's shards (DTensors)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The optimizer state keyed by parameter name (loads into any parallelism); sharded with
        ``shard_parameters``, else the full state."""
        return ckpt.optimizer_state(self.lightning_module, optimizer, self._options.shard_parameters)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Atomic: a crash mid-save leaves the previous checkpoint at ``filepath`` usable. A file with
        replicated weights, a distributed-checkpoint directory with ``shard_parameters``."""
        add_run_state(checkpoint, self.world_size, self._parallelism())  # a collective: every rank's RNG states
        target = str(self.broadcast(str(filepath)))
        own_io = isinstance(self.checkpoint_io, TorchCheckpointIO) and storage_options is None
        if self._options.shard_parameters:
            ckpt.save_sharded(checkpoint, target, self.broadcast(ckpt.new_token()), self.barrier, self._on_rank_zero)
        elif own_io and not ckpt.is_remote(target):
            self._on_rank_zero(lambda: ckpt.atomic_save(checkpoint, target), f"saving {target}")
        else:
            super().save_checkpoint(checkpoint, target, storage_options)  # the CheckpointIO decides

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero and not ckpt.is_remote(str(filepath)) and Path(filepath).is_dir():
            ckpt.remove(Path(filepath))  # renamed first: a crash mid-delete never leaves a half checkpoint
        else:
            super().remove_checkpoint(filepath)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a checkpoint saved with any parallelism, a file (replicated weights) or a distributed
        checkpoint directory (sharded), into this run's model and optimizers by parameter name.

        The model and optimizer states are restored here, so :meth:`load_model_state_dict` and
        :meth:`load_optimizer_state_dict` have nothing left to do (as in Lightning's ModelParallelStrategy).
        """
        target, module = str(self.broadcast(str(checkpoint_path))), self.lightning_module
        fitting = module._trainer is not None and module._trainer.state.fn == TrainerFn.FITTING
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers] if fitting else []
        parent = super().load_checkpoint  # reads a remote checkpoint through fsspec
        checkpoint = ckpt.load_states(target, module, optimizers, lambda: parent(target, weights_only=weights_only))
        restore_run_state(checkpoint, self.global_rank, self._parallelism())
        if fitting:
            warn_if_saved_at_epoch_end(checkpoint)
        return checkpoint

    def _on_rank_zero(self, fn: Callable[[], None], what: str) -> None:
        ckpt.on_rank_zero(fn, what, self.is_global_zero, self.broadcast)

    def _parallelism(self) -> dict[str, Any]:
        return parallelism_state(self.data_parallel_size, self.sequence_parallel_size, self.chunk_size,
                                 self._options.shard_parameters)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # restored by name in load_checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # restored by name in load_checkpoint

