"""The settings of a memory estimate: one frozen object, built from a strategy's options or from a YAML.

:class:`EstimateOptions` is what :func:`lightning_fpdt.memory.estimate`, :func:`~lightning_fpdt.memory.auto_chunk_size`,
:func:`~lightning_fpdt.memory.report` and :class:`lightning_fpdt.memory.planning.ChunkPlanner` take. It is built in
one of two ways, and each rule is written once, in the strategy's configuration
(:class:`lightning_fpdt.options.FPDTOptions`):

- :meth:`EstimateOptions.from_strategy`: from the options of a strategy and the run's processes;
- :meth:`EstimateOptions.from_yaml`: from an ``fpdt-train`` YAML (its strategy's ``init_args`` read as the
  strategy reads them, its trainer's devices, nodes and precision, its data's batch size).

Only ``offload="on"`` frees device memory: under ``"emulate"`` the chunks are copied between host buffers
but counted where they were computed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from torch import nn

from lightning_fpdt.errors import FPDTError, is_positive_int
from lightning_fpdt.options import FPDTOptions
from lightning_fpdt.parallel.layout import validate_chunk_size

# Lightning precision string -> (parameter bytes, activation bytes)
PRECISION_BYTES = {
    "32-true": (4, 4), "32": (4, 4), "64-true": (8, 8), "64": (8, 8),
    "bf16-mixed": (4, 2), "16-mixed": (4, 2), "bf16-true": (2, 2), "16-true": (2, 2),
}
OPTIMIZER_STATES = {"adamw": 2, "sgd": 1, "none": 0}  # float tensors per parameter


@dataclass(frozen=True)
class EstimateOptions:
    """How a run trains, as far as its memory is concerned. The field order is the order
    :func:`~lightning_fpdt.memory.report` prints them in."""

    batch_size: int = 1
    """Samples per step on each data-parallel rank."""
    chunk_size: int | Literal["auto"] | None = None
    """Global tokens per attention chunk; ``None``: one chunk (plain Ulysses); ``"auto"``: to be picked
    against a budget (:func:`~lightning_fpdt.memory.report`, :class:`~lightning_fpdt.memory.planning.ChunkPlanner`);
    :func:`~lightning_fpdt.memory.estimate` needs it resolved."""
    sequence_parallel_size: int = 1
    """Ranks sharing one sample's sequence."""
    data_parallel_size: int = 1
    """Sequence-parallel groups (matters when parameters are sharded over data x sequence ranks)."""
    ring_size: int = 1
    """Of the sequence-parallel group, ranks that form a ring (``sequence_parallel_size = ulysses x ring``,
    :mod:`lightning_fpdt.parallel.mesh`): the heads are scattered over the Ulysses degree ``sequence_parallel_size /
    ring_size`` only, and each rank's chunk store holds its ring peers' key/value parts too. 1: plain Ulysses."""
    offload: bool = False
    """Saved attention chunks live in host memory (the strategy's ``offload="on"``)."""
    activation_checkpointing: bool = False
    """Each decoder layer keeps only its input for backward and is recomputed there."""
    offload_checkpoints: bool = False
    """With ``activation_checkpointing``: those inputs live in host memory (``offload_checkpoints="on"``)."""
    mlp_tiled: bool = False
    """The MLPs run in recomputed sequence tiles (read from the module: ``ModelShape.from_module``)."""
    loss_tiled: bool = False
    """The loss runs in token tiles, never holding the full logits (read from the module)."""
    precision: str = "32-true"
    """Lightning's precision string: the bytes of parameters and of activations."""
    optimizer: str = "adamw"
    """``"adamw"`` (two states per parameter), ``"sgd"`` (one) or ``"none"``."""
    attention_backend: str = "sdpa"
    """The attention backend; ``"math"`` materializes a chunk pair's scores, and so does every route whose kernels
    cannot cap, for a model that caps its attention logits (:mod:`lightning_fpdt.memory.scores`)."""
    shard_parameters: bool = False
    """Parameters, gradients and optimizer state sharded over every rank (FSDP2)."""
    offload_optimizer: bool = False
    """With ``shard_parameters``: the shards and optimizer state live in host memory."""
    gradient_as_bucket_view: bool = True
    """Without ``shard_parameters``: DDP's gradients are views into its buckets; ``False``: the buckets are a
    second copy of the gradients, kept between steps."""
    streaming: bool = True
    """Checkpointed decoder layers with chunked attention and no other token mixer stream chunk by chunk
    (:mod:`lightning_fpdt.layers.streaming`) and the tiled loss applies the final norm; ``False``: layers recomputed
    whole (``SequenceParallelContext.streaming``, for comparisons)."""
    keep_attention: bool = False
    """With ``activation_checkpointing``: every recomputed attention layer keeps its attention's output and
    log-sum-exp from its forward to its backward (:mod:`lightning_fpdt.attention.kept_answers`), in host memory with
    ``offload``, else on the device."""

    def __post_init__(self) -> None:
        if self.precision not in PRECISION_BYTES:
            raise FPDTError(f"precision={self.precision!r} is not one of {sorted(PRECISION_BYTES)}.")
        if self.optimizer not in OPTIMIZER_STATES:
            raise FPDTError(f"optimizer={self.optimizer!r} is not one of {sorted(OPTIMIZER_STATES)}.")
        for name in ("batch_size", "sequence_parallel_size", "data_parallel_size", "ring_size"):
            value = getattr(self, name)
            if not is_positive_int(value):
                raise FPDTError(f"{name} must be a positive int, got {value!r}.")
        if self.sequence_parallel_size % self.ring_size:
            sp = self.sequence_parallel_size
            divisors = [r for r in range(1, sp + 1) if sp % r == 0]
            raise FPDTError(f"EstimateOptions: ring_size={self.ring_size} does not divide sequence_parallel_size={sp}"
                            f" (the group is ulysses x ring ranks); use one of {divisors}.")
        if isinstance(self.chunk_size, int):  # as the strategy refuses it: no estimate of a run that cannot start
            validate_chunk_size(self.chunk_size, self.sequence_parallel_size, self.ring_size)

    @property
    def ulysses_size(self) -> int:
        """The Ulysses degree: ranks whose all-to-alls scatter the heads (``sequence_parallel_size / ring_size``)."""
        return self.sequence_parallel_size // self.ring_size

    def replace(self, **changes: Any) -> EstimateOptions:
        """A copy with ``changes`` (field names) applied."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_strategy(
        cls, options: FPDTOptions, num_nodes: int, processes_per_node: int, ring_size: int | None = None,
        model: nn.Module | None = None, **run: Any
    ) -> EstimateOptions:
        """The estimate of a run of ``FPDTStrategy(**options)`` on ``num_nodes`` x ``processes_per_node``
        processes.

        Args:
            options: the strategy's validated options.
            num_nodes: nodes of the run.
            processes_per_node: processes (devices) per node; ``sequence_parallel_size="auto"`` is resolved
                against it by :meth:`FPDTOptions.mesh_shape`, as the strategy resolves it.
            ring_size: the run's resolved ring size; ``None``: ``options.ring_size`` resolved by
                :meth:`FPDTOptions.resolved_ring_size` against the node's processes and ``model``'s heads, as the
                strategy resolves it in ``setup_environment``.
            model: the module whose attention heads ``ring_size="auto"`` must fit (``None``: heads not known yet).
            **run: the fields the strategy does not know (``batch_size``, ``precision``, ``optimizer``,
                ``mlp_tiled``, ``loss_tiled``).

        Raises:
            ValueError: a ring size that does not divide the sequence-parallel size.
        """
        dp, sp = options.mesh_shape(num_nodes, processes_per_node)
        if ring_size is None:
            ring_size = options.resolved_ring_size(sp, processes_per_node, model)
        return cls(
            chunk_size=options.chunk_size, sequence_parallel_size=sp, data_parallel_size=dp, ring_size=ring_size,
            offload=options.offload == "on", activation_checkpointing=options.activation_checkpointing,
            offload_checkpoints=options.offload_checkpoints == "on", attention_backend=options.attention_backend,
            shard_parameters=options.shard_parameters, offload_optimizer=options.offload_optimizer,
            gradient_as_bucket_view=options.gradient_as_bucket_view,
            keep_attention=options.activation_checkpointing and options.keep_attention is True, **run,
        )

    @classmethod
    def from_yaml(cls, config: Mapping[str, Any], batch_size: int = 1, model: nn.Module | None = None,
                  **tiling: bool) -> EstimateOptions:
        """The estimate of the run an ``fpdt-train`` YAML describes (``config`` as ``yaml.safe_load`` reads it).

        The strategy's ``init_args`` become :class:`FPDTOptions` (validated as the strategy validates them) and
        go through :meth:`from_strategy`, with the trainer's ``num_nodes`` and ``devices`` (an int, else 1) and
        ``precision``, and the data's ``batch_size``.

        Args:
            config: the YAML's content.
            batch_size: used when the YAML's data has none.
            model: the YAML's model (built on the meta device), whose heads ``ring_size="auto"`` fits.
            **tiling: ``mlp_tiled`` and ``loss_tiled``, read from the model (``ModelShape.from_module``).
        """
        trainer = config.get("trainer") or {}
        strategy = trainer.get("strategy") or {}
        init = (strategy.get("init_args") or {}) if isinstance(strategy, Mapping) else {}
        known = {name: init[name] for name in FPDTOptions.__dataclass_fields__ if name in init}
        devices = trainer.get("devices", 1)
        data = (config.get("data") or {}).get("init_args") or {}
        return cls.from_strategy(
            FPDTOptions(**known), trainer.get("num_nodes", 1), devices if isinstance(devices, int) else 1, model=model,
            batch_size=data.get("batch_size", batch_size), precision=str(trainer.get("precision", "32-true")),
            **tiling,
        )
