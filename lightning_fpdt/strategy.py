"""``FPDTStrategy``: data parallel x sequence parallel training with FPDT attention."""

from __future__ import annotations

import logging
import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from typing_extensions import override

from lightning_fpdt.attention.kernels import BACKENDS
from lightning_fpdt.block import SequenceParallelContext, fpdt_blocks, new_checkpoint_store
from lightning_fpdt.offload import ChunkStore
from lightning_fpdt.layout import DEFAULT_SEQUENCE_KEYS, shard_batch, validate_chunk_size

log = logging.getLogger(__name__)



class FPDTStrategy(DDPStrategy):
    """Fully Pipelined Distributed Transformer training: Ulysses sequence parallelism with chunked,
    optionally host-offloaded attention, on top of data parallelism.

    The world is a ``(data_parallel, sequence_parallel)`` device mesh, sequence parallel innermost
    so that an SP group sits on one node:

    - ``data_parallel``: ranks with different samples (the sampler shards by this coordinate only);
    - ``sequence_parallel``: ranks that share one sample, each holding ``1 / sp`` of its sequence in
      the FPDT layout and exchanging heads by all-to-all inside attention.

    Gradients are averaged over the whole world (DDP); with the token-weighted loss of
    :func:`lightning_fpdt.loss.token_weighted_loss` this is exactly the single-process gradient.

    Args:
        sequence_parallel_size: ranks per sequence-parallel group, or ``"auto"`` (all processes of
            a node). Must divide the world size.
        chunk_size: global tokens per attention chunk (a multiple of ``sequence_parallel_size``);
            ``None`` runs plain Ulysses; ``"auto"`` picks, per sequence length (at the first batch of
            that length), the largest chunk whose estimated device peak
            (:mod:`lightning_fpdt.memory`) fits ``memory_budget``, and logs it.
        memory_budget: GiB per rank that ``chunk_size="auto"`` may plan for. Default: 90% of the
            device's free memory at setup (CUDA), or of the host's available memory shared by this
            node's processes (CPU); the smallest over all ranks.
        attention_backend: ``"auto"``, ``"math"``, ``"sdpa"`` or ``"flash_attn"``.
        offload: keep attention chunks saved for backward in host memory (pays off when activations,
            not weights, fill the device; see docs/configuration.md). CUDA only; ``"emulate"`` runs the
            same schedule on any device (on CPU: a background worker copying between host buffers).
        activation_checkpointing: keep only each FPDT block's input for backward and recompute the
            block (attention chunks included) in backward.
        offload_checkpoints: with ``activation_checkpointing``, keep those block inputs in host memory
            and prefetch the previous block's input during backward. CUDA only, or ``"emulate"``.
        sequence_keys: batch keys that are ``[batch, seq, ...]`` tensors to pad and shard; other keys
            pass through untouched.
        pad_token_id: id used to pad ``input_ids`` to the layout's multiple.
        shard_parameters: shard parameters, gradients and optimizer state over all ranks (FSDP2
            ``fully_shard`` per FPDT block and on the LightningModule, over the flattened
            data x sequence mesh) instead of replicating them (DDP). Checkpoints are then torch
            distributed checkpoints (directories); they load into any layout, sharded or not.
        offload_optimizer: with ``shard_parameters``, keep the sharded parameters, gradients and
            optimizer state in pinned host memory and run the optimizer step there (FSDP2
            ``CPUOffloadPolicy``; CUDA only).
        nonfinite_loss: ``"raise"`` stops training when any rank's loss is NaN/inf, naming the step and
            the ranks; ``"skip"`` drops the update of that step's accumulation window on every rank (the
            backward runs as usual, its gradients are discarded, the optimizer does not step) and warns.
            Checked with one small all-reduce per step.
            ``"skip"`` runs the closure once before ``optimizer.step``: not for optimizers that call
            it several times (LBFGS).
        **kwargs: the usual :class:`~lightning.pytorch.strategies.DDPStrategy` arguments.
    """

    strategy_name = "fpdt"

    def __init__(
        self,
        sequence_parallel_size: int | Literal["auto"] = "auto",
        chunk_size: int | Literal["auto"] | None = None,
        memory_budget: float | None = None,
        attention_backend: Literal["auto", "math", "sdpa", "flash_attn"] = "auto",
        offload: bool | Literal["emulate"] = False,
        activation_checkpointing: bool = False,
        offload_checkpoints: bool | Literal["emulate"] = False,
        sequence_keys: Sequence[str] = DEFAULT_SEQUENCE_KEYS,
        pad_token_id: int = 0,
        shard_parameters: bool = False,
        offload_optimizer: bool = False,
        nonfinite_loss: Literal["raise", "skip"] = "raise",
        process_group_backend: str | None = None,
        timeout: timedelta | None = timedelta(minutes=30),
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **kwargs: Any,
    ) -> None:
        super().__init__(process_group_backend=process_group_backend, timeout=timeout, start_method=start_method, **kwargs)
        if sequence_parallel_size != "auto" and (
            isinstance(sequence_parallel_size, bool) or not isinstance(sequence_parallel_size, int)
            or sequence_parallel_size < 1
        ):
            raise ValueError(
                f"FPDTStrategy: sequence_parallel_size must be a positive int or 'auto', got {sequence_parallel_size!r}."
            )
        if attention_backend not in BACKENDS:
            raise ValueError(f"FPDTStrategy: attention_backend={attention_backend!r} is not one of {BACKENDS}.")
        if memory_budget is not None and (isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float))
                                          or memory_budget <= 0):
            raise ValueError(f"FPDTStrategy: memory_budget must be a positive number of GiB, got {memory_budget!r}.")
        if memory_budget is not None and chunk_size != "auto":
            raise ValueError(
                f"FPDTStrategy: memory_budget={memory_budget} only applies to chunk_size='auto', but chunk_size={chunk_size!r}."
            )
        if isinstance(chunk_size, str) and chunk_size != "auto":
            raise ValueError(f"FPDTStrategy: chunk_size must be a positive int, None or 'auto', got {chunk_size!r}.")
        if chunk_size is not None and chunk_size != "auto":
            validate_chunk_size(chunk_size, 1)  # positive int; divisibility is checked once sp is known
            if sequence_parallel_size != "auto":
                validate_chunk_size(chunk_size, sequence_parallel_size)
        self._sequence_parallel_size = sequence_parallel_size
        self._chunk_size = chunk_size
        self._memory_budget = memory_budget
        self._budget_bytes: int | None = None  # chunk_size="auto": resolved in setup_environment
        self._auto_chunks: dict[tuple[int, int], int | None] = {}  # (batch, seq_len) -> chunk size
        self._active_chunk_size: int | None = None if chunk_size == "auto" else chunk_size
        self._attention_backend = attention_backend
        from lightning_fpdt.validation import check_offload_value

        check_offload_value("offload", offload)
        check_offload_value("offload_checkpoints", offload_checkpoints)
        if offload_checkpoints and not activation_checkpointing:
            raise ValueError(
                f"FPDTStrategy: offload_checkpoints={offload_checkpoints!r} needs activation_checkpointing=True"
                " (only checkpointed block inputs are offloaded)."
            )
        self._offload = offload
        self._activation_checkpointing = activation_checkpointing
        self._offload_checkpoints = offload_checkpoints
        self._checkpoint_store: ChunkStore | None = None
        self._sequence_keys = tuple(sequence_keys)
        self._pad_token_id = pad_token_id
        self._device_mesh: DeviceMesh | None = None
        if offload_optimizer and not shard_parameters:
            raise ValueError(
                "FPDTStrategy: offload_optimizer=True needs shard_parameters=True (the optimizer state is offloaded"
                " shard by shard by FSDP2)."
            )
        if nonfinite_loss not in ("raise", "skip"):
            raise ValueError(f"FPDTStrategy: nonfinite_loss must be 'raise' or 'skip', got {nonfinite_loss!r}.")
        self._shard_parameters = shard_parameters
        self._offload_optimizer = offload_optimizer
        self._nonfinite_loss = nonfinite_loss
        self._skip_optimizer_step = False
        self._shard_mesh: DeviceMesh | None = None
        self._states_loaded = False  # load_checkpoint restored model/optimizers itself (by name)
        self._resume_batches = 0  # training batches of the current epoch consumed before the checkpoint

    # ---- properties ---------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.num_processes

    @property
    def sequence_parallel_size(self) -> int:
        """Ranks per sequence-parallel group (``"auto"`` resolved to the processes per node)."""
        if self._sequence_parallel_size == "auto":
            return max(1, self.num_processes)
        return self._sequence_parallel_size

    @property
    def data_parallel_size(self) -> int:
        return max(1, self.world_size // self.sequence_parallel_size)

    @property
    def sequence_parallel_rank(self) -> int:
        return self.global_rank % self.sequence_parallel_size

    @property
    def data_parallel_rank(self) -> int:
        return self.global_rank // self.sequence_parallel_size

    @property
    def chunk_size(self) -> int | Literal["auto"] | None:
        """The chunk size in use (with ``"auto"``: the one picked for the latest batch; ``"auto"`` before
        the first batch)."""
        if self._chunk_size == "auto" and not self._auto_chunks:
            return "auto"
        return self._active_chunk_size

    @property
    def memory_budget_bytes(self) -> int | None:
        """The per-rank budget ``chunk_size="auto"`` plans for (``None`` before setup or without "auto")."""
        return self._budget_bytes

    @property
    def device_mesh(self) -> DeviceMesh:
        if self._device_mesh is None:
            raise RuntimeError("FPDTStrategy: the device mesh is not available before the processes are initialized.")
        return self._device_mesh

    @property
    def sequence_parallel_group(self) -> ProcessGroup | None:
        """The SP process group; ``None`` when ``sequence_parallel_size == 1``."""
        if self.sequence_parallel_size == 1:
            return None
        return self.device_mesh["sequence_parallel"].get_group()

    @property
    def sequence_parallel_context(self) -> SequenceParallelContext:
        """What every FPDT block is bound to (the checkpoint store exists once ``setup`` ran)."""
        return SequenceParallelContext(
            group=self.sequence_parallel_group,
            chunk_size=self._active_chunk_size,
            attention_backend=self._attention_backend,
            offload=self._offload in (True, "emulate"),  # "emulate" is the same code path as True
            activation_checkpointing=self._activation_checkpointing,
            checkpoint_store=self._checkpoint_store,
        )

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # every rank of an SP group reads the same samples: shard by the data-parallel coordinate only
        return {"num_replicas": self.data_parallel_size, "rank": self.data_parallel_rank}

    # ---- environment --------------------------------------------------------------------------

    @override
    def setup_environment(self) -> None:
        self._validate_layout()  # on every rank, before any collective
        super().setup_environment()
        dp, sp = self.data_parallel_size, self.sequence_parallel_size
        self._device_mesh = init_device_mesh(
            self.root_device.type, (dp, sp), mesh_dim_names=("data_parallel", "sequence_parallel")
        )
        if self._shard_parameters:  # FSDP2 over every rank: the data x sequence mesh, flattened
            self._shard_mesh = init_device_mesh(self.root_device.type, (dp * sp,), mesh_dim_names=("data_sequence",))
        assert self.model is not None
        self.model._device_mesh = self._device_mesh  # exposed as `LightningModule.device_mesh`
        if self._chunk_size == "auto":
            self._budget_bytes = self._resolve_memory_budget()
        rank_zero_info(
            f"FPDTStrategy: {self.world_size} processes as data_parallel={dp} x sequence_parallel={sp};"
            f" chunk_size={self._chunk_size!r}, attention_backend={self._attention_backend!r}, offload={self._offload}"
        )

    def _validate_layout(self) -> None:
        from lightning_fpdt.validation import validate_setup

        validate_setup(
            world_size=self.world_size, num_nodes=self.num_nodes, num_processes=self.num_processes,
            sequence_parallel_size=self.sequence_parallel_size, chunk_size=self._chunk_size,
            attention_backend=self._attention_backend, precision=str(self.precision_plugin.precision),
            device_type=self.root_device.type, offload=self._offload, offload_checkpoints=self._offload_checkpoints,
            model=self.model, offload_optimizer=self._offload_optimizer,
        )

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None
        if self._chunk_size == "auto":
            from lightning_fpdt.memory import ModelShape

            ModelShape.from_module(self.model)  # fail now, not at the first batch, for a model it cannot size
        self._bind_blocks(self.model)  # before DDP wraps the module; raises on bad head counts
        if self._nonfinite_loss == "skip" and not self.lightning_module.automatic_optimization:
            raise ValueError(
                "FPDTStrategy: nonfinite_loss='skip' needs automatic optimization (with manual optimization your"
                " training_step steps the optimizer before the strategy sees the loss). Check the loss yourself"
                " or use nonfinite_loss='raise'."
            )
        if self._shard_parameters:
            self._setup_sharded(trainer)
        else:
            super().setup(trainer)

    def _setup_sharded(self, trainer: pl.Trainer) -> None:
        """``DDPStrategy.setup`` without DDP: FSDP2 in every stage (fit, validate, test, predict)."""
        from lightning.fabric.utilities.optimizer import _optimizers_to_device
        from lightning.pytorch.trainer.states import TrainerFn

        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._fully_shard(self.lightning_module)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def memory_options(self) -> dict[str, Any]:
        """This strategy's arguments to :func:`lightning_fpdt.memory.estimate` (sequence parallelism,
        offload, checkpointing, attention backend); ``chunk_size`` is left out while it is ``"auto"``."""
        options: dict[str, Any] = dict(
            # "emulate" keeps everything in the same (host) memory: nothing leaves the device
            sequence_parallel_size=self.sequence_parallel_size, offload=self._offload is True,
            activation_checkpointing=self._activation_checkpointing,
            offload_checkpoints=self._offload_checkpoints is True,
            attention_backend=self._attention_backend, shard_parameters=self._shard_parameters,
            data_parallel_size=self.data_parallel_size, offload_optimizer=self._offload_optimizer,
        )
        if self._chunk_size != "auto":
            options["chunk_size"] = self._chunk_size
        return options

    def _resolve_memory_budget(self) -> int:
        from lightning_fpdt.memory import GIB, available_memory

        if self._memory_budget is not None:
            return int(self._memory_budget * GIB)
        free = available_memory(self.root_device, self.num_processes)
        budget = torch.tensor([int(0.9 * free)], dtype=torch.int64, device=self.root_device)
        if self.world_size > 1:  # every rank must pick the same chunk size: plan for the tightest rank
            torch.distributed.all_reduce(budget, op=torch.distributed.ReduceOp.MIN)
        return int(budget.item())

    def _auto_chunk_size(self, batch_size: int, seq_len: int) -> int | None:
        """The chunk size for batches of this shape under ``chunk_size="auto"`` (picked once per shape)."""
        from lightning_fpdt.memory import ModelShape, auto_chunk_size, estimate, format_bytes, optimizer_kind

        key = (batch_size, seq_len)
        if key not in self._auto_chunks:
            assert self._budget_bytes is not None
            module = self.lightning_module
            shape, tiling = ModelShape.from_module(module)
            trainer = module._trainer
            optimizers = trainer.optimizers if trainer is not None else []
            options = dict(
                batch_size=batch_size, precision=str(trainer.precision) if trainer else "32-true",
                optimizer=optimizer_kind(optimizers[0]) if optimizers else "none", **self.memory_options(), **tiling,
            )
            try:
                chunk = auto_chunk_size(shape, seq_len, self._budget_bytes, **options)
            except ValueError as err:
                raise ValueError(f"FPDTStrategy: {err}") from None
            peak = estimate(shape, seq_len, chunk_size=chunk, **options).device_peak
            self._auto_chunks[key] = chunk
            rank_zero_info(
                f"FPDTStrategy: chunk_size='auto' picked {chunk} for batches of {batch_size} x {seq_len} tokens"
                f" (estimated device peak {format_bytes(peak)} per rank, budget {format_bytes(self._budget_bytes)})"
            )
        return self._auto_chunks[key]

    def _bind_blocks(self, module: torch.nn.Module, log: bool = True) -> None:
        offload_checkpoints = self._offload_checkpoints in (True, "emulate")  # "emulate": the same store
        if self._activation_checkpointing and offload_checkpoints and self._checkpoint_store is None:
            self._checkpoint_store = new_checkpoint_store(self.root_device)
        from lightning_fpdt.validation import check_has_blocks

        context = self.sequence_parallel_context
        bound = fpdt_blocks(module)
        for index, (_, block) in enumerate(bound):  # module order = forward order for a stack of layers
            block.bind(context, layer_index=index)
        if not log:
            return
        check_has_blocks(module, len(bound), self.sequence_parallel_size)  # layers made in configure_model
        rank_zero_info(
            f"FPDTStrategy: bound {len(bound)} FPDT block(s) to the sequence-parallel group"
            f" (activation_checkpointing={self._activation_checkpointing},"
            f" offload_checkpoints={self._offload_checkpoints})"
        )

    # ---- parameter sharding -------------------------------------------------------------------

    @property
    def shard_parameters(self) -> bool:
        return self._shard_parameters

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if isinstance(self._launcher, _MultiProcessingLauncher):
            self._launcher = _ShardAwareLauncher(self, start_method=self._start_method)

    def _fully_shard(self, module: pl.LightningModule) -> None:
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            FSDPModule,
            OffloadPolicy,
            fully_shard,
            register_fsdp_forward_method,
        )

        if isinstance(module, FSDPModule):  # sharded by an earlier fit/validate of this module
            return
        assert self._shard_mesh is not None
        options: dict[str, Any] = dict(
            mesh=self._shard_mesh,
            mp_policy=self._mixed_precision_policy(),
            offload_policy=CPUOffloadPolicy() if self._offload_optimizer else OffloadPolicy(),
        )
        for _, block in fpdt_blocks(module):
            fully_shard(block, **options)
        fully_shard(module, **options)  # the rest: embeddings, final norm, output projection
        # Lightning calls the *_step methods, not forward: they gather the root's parameters
        for name in ("training_step", "validation_step", "test_step", "predict_step"):
            register_fsdp_forward_method(module, name)

    def _mixed_precision_policy(self) -> Any:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        precision = str(self.precision_plugin.precision)
        low = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
        if low is None:  # true precisions: the parameters already have the compute dtype
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)

    # ---- non-finite loss ----------------------------------------------------------------------

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().training_step(*args, **kwargs)
        return self._check_finite(output)

    def _check_finite(self, output: Any) -> Any:
        loss = output["loss"] if isinstance(output, Mapping) else output
        if not isinstance(loss, torch.Tensor):
            return output
        bad = torch.zeros(self.world_size, device=self.root_device)
        bad[self.global_rank] = float(not torch.isfinite(loss.detach()).all())
        if self.world_size > 1:  # every rank must take the same decision, or the gradient sync hangs
            torch.distributed.all_reduce(bad)
        ranks = bad.nonzero().flatten().tolist()
        if not ranks:
            return output
        step = self.lightning_module.trainer.global_step if self.lightning_module._trainer else -1
        message = (
            f"FPDTStrategy: non-finite loss at global step {step} on rank(s) {ranks}"
            f" (this rank {self.global_rank}: {loss.detach().item()})"
        )
        if self._nonfinite_loss == "raise":
            raise FloatingPointError(
                message + ". Lower the learning rate, check the data, or pass nonfinite_loss='skip' to skip such steps."
            )
        rank_zero_warn(message + ": the update is skipped on every rank (nonfinite_loss='skip').")
        # Lightning refuses a `None` step under DDP. Every rank runs its ordinary backward (the gradient
        # collectives stay matched); the non-finite gradients are discarded in optimizer_step, together
        # with those of the other micro-batches of the accumulation window.
        self._skip_optimizer_step = True
        return output

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if self._nonfinite_loss != "skip":
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        result = closure()  # training_step and backward, once (the policy needs the loss before stepping)
        skip, self._skip_optimizer_step = self._skip_optimizer_step, False
        if skip:
            optimizer.zero_grad(set_to_none=True)
            return result
        return super().optimizer_step(optimizer, lambda: result, model, **kwargs)

    # ---- checkpoints --------------------------------------------------------------------------

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # states are loaded by name into the set-up (sharded or wrapped) model

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if not self._shard_parameters:
            return super().lightning_module_state_dict()
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.lightning_module)  # this rank's shards (DTensors)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The optimizer state keyed by parameter name (loads into any layout); sharded with
        ``shard_parameters``, else the full state."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        optimizer = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer
        options = StateDictOptions(full_state_dict=not self._shard_parameters)
        return get_optimizer_state_dict(self.lightning_module, optimizer, options=options)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Atomic: a crash mid-save leaves the previous checkpoint at ``filepath`` usable. A file with
        replicated weights, a distributed-checkpoint directory with ``shard_parameters``."""
        from lightning_fpdt import checkpoint as ckpt

        checkpoint["fpdt"] = {
            "layout": {"data_parallel": self.data_parallel_size, "sequence_parallel": self.sequence_parallel_size,
                       "chunk_size": self.chunk_size, "shard_parameters": self._shard_parameters},
            "rng": self._all_rng_states(),
        }
        target = str(self.broadcast(str(filepath)))
        remote = ckpt.is_remote(target)
        if not self._shard_parameters:
            if remote or storage_options is not None or not isinstance(self.checkpoint_io, TorchCheckpointIO):
                super().save_checkpoint(checkpoint, target, storage_options)  # the CheckpointIO decides
            else:
                self._on_rank_zero(lambda: ckpt.atomic_save(checkpoint, target), f"saving {target}")
            return
        if remote:
            raise ValueError(
                f"FPDTStrategy: sharded checkpoints are written with torch.distributed.checkpoint to a path every"
                f" rank can see; {target!r} is not a local or shared-filesystem path. Mount it, or save replicated"
                " checkpoints (shard_parameters=False)."
            )
        import torch.distributed.checkpoint as dcp

        path = Path(target)
        tmp = ckpt.temporary_path(path, self.broadcast(ckpt.new_token()))
        states = {"state_dict": checkpoint.pop("state_dict")}
        states.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        dcp.save(states, checkpoint_id=tmp)
        self.barrier("fpdt_checkpoint_shards_written")

        def commit() -> None:
            ckpt.atomic_save(checkpoint, tmp / ckpt.META_FILE)  # written last: marks the directory complete
            ckpt.swap_in(tmp, path)

        self._on_rank_zero(commit, f"saving {path}")

    def _on_rank_zero(self, fn: Any, what: str) -> None:
        """Run ``fn`` on rank 0; if it fails, every rank raises (instead of waiting in the next barrier)."""
        error = None
        if self.is_global_zero:
            try:
                fn()
            except Exception as err:  # noqa: BLE001  (re-raised below, on every rank)
                error = f"{type(err).__name__}: {err}"
        error = self.broadcast(error)
        if error is not None:
            raise RuntimeError(f"FPDTStrategy: {what} failed on rank 0: {error}")

    def _all_rng_states(self) -> list[dict[str, Any]]:
        from lightning_fpdt.checkpoint import rng_state

        if self.world_size == 1 or not _distributed_is_initialized():
            return [rng_state()]
        states: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(states, rng_state())
        return states

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        from lightning_fpdt.checkpoint import is_remote, remove

        if self.is_global_zero and not is_remote(str(filepath)) and Path(filepath).is_dir():
            remove(Path(filepath))  # renamed first: a crash mid-delete never leaves a half checkpoint
        else:
            super().remove_checkpoint(filepath)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a checkpoint saved with any layout: a file (replicated weights) or a distributed
        checkpoint directory (sharded), into this run's model and optimizers, by parameter name."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        from lightning_fpdt import checkpoint as ckpt

        self._states_loaded = False
        target = str(self.broadcast(str(checkpoint_path)))
        if ckpt.is_remote(target):
            checkpoint = super().load_checkpoint(target, weights_only=weights_only)
            self._restore_extra_state(checkpoint)
            return checkpoint
        path = ckpt.resolve(target)
        module = self.lightning_module
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers]
        if path.is_dir():
            checkpoint = self._load_distributed(path, module, optimizers)
        else:
            checkpoint = torch.load(path, map_location="cpu", weights_only=False)
            if self._shard_parameters:  # full tensors by name -> this rank's shards
                set_model_state_dict(module, checkpoint["state_dict"], options=StateDictOptions(
                    full_state_dict=True, strict=module.strict_loading))
                for optimizer, state in zip(optimizers, checkpoint.get("optimizer_states", [])):
                    self._set_optimizer_state(module, optimizer, state)
                self._states_loaded = True
        self._restore_extra_state(checkpoint)
        return checkpoint

    def _load_distributed(self, path: Path, module: pl.LightningModule, optimizers: list[Any]) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        from lightning_fpdt.checkpoint import META_FILE

        checkpoint = torch.load(path / META_FILE, map_location="cpu", weights_only=False)
        # the targets have this run's layout: shards (sharded) or full tensors (replicated); DCP reshards
        states: dict[str, Any] = {"state_dict": get_model_state_dict(module)}
        for i, optimizer in enumerate(optimizers):
            states[f"optimizer_{i}"] = get_optimizer_state_dict(module, optimizer)
        dcp.load(states, checkpoint_id=path)
        set_model_state_dict(module, states["state_dict"])
        for i, optimizer in enumerate(optimizers):
            set_optimizer_state_dict(module, optimizer, states[f"optimizer_{i}"])
        self._states_loaded = True
        # Lightning checks that a checkpoint has optimizer states before restoring them (here: done)
        checkpoint["optimizer_states"] = [states[f"optimizer_{i}"] for i in range(len(optimizers))]
        return checkpoint

    @staticmethod
    def _set_optimizer_state(module: torch.nn.Module, optimizer: Any, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        if all(isinstance(k, int) for k in state.get("state", {})):  # a plain `optimizer.state_dict()` (ids)
            from torch.distributed.tensor import DTensor

            if any(isinstance(p, DTensor) for group in optimizer.param_groups for p in group["params"]):
                raise ValueError(
                    "FPDTStrategy: this checkpoint's optimizer state is keyed by parameter position (a plain"
                    " Lightning/DDP checkpoint), which cannot be sharded by name. Resume it once with"
                    " shard_parameters=False and save again (lightning-fpdt saves optimizer states by name),"
                    " or load only the weights."
                )
            optimizer.load_state_dict(state)
        else:
            set_optimizer_state_dict(module, optimizer, state, options=StateDictOptions(full_state_dict=True))

    def _restore_extra_state(self, checkpoint: dict[str, Any]) -> None:
        from lightning_fpdt.checkpoint import set_rng_state

        extra = checkpoint.get("fpdt", {})
        saved = extra.get("layout")
        if saved:
            rank_zero_info(
                f"FPDTStrategy: resuming a checkpoint saved at data_parallel={saved['data_parallel']} x"
                f" sequence_parallel={saved['sequence_parallel']} (chunk_size={saved['chunk_size']},"
                f" shard_parameters={saved['shard_parameters']}) as {self.data_parallel_size} x"
                f" {self.sequence_parallel_size} (chunk_size={self._chunk_size!r}, shard_parameters={self._shard_parameters})"
            )
        rngs = extra.get("rng")
        if rngs:
            set_rng_state(rngs[self.global_rank % len(rngs)])
        trainer = self.lightning_module._trainer
        fitting = trainer is not None and trainer.state.fn == "fit"
        loops = checkpoint.get("loops", {}).get("fit_loop", {})
        batches = loops.get("epoch_loop.batch_progress", {}).get("current", {})
        epochs = loops.get("epoch_progress", {}).get("current", {})
        epoch_done = epochs.get("processed", 0) >= epochs.get("ready", 0)  # saved at the end of the epoch
        # batches of the unfinished epoch already trained on (ResumableLoader also skips none when they
        # are a whole epoch: a save after its last batch)
        self._resume_batches = int(batches.get("ready", 0)) if fitting and not epoch_done else 0
        if fitting and epoch_done and epochs.get("completed", 0) < epochs.get("ready", 0):
            rank_zero_warn(
                "FPDTStrategy: this checkpoint was saved in on_train_epoch_end. Lightning resumes such a checkpoint"
                " with one batch of the next epoch and then starts another epoch (its own behaviour, with or"
                " without this strategy), so the run will not repeat an uninterrupted one exactly. Checkpoints"
                " saved during the epoch (every_n_train_steps, also after an epoch's last batch) resume exactly."
            )

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if not self._states_loaded:
            super().load_model_state_dict(checkpoint, strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if self._states_loaded:
            return
        module = self.lightning_module
        for optimizer, state in zip(self.optimizers, checkpoint.get("optimizer_states", [])):
            self._set_optimizer_state(module, getattr(optimizer, "_optimizer", optimizer), state)

    # ---- data position ------------------------------------------------------------------------

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        trainer = self.lightning_module._trainer if self.lightning_module is not None else None
        if trainer is None or not trainer.training or not isinstance(dataloader, Iterable):
            return dataloader
        skip = 0 if isinstance(dataloader, _Stateful) else self._resume_batches  # stateful loaders resume themselves
        return ResumableLoader(dataloader, skip)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._resume_batches = 0  # every training loader has taken its share


    # ---- batches ------------------------------------------------------------------------------

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        batch = super().batch_to_device(batch, device, dataloader_idx)
        if self.data_parallel_size == 1 or not _distributed_is_initialized():
            return self.shard_batch(batch)  # every rank holds the same batch: all of them raise together
        # data-parallel groups hold different batches: a group whose batch is refused must not leave the
        # others waiting in the next collective, so every rank learns whether any rank failed
        error: Exception | None = None
        try:
            batch = self.shard_batch(batch)
        except (ValueError, TypeError, KeyError) as err:
            error = err
        failed = torch.tensor([float(error is not None)], device=self.root_device)
        torch.distributed.all_reduce(failed)
        if error is not None:
            raise error
        if failed.item():
            raise ValueError(
                "FPDTStrategy: another data-parallel group's batch was refused (its ranks raised the reason);"
                " stopping every rank."
            )
        return batch

    def shard_batch(self, batch: Any) -> Any:
        """This rank's part of a dict batch of whole sequences (see :func:`lightning_fpdt.layout.shard_batch`)."""
        sp = self.sequence_parallel_size
        if not isinstance(batch, Mapping):
            if sp == 1:
                return batch
            raise TypeError(
                f"FPDTStrategy: sequence_parallel_size={sp} needs dict batches with 'input_ids' [batch, seq]"
                f" to shard; got a {type(batch).__name__}."
            )
        if self._chunk_size == "auto" and "input_ids" in batch and isinstance(batch["input_ids"], torch.Tensor):
            ids = batch["input_ids"]
            chunk = self._auto_chunk_size(ids.shape[0], ids.shape[-1])
            if chunk != self._active_chunk_size:  # the blocks follow the batch's layout
                self._active_chunk_size = chunk
                self._bind_blocks(self.lightning_module, log=False)
        return shard_batch(batch, sp, self.sequence_parallel_rank, self._active_chunk_size, self._sequence_keys,
                           self._pad_token_id, owner="FPDTStrategy")

    # ---- registration -------------------------------------------------------------------------

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, start_method in (("fpdt", "popen"), ("fpdt_spawn", "spawn"), ("fpdt_fork", "fork")):
            strategy_registry.register(
                name,
                cls,
                description=f"FPDT sequence-parallel strategy with start_method={start_method!r}",
                start_method=start_method,
                override=True,
            )

    @override
    def teardown(self) -> None:
        self._resume_batches = 0
        self._states_loaded = False
        if self._checkpoint_store is not None:
            self._checkpoint_store.close()
            self._checkpoint_store = None
        super().teardown()
        if _distributed_is_initialized():
            self._device_mesh = None


class _ShardAwareLauncher(_MultiProcessingLauncher):
    """spawn/fork launcher that hands the parent process whole weights, not rank 0's shards."""

    @override
    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> Any:
        strategy = trainer.strategy
        if not (isinstance(strategy, FPDTStrategy) and strategy.shard_parameters and strategy._shard_mesh is not None):
            return super()._collect_rank_zero_results(trainer, results)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        module = trainer.lightning_module
        # collective: every rank takes part, rank 0 receives the full tensors on the CPU
        full = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        module.state_dict = lambda *args, **kwargs: full  # what the base launcher sends to the parent
        try:
            return super()._collect_rank_zero_results(trainer, results)
        finally:
            del module.state_dict


class ResumableLoader:
    """The training data loader, which after a resume skips the batches of the unfinished epoch that
    the checkpoint had already trained on (their indices are drawn and the batches loaded, then
    dropped: the sampler's order stays that of the uninterrupted run).

    Attributes are the wrapped loader's (read and written), so Lightning's ``set_epoch`` reaches the
    distributed sampler and its ``worker_init_fn`` reaches the loader.
    """

    _OWN = ("loader", "_skip")

    def __init__(self, loader: Iterable, skip: int = 0) -> None:
        object.__setattr__(self, "loader", loader)
        object.__setattr__(self, "_skip", skip)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["loader"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.loader, name, value)

    def __iter__(self) -> Iterator[Any]:
        # a generator: the inner iterator (and its workers' first indices) is made at the first next(),
        # after Lightning set the sampler's epoch
        skip = self._skip
        object.__setattr__(self, "_skip", 0)
        if skip >= len(self):  # the checkpoint closed its epoch: nothing of this one was trained on
            skip = 0
        yield from itertools.islice(iter(self.loader), skip, None)
