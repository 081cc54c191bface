"""The contract between ``FPDTStrategy`` and a model: what the strategy binds, and how it finds what to bind.

A model is a plain ``nn.Module`` that knows nothing of processes. Some of its modules implement
:class:`SequenceParallelAttention`: an :class:`~lightning_fpdt.layers.block.FPDTBlock`, or
:class:`~lightning_fpdt.models.HFCausalLM`, which routes a transformers model's attention layers. The
strategy walks the model once per question (:func:`bind`, :func:`attention_heads`,
:func:`attention_records`, :func:`decoder_layers`), and each such module answers for the layers it holds:

- :func:`bind` hands every one the :class:`SequenceParallelContext` (group, chunk size, backend, offload,
  activation checkpointing);
- :func:`attention_heads` gives the head counts the strategy checks against the group size before any
  collective;
- :func:`decoder_layers` gives the :class:`DecoderLayer` s that FSDP2 shards and the memory model sizes;
- :func:`attention_records` gives what each attention layer did in its latest call (``FPDTMonitor``).

This module imports nothing of the attention pipeline, so configuration (``options.py``), the memory
model and the callbacks can use it without loading the attention code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from torch import nn
from torch.distributed import ProcessGroup

from lightning_fpdt.offload.chunk_store import ChunkStore
from lightning_fpdt.offload.stats import OffloadStats
from lightning_fpdt.parallel.comm import group_size


@dataclass
class SequenceParallelContext:
    """What the strategy binds to every sequence-parallel attention layer.

    Attributes:
        group: the sequence-parallel process group; ``None`` means one process.
        chunk_size: global tokens per attention chunk; ``None`` is plain Ulysses (one chunk).
        attention_backend: ``"auto"``, ``"math"``, ``"sdpa"``, ``"cudnn"``, ``"flash_attn"``, ``"flash_attn_3"`` or
            ``"flash_attn_4"``.
        offload: keep the attention chunks saved for backward in host memory.
        activation_checkpointing: keep only each decoder layer's input for backward and recompute the layer.
        layer_input_store: where the inputs of recomputed layers live (``None``: in the autograd graph); a
            store with ``offload=True`` keeps them in host memory, and each layer's backward prefetches
            the input of the backward that runs next (``lightning_fpdt.layers.activation_checkpoint``).
        ulysses_group: with a ring, the Ulysses group (``U`` consecutive ranks of ``group``) attention's
            all-to-alls run in (``lightning_fpdt.parallel.mesh``).
        ring_group: the ring (``R`` ranks, one per Ulysses group, ``P = U x R``) key/value parts move between;
            ``None``: no ring, the all-to-alls run over ``group``.
        streaming: decoder layers that can stream do, chunk by chunk, when checkpointed or without a backward
            (:mod:`lightning_fpdt.layers.streaming`); ``False`` recomputes them whole, as before streaming existed (for
            comparisons: ``benchmarks/memory_floor.py``).
        keep_attention: a recomputed layer keeps its attention's output and log-sum-exp from its forward and answers
            its recomputation from them, so attention's forward runs once per step
            (:mod:`lightning_fpdt.attention.kept_answers`).
    """

    group: ProcessGroup | None = None
    chunk_size: int | None = None
    attention_backend: str = "auto"
    offload: bool = False
    activation_checkpointing: bool = False
    layer_input_store: ChunkStore | None = None
    ulysses_group: ProcessGroup | None = None
    ring_group: ProcessGroup | None = None
    streaming: bool = True
    keep_attention: bool = False

    @property
    def size(self) -> int:
        """Ranks in the sequence-parallel group."""
        return group_size(self.group)

    @property
    def ring_size(self) -> int:
        """Ranks in the ring (1: none)."""
        return group_size(self.ring_group)

    @property
    def ulysses_size(self) -> int:
        """Ranks of a Ulysses group, over which the heads are scattered."""
        return self.size // self.ring_size

    @property
    def attention_group(self) -> ProcessGroup | None:
        """The group attention's all-to-alls run in: the Ulysses group with a ring, else the whole group."""
        return self.group if self.ring_group is None else self.ulysses_group


@dataclass
class AttentionRecord:
    """What one attention layer did in its latest call, for callbacks (``FPDTMonitor``).

    ``sink`` receives the pipeline's :class:`OffloadStats` once its backward (or, without
    gradients, its forward) has finished, so read it after the step.
    """

    seq_len_local: int = 0
    chunks: int = 0
    sink: list[OffloadStats] = field(default_factory=list)

    @classmethod
    def for_call(cls, seq_len_local: int, context: SequenceParallelContext) -> AttentionRecord:
        """A fresh record of one attention call over ``seq_len_local`` tokens of this rank under ``context``."""
        chunks = 1 if context.chunk_size is None else -(-seq_len_local * context.size // context.chunk_size)
        return cls(seq_len_local=seq_len_local, chunks=chunks)

    @property
    def stats(self) -> OffloadStats:
        """The offload statistics of the call, summed over its pipeline runs."""
        total = OffloadStats()
        for s in self.sink:
            total.merge(s)
        return total


@dataclass(frozen=True)
class DecoderLayer:
    """One decoder layer as the strategy and the memory model see it: the unit of activation
    checkpointing and of FSDP2 sharding, and the sizes the memory model reads.

    Attributes:
        name: the layer's module name (relative to the module asked; the walkers make it the full name).
        module: the layer (an :class:`~lightning_fpdt.layers.block.FPDTBlock`, a Hugging Face decoder layer, ...).
        hidden_size: width of its input and output.
        n_heads: query heads of its attention.
        n_kv_heads: key/value heads.
        head_dim: per-head width of q and k (and of v unless ``v_head_dim``).
        mlp: its MLP as written (inside any tiling); ``None`` if it has no MLP module.
        mlp_tiled: whether the MLP runs in recomputed sequence tiles.
        norms: its norm modules (LayerNorm keeps only its input for backward; RMSNorm also its output).
        chunked_projections: q/k/v are projected chunk by chunk inside the attention pipeline
            (``FPDTBlock``) rather than for the whole local sequence before it (Hugging Face layers).
        attention: whether it has an attention layer (a hybrid's gated delta-net or Mamba-2 layer may not).
        mixers: what its sequence-parallel modules besides attention keep (:class:`SequenceMixerMemory`: a gated
            delta-net, a Mamba-2 mixer, a short convolution).
        v_head_dim: per-head width of v and of the attention output where it differs from ``head_dim`` (multi-head
            latent attention); ``None``: ``head_dim``.
        experts: a block of routed experts the layer runs beside its MLP (Gemma-4), or ``None``.
        experts_per_token: the routed experts per token where the layer's router does not say (``None``: it does,
            or no experts).
        stream_refusal: why the layer, checkpointed, is recomputed whole instead of streaming chunk by chunk
            (:mod:`lightning_fpdt.layers.streaming`), whatever its arguments; ``None``: it streams.
        attention_softcap: its attention-logit cap (Gemma-2's ``attn_logit_softcapping``), or ``None``: a route whose
            kernels cannot cap computes its blocks' scores (:mod:`lightning_fpdt.memory.scores`).
    """

    name: str
    module: nn.Module
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    mlp: nn.Module | None
    mlp_tiled: bool
    norms: tuple[nn.Module, ...]
    chunked_projections: bool = True
    attention: bool = True
    mixers: tuple[SequenceMixerMemory, ...] = ()
    v_head_dim: int | None = None
    experts: nn.Module | None = None
    experts_per_token: int | None = None
    stream_refusal: str | None = None
    attention_softcap: float | None = None


@runtime_checkable
class SequenceMixerMemory(Protocol):
    """What a module that mixes tokens outside attention and runs sequence-parallel keeps, as the memory model
    counts it: values per token of a rank (``T = batch x S / sp`` tokens), at ``sp`` ranks and chunks of
    ``chunk_size`` global tokens (``None``: one chunk)."""

    kind: str
    chunked: bool  # runs chunk by chunk, each chunk recomputed in backward; False: over the whole local sequence

    def saved(self, sp: int, chunk_size: int | None, seq_len: int) -> float:
        """Values per rank-token kept for backward, in the activations' dtype (its chunk inputs included)."""
        ...

    def kept_float32(self) -> float:
        """float32 values per rank-token kept for backward besides :meth:`saved` (a kernel run over the whole
        sequence keeps its intermediates)."""
        ...

    def offloaded(self, sp: int) -> float:
        """Of :meth:`saved`, the values ``offload`` keeps in host memory (its chunk inputs)."""
        ...

    def work(self) -> float:
        """float32 values per token of one chunk on a rank (``batch x chunk / sp``) that its backward holds while
        it recomputes the chunk (the kernel's intermediates and their gradients)."""
        ...

    def released(self) -> float:
        """Of :meth:`saved`, the values per rank-token its backward has freed before it recomputes the kernel's
        chunks (what the ops after the kernel kept)."""
        ...


@runtime_checkable
class SequenceParallelAttention(Protocol):
    """A module whose attention runs through the FPDT pipeline once bound: an
    :class:`~lightning_fpdt.layers.block.FPDTBlock`, or :class:`~lightning_fpdt.models.HFCausalLM` for the
    attention layers of a transformers model. The strategy binds it to the sequence-parallel context and
    checks its head counts, shards its decoder layers with FSDP2, and the memory model reads them.

    Names are relative to the module itself (``""`` is the module); the walkers below prefix its own name.
    """

    def bind_sequence_parallel(self, context: SequenceParallelContext) -> None:
        """Run every attention layer it holds under ``context`` from the next forward on."""
        ...

    def attention_heads(self) -> list[tuple[str, int, int]]:
        """``(layer name, n_heads, n_kv_heads)`` of every attention layer it routes."""
        ...

    def decoder_layers(self) -> list[DecoderLayer]:
        """Its decoder layers, in forward order."""
        ...

    def attention_records(self) -> list[AttentionRecord]:
        """What each attention layer did in its latest call (for ``FPDTMonitor``)."""
        ...


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def sequence_parallel_modules(module: nn.Module) -> Iterator[tuple[str, SequenceParallelAttention]]:
    """``(name, module)`` of every :class:`SequenceParallelAttention` in ``module`` (itself included), in
    module order (the forward order of a stack of layers). The walk does not enter one: it answers for the
    layers inside it."""
    seen: set[int] = set()

    def walk(m: nn.Module, name: str) -> Iterator[tuple[str, SequenceParallelAttention]]:
        if id(m) in seen:  # a module shared by two parents is bound and counted once
            return
        seen.add(id(m))
        if isinstance(m, SequenceParallelAttention):
            yield name, m
            return
        for child_name, child in m.named_children():
            yield from walk(child, _join(name, child_name))

    yield from walk(module, "")


def bind(module: nn.Module, context: SequenceParallelContext) -> int:
    """Bind every :class:`SequenceParallelAttention` of ``module`` to ``context``; returns how many attention
    layers are bound."""
    count = 0
    for _, m in sequence_parallel_modules(module):
        m.bind_sequence_parallel(context)
        count += len(m.attention_heads())
    return count


def attention_heads(module: nn.Module) -> list[tuple[str, int, int]]:
    """``(name, n_heads, n_kv_heads)`` of every attention layer the strategy binds in ``module``."""
    return [(_join(prefix, name), n_heads, n_kv_heads) for prefix, m in sequence_parallel_modules(module)
            for name, n_heads, n_kv_heads in m.attention_heads()]


def decoder_layers(module: nn.Module) -> list[DecoderLayer]:
    """Every decoder layer of ``module`` (its FPDT blocks, the layers of its ``HFCausalLM``, ...), in module
    order, named from ``module``."""
    return [dataclasses.replace(layer, name=_join(prefix, layer.name))
            for prefix, m in sequence_parallel_modules(module) for layer in m.decoder_layers()]


def attention_records(module: nn.Module) -> list[AttentionRecord]:
    """The latest :class:`AttentionRecord` of every attention layer the strategy binds in ``module``."""
    return [record for _, m in sequence_parallel_modules(module) for record in m.attention_records()]
