"""An analytic per-rank memory model of a training step, and ``chunk_size="auto"``.

    python -m lightning_fpdt.memory --config examples/configs/tiny_cpu.yaml
    python -m lightning_fpdt.memory --hidden 4096 --layers 32 --heads 32 --kv-heads 8 --vocab 128256 \\
        --seq 1048576 --sp 8 --chunk-size 65536 --offload --checkpointing --precision bf16-mixed

The model counts what lightning-fpdt's implementation keeps (see docs/how-fpdt-works.md): per rank,
``T = batch x S / sp`` tokens of every sample.

- parameters, gradients (twice under DDP without ``gradient_as_bucket_view``: its buckets) and AdamW state
  (every rank holds all of them, or ``1 / world`` of them and the gathered layers in use with ``shard_parameters``);
- saved activations per layer (block input, norm outputs, the attention pipeline's head-sharded
  q/k/v/out chunks and lse, the o_proj input, the MLP intermediates unless tiled); with
  checkpointing only the block input (on the host with ``offload_checkpoints``);
- the largest transient: the loss (full logits unless tiled) or the recomputation of one block,
  plus the attention working set of one chunk;
- host memory: offloaded attention chunks (one layer's worth at a time: the pipeline keeps a layer's
  chunks from its forward to its backward only when it is not checkpointed) and block checkpoints.

The sizes come from the module itself (:meth:`ModelShape.from_module`): its decoder layers
(``FPDTBlock`` s, or the transformers decoder layers of ``HFCausalLM``), its output projection or token
embedding, and its parameters, so any model built from ``FPDTBlock`` or wrapped by ``HFCausalLM`` can be
sized, not only the bundled ones; this package imports no model. How the run trains is one
:class:`EstimateOptions` (built from a strategy's options or from a YAML). It is an estimate for planning.
``benchmarks/training.py`` measures the real peak of live tensors.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from torch import nn

from lightning_fpdt.binding import DecoderLayer, decoder_layers
from lightning_fpdt.memory.estimate_options import OPTIMIZER_STATES, PRECISION_BYTES, EstimateOptions
from lightning_fpdt.memory.experts import read_experts
from lightning_fpdt.tiling import configured_tiles, largest_tile, mlp_tile_tokens

__all__ = ["GIB", "EstimateOptions", "MemoryEstimate", "ModelShape", "auto_chunk_size", "estimate", "format_bytes",
           "report"]

GIB = 2**30

_EXPLICIT = "set an explicit chunk_size instead of 'auto' (`python -m lightning_fpdt.memory` helps choose one)"


@dataclass(frozen=True)
class ModelShape:
    """What the memory model needs to know about a decoder; :meth:`from_module` reads it from a model.

    Attributes:
        hidden_size: width of the residual stream (the blocks' input and output).
        num_layers: FPDT blocks.
        num_heads: query heads of each block's attention.
        num_kv_heads: key/value heads of each block's attention.
        intermediate_size: the MLP's inner width.
        vocab_size: logits per token (the output projection's width).
        num_params: parameters of the whole model, each shared (tied) parameter once.
        tied_embeddings: the output projection shares the token embedding's weight.
        head_dim: per-head width of q, k and v; ``None`` means ``hidden_size // num_heads``.
        mlp_projections: linear layers producing the intermediate: 2 gated (SwiGLU's gate and up), 1 plain (GELU).
        block_params: parameters of one block (FSDP2 gathers it; every expert); ``None``: from ``num_params``.
        norm_extras: hidden-wide tensors a block's norms keep besides their input (LayerNorm 0, RMSNorm 1 each).
        chunked_projections: q/k/v are projected chunk by chunk inside the attention pipeline (``FPDTBlock``);
            ``False`` (Hugging Face layers): the whole local q/k/v exist while a layer runs.
        mlp_tiles: the MLP's ``num_tiles`` when it is tiled, sized by the rule of :mod:`lightning_fpdt.tiling`;
            ``None``: automatic (also for an untiled MLP: what an estimate with ``mlp_tiled`` assumes).
        loss_tiles: the loss's ``num_tiles`` when it is tiled, likewise.
        experts_per_token: an MoE layer's ``top_k`` (1: dense): MLP activations count once per routed expert.
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    num_params: int
    tied_embeddings: bool = False
    head_dim: int | None = None
    mlp_projections: int = 2
    block_params: int | None = None
    norm_extras: int = 2
    chunked_projections: bool = True
    mlp_tiles: int | None = None
    loss_tiles: int | None = None
    experts_per_token: int = 1

    def __post_init__(self) -> None:
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)

    @property
    def mlp_intermediates(self) -> int:
        """Values an untiled MLP keeps per token for backward: two intermediate-wide tensors per projection
        (SwiGLU: gate, up, silu(gate) and the product; GELU: fc's output and the activation's)."""
        return 2 * self.mlp_projections * self.intermediate_size * self.experts_per_token

    @classmethod
    def from_module(cls, module: nn.Module) -> tuple[ModelShape, dict[str, bool]]:
        """The shape of a model built from :class:`~lightning_fpdt.block.FPDTBlock` s or wrapping a Hugging
        Face decoder (:class:`~lightning_fpdt.models.HFCausalLM`), and whether its MLP and loss are tiled
        (``{"mlp_tiled": ..., "loss_tiled": ...}``, fields of :class:`EstimateOptions`).

        What is read, and from where (``module`` may be the ``LightningModule`` or the model inside it):

        - the decoder layers (:func:`~lightning_fpdt.binding.decoder_layers`: the FPDT blocks, or the
          transformers decoder layers, sized from the model's config), which must all have the same shape:
          ``hidden_size``, ``num_heads``, ``num_kv_heads`` and ``head_dim``;
        - ``norm_extras``: 0 for each LayerNorm of a layer, 1 for any other norm (RMSNorm);
        - the MLP (inside its tiling if tiled): its output projection is its last ``nn.Linear`` back to
          ``hidden_size``; ``intermediate_size`` is that layer's ``in_features`` and ``mlp_projections`` is
          the width of its other ``nn.Linear`` s over the intermediate (2 for a gated MLP, fused or not); an MoE
          MLP's experts likewise, and its ``top_k`` (:mod:`lightning_fpdt.memory.experts`). It is tiled when
          every layer's MLP is, in ``mlp_tiles`` tiles (:func:`~lightning_fpdt.tiling.configured_tiles`);
        - ``vocab_size``: the ``out_features`` of the output projection, the widest ``nn.Linear`` outside
          the layers that reads ``hidden_size``; without one, the ``num_embeddings`` of the first
          ``nn.Embedding`` of width ``hidden_size`` outside the layers (the token embedding, taken as
          tied). Embeddings are tied when the output projection's weight is such an embedding's weight;
        - ``num_params``: every parameter of ``module``, shared ones once (position embeddings, norms
          and biases included);
        - ``loss_tiles``: the first ``loss_tiles`` attribute on ``module`` (``CausalLM``'s), a submodule or its
          ``config`` (tiled unless 1); without one the loss is taken as untiled (the larger estimate).

        Raises:
            ValueError: when ``module`` cannot be sized (no decoder layer; layers of different shapes; an
                MLP without an ``nn.Linear`` back to ``hidden_size``; no output projection and no token
                embedding), naming what is missing.
        """
        name = type(module).__name__
        layers = decoder_layers(module)
        if not layers:
            raise ValueError(
                f"{name} has no FPDTBlock and no Hugging Face decoder layer (HFCausalLM), so its memory cannot be"
                f" estimated (the memory model reads the layer shapes from them): build its layers from FPDTBlock,"
                f" or {_EXPLICIT}."
            )
        read = [_read_layer(layer) for layer in layers]
        shapes = sorted({dims for dims, _ in read})
        if len(shapes) > 1:
            raise ValueError(
                f"{name}: its decoder layers differ in shape (hidden, heads, kv heads, head_dim, intermediate, MLP"
                f" projections, parameters, norm extras): {shapes}; the memory model assumes one shape per layer:"
                f" {_EXPLICIT}."
            )
        hidden, heads, kv_heads, head_dim, inter, projections, block_params, norm_extras, top_k = shapes[0]
        in_layers = {id(m) for layer in layers for m in layer.module.modules()}
        outside = [m for m in module.modules() if id(m) not in in_layers]
        heads_out = [m for m in outside if isinstance(m, nn.Linear) and m.in_features == hidden]
        embeddings = [m for m in outside if isinstance(m, nn.Embedding) and m.embedding_dim == hidden]
        if heads_out:
            head = max(heads_out, key=lambda m: m.out_features)
            vocab, tied = head.out_features, any(e.weight is head.weight for e in embeddings)
        elif embeddings:
            vocab, tied = embeddings[0].num_embeddings, True
        else:
            raise ValueError(
                f"{name} has neither an output projection (an nn.Linear from hidden_size={hidden} outside the"
                f" decoder layers) nor a token embedding (an nn.Embedding of width {hidden}), so its vocabulary"
                f" size, and with it the loss's memory, cannot be read: {_EXPLICIT}."
            )
        num_params = sum(p.numel() for p in module.parameters())  # parameters() yields a shared one once
        mlp_tiles = {configured_tiles(layer.module) for layer in layers}
        if len(mlp_tiles) > 1:
            raise ValueError(f"{name}: its decoder layers' MLPs run in different tile counts ({mlp_tiles}); the"
                             f" memory model assumes one: {_EXPLICIT}.")
        mlp_count, loss_count = mlp_tiles.pop(), _loss_tiles(module)
        shape = cls(hidden, len(layers), heads, kv_heads, inter, vocab, num_params, tied, head_dim, projections,
                    block_params, norm_extras, all(layer.chunked_projections for layer in layers),
                    mlp_tiles=None if mlp_count == 1 else mlp_count, loss_tiles=None if loss_count == 1 else loss_count,
                    experts_per_token=top_k)
        return shape, {"mlp_tiled": all(tiled for _, tiled in read), "loss_tiled": loss_count != 1}


def _read_layer(layer: DecoderLayer) -> tuple[tuple[int, ...], bool]:
    """``((hidden, heads, kv_heads, head_dim, intermediate, mlp_projections, parameters, norm_extras,
    experts_per_token), mlp_tiled)``; an MoE MLP is read by :func:`~lightning_fpdt.memory.experts.read_experts`."""
    hidden, mlp = layer.hidden_size, layer.mlp
    if mlp is None:
        raise ValueError(f"{layer.name} has no 'mlp' module, so its intermediate size cannot be read: {_EXPLICIT}.")
    linears = [m for m in mlp.modules() if isinstance(m, nn.Linear)]
    back = [m for m in linears if m.out_features == hidden]
    experts = None if back else read_experts(mlp, hidden)
    if not back and experts is None:
        raise ValueError(
            f"{layer.name}: its MLP ({type(mlp).__name__}) has no nn.Linear back to hidden_size={hidden}, so its"
            f" intermediate size cannot be read: {_EXPLICIT}."
        )
    if experts is None:
        down = back[-1]  # the output projection; the intermediate is its input
        # gate and up (SwiGLU: 2), a fused gate_up (Phi-3: 2), fc (GeLU: 1): their width over the intermediate's
        widths = sum(m.out_features for m in linears if m is not down and m.out_features % down.in_features == 0)
        experts = (down.in_features, max(1, widths // down.in_features), 1)
    inter, projections, top_k = experts
    params = sum(p.numel() for p in layer.module.parameters())
    # LayerNorm's kernel keeps only its input (and per-token statistics); RMSNorm, torch's included, also
    # keeps the normalized values
    norm_extras = sum(not isinstance(norm, nn.LayerNorm) for norm in layer.norms)
    dims = (hidden, layer.n_heads, layer.n_kv_heads, layer.head_dim, inter, projections, params, norm_extras, top_k)
    return dims, layer.mlp_tiled


def _loss_tiles(module: nn.Module) -> int | None:
    """The first ``loss_tiles`` found (see :meth:`ModelShape.from_module`); ``1`` (untiled) without one."""
    for sub in module.modules():
        for owner in (sub, getattr(sub, "config", None)):
            if owner is not None and hasattr(owner, "loss_tiles"):
                return owner.loss_tiles
    return 1


def format_bytes(n: float) -> str:
    """``1.50 GiB``, ``12.3 MiB``, ``640 KiB``: the unit that keeps the number readable."""
    for unit, size in (("GiB", GIB), ("MiB", 2**20)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}" if unit == "GiB" else f"{n / size:.1f} {unit}"
    return f"{n / 1024:.0f} KiB"


@dataclass
class MemoryEstimate:
    """Bytes per rank. ``device_peak`` is the estimated peak of live tensors on the compute device."""

    parameters: int
    gradients: int
    optimizer: int
    saved_activations: int
    chunk_buffers: int
    peak_transient: int
    host: int
    device_peak: int
    notes: list[str] = field(default_factory=list)

    def table(self) -> str:
        rows = [("parameters", self.parameters), ("gradients", self.gradients), ("optimizer state", self.optimizer),
                ("saved activations", self.saved_activations), ("attention chunk buffers", self.chunk_buffers),
                ("peak transient", self.peak_transient), ("device peak", self.device_peak),
                ("host (pinned)", self.host)]
        width = max(len(r[0]) for r in rows)
        lines = [f"{name:<{width}}  {format_bytes(value):>11}" for name, value in rows]
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


def estimate(shape: ModelShape, seq_len: int, options: EstimateOptions | None = None) -> MemoryEstimate:
    """Per-rank memory of one training step of ``shape`` on sequences of ``seq_len`` tokens under ``options``
    (default: ``EstimateOptions()``; see the module docstring for what is counted).

    Raises:
        ValueError: ``options.chunk_size`` is ``"auto"`` (resolve it with :func:`auto_chunk_size`).
    """
    options = options or EstimateOptions()
    if options.chunk_size == "auto":
        raise ValueError("estimate needs a chunk size: resolve chunk_size='auto' with auto_chunk_size() first.")
    batch_size, chunk_size = options.batch_size, options.chunk_size
    pe, e = PRECISION_BYTES[options.precision]
    p = options.sequence_parallel_size
    s_pad = -(-seq_len // p) * p
    t = batch_size * s_pad // p  # tokens per rank
    h, hd = shape.hidden_size, shape.head_dim or shape.hidden_size // shape.num_heads
    qd = shape.num_heads * hd  # width of q and of the attention output per token (need not be h)
    kv_eff = max(shape.num_kv_heads, p) * hd  # KV heads are replicated up to sp
    chunk = s_pad if chunk_size is None else min(chunk_size, s_pad)
    chunk_tokens_rank = batch_size * chunk // p  # one chunk, per rank

    # replicated: every rank holds everything; sharded (FSDP2): 1/world of it, plus the gathered
    # parameters of the units in use (the root's embeddings and output projection, and two blocks:
    # the current one and the prefetched next one)
    shards = max(1, options.data_parallel_size * p) if options.shard_parameters else 1
    params = shape.num_params * pe // shards
    grads = shape.num_params * pe // shards
    buckets = 0 if options.shard_parameters or options.gradient_as_bucket_view else grads  # DDP's, between steps
    opt = OPTIMIZER_STATES[options.optimizer] * shape.num_params * max(pe, 4) // shards  # float32 or wider
    notes: list[str] = []
    gathered = 0
    if options.shard_parameters:
        layer = shape.block_params
        if layer is None:
            layer = (shape.num_params - shape.vocab_size * h * (1 if shape.tied_embeddings else 2)) // max(
                1, shape.num_layers)
        root = shape.num_params - layer * shape.num_layers
        gathered = (root + 2 * layer) * (2 if options.precision in ("bf16-mixed", "16-mixed") else pe)
        if options.offload_optimizer:  # sharded parameters, gradients and optimizer state live on the host
            notes.append(f"offload_optimizer: {format_bytes(params + grads + opt)} of sharded state in host memory")

    # what one layer saves between its forward and its backward (bytes)
    pipeline_saved = t * e * (2 * qd + 2 * kv_eff) + t * shape.num_heads * 4  # q, out, k, v chunks + lse
    rope = 4 * t * hd * e if chunk_size is None else 0  # with chunking RoPE runs inside the pipeline
    mlp_saved = 0 if options.mlp_tiled else t * shape.mlp_intermediates * e
    # x, the norms' outputs and extras, the residual; o_proj's input
    layer_saved = t * e * ((4 + shape.norm_extras) * h + qd) + pipeline_saved + rope + mlp_saved
    layer_device = layer_saved - (pipeline_saved if options.offload else 0)
    checkpoint = t * h * e

    # the loss: full float32 logits unless tiled (then one tile of the rank's tokens at a time)
    tile_tokens = largest_tile(t, shape.loss_tiles) if options.loss_tiled else t
    logits = tile_tokens * shape.vocab_size * 4
    final = 3 * t * h * e  # final norm input, normalized, output
    loss_saved = 0 if options.loss_tiled else logits  # the log-softmax output, kept for backward
    loss_transient = 2 * logits  # gradients of the log-softmax output and of the logits
    if options.loss_tiled:  # a tile's logits and their softmax; the output-embedding gradient and d(hidden)
        loss_transient += shape.vocab_size * h * max(pe, 4) + t * h * e

    # a tiled MLP recomputes one tile of tokens at a time in backward: its intermediates and their gradients
    s_local = s_pad // p
    tile_tokens = batch_size * largest_tile(s_local, shape.mlp_tiles, mlp_tile_tokens(h))
    mlp_tile_work = (shape.mlp_intermediates + 2 * shape.intermediate_size * shape.experts_per_token) * tile_tokens * e
    mlp_tile_work = mlp_tile_work if options.mlp_tiled else 0

    # attention working set: the current and the prefetched chunk (one chunk: the whole local q/k/v
    # and their head-sharded copies)
    chunk_buffers = 2 * min(chunk_tokens_rank, t) * (2 * qd + 2 * kv_eff) * e
    if options.attention_backend == "math":  # it materializes a chunk pair's scores: S, P, dP and dS in backward
        chunk_global = min(chunk, s_pad)
        chunk_buffers += 4 * batch_size * (shape.num_heads // p or 1) * chunk_global**2 * max(e, 4)

    # Hugging Face layers project q/k/v for the whole local sequence before the pipeline: those and their
    # gradients exist while a layer's attention runs (forward, and its recomputation's backward)
    qkv_local = 0 if shape.chunked_projections else 2 * t * (qd + 2 * shape.num_kv_heads * hd) * e

    if options.activation_checkpointing:
        saved = shape.num_layers * (0 if options.offload_checkpoints else checkpoint) + final
        # one block recomputed and its backward: the block's saved activations, the incoming gradient,
        # and the larger of the attention chunk buffers and one MLP tile's forward and backward. The
        # loss's saved logits are freed before the first block is recomputed: they count in the loss only.
        recompute = layer_device + t * h * e + max(chunk_buffers + qkv_local, mlp_tile_work)
        transient = max(loss_saved + loss_transient, recompute)
    else:
        saved = shape.num_layers * layer_device + final + loss_saved
        # the peak is at the start of backward, in the loss; with offload, the chunks of the layer being
        # computed stay on the device
        transient = max(loss_transient, chunk_buffers) if options.offload else loss_transient
    host = 0
    if options.shard_parameters and options.offload_optimizer:
        host += params + grads + opt
        params = grads = opt = 0
    if options.offload:
        host += pipeline_saved * (1 if options.activation_checkpointing else shape.num_layers)
    if options.activation_checkpointing and options.offload_checkpoints:
        host += shape.num_layers * checkpoint
    # gradients are created during backward; AdamW's update adds about half a parameter set
    device_peak = gathered + buckets + max(params + grads + opt + shape.num_params * pe // 2 // shards,
                                           params + opt + saved + transient)
    if p > 1 and shape.num_heads % p:
        notes.append(f"num_heads={shape.num_heads} is not divisible by sp={p}: the run will be refused")
    return MemoryEstimate(params, grads + buckets, opt, saved, chunk_buffers, transient, host, device_peak, notes)


def auto_chunk_size(
    shape: ModelShape, seq_len: int, budget_bytes: int, options: EstimateOptions | None = None
) -> int | None:
    """The largest chunk size (a multiple of ``options.sequence_parallel_size``, halving from the whole
    sequence) whose estimated device peak fits ``budget_bytes``; ``None`` means no chunking fits best (one
    chunk). ``options.chunk_size`` is not read.

    Raises:
        ValueError: when not even the smallest chunk fits, naming the estimate and the budget.
    """
    options = options or EstimateOptions()
    p = options.sequence_parallel_size
    s_pad = -(-seq_len // p) * p
    candidates: list[int | None] = [None]  # no chunking first, then halving chunks (multiples of p)
    size = s_pad // 2 // p * p
    while size >= p:
        candidates.append(size)
        size = size // 2 // p * p
    smallest = None
    for candidate in candidates:
        smallest = estimate(shape, seq_len, options.replace(chunk_size=candidate))
        if smallest.device_peak <= budget_bytes:
            return candidate
    assert smallest is not None
    raise ValueError(
        f"chunk_size='auto': nothing fits a budget of {format_bytes(budget_bytes)} per rank at {seq_len} tokens; the"
        f" smallest chunk ({candidates[-1]}) still needs {format_bytes(smallest.device_peak)} (saved activations"
        f" {format_bytes(smallest.saved_activations)}, parameters+gradients+optimizer"
        f" {format_bytes(smallest.parameters + smallest.gradients + smallest.optimizer)})."
        " Turn on activation_checkpointing / offload / shard_parameters, raise sequence_parallel_size, shorten the"
        " sequence, or raise memory_budget."
    )


def report(shape: ModelShape, seq_len: int, options: EstimateOptions, budget_gib: float | None = None) -> str:
    """The estimate as printed by ``python -m lightning_fpdt.memory`` and by ``fpdt-train fit``: a header
    line with the run's options, then :meth:`MemoryEstimate.table`. ``chunk_size="auto"`` is resolved
    against ``budget_gib`` when given, else estimated as one chunk with a note."""
    lines = []
    if options.chunk_size == "auto":
        if budget_gib is not None:
            options = options.replace(chunk_size=auto_chunk_size(shape, seq_len, int(budget_gib * GIB), options))
            lines.append(f"chunk_size='auto' with a budget of {budget_gib} GiB per rank picks {options.chunk_size}")
        else:
            options = options.replace(chunk_size=None)
            lines.append("chunk_size='auto' is picked at the first batch from the device's free memory;"
                         " estimated here as one chunk (give a budget to resolve it)")
    settings = ", ".join(f"{f.name}={getattr(options, f.name)}" for f in dataclasses.fields(options))
    lines.insert(0, f"memory estimate per rank: {shape.num_params / 1e6:.1f}M parameters, seq_len {seq_len},"
                    f" {settings}")
    lines.append(estimate(shape, seq_len, options).table())
    return "\n".join(lines)
