"""``FPDTStrategy``: data parallel x sequence parallel training with FPDT attention."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from typing_extensions import override

from lightning_fpdt.attention.kernels import BACKENDS
from lightning_fpdt.block import SequenceParallelContext, new_checkpoint_store
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
            not weights, fill the device; see docs/configuration.md).
        activation_checkpointing: keep only each FPDT block's input for backward and recompute the
            block (attention chunks included) in backward.
        offload_checkpoints: with ``activation_checkpointing``, keep those block inputs in host memory
            and prefetch the previous block's input during backward.
        sequence_keys: batch keys that are ``[batch, seq, ...]`` tensors to pad and shard; other keys
            pass through untouched.
        pad_token_id: id used to pad ``input_ids`` to the layout's multiple.
        **kwargs: the usual :class:`~lightning.pytorch.strategies.DDPStrategy` arguments.
    """

    strategy_name = "fpdt"

    def __init__(
        self,
        sequence_parallel_size: int | Literal["auto"] = "auto",
        chunk_size: int | Literal["auto"] | None = None,
        memory_budget: float | None = None,
        attention_backend: Literal["auto", "math", "sdpa", "flash_attn"] = "auto",
        offload: bool = False,
        activation_checkpointing: bool = False,
        offload_checkpoints: bool = False,
        sequence_keys: Sequence[str] = DEFAULT_SEQUENCE_KEYS,
        pad_token_id: int = 0,
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
        if offload_checkpoints and not activation_checkpointing:
            raise ValueError(
                "FPDTStrategy: offload_checkpoints=True needs activation_checkpointing=True (only checkpointed"
                " block inputs are offloaded)."
            )
        self._offload = offload
        self._activation_checkpointing = activation_checkpointing
        self._offload_checkpoints = offload_checkpoints
        self._checkpoint_store: ChunkStore | None = None
        self._sequence_keys = tuple(sequence_keys)
        self._pad_token_id = pad_token_id
        self._device_mesh: DeviceMesh | None = None

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
            offload=self._offload,
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
        assert self.model is not None
        self.model._device_mesh = self._device_mesh  # exposed as `LightningModule.device_mesh`
        if self._chunk_size == "auto":
            self._budget_bytes = self._resolve_memory_budget()
        rank_zero_info(
            f"FPDTStrategy: {self.world_size} processes as data_parallel={dp} x sequence_parallel={sp};"
            f" chunk_size={self._chunk_size!r}, attention_backend={self._attention_backend!r}, offload={self._offload}"
        )

    def _validate_layout(self) -> None:
        world, sp = self.world_size, self.sequence_parallel_size
        if world % sp != 0:
            options = [d for d in range(1, world + 1) if world % d == 0]
            raise ValueError(
                f"FPDTStrategy: sequence_parallel_size={sp} does not divide the world size {world}"
                f" ({self.num_nodes} node(s) x {self.num_processes} device(s)); use one of {options}."
            )
        if self._chunk_size != "auto":
            validate_chunk_size(self._chunk_size, sp)
        if self._offload and self.root_device.type != "cuda":
            rank_zero_info(
                "FPDTStrategy: offload=True on a CPU device copies chunks between host buffers through a"
                " background worker: correct, but it saves no memory. It pays on CUDA devices."
            )

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None
        if self._chunk_size == "auto":
            from lightning_fpdt.memory import ModelShape

            ModelShape.from_module(self.model)  # fail now, not at the first batch, for a model it cannot size
        self._bind_blocks(self.model)  # before DDP wraps the module; raises on bad head counts
        super().setup(trainer)

    def memory_options(self) -> dict[str, Any]:
        """This strategy's arguments to :func:`lightning_fpdt.memory.estimate` (sequence parallelism,
        offload, checkpointing, attention backend); ``chunk_size`` is left out while it is ``"auto"``."""
        options: dict[str, Any] = dict(
            sequence_parallel_size=self.sequence_parallel_size, offload=self._offload,
            activation_checkpointing=self._activation_checkpointing, offload_checkpoints=self._offload_checkpoints,
            attention_backend=self._attention_backend,
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
            chunk = auto_chunk_size(shape, seq_len, self._budget_bytes, **options)
            peak = estimate(shape, seq_len, chunk_size=chunk, **options).device_peak
            self._auto_chunks[key] = chunk
            rank_zero_info(
                f"FPDTStrategy: chunk_size='auto' picked {chunk} for batches of {batch_size} x {seq_len} tokens"
                f" (estimated device peak {format_bytes(peak)} per rank, budget {format_bytes(self._budget_bytes)})"
            )
        return self._auto_chunks[key]

    def _bind_blocks(self, module: torch.nn.Module, log: bool = True) -> None:
        if self._activation_checkpointing and self._offload_checkpoints and self._checkpoint_store is None:
            self._checkpoint_store = new_checkpoint_store(self.root_device)
        context = self.sequence_parallel_context
        bound = [name for name, m in module.named_modules() if _is_fpdt_block(m)]
        for index, name in enumerate(bound):  # module order = forward order for a stack of layers
            module.get_submodule(name).bind(context, layer_index=index)
        if not log:
            return
        if not bound and self.sequence_parallel_size > 1:
            raise ValueError(
                f"FPDTStrategy: sequence_parallel_size={self.sequence_parallel_size} but"
                f" {type(module).__name__} has no FPDTBlock; without one, attention would only see this"
                " rank's shard of the sequence. Build the model from lightning_fpdt.FPDTBlock (see"
                " docs/own-model.md) or use sequence_parallel_size=1."
            )
        rank_zero_info(
            f"FPDTStrategy: bound {len(bound)} FPDT block(s) to the sequence-parallel group"
            f" (activation_checkpointing={self._activation_checkpointing},"
            f" offload_checkpoints={self._offload_checkpoints})"
        )

    # ---- batches ------------------------------------------------------------------------------

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        batch = super().batch_to_device(batch, device, dataloader_idx)
        return self.shard_batch(batch)

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
        if self._checkpoint_store is not None:
            self._checkpoint_store.close()
            self._checkpoint_store = None
        super().teardown()
        if _distributed_is_initialized():
            self._device_mesh = None


def _is_fpdt_block(module: torch.nn.Module) -> bool:
    from lightning_fpdt.block import FPDTBlock

    return isinstance(module, FPDTBlock)
