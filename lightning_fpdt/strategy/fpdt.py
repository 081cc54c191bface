"""``FPDTStrategy``: data parallel x sequence parallel training with FPDT attention.

A thin layer of Lightning hooks; each hands its concern to the module that owns it (the README's
"what is where" table): options, batches, planning, sharding, the step guard and the launchers; its checkpoint
hooks are :class:`~lightning_fpdt.strategy.checkpoint_hooks.CheckpointHooks` (the checkpoint files, run state and
resume).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import override

from lightning_fpdt.attention.routes import FirstStep
from lightning_fpdt.backends import route_description
from lightning_fpdt.checkpoints.resume import resumable
from lightning_fpdt.errors import PREFIX, FPDTError, said_by_every_rank
from lightning_fpdt.layers.accumulation import optimizer_gradients, scale_window_gradients
from lightning_fpdt.layers.activation_checkpoint import new_layer_input_store
from lightning_fpdt.memory import EstimateOptions, ModelShape
from lightning_fpdt.memory.planning import RunPlans, run_planners
from lightning_fpdt.memory.unstreamed import report_unstreamed
from lightning_fpdt.offload.chunk_store import ChunkStore
from lightning_fpdt.offload.copy_engine import release_copy_engines
from lightning_fpdt.options import (
    AttentionBackend,
    FPDTOptions,
    OffloadArgument,
    attention_dtype,
    check_has_blocks,
)
from lightning_fpdt.parallel.batches import (
    DEFAULT_SEQUENCE_KEYS,
    BatchGate,
    input_vocab_size,
    shard_batch,
    target_tokens,
)
from lightning_fpdt.parallel.binding import SequenceParallelContext, bind
from lightning_fpdt.parallel.mesh import SequenceParallelGroups, build_mesh, placement
from lightning_fpdt.strategy.checkpoint_hooks import CheckpointHooks
from lightning_fpdt.strategy.launcher import (
    Peer,
    destroy_group_at_exit,
    explain_peer_failure,
    fpdt_launcher,
    gather_peers,
)
from lightning_fpdt.strategy.sharding import check_replicated_gradients, host_shards_backend, setup_sharded
from lightning_fpdt.strategy.step_guard import StepGuard


class FPDTStrategy(CheckpointHooks):
    """Fully Pipelined Distributed Transformer training: Ulysses sequence parallelism with chunked,
    optionally host-offloaded attention, on top of data parallelism.

    The world is a ``(data_parallel, sequence_parallel)`` device mesh, sequence parallel innermost
    (``lightning_fpdt.parallel.mesh`` says where each group lies):

    - ``data_parallel``: ranks with different samples (the sampler shards by this coordinate only);
    - ``sequence_parallel``: ranks that share one sample, each holding ``1 / sp`` of its sequence in
      the FPDT layout, exchanging heads by all-to-all inside each Ulysses group of consecutive ranks
      (``sp / ring_size`` of them, on one node) and key/value chunks between ring peers.

    Gradients are averaged over the whole world (DDP, or FSDP2 with ``shard_parameters``); with the
    token-weighted loss of :func:`lightning_fpdt.layers.loss.token_weighted_loss` this is exactly the
    single-process gradient, and over an accumulation window of a module with a
    :class:`~lightning_fpdt.layers.accumulation.TokenWindow` the gradient of the window's tokens as one batch.

    Args: the fields of :class:`lightning_fpdt.options.FPDTOptions` up to ``nonfinite_loss``, each documented and
    validated there; ``gradient_as_bucket_view`` (``True``: DDP's gradients are views into its buckets, one copy of
    them instead of two; DDP's own default is ``False``); then DDPStrategy's (``process_group_backend``, ``timeout``,
    ``start_method``, ``**kwargs`` for ``DistributedDataParallel``). A value wrong on its own raises ``ValueError``.
    """

    strategy_name = "fpdt"

    def __init__(
        self,
        sequence_parallel_size: int | Literal["auto"] = "auto",
        ring_size: int | Literal["auto"] = "auto",
        chunk_size: int | Literal["auto"] | None = None,
        memory_budget: float | None = None,
        attention_backend: AttentionBackend = "auto",
        offload: OffloadArgument = False,
        activation_checkpointing: bool = False,
        offload_checkpoints: OffloadArgument = False,
        keep_attention: bool | Literal["auto"] = "auto",
        sequence_keys: Sequence[str] = DEFAULT_SEQUENCE_KEYS,
        pad_token_id: int = 0,
        shard_parameters: bool = False,
        offload_optimizer: bool = False,
        nonfinite_loss: Literal["raise", "skip"] = "raise",
        gradient_as_bucket_view: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = timedelta(minutes=30),
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **kwargs: Any,
    ) -> None:
        # DDP's gradients as views into its buckets: one copy of them, not two. A parameter of its own, not a default
        # set in **kwargs: LightningCLI fills **kwargs with every argument of DistributedDataParallel at its default
        kwargs["gradient_as_bucket_view"] = gradient_as_bucket_view
        super().__init__(process_group_backend=process_group_backend, timeout=timeout, start_method=start_method,
                         **kwargs)
        self._options = FPDTOptions(
            sequence_parallel_size=sequence_parallel_size, ring_size=ring_size, chunk_size=chunk_size,
            memory_budget=memory_budget, attention_backend=attention_backend, offload=offload,
            activation_checkpointing=activation_checkpointing,
            offload_checkpoints=offload_checkpoints, keep_attention=keep_attention, sequence_keys=sequence_keys,
            pad_token_id=pad_token_id,
            shard_parameters=shard_parameters, offload_optimizer=offload_optimizer, nonfinite_loss=nonfinite_loss,
            gradient_as_bucket_view=kwargs["gradient_as_bucket_view"],
        )
        self._device_mesh: DeviceMesh | None = None
        self._groups = SequenceParallelGroups(1, 1, 1)  # the Ulysses groups and rings: made in setup_environment
        self._plans = RunPlans()  # chunk_size="auto", keep_attention="auto": made in setup_environment
        self._active_chunk_size: int | None = None if chunk_size == "auto" else chunk_size
        self._layer_input_store: ChunkStore | None = None  # offloaded block inputs: made in setup
        self._keep_attention = keep_attention is not False  # "auto": decided per batch shape
        self._guard = StepGuard(nonfinite_loss)
        self._gate: BatchGate | None = None  # made in setup, once the model is known
        self._batch_seen = False  # a refusal before the first batch is every rank's alike (on_exception)
        self._peers: tuple[Peer, ...] = ()  # every rank's host and pid, to name a rank that dies
        self.first_step_attention = FirstStep()  # the kernels the first step's attention ran on, said once

    # ---- properties ---------------------------------------------------------------------------

    @property
    def options(self) -> FPDTOptions:
        """The validated configuration."""
        return self._options

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.num_processes

    @property
    def shard_parameters(self) -> bool:
        """Whether parameters are sharded over every rank (FSDP2); a model built on the meta device then reads
        only its shards in ``setup`` (``HFCausalLM.load_sharded_weights``)."""
        return self._options.shard_parameters

    @property
    def sequence_parallel_size(self) -> int:
        """Ranks per sequence-parallel group (``"auto"`` resolved to the processes per node)."""
        return self._options.mesh_shape(self.num_nodes, self.num_processes)[1]

    @property
    def data_parallel_size(self) -> int:
        """Sequence-parallel groups in the world."""
        return self._options.mesh_shape(self.num_nodes, self.num_processes)[0]

    @property
    def estimate_options(self) -> EstimateOptions:
        """What the memory model needs of this strategy (the batch size, precision, optimizer and tiling
        are the module's and the trainer's)."""
        return EstimateOptions.from_strategy(self._options, self.num_nodes, self.num_processes, model=self.model)

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
        if self._options.chunk_size == "auto" and (self._plans.chunks is None or not self._plans.chunks.planned):
            return "auto"
        return self._active_chunk_size

    @property
    def memory_budget_bytes(self) -> int | None:
        """The per-rank budget ``chunk_size="auto"`` plans for (``None`` before setup or without "auto")."""
        return None if self._plans.chunks is None else self._plans.chunks.budget_bytes

    @property
    def device_mesh(self) -> DeviceMesh:
        if self._device_mesh is None:
            raise RuntimeError(f"{PREFIX}the device mesh is not available before the processes are initialized.")
        return self._device_mesh

    @property
    def sequence_parallel_group(self) -> ProcessGroup | None:
        """The SP process group; ``None`` when ``sequence_parallel_size == 1``."""
        if self.sequence_parallel_size == 1:
            return None
        return self.device_mesh["sequence_parallel"].get_group()

    @property
    def sequence_parallel_context(self) -> SequenceParallelContext:
        """What every sequence-parallel attention layer is bound to (the layer input store exists once ``setup``
        ran)."""
        return self._options.context(self.sequence_parallel_group, self._active_chunk_size, self._layer_input_store,
                                     self._groups, self._keep_attention)

    @property
    def ring_size(self) -> int:
        """Ranks of the ring in each sequence-parallel group (``"auto"`` resolved in ``setup_environment``)."""
        return self._groups.ring

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # every rank of an SP group reads the same samples: shard by the data-parallel coordinate only
        return {"num_replicas": self.data_parallel_size, "rank": self.data_parallel_rank}

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # states are loaded by name into the set-up (sharded or wrapped) model

    # ---- launcher and environment ---------------------------------------------------------------

    @override
    def _get_process_group_backend(self) -> str:
        chosen = self._process_group_backend or host_shards_backend(self.root_device, self._options.offload_optimizer)
        return chosen or super()._get_process_group_backend()

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self._launcher = fpdt_launcher(self, self._start_method)

    def check_run(self, model: pl.LightningModule | None, backend: bool = True) -> None:
        """Refuse what is wrong for this run of ``model`` (:meth:`FPDTOptions.check_run`: the world size, chunk size,
        device, precision, head counts, and with ``backend`` the attention backend): on every rank before any
        collective, and by ``fpdt-train`` before it launches any (the world as the trainer was given it, nodes x
        devices; ``backend=False`` there, since asking CUDA about the device would spoil the ranks it forks)."""
        self._options.check_run(
            world_size=self.world_size, num_nodes=self.num_nodes,
            num_processes=self.num_processes, sequence_parallel_size=self.sequence_parallel_size,
            precision=str(self.precision_plugin.precision), device_type=self.root_device.type, model=model,
            backend=backend,
        )

    @override
    def setup_environment(self) -> None:
        self.check_run(self.model)
        super().setup_environment()
        destroy_group_at_exit()
        self._peers = gather_peers()
        dp, sp = self.data_parallel_size, self.sequence_parallel_size
        ring = self._options.resolved_ring_size(sp, self.num_processes, self.model)
        self._device_mesh, self._groups = build_mesh(self.root_device.type, dp, sp, ring)
        assert self.model is not None
        self.model._device_mesh = self._device_mesh  # exposed as `LightningModule.device_mesh`
        o, where = self._options, placement(self._groups, self.num_processes)
        self._plans = run_planners(
            o.chunk_size == "auto", o.keep_attention == "auto" and o.activation_checkpointing, o.memory_budget,
            o.offload == "on", self.estimate_options, self.root_device, self.num_processes, self.world_size)
        # the route and its library's version, once: a fallback (an old cuDNN, flash-attn missing) cannot hide
        route = route_description(o.attention_backend, self.root_device.type,
                                  attention_dtype(str(self.precision_plugin.precision)))
        rank_zero_info(f"{PREFIX}{self.world_size} processes on {self.num_nodes} node(s): {where}; chunk_size="
                       f"{o.chunk_size!r}, attention_backend={o.attention_backend!r} ({route}), offload={o.offload!r}")

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None
        if self._options.chunk_size == "auto":
            ModelShape.from_module(self.model)  # fail now, not at the first batch, for a model it cannot size
        self._guard.setup(self.lightning_module.automatic_optimization, str(self.precision_plugin.precision))
        if self._options.offload_block_inputs and self._layer_input_store is None:
            self._layer_input_store = new_layer_input_store(self.root_device)
        refuse = getattr(self.lightning_module, "refuse_token_mixers", None)  # CausalLM's: what sees one shard only
        if refuse is not None:
            refuse(self.sequence_parallel_size)
        self._bind(self.model)  # before DDP/FSDP wraps the module; raises on bad head counts
        self._gate = BatchGate(self.world_size, self.sequence_parallel_size, self.global_rank, self.root_device,
                               input_vocab_size(self.model))
        if self._options.shard_parameters:  # DDPStrategy.setup without DDP: FSDP2 in every stage
            setup_sharded(self, trainer, self._options.offload_optimizer)
        else:
            super().setup(trainer)

    def _bind(self, module: torch.nn.Module, log: bool = True) -> None:
        count = bind(module, self.sequence_parallel_context)
        if log:
            check_has_blocks(module, count, self.sequence_parallel_size)  # layers made in configure_model
            rank_zero_info(f"{PREFIX}bound {count} attention layer(s) to the sequence-parallel group"
                           f" (activation_checkpointing={self._options.activation_checkpointing},"
                           f" offload_checkpoints={self._options.offload_checkpoints!r})")
            report_unstreamed(module, self.estimate_options)  # what cannot stream, named once

    # ---- batches and data -----------------------------------------------------------------------

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        trainer = self.lightning_module._trainer if self.lightning_module is not None else None
        if trainer is None or not trainer.training:
            return dataloader
        return resumable(dataloader, trainer)

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        batch = super().batch_to_device(batch, device, dataloader_idx)
        complete = getattr(self.lightning_module, "complete_batch", None)  # CausalLM's: before any padding
        if complete is not None:
            batch = complete(batch)
        if self._gate is None:
            raise RuntimeError(f"{PREFIX}batches are sharded only once the strategy is set up (Trainer.fit/validate).")
        self._batch_seen = True
        return self._gate(batch, self.shard_batch)  # checks, agreement across ranks, this rank's shard

    def shard_batch(self, batch: Any) -> Any:
        """This rank's part of a dict batch of whole sequences (see
        :func:`lightning_fpdt.parallel.batches.shard_batch`)."""
        chunk, keep = self._plans.for_batch(self.lightning_module, batch, self._active_chunk_size, self._keep_attention)
        if (chunk, keep) != (self._active_chunk_size, self._keep_attention):  # the layers follow the batch's shape
            self._active_chunk_size, self._keep_attention = chunk, keep
            self._bind(self.lightning_module, log=False)
        return shard_batch(batch, self.sequence_parallel_size, self.sequence_parallel_rank, self._active_chunk_size,
                           self._options.sequence_keys, self._options.pad_token_id, "FPDTStrategy", self.ring_size)

    # ---- training step and the non-finite policy ------------------------------------------------

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.first_step_attention.watch(lambda said: rank_zero_info(f"{PREFIX}attention calls of the first"
                                                                          f" training batch: {said}")):
            output = super().training_step(*args, **kwargs)
        loss = output["loss"] if isinstance(output, Mapping) else output
        if isinstance(loss, torch.Tensor) and self.lightning_module.automatic_optimization:  # manual: stepped already
            self._guard.observe(loss, target_tokens(args[0] if args else kwargs.get("batch")))
        return output

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        result = closure()  # training_step and backward first: the policy needs the loss and the gradients
        step = self.lightning_module.trainer.global_step if self.lightning_module._trainer else -1
        check_replicated_gradients(self.lightning_module, step, not self.shard_parameters and self.world_size > 1)
        grads = optimizer_gradients(optimizer)
        scale_window_gradients(self.lightning_module, grads)  # the window's token mean, before guard and clipping
        if not self._guard.allows_step(grads, step, self.global_rank, self.world_size, self.root_device):
            optimizer.zero_grad(set_to_none=True)
            return result
        return super().optimizer_step(optimizer, lambda: result, model, **kwargs)

    # ---- registration and teardown ----------------------------------------------------------------

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, start_method in (("fpdt", "popen"), ("fpdt_spawn", "spawn"), ("fpdt_fork", "fork")):
            strategy_registry.register(
                name, cls, description=f"FPDT sequence-parallel strategy with start_method={start_method!r}",
                start_method=start_method, override=True,
            )

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        if isinstance(exception, FPDTError) and not self._batch_seen:  # the configuration's, the model's, the files'
            said_by_every_rank(exception)
        explain_peer_failure(exception, self._peers, self.global_rank)  # which rank died, not gloo's words

    @override
    def teardown(self) -> None:
        if self._layer_input_store is not None:
            self._layer_input_store.close()
            self._layer_input_store = None
        release_copy_engines()  # the copy streams, workers and pinned host pools of this run
        super().teardown()
        if _distributed_is_initialized():
            self._device_mesh = None
