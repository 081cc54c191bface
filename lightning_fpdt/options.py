"""The strategy's configuration: one frozen, validated object, and the checks that need the run.

:class:`FPDTOptions` is built once from :class:`~lightning_fpdt.FPDTStrategy`'s arguments. Its
``__post_init__`` refuses values that are wrong on their own (types, ranges, combinations); its
:meth:`FPDTOptions.check_run` refuses values that are wrong for this run (world size, device type,
precision, the model's head counts). ``check_run`` runs on every rank, first thing in
``setup_environment``, before the process group exists, and depends only on values that are the same
on every rank, so a bad configuration raises the same ``ValueError`` everywhere instead of leaving
some ranks waiting in a collective. Each message names the numbers and the fix.

Each rule is written once: the chunk-size rule in :func:`lightning_fpdt.parallel.layout.validate_chunk_size`
(a chunk is cut into one equal sub-chunk per rank), the head-count rule in
:func:`lightning_fpdt.parallel.comm.check_heads` (heads are scattered over the group by the all-to-all), the
backend's device and package rules in :func:`lightning_fpdt.backends.resolve_backend`.
The one check that needs data, a sequence shorter than the sequence-parallel group, is made per
batch in :func:`lightning_fpdt.parallel.batches.shard_batch`.

Offload is one three-valued setting, read the same way everywhere:

- ``"off"``: chunks stay where they were computed;
- ``"on"``: chunks move to pinned host memory between uses (CUDA): the schedule runs *and* device
  memory is freed (the memory estimate counts them on the host);
- ``"emulate"``: the same schedule on any device, copying between host buffers on a background
  worker (CPU tests); nothing leaves the device, so the estimate counts them on the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import lightning.pytorch as pl
import torch

from lightning_fpdt.backends import BACKENDS, HALF_ONLY_BACKENDS, resolve_backend
from lightning_fpdt.errors import PREFIX, FPDTError, WrongType, is_positive_int
from lightning_fpdt.parallel.batches import DEFAULT_SEQUENCE_KEYS
from lightning_fpdt.parallel.binding import SequenceParallelContext, attention_heads
from lightning_fpdt.parallel.comm import check_heads
from lightning_fpdt.parallel.layout import validate_chunk_size
from lightning_fpdt.parallel.mesh import SequenceParallelGroups, resolve_ring_size

Offload = Literal["off", "on", "emulate"]
OffloadArgument = bool | Literal["emulate"]
# the names of backends.BACKENDS, spelt out for LightningCLI's --help and type checks (tests/test_validation.py)
AttentionBackend = Literal["auto", "math", "sdpa", "cudnn", "flash_attn", "flash_attn_3", "flash_attn_4"]

# Lightning precision strings whose attention inputs are float16/bfloat16
HALF_PRECISIONS = ("bf16-mixed", "16-mixed", "bf16-true", "16-true")


def offload_mode(name: str, value: Any) -> Offload:
    """``False`` / ``True`` / ``"emulate"`` (the strategy's argument ``name``) as ``"off"`` / ``"on"`` /
    ``"emulate"``."""
    if value is False or value == "off":
        return "off"
    if value is True or value == "on":
        return "on"
    if isinstance(value, str) and value == "emulate":
        return "emulate"
    raise FPDTError(f"{PREFIX}{name} must be True, False or 'emulate', got {value!r}.")


def _argument(value: Offload) -> OffloadArgument:
    """The user's spelling of an offload mode, for messages."""
    return {"off": False, "on": True, "emulate": "emulate"}[value]


@dataclass(frozen=True)
class FPDTOptions:
    """Everything :class:`~lightning_fpdt.FPDTStrategy` is configured with, validated on construction.

    The fields are the strategy's arguments of the same names. ``offload`` and ``offload_checkpoints``
    accept ``True`` / ``False`` / ``"emulate"`` and are stored as :data:`Offload` modes.
    """

    sequence_parallel_size: int | Literal["auto"] = "auto"
    """Ranks per sequence-parallel group, or ``"auto"`` (all processes of a node). Must divide the world size."""
    ring_size: int | Literal["auto"] = "auto"
    """Of the sequence-parallel group, ranks that form a ring: ``sequence_parallel_size = ulysses x ring``. The heads
    are scattered over the ``ulysses`` ranks of each Ulysses group (consecutive ranks: one node's devices), and
    key/value chunks move point to point between ring peers (``lightning_fpdt.attention.ring``), so the heads
    need only divide by the Ulysses degree. ``"auto"``: the largest Ulysses degree that divides the group, fits
    every attention layer's heads and one node's devices (``lightning_fpdt.parallel.mesh``); 1 is plain Ulysses."""
    chunk_size: int | Literal["auto"] | None = None
    """Global tokens per attention chunk, a multiple of ``sequence_parallel_size`` (each chunk is cut into
    one sub-chunk per rank); ``None`` runs plain Ulysses (one chunk); ``"auto"`` picks, per batch shape at
    its first batch, the largest chunk whose estimated device peak (:mod:`lightning_fpdt.memory`) fits
    ``memory_budget``, and logs it."""
    memory_budget: float | None = None
    """GiB per rank that ``chunk_size="auto"`` may plan for. Default: 90% of the device's free memory at
    setup (CUDA), or of the host's available memory shared by this node's processes (CPU); the smallest
    over all ranks."""
    attention_backend: str = "auto"
    """``"auto"``, ``"math"``, ``"sdpa"``, ``"cudnn"``, ``"flash_attn"``, ``"flash_attn_3"`` or ``"flash_attn_4"``
    (:mod:`lightning_fpdt.attention.kernels`)."""
    offload: Offload = "off"
    """Keep the attention chunks saved for backward in pinned host memory, prefetching each before use
    (pays off when activations, not weights, fill the device; see docs/configuration.md). ``True`` needs
    CUDA; ``"emulate"`` runs the same schedule on any device (on CPU: a background worker copying between
    host buffers)."""
    activation_checkpointing: bool = False
    """Keep only each decoder layer's input for backward (an FPDT block, or a transformers decoder layer of
    ``HFCausalLM``) and recompute the layer (attention chunks included)."""
    offload_checkpoints: Offload = "off"
    """With ``activation_checkpointing``: keep those block inputs in host memory and prefetch the previous
    block's input during backward. ``True`` needs CUDA; ``"emulate"`` runs anywhere."""
    keep_attention: bool | Literal["auto"] = "auto"
    """With ``activation_checkpointing``: each recomputed layer keeps its attention's output and log-sum-exp from its
    forward (host memory with ``offload``) and answers its recomputation from them, so attention's forward runs once
    per step (:mod:`lightning_fpdt.attention.kept_answers`). ``"auto"``: on for each batch shape where the memory
    model says they fit (said once where not); ``True`` / ``False`` force it."""
    sequence_keys: tuple[str, ...] = field(default=DEFAULT_SEQUENCE_KEYS)
    """Batch keys that are ``[batch, seq, ...]`` tensors to pad and shard; other keys pass through."""
    pad_token_id: int = 0
    """Id used to pad ``input_ids`` to the layout's multiple (padded positions are never trained on)."""
    shard_parameters: bool = False
    """Shard parameters, gradients and optimizer state over all ranks (FSDP2 ``fully_shard`` per decoder layer
    and on the LightningModule, over the flattened data x sequence mesh) instead of replicating them (DDP).
    Checkpoints are then torch distributed checkpoints (directories); they load into any parallelism."""
    offload_optimizer: bool = False
    """With ``shard_parameters``: keep the shards, gradients and optimizer state in pinned host memory and
    run the optimizer step there (FSDP2 ``CPUOffloadPolicy``; CUDA only)."""
    nonfinite_loss: Literal["raise", "skip"] = "raise"
    """What to do when a loss or gradient is NaN/inf, checked before every optimizer step with one small
    all-reduce (:mod:`lightning_fpdt.strategy.step_guard`): ``"raise"`` stops before the update, naming the step,
    the ranks and loss versus gradients; ``"skip"`` drops the update of that accumulation window on every
    rank and warns (it runs the closure once before ``optimizer.step``: not for optimizers that call it
    several times, such as LBFGS). With manual optimization (``"raise"`` only) each step is checked by its
    gradients: your ``training_step`` steps before the strategy sees its loss."""
    gradient_as_bucket_view: bool = True
    """Without ``shard_parameters``: DDP's ``gradient_as_bucket_view``, which ``FPDTStrategy`` passes on (a value
    given to the strategy wins). ``True``: each ``.grad`` is a view into DDP's all-reduce buckets, so the
    gradients exist once, not twice (the buckets are the size of all gradients). Exact: the reduced values are
    the same; the strategy scales, checks and clips gradients in place and never rebinds a ``.grad``."""

    def __post_init__(self) -> None:
        # accept the strategy's spellings (True/False/"emulate", any sequence of keys), store one form
        object.__setattr__(self, "offload", offload_mode("offload", self.offload))
        object.__setattr__(self, "offload_checkpoints", offload_mode("offload_checkpoints", self.offload_checkpoints))
        if isinstance(self.sequence_keys, str) or not isinstance(self.sequence_keys, Sequence):
            raise WrongType(f"{PREFIX}sequence_keys must be a list of batch keys, got {self.sequence_keys!r}.")
        object.__setattr__(self, "sequence_keys", tuple(self.sequence_keys))
        sp = self.sequence_parallel_size
        if sp != "auto" and not is_positive_int(sp):
            raise FPDTError(f"{PREFIX}sequence_parallel_size must be a positive int or 'auto', got {sp!r}.")
        if self.ring_size != "auto" and not is_positive_int(self.ring_size):
            raise FPDTError(f"{PREFIX}ring_size must be a positive int or 'auto', got {self.ring_size!r}.")
        if self.attention_backend not in BACKENDS:
            raise FPDTError(f"{PREFIX}attention_backend={self.attention_backend!r} is not one of {BACKENDS}.")
        self._check_chunking()
        if self.offload_checkpoints != "off" and not self.activation_checkpointing:
            raise FPDTError(
                f"{PREFIX}offload_checkpoints={_argument(self.offload_checkpoints)!r} needs"
                " activation_checkpointing=True (only checkpointed block inputs are offloaded)."
            )
        if self.offload_optimizer and not self.shard_parameters:
            raise FPDTError(
                f"{PREFIX}offload_optimizer=True needs shard_parameters=True (the optimizer state is offloaded"
                " shard by shard by FSDP2)."
            )
        if not (isinstance(self.keep_attention, bool) or self.keep_attention == "auto"):
            raise FPDTError(f"{PREFIX}keep_attention must be True, False or 'auto', got {self.keep_attention!r}.")
        if self.nonfinite_loss not in ("raise", "skip"):
            raise FPDTError(f"{PREFIX}nonfinite_loss must be 'raise' or 'skip', got {self.nonfinite_loss!r}.")
        if isinstance(self.pad_token_id, bool) or not isinstance(self.pad_token_id, int) or self.pad_token_id < 0:
            raise FPDTError(f"{PREFIX}pad_token_id must be a non-negative int, got {self.pad_token_id!r}.")

    def _check_chunking(self) -> None:
        chunk, budget = self.chunk_size, self.memory_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget <= 0):
            raise FPDTError(f"{PREFIX}memory_budget must be a positive number of GiB, got {budget!r}.")
        if budget is not None and chunk != "auto":
            raise FPDTError(
                f"{PREFIX}memory_budget={budget} only applies to chunk_size='auto', but chunk_size={chunk!r}."
            )
        if chunk is None or chunk == "auto":
            return
        if not is_positive_int(chunk):
            raise FPDTError(f"{PREFIX}chunk_size must be a positive int, None or 'auto', got {chunk!r}.")
        # chunk_size against sequence_parallel_size is checked in check_run, after the world size: a size
        # that does not divide the devices must be reported as that, not as a chunk size to change

    # ---- how each setting is read -------------------------------------------------------------

    @property
    def offload_attention(self) -> bool:
        """Whether the attention pipeline runs its offload schedule (``"on"`` and ``"emulate"``)."""
        return self.offload != "off"

    @property
    def offload_block_inputs(self) -> bool:
        """Whether the inputs of recomputed layers go through the offloading store (``"on"`` and ``"emulate"``)."""
        return self.activation_checkpointing and self.offload_checkpoints != "off"

    def mesh_shape(self, num_nodes: int, processes_per_node: int) -> tuple[int, int]:
        """``(data_parallel_size, sequence_parallel_size)`` of a run of ``num_nodes`` x ``processes_per_node``
        processes: ``sequence_parallel_size="auto"`` is all processes of a node, and the data-parallel size is
        the number of sequence-parallel groups (at least 1; a size that does not divide the world is refused
        by :meth:`check_run`)."""
        sp = self.sequence_parallel_size
        sp = max(1, processes_per_node) if sp == "auto" else sp
        return max(1, num_nodes * processes_per_node // sp), sp

    def context(self, group: Any, chunk_size: int | None, layer_input_store: Any,
                ring: SequenceParallelGroups | None = None, keep_attention: bool = False) -> SequenceParallelContext:
        """The :class:`~lightning_fpdt.parallel.binding.SequenceParallelContext` the strategy binds to the attention
        layers: ``"on"`` and ``"emulate"`` both run the offload schedule; ``keep_attention`` as resolved for the
        batch shape."""
        return SequenceParallelContext(
            group=group, chunk_size=chunk_size, attention_backend=self.attention_backend,
            offload=self.offload_attention, activation_checkpointing=self.activation_checkpointing,
            layer_input_store=layer_input_store, ulysses_group=None if ring is None else ring.ulysses_group,
            ring_group=None if ring is None else ring.ring_group,
            keep_attention=self.activation_checkpointing and keep_attention,
        )

    def resolved_ring_size(self, sequence_parallel_size: int, processes_per_node: int,
                           model: torch.nn.Module | None) -> int:
        """The ring size of this run (``"auto"`` resolved from the model's heads and the node's devices)."""
        heads = [] if model is None else [(h, kv) for _, h, kv in attention_heads(model)]
        return resolve_ring_size(self.ring_size, sequence_parallel_size, processes_per_node, heads)

    # ---- checks that need the run ----------------------------------------------------------------

    def check_chunk_size(self, sequence_parallel_size: int, ring_size: int = 1) -> None:
        """Raise if a fixed ``chunk_size`` cannot be cut into one equal sub-chunk per rank (and its ring pieces)."""
        if self.chunk_size is None or self.chunk_size == "auto":
            return
        try:
            validate_chunk_size(self.chunk_size, sequence_parallel_size, ring_size)
        except ValueError as err:
            raise FPDTError(f"{PREFIX}{err}") from None

    def check_run(
        self,
        *,
        world_size: int,
        num_nodes: int,
        num_processes: int,
        sequence_parallel_size: int,
        precision: str,
        device_type: str,
        model: torch.nn.Module | None = None,
        backend: bool = True,
    ) -> None:
        """Every check that needs the run; raises the first ``ValueError`` found (same on every rank).

        Args:
            world_size: processes in the run (``num_nodes * num_processes``).
            num_nodes: nodes, for the message.
            num_processes: devices per node, for the message.
            sequence_parallel_size: the resolved SP size (``"auto"`` already turned into a number).
            precision: Lightning's precision string (``"32-true"``, ``"bf16-mixed"``, ``"64-true"``, ...).
            device_type: the root device's type (``"cpu"``, ``"cuda"``, ...).
            model: the module whose FPDT blocks get bound (``None`` skips the model checks).
            backend: check the attention backend too: it asks CUDA about the device, which a process that will fork
                its ranks must not do (``False`` there; the ranks check it).
        """
        check_world_size(world_size, num_nodes, num_processes, sequence_parallel_size)
        ring = self.resolved_ring_size(sequence_parallel_size, num_processes, model)
        self.check_chunk_size(sequence_parallel_size, ring)
        self.check_offload(device_type)
        if backend:
            check_attention_backend(self.attention_backend, device_type, precision)
        check_model(model, sequence_parallel_size, ring)

    def check_offload(self, device_type: str) -> None:
        """Raise for ``True`` offload settings on a device without memory of its own.

        ``"emulate"`` runs the same offload schedule (a background worker copying between host buffers)
        and is allowed on any device; it exists so that CPU runs can exercise the offload path on purpose.
        """
        if device_type == "cuda":
            return
        if self.offload == "on":
            raise FPDTError(
                f"{PREFIX}offload=True moves saved attention chunks from device to pinned host memory; on"
                f" {device_type} there is no device memory to save. Use offload=False, or offload='emulate' to"
                " run the offload schedule on CPU (as the tests do)."
            )
        if self.offload_checkpoints == "on":
            raise FPDTError(
                f"{PREFIX}offload_checkpoints=True moves checkpointed block inputs from device to pinned host"
                f" memory; on {device_type} there is no device memory to save. Use offload_checkpoints=False, or"
                " offload_checkpoints='emulate' to run the offload schedule on CPU (as the tests do)."
            )
        if self.offload_optimizer:
            raise FPDTError(
                f"{PREFIX}offload_optimizer=True moves the sharded optimizer state from the device to host memory;"
                f" on {device_type} it is there already. Use offload_optimizer=False."
            )


def check_world_size(world_size: int, num_nodes: int, num_processes: int, sequence_parallel_size: int) -> None:
    """Raise if the world (nodes x devices) does not split into whole sequence-parallel groups."""
    if world_size % sequence_parallel_size != 0:
        options = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise FPDTError(
            f"{PREFIX}sequence_parallel_size={sequence_parallel_size} does not divide the world size {world_size}"
            f" ({num_nodes} node(s) x {num_processes} device(s)); use one of {options}."
        )


def attention_dtype(precision: str) -> torch.dtype:
    """The dtype attention inputs have under a Lightning precision string."""
    if precision in HALF_PRECISIONS:
        return torch.float16 if precision.startswith("16") else torch.bfloat16
    return torch.float64 if precision.startswith("64") else torch.float32


def check_attention_backend(attention_backend: str, device_type: str, precision: str) -> None:
    """Raise if the attention backend cannot run on this device type at this precision.

    The device and package rules are the kernel selection's own
    (:func:`~lightning_fpdt.backends.resolve_backend`); the precision rule is said here in
    Lightning's terms.
    """
    dtype = attention_dtype(precision)
    if attention_backend in HALF_ONLY_BACKENDS and device_type == "cuda" and precision not in HALF_PRECISIONS:
        raise FPDTError(
            f"{PREFIX}attention_backend={attention_backend!r} needs float16/bfloat16 attention inputs, but"
            f" precision={precision!r}. Use precision='bf16-mixed' (or one of {list(HALF_PRECISIONS)}),"
            " or attention_backend='sdpa' or 'auto'."
        )
    try:
        resolve_backend(attention_backend, device_type, dtype)
    except ValueError as err:
        raise FPDTError(f"{PREFIX}{err}") from None


def _builds_layers_later(model: torch.nn.Module) -> bool:
    """Whether the model may create its layers in ``LightningModule.configure_model`` (after setup_environment)."""
    return (
        isinstance(model, pl.LightningModule)
        and type(model).configure_model is not pl.LightningModule.configure_model
    )


def check_has_blocks(model: torch.nn.Module, num_blocks: int, sequence_parallel_size: int) -> None:
    """Raise if ``sequence_parallel_size > 1`` and ``model`` has no FPDT block (``num_blocks == 0``)."""
    if num_blocks == 0 and sequence_parallel_size > 1:
        raise FPDTError(
            f"{PREFIX}sequence_parallel_size={sequence_parallel_size} but {type(model).__name__} has no"
            " FPDTBlock; without one, attention would only see this rank's shard of the sequence. Build the"
            " model from lightning_fpdt.FPDTBlock (see docs/own-model.md) or use sequence_parallel_size=1."
        )


def check_model(model: torch.nn.Module | None, sequence_parallel_size: int, ring_size: int = 1) -> None:
    """Raise if the model's FPDT blocks cannot be sharded over ``sequence_parallel_size`` ranks, or if
    ``sequence_parallel_size > 1`` and the model has no FPDT block at all.

    A model that builds its layers in ``configure_model`` may have no block yet; then the strategy's
    block binding in ``setup`` makes the same checks (also on every rank).
    """
    if model is None:
        return
    layers = attention_heads(model)
    if not layers:
        if not _builds_layers_later(model):
            check_has_blocks(model, 0, sequence_parallel_size)
        return
    seen: set[tuple[int, int]] = set()
    for name, n_heads, n_kv_heads in layers:
        if (n_heads, n_kv_heads) in seen:
            continue
        seen.add((n_heads, n_kv_heads))
        try:
            check_heads(n_heads, n_kv_heads, sequence_parallel_size, ring_size)
        except ValueError as err:
            raise FPDTError(f"{PREFIX}{err} (attention layer '{name}' of {type(model).__name__})") from None
