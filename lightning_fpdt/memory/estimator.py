"""The per-rank memory of one training step (:func:`estimate`), as the package's docstring counts it, and how it
is printed (:class:`MemoryEstimate`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_fpdt.attention.fused_ops import padded_width
from lightning_fpdt.errors import FPDTError
from lightning_fpdt.memory.estimate_options import OPTIMIZER_STATES, PRECISION_BYTES, EstimateOptions
from lightning_fpdt.memory.scores import UNCAPPED_MATH, capped_block_bytes, caps_in_kernel
from lightning_fpdt.memory.shape import LayerKind, ModelShape
from lightning_fpdt.offload.tiling import largest_tile, mlp_tile_tokens
from lightning_fpdt.parallel.comm import heads_fit
from lightning_fpdt.parallel.layout import padded_length

GIB = 2**30


def format_bytes(n: float) -> str:
    """``1.50 GiB``, ``12.3 MiB``, ``640 KiB``: the unit that keeps the number readable."""
    for unit, size in (("GiB", GIB), ("MiB", 2**20)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}" if unit == "GiB" else f"{n / size:.1f} {unit}"
    return f"{n / 1024:.0f} KiB"


@dataclass
class MemoryEstimate:
    """Bytes per rank. ``device_peak`` is the estimated peak of live tensors on the compute device;
    ``gathered`` the parameters FSDP2 holds all-gathered (the root's and two blocks', with ``shard_parameters``;
    printed only then); ``ring_buffers`` the ring's point-to-point buffers of one chunk (with ``ring_size > 1``;
    printed only then); ``kept_answers`` the attention outputs and log-sum-exps the recomputed layers keep from
    forward to backward (with ``keep_attention``; in ``host`` with ``offload``, else in ``saved_activations``)."""

    parameters: int
    gradients: int
    optimizer: int
    saved_activations: int
    chunk_buffers: int
    peak_transient: int
    host: int
    device_peak: int
    notes: list[str] = field(default_factory=list)
    gathered: int = 0
    ring_buffers: int = 0
    kept_answers: int = 0

    def table(self) -> str:
        rows = [("parameters", self.parameters), ("gradients", self.gradients), ("optimizer state", self.optimizer),
                ("saved activations", self.saved_activations), ("attention chunk buffers", self.chunk_buffers),
                ("peak transient", self.peak_transient), ("device peak", self.device_peak),
                ("host (pinned)", self.host)]
        if self.gathered:
            rows.insert(3, ("gathered (FSDP)", self.gathered))
        if self.ring_buffers:
            rows.insert(rows.index(("attention chunk buffers", self.chunk_buffers)) + 1,
                        ("ring buffers", self.ring_buffers))
        if self.kept_answers:
            rows.insert(rows.index(("saved activations", self.saved_activations)) + 1,
                        ("kept attention answers", self.kept_answers))
        width = max(len(r[0]) for r in rows)
        lines = [f"{name:<{width}}  {format_bytes(value):>11}" for name, value in rows]
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


@dataclass(frozen=True)
class ModelState:
    """Bytes per rank of the model's state: ``params``, ``grads`` and ``opt`` (AdamW's moments) as the rank holds them
    between steps (everything, or ``1 / shards`` of it under FSDP2), DDP's gradient ``buckets``; under FSDP2 the
    ``gathered`` parameters of the units in use and the ``unsharded_grads`` of a block in its backward; the output
    projection's gradient made in the loss's backward (``out_proj_grad``); ``trained`` and ``layer_trained`` parameter
    counts (LoRA: the adapters'); the compute-dtype casts of one layer's weights under mixed precision
    (``layer_casts``: a layer's run casts each once, :mod:`lightning_fpdt.offload.weight_casts`); and notes for the
    report."""

    params: int
    grads: int
    buckets: int
    opt: int
    gathered: int
    unsharded_grads: int
    out_proj_grad: int
    trained: int
    layer_trained: int
    shards: int
    notes: tuple[str, ...]
    layer_casts: int = 0


def model_state(shape: ModelShape, options: EstimateOptions) -> ModelState:
    """The model's parameters, gradients and optimizer state per rank (:class:`ModelState`)."""
    pe = PRECISION_BYTES[options.precision][0]
    p, h = options.sequence_parallel_size, shape.hidden_size
    # replicated: every rank holds everything; sharded (FSDP2): 1/world of it, plus the gathered
    # parameters of the units in use (the root's embeddings and output projection, and two blocks:
    # the current one and the prefetched next one)
    shards = max(1, options.data_parallel_size * p) if options.shard_parameters else 1
    trained = shape.num_params if shape.trainable_params is None else shape.trainable_params  # LoRA: the adapters
    params = shape.num_params * pe // shards
    grads = trained * pe // shards
    buckets = 0 if options.shard_parameters or options.gradient_as_bucket_view else grads  # DDP's, between steps
    opt = OPTIMIZER_STATES[options.optimizer] * trained * max(pe, 4) // shards  # float32 or wider
    notes: list[str] = []
    layer = shape.block_params
    if layer is None:
        layer = (shape.num_params - shape.vocab_size * h * (1 if shape.tied_embeddings else 2)) // max(
            1, shape.num_layers)
    layer_trained = layer if shape.block_trainable is None else shape.block_trainable
    mixed = options.precision in ("bf16-mixed", "16-mixed")
    gathered = unsharded_grads = 0
    # the output projection's gradient is made in the loss's backward and lives through every block's
    out_proj_grad = shape.vocab_size * h * pe * shape.head_trainable
    if options.shard_parameters:
        root = shape.num_params - layer * shape.num_layers
        compute = 2 if mixed else pe  # FSDP2 gathers (and makes gradients) in the compute dtype
        gathered = (root + 2 * layer) * compute
        # FSDP2 reduce-scatters the root's gradients (the output projection's) at the end of backward: unsharded
        # until then; a block's are unsharded while its backward runs, and its reduce-scatter input (in float32
        # under mixed precision) is held until the next block's reduce-scatter is issued
        out_proj_grad = shape.vocab_size * h * compute * shape.head_trainable
        unsharded_grads = layer_trained * (compute + (4 if mixed else pe))
        if options.offload_optimizer:  # sharded parameters, gradients and optimizer state live on the host
            notes.append(f"offload_optimizer: {format_bytes(params + grads + opt)} of sharded state in host memory")
    # FSDP2's mixed-precision policy gathers the weights in the compute dtype: nothing left to cast
    layer_casts = 2 * layer if mixed and not options.shard_parameters else 0
    return ModelState(params, grads, buckets, opt, gathered, unsharded_grads, out_proj_grad, trained, layer_trained,
                      shards, tuple(notes), layer_casts)


def estimate(shape: ModelShape, seq_len: int, options: EstimateOptions | None = None) -> MemoryEstimate:
    """Per-rank memory of one training step of ``shape`` on sequences of ``seq_len`` tokens under ``options``
    (default: ``EstimateOptions()``; see the module docstring for what is counted).

    Raises:
        ValueError: ``options.chunk_size`` is ``"auto"`` (resolve it with :func:`auto_chunk_size`).
    """
    options = options or EstimateOptions()
    if options.chunk_size == "auto":
        raise FPDTError("estimate needs a chunk size: resolve chunk_size='auto' with auto_chunk_size() first.")
    batch_size, chunk_size = options.batch_size, options.chunk_size
    pe, e = PRECISION_BYTES[options.precision]
    p, r, u = options.sequence_parallel_size, options.ring_size, options.ulysses_size  # p = u x r
    s_pad = padded_length(seq_len, p, ring_size=r)
    t = batch_size * s_pad // p  # tokens per rank
    h, hd = shape.hidden_size, shape.head_dim or shape.hidden_size // shape.num_heads
    vd = shape.v_head_dim or hd  # v's head width (multi-head latent attention: narrower than q's and k's)
    qd, od = shape.num_heads * hd, shape.num_heads * vd  # widths of q and of the attention output (need not be h)
    kv_heads = max(shape.num_kv_heads, u)  # KV heads are replicated up to the Ulysses degree (comm.expand_kv_heads)
    # q, out, k and v kept per token of the rank: a rank holds heads / u of its ring part (S / r tokens) of q and out,
    # and k/v of the whole sequence at heads / u (its ring peers' parts join its store: lightning_fpdt.attention.ring)
    qkvo = qd + od + r * kv_heads * (hd + vd)
    chunk = s_pad if chunk_size is None else min(chunk_size, s_pad)
    chunk_tokens_rank = batch_size * chunk // p  # one chunk, per rank

    state = model_state(shape, options)
    params, grads, buckets, opt = state.params, state.grads, state.buckets, state.opt
    notes = list(state.notes)

    # what one layer saves between its forward and its backward (bytes), by what it has (a hybrid's layers differ)
    pipeline_saved = t * e * qkvo + t * shape.num_heads * 4  # q, out, k, v chunks + lse
    rope = 4 * t * hd * e if chunk_size is None else 0  # with chunking RoPE runs inside the pipeline
    mlp_saved = 0 if options.mlp_tiled else t * shape.mlp_intermediates * e
    kinds = shape.layer_kinds()

    def layer_saved(kind: LayerKind, device_only: bool) -> float:
        # x, the norms' outputs and extras, the residual; o_proj's input and the pipeline's chunks; the MLP's
        # intermediates; each sequence-parallel mixer's own (chunk inputs offloaded with the pipeline's chunks)
        saved = t * e * (4 + shape.norm_extras) * h + (mlp_saved if kind.mlp else 0)
        if kind.attention:
            saved += t * e * od + rope + (0 if device_only and options.offload else pipeline_saved)
        for m in kind.mixers:
            kept = m.saved(p, chunk_size, s_pad) - (m.offloaded(p) if device_only and options.offload else 0)
            saved += t * e * kept + t * 4 * m.kept_float32()
        return saved

    layer_device = max(layer_saved(k, True) for k in kinds)  # the largest layer, recomputed or last
    all_layers_device = sum(layer_saved(k, True) for k in kinds)
    offloaded_layer = max(layer_saved(k, False) - layer_saved(k, True) for k in kinds)
    offloaded_layers = sum(layer_saved(k, False) - layer_saved(k, True) for k in kinds)
    layer_input = t * h * e  # what activation checkpointing keeps of a block

    # the loss: full float32 logits unless tiled (then one tile of the rank's tokens at a time)
    tile_tokens = largest_tile(t, shape.loss_tiles) if options.loss_tiled else t
    logits = tile_tokens * shape.vocab_size * 4
    # streamed layers (LayerKind.can_stream): checkpointed, in two or more chunks; a layer that cannot stream is
    # recomputed whole
    streams = options.streaming and options.activation_checkpointing and chunk_tokens_rank < t
    def streamed(kind: LayerKind) -> bool:
        return streams and kind.can_stream(r)

    final = (1 if streams and options.loss_tiled else 3) * t * h * e  # norm input, output, its own; or the input
    loss_saved = 0 if options.loss_tiled else logits  # the log-softmax output, kept for backward
    loss_transient = 2 * logits  # gradients of the log-softmax output and of the logits
    if options.loss_tiled:  # a tile's logits, overwritten by their softmax; the output-embedding gradient, d(hidden)
        loss_transient = logits + shape.vocab_size * h * max(pe, 4) * shape.head_trainable + t * h * e

    # the MLP's backward: a tiled MLP recomputes one tile of tokens at a time, its intermediates and their
    # gradients; an untiled one keeps its intermediates (saved above) and makes their gradients for every token
    s_local = s_pad // p
    tile_tokens = batch_size * largest_tile(s_local, shape.mlp_tiles, mlp_tile_tokens(h))
    intermediate_grads = 2 * shape.intermediate_size * shape.experts_per_token * e
    if options.mlp_tiled:
        mlp_work = (shape.mlp_intermediates * e + intermediate_grads) * tile_tokens
    else:
        mlp_work = intermediate_grads * t
    # a streamed layer's MLP runs on one chunk at a time: its tiles cut the chunk (untiled: the chunk is the tile)
    chunk_local = s_local if chunk_size is None else min(chunk_size // p, s_local)
    stream_tile = batch_size * largest_tile(chunk_local, shape.mlp_tiles if options.mlp_tiled else 1,
                                            mlp_tile_tokens(h))
    streamed_mlp_work = (shape.mlp_intermediates * e + intermediate_grads) * stream_tile

    # attention working set, forward: the current and the prefetched chunk's query side (one chunk: the whole local
    # q/k/v and their head-sharded copies), the current chunk's k/v parts of every ring rank and the next one prefetched
    part = min(chunk_tokens_rank, t) * kv_heads * (hd + vd)  # one ring rank's k/v of one chunk, at heads / u
    chunk_buffers = 2 * min(chunk_tokens_rank, t) * (qd + od) * e + (r + 1) * part * e
    # backward: the query sides, the current and the prefetched part, and the ring's buffers: the packed dk/dv sums of
    # the peers' parts going home and the peers' sums for this rank's part arriving, both in the accumulation dtype
    # (float32, float64 for float64). Not offloaded, the peers' parts leave the store as their sums are made
    ring_buffers = 2 * (r - 1) * part * max(e, 4)
    backward_buffers = (2 * min(chunk_tokens_rank, t) * (qd + od) * e + 2 * part * e + ring_buffers
                        - (0 if options.offload else (r - 1) * part * e))
    # scores where the route makes them: math's every block whole; a capped block on a route that cannot cap, banded
    block = min(chunk, s_pad) // r  # a ring part of a chunk against a ring part
    local_heads = shape.num_heads // u or 1
    on_math = options.attention_backend == "math"
    width = padded_width(hd, vd)  # q, k and v at one width, as the fused kernels take them (common_head_dim)
    if shape.capped_attention and not caps_in_kernel(options.attention_backend, width):
        forward_scores, backward_scores = capped_block_bytes(batch_size, local_heads, block, block, hd, vd, max(e, 4),
                                                             banded=not on_math)
        chunk_buffers += forward_scores
        backward_buffers += backward_scores
    elif on_math:
        scores = UNCAPPED_MATH * batch_size * local_heads * block**2 * max(e, 4)
        chunk_buffers += scores
        backward_buffers += scores
    attention_work = max(chunk_buffers, backward_buffers)

    # Hugging Face layers project q/k/v for the whole local sequence before the pipeline: those and their
    # gradients exist while a layer's attention runs (forward, and its recomputation's backward)
    qkv_local = 0 if shape.chunked_projections else 2 * t * (qd + shape.num_kv_heads * (hd + vd)) * e

    # a sequence-parallel mixer's backward recomputes one chunk at a time: its kernel's float32 intermediates and
    # their gradients for one chunk's tokens of the rank, once the ops after the kernel have given theirs back
    def layer_work(kind: LayerKind) -> float:
        mixer = max(((min(chunk_tokens_rank, t) if m.chunked else t) * 4 * m.work() - t * e * m.released()
                     for m in kind.mixers), default=0)
        return max(attention_work + qkv_local if kind.attention else 0, mlp_work if kind.mlp else 0, mixer)

    # one block's backward: the incoming gradient and the larger of the attention chunk buffers (with the whole
    # local q/k/v of a Hugging Face layer), the MLP's backward and a mixer's chunk; recomputed, on top of the
    # block's own saved activations (the largest layer of a hybrid may not be the one with the largest backward)
    block_backward = t * h * e + max(layer_work(k) for k in kinds) + state.layer_casts
    # a streamed layer's backward: its output's and its input's gradients, one chunk's recomputed graph (with its q/k/v
    # and attention output's gradient) and work, a Hugging Face model's rotary cos/sin of every local token; without
    # offload its attention store (the pipeline's chunks and each chunk's dout)
    c = min(chunk_tokens_rank, t)

    def streamed_backward(kind: LayerKind) -> float:
        if kind.mixers:  # carried: one chunk recomputed, its saved activations and its kernels' work
            mixers_saved = sum(m.saved(p, chunk_size, s_pad) for m in kind.mixers)
            chunk_saved = c * e * ((4 + shape.norm_extras) * h + mixers_saved)
            mixer_work = max(c * 4 * m.work() for m in kind.mixers)
            return 2 * t * h * e + chunk_saved + max(mixer_work, streamed_mlp_work if kind.mlp else 0)
        store = (0 if options.offload else pipeline_saved + t * e * od) + (0 if shape.chunked_projections else
                                                                          2 * t * hd * e)
        chunk_graph = c * e * ((4 + shape.norm_extras) * h + 2 * od + qd + 2 * shape.num_kv_heads * hd)
        return 2 * t * h * e + chunk_graph + max(attention_work, streamed_mlp_work if kind.mlp else 0) + store

    # a tiled MLP's backward sums its tiles' parameter gradients into a buffer of its own (float32 or wider) while
    # each tile's arrive: one more MLP parameter set than the layer's gradient (an MoE layer's experts make it large;
    # measured on CPU: Qwen3-MoE-shaped 0.93 of the peak without it, within 3% with it, dense models too)
    mlp_params = max(state.layer_trained - h * (qd + shape.num_kv_heads * (hd + vd)) - od * h, 0)
    mlp_grad_pieces = mlp_params * max(pe, 4) // state.shards if options.mlp_tiled else 0
    recomputed_block = max(streamed_backward(k) if streamed(k) else layer_saved(k, True) + t * h * e + layer_work(k)
                           for k in kinds) + state.layer_casts + mlp_grad_pieces
    # attention once per step: each recomputed attention layer's output and lse, from its forward to its backward
    kept_answers = 0
    if options.activation_checkpointing and options.keep_attention:
        kept_answers = sum(k.attention for k in kinds) * t * (od * e + shape.num_heads * 4)
    # a carried layer's states at its chunk boundaries, from its forward to its backward (with the layer inputs)
    carries = sum(t * max(e, 4) * m.state / min(chunk, s_pad) for k in kinds if streamed(k) and k.mixers
                  for m in k.mixers)
    if options.activation_checkpointing:
        stored = 0 if options.offload_checkpoints else layer_input  # one block's input on the device
        all_stored = (shape.num_layers * stored + (0 if options.offload else kept_answers)
                      + (0 if options.offload_checkpoints else carries))
        saved = all_stored + final
        # one block recomputed and its backward: its saved activations besides the above. The loss's saved
        # logits are freed before the first block is recomputed (the final norm's activations are counted on:
        # measured on CPU, one of them outlives the first recomputation)
        recompute = recomputed_block
        transient = max(loss_saved + loss_transient, recompute)
        loss_phase = saved + loss_saved + loss_transient
    else:
        stored = layer_device  # every block's activations, until its backward
        all_stored = all_layers_device
        saved = all_stored + final + loss_saved
        recompute = block_backward
        # with offload, the chunks of the layer being computed stay on the device
        transient = max(loss_transient, chunk_buffers) if options.offload else loss_transient
        loss_phase = saved + transient
    host = 0
    if options.shard_parameters and options.offload_optimizer:
        host += params + grads + opt
        params = grads = opt = 0
    if options.offload:
        host += offloaded_layer if options.activation_checkpointing else offloaded_layers
    if options.activation_checkpointing and options.offload_checkpoints:
        host += shape.num_layers * layer_input + carries
    if options.offload:
        host += kept_answers
    # the blocks' backward, from the last block to the first: the gradients made so far grow by one block's
    # as the stored activations shrink by one block's, so the peak is at one end: the last block (the
    # output projection's gradient, every block's activations) or the first (every block's gradients too, one
    # block's activations). The input embedding's gradient comes after the first block's backward (under FSDP2
    # the root's sharded gradients too: it reduce-scatters the root's at the very end).
    layer_grads = 0 if grads == 0 else shape.num_layers * state.layer_trained * pe // state.shards
    kept_final = 0 if streams and options.loss_tiled else final  # the loss's input dies in its backward
    backward_phase = (state.unsharded_grads + kept_final + recompute + state.out_proj_grad
                      + max(all_stored, layer_grads + stored))
    # gradients are created during backward; AdamW's foreach update adds one parameter set (its sqrt of the second
    # moments, made for every parameter at once: measured, peak = 5 sets with the gradients)
    device_peak = state.gathered + buckets + max(params + grads + opt + state.trained * pe // state.shards,
                                                 params + opt + max(loss_phase, backward_phase))
    if u > 1 and not heads_fit(shape.num_heads, shape.num_kv_heads, u):
        degree = f"sp={p}" if r == 1 else f"the Ulysses degree {u} (sp={p} / ring_size={r})"
        notes.append(f"num_heads={shape.num_heads}, num_kv_heads={shape.num_kv_heads} cannot be sharded over {degree}:"
                     " the run will be refused")
    if r > 1 and any(k.mixers for k in kinds):
        notes.append(f"ring_size={r} with token mixers besides attention (a gated delta-net, Mamba-2, a short"
                     " convolution): the run will be refused")
    return MemoryEstimate(params, grads + buckets, opt, saved, chunk_buffers, transient, host, device_peak, notes,
                          state.gathered, ring_buffers, kept_answers)
