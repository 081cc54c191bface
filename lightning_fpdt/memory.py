"""An analytic per-rank memory model of a training step, and ``chunk_size="auto"``.

    python -m lightning_fpdt.memory --config examples/configs/tiny_cpu.yaml
    python -m lightning_fpdt.memory --hidden 4096 --layers 32 --heads 32 --kv-heads 8 --vocab 128256 \\
        --seq 1048576 --sp 8 --chunk-size 65536 --offload --checkpointing --precision bf16-mixed

The model counts what lightning-fpdt's implementation keeps (see docs/how-fpdt-works.md): per rank,
``T = batch x S / sp`` tokens of every sample.

- parameters, gradients and AdamW state (replicated: every rank holds the full model);
- saved activations per layer (block input, norm outputs, the attention pipeline's head-sharded
  q/k/v/out chunks and lse, the o_proj input, the MLP intermediates unless tiled); with
  checkpointing only the block input (on the host with ``offload_checkpoints``);
- the largest transient: the loss (full logits unless tiled) or the recomputation of one block,
  plus the attention working set of one chunk;
- host memory: offloaded attention chunks (one layer's worth at a time: the pipeline keeps a layer's
  chunks from its forward to its backward only when it is not checkpointed) and block checkpoints.

It is an estimate for planning. ``benchmarks/training.py`` measures the real peak of live tensors.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from typing import Any

GIB = 2**30

_PRECISION_BYTES = {  # (parameter bytes, activation bytes)
    "32-true": (4, 4), "32": (4, 4), "64-true": (8, 8), "64": (8, 8),
    "bf16-mixed": (4, 2), "16-mixed": (4, 2), "bf16-true": (2, 2), "16-true": (2, 2),
}
_OPTIMIZER_STATES = {"adamw": 2, "sgd": 1, "none": 0}  # float tensors per parameter


@dataclass(frozen=True)
class ModelShape:
    """What the memory model needs to know about a decoder."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    num_params: int
    tied_embeddings: bool = False

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """From a :class:`~lightning_fpdt.models.LlamaConfig` or :class:`~lightning_fpdt.models.GPTConfig`."""
        if hasattr(config, "hidden_size"):  # Llama
            h, n_layers, heads = config.hidden_size, config.num_hidden_layers, config.num_attention_heads
            kv, inter, vocab, tied = config.num_key_value_heads, config.intermediate_size, config.vocab_size, config.tie_word_embeddings
            kv_dim = h // heads * kv
            per_layer = h * (h + 2 * kv_dim) + h * h + 3 * h * inter + 2 * h
            mlp_intermediates = 4 * inter  # gate, silu(gate), up, product
        else:  # GPT
            h, n_layers, heads = config.n_embd, config.n_layer, config.n_head
            kv, inter, vocab, tied = heads, config.n_inner or 4 * h, config.vocab_size, config.tie_word_embeddings
            per_layer = 4 * h * h + 4 * h + 2 * h * inter + inter + h + 4 * h
            mlp_intermediates = 3 * inter  # fc out, gelu out (and its tanh intermediate)
        n_params = n_layers * per_layer + vocab * h * (1 if tied else 2) + h
        shape = cls(h, n_layers, heads, kv, inter, vocab, n_params, tied)
        object.__setattr__(shape, "_mlp_intermediates", mlp_intermediates)
        return shape

    @property
    def mlp_intermediates(self) -> int:
        return getattr(self, "_mlp_intermediates", 4 * self.intermediate_size)

    @classmethod
    def from_module(cls, module: Any) -> tuple[ModelShape, dict[str, bool]]:
        """The shape of the first :class:`~lightning_fpdt.models.LlamaConfig` / ``GPTConfig`` found as a
        ``config`` attribute in ``module`` or its submodules, and whether its MLP and loss are tiled.

        Raises:
            ValueError: when the module carries no such config (a custom model).
        """
        from lightning_fpdt.models import GPTConfig, LlamaConfig

        for sub in module.modules():
            config = getattr(sub, "config", None)
            if isinstance(config, (LlamaConfig, GPTConfig)):
                return cls.from_config(config), {"mlp_tiled": config.mlp_tiles != 1, "loss_tiled": config.loss_tiles != 1}
        raise ValueError(
            f"{type(module).__name__} has no LlamaConfig/GPTConfig `config` attribute, so its memory cannot be"
            " estimated: set an explicit chunk_size instead of 'auto' (`python -m lightning_fpdt.memory` helps"
            " choose one)."
        )


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


def estimate(
    shape: ModelShape,
    seq_len: int,
    batch_size: int = 1,
    sequence_parallel_size: int = 1,
    chunk_size: int | None = None,
    offload: bool = False,
    activation_checkpointing: bool = False,
    offload_checkpoints: bool = False,
    mlp_tiled: bool = False,
    loss_tiled: bool = False,
    precision: str = "32-true",
    optimizer: str = "adamw",
    attention_backend: str = "sdpa",
    shard_parameters: bool = False,
    data_parallel_size: int = 1,
    offload_optimizer: bool = False,
) -> MemoryEstimate:
    """Per-rank memory of one training step (see the module docstring for what is counted)."""
    if precision not in _PRECISION_BYTES:
        raise ValueError(f"precision={precision!r} is not one of {sorted(_PRECISION_BYTES)}.")
    pe, e = _PRECISION_BYTES[precision]
    p = sequence_parallel_size
    s_pad = -(-seq_len // p) * p
    t = batch_size * s_pad // p  # tokens per rank
    h, hd = shape.hidden_size, shape.hidden_size // shape.num_heads
    kv_eff = max(shape.num_kv_heads, p) * hd  # KV heads are replicated up to sp
    chunk = s_pad if chunk_size is None else min(chunk_size, s_pad)
    chunk_tokens_rank = batch_size * chunk // p  # one chunk, per rank

    if optimizer not in _OPTIMIZER_STATES:
        raise ValueError(f"optimizer={optimizer!r} is not one of {sorted(_OPTIMIZER_STATES)}.")
    # replicated: every rank holds everything; sharded (FSDP2): 1/world of it, plus the gathered
    # parameters of the units in use (the root's embeddings and output projection, and two blocks:
    # the current one and the prefetched next one)
    shards = max(1, data_parallel_size * p) if shard_parameters else 1
    params = shape.num_params * pe // shards
    grads = shape.num_params * pe // shards
    opt = _OPTIMIZER_STATES[optimizer] * shape.num_params * max(pe, 4) // shards  # float32 or wider
    notes: list[str] = []
    gathered = 0
    if shard_parameters:
        layer = (shape.num_params - shape.vocab_size * shape.hidden_size * (1 if shape.tied_embeddings else 2)) // max(
            1, shape.num_layers)
        root = shape.num_params - layer * shape.num_layers
        gathered = (root + 2 * layer) * (2 if precision in ("bf16-mixed", "16-mixed") else pe)
        if offload_optimizer:  # sharded parameters, gradients and optimizer state live on the host
            notes.append(f"offload_optimizer: {format_bytes(params + grads + opt)} of sharded state in host memory")

    # what one layer saves between its forward and its backward (bytes)
    pipeline_saved = t * e * (2 * h + 2 * kv_eff) + t * shape.num_heads * 4  # q, out, k, v chunks + lse
    rope = 4 * t * hd * e if chunk_size is None else 0  # with chunking RoPE runs inside the pipeline
    mlp_saved = 0 if mlp_tiled else t * shape.mlp_intermediates * e
    layer_saved = t * e * 7 * h + pipeline_saved + rope + mlp_saved  # x, 2 norms x 2, o_proj in, residual
    layer_device = layer_saved - (pipeline_saved if offload else 0)
    checkpoint = t * h * e

    # the loss: full float32 logits unless tiled (then tiles of 1024 tokens)
    tile_tokens = min(t, 1024) if loss_tiled else t
    logits = tile_tokens * shape.vocab_size * 4
    final = 3 * t * h * e  # final norm input, normalized, output
    loss_saved = 0 if loss_tiled else logits  # the log-softmax output, kept for backward
    loss_transient = 2 * logits  # gradients of the log-softmax output and of the logits
    if loss_tiled:  # a tile's logits and their softmax; the output-embedding gradient and d(hidden)
        loss_transient += shape.vocab_size * h * max(pe, 4) + t * h * e

    # a tiled MLP recomputes one tile of tokens at a time in backward: its intermediates and their gradients
    s_local = s_pad // p
    tile_tokens = batch_size * -(-s_local // -(-s_local // max(h, 1024)))
    mlp_tile_work = (shape.mlp_intermediates + 2 * shape.intermediate_size) * tile_tokens * e if mlp_tiled else 0

    # attention working set: the current and the prefetched chunk (one chunk: the whole local q/k/v
    # and their head-sharded copies)
    chunk_buffers = 2 * min(chunk_tokens_rank, t) * (2 * h + 2 * kv_eff) * e
    if attention_backend == "math":  # it materializes a chunk pair's scores: S, P, dP and dS in backward
        chunk_global = min(chunk, s_pad)
        chunk_buffers += 4 * batch_size * (shape.num_heads // p or 1) * chunk_global**2 * max(e, 4)

    if activation_checkpointing:
        saved = shape.num_layers * (0 if offload_checkpoints else checkpoint) + final + loss_saved
        # one block recomputed and its backward: the block's saved activations, the incoming gradient,
        # and the larger of the attention chunk buffers and one MLP tile's forward and backward
        recompute = layer_device + t * h * e + max(chunk_buffers, mlp_tile_work)
        transient = max(loss_transient, recompute)
    else:
        saved = shape.num_layers * layer_device + final + loss_saved
        # the peak is at the start of backward, in the loss; with offload, the chunks of the layer being
        # computed stay on the device
        transient = max(loss_transient, chunk_buffers) if offload else loss_transient
    host = 0
    if shard_parameters and offload_optimizer:
        host += params + grads + opt
        params = grads = opt = 0
    if offload:
        host += pipeline_saved * (1 if activation_checkpointing else shape.num_layers)
    if activation_checkpointing and offload_checkpoints:
        host += shape.num_layers * checkpoint
    # gradients are created during backward; AdamW's update adds about half a parameter set
    device_peak = gathered + max(params + grads + opt + shape.num_params * pe // 2 // shards,
                                 params + opt + saved + transient)
    if p > 1 and shape.num_heads % p:
        notes.append(f"num_heads={shape.num_heads} is not divisible by sp={p}: the run will be refused")
    return MemoryEstimate(params, grads, opt, saved, chunk_buffers, transient, host, device_peak, notes)


def optimizer_kind(optimizer: Any) -> str:
    """``"adamw"`` (two moments per parameter), ``"sgd"`` (one momentum buffer) or ``"none"``."""
    name = type(optimizer).__name__.lower()
    if "adam" in name or "lamb" in name:
        return "adamw"
    if name == "sgd" and optimizer.defaults.get("momentum", 0):
        return "sgd"
    return "none" if name == "sgd" else "adamw"  # unknown optimizers: assume two states (conservative)


def available_memory(device: Any, local_processes: int = 1) -> int:
    """Bytes this rank may use: the CUDA device's free memory, or on CPU the host's available memory
    (``MemAvailable``) shared by the ``local_processes`` ranks on this host."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024 // max(1, local_processes)


def auto_chunk_size(
    shape: ModelShape, seq_len: int, budget_bytes: int, sequence_parallel_size: int = 1, **options: Any
) -> int | None:
    """The largest chunk size (a multiple of ``sequence_parallel_size``, halving from the whole sequence)
    whose estimated device peak fits ``budget_bytes``; ``None`` means no chunking fits best (one chunk).

    Raises:
        ValueError: when not even the smallest chunk fits, naming the estimate and the budget.
    """
    p = sequence_parallel_size
    s_pad = -(-seq_len // p) * p
    candidates: list[int | None] = [None]  # no chunking first, then halving chunks (multiples of p)
    size = s_pad // 2 // p * p
    while size >= p:
        candidates.append(size)
        size = size // 2 // p * p
    smallest = None
    for candidate in candidates:
        smallest = estimate(shape, seq_len, sequence_parallel_size=p, chunk_size=candidate, **options)
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="an fpdt-train YAML; its model, data.seq_len and strategy are used")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--seq", type=int, default=262144)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--sp", type=int, default=1)
    parser.add_argument("--chunk-size", type=lambda v: v if v == "auto" else int(v), default=None)
    parser.add_argument("--offload", action="store_true")
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--offload-checkpoints", action="store_true")
    parser.add_argument("--tiled", action="store_true", help="tiled MLP and loss")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--attention-backend", default="sdpa", choices=["sdpa", "flash_attn", "math"])
    parser.add_argument("--budget", type=float, default=None, help="GiB per rank, to resolve chunk_size 'auto'")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel size (matters with --shard)")
    parser.add_argument("--shard", action="store_true", help="shard_parameters (FSDP2 over dp x sp)")
    parser.add_argument("--offload-optimizer", action="store_true")
    args = parser.parse_args(argv)
    from lightning_fpdt.models import LlamaConfig

    options: dict[str, Any] = {}
    init: dict[str, Any] = {}
    if args.config:
        import yaml

        with open(args.config) as f:
            cfg = yaml.safe_load(f)
        model_cfg = cfg["model"]["init_args"].get("config", {})
        if "GPT" in cfg["model"]["class_path"]:
            from lightning_fpdt.models import GPTConfig

            config: Any = GPTConfig(**model_cfg)
            tiles = (config.mlp_tiles, config.loss_tiles)
        else:
            config = LlamaConfig(**model_cfg)
            tiles = (config.mlp_tiles, config.loss_tiles)
        strategy = cfg["trainer"].get("strategy", {})
        init = strategy.get("init_args", {}) if isinstance(strategy, dict) else {}
        devices = cfg["trainer"].get("devices", 1)
        data = cfg.get("data", {}).get("init_args", {})
        options = dict(seq_len=data.get("seq_len", args.seq), batch_size=data.get("batch_size", args.batch),
                       sequence_parallel_size=init.get("sequence_parallel_size", devices if isinstance(devices, int) else 1),
                       chunk_size=init.get("chunk_size"), offload=init.get("offload", False),
                       activation_checkpointing=init.get("activation_checkpointing", False),
                       offload_checkpoints=init.get("offload_checkpoints", False),
                       mlp_tiled=tiles[0] != 1, loss_tiled=tiles[1] != 1,
                       precision=str(cfg["trainer"].get("precision", "32-true")),
                       attention_backend=init.get("attention_backend", "sdpa"),
                       shard_parameters=init.get("shard_parameters", False),
                       offload_optimizer=init.get("offload_optimizer", False),
                       data_parallel_size=max(1, (cfg["trainer"].get("num_nodes", 1) * (devices if isinstance(devices, int) else 1))
                                              // init.get("sequence_parallel_size", devices if isinstance(devices, int) else 1)))
    else:
        config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                             num_hidden_layers=args.layers, num_attention_heads=args.heads,
                             num_key_value_heads=args.kv_heads)
        options = dict(seq_len=args.seq, batch_size=args.batch, sequence_parallel_size=args.sp,
                       chunk_size=args.chunk_size, offload=args.offload, activation_checkpointing=args.checkpointing,
                       offload_checkpoints=args.offload_checkpoints, mlp_tiled=args.tiled, loss_tiled=args.tiled,
                       precision=args.precision, attention_backend=args.attention_backend,
                       shard_parameters=args.shard, data_parallel_size=args.dp, offload_optimizer=args.offload_optimizer)
    shape = ModelShape.from_config(config)
    seq = options.pop("seq_len")
    try:
        print(report(shape, seq, budget_gib=args.budget if args.budget is not None else init.get("memory_budget"), **options))
    except ValueError as err:
        raise SystemExit(str(err)) from None


def report(shape: ModelShape, seq_len: int, budget_gib: float | None = None, **options: Any) -> str:
    """The estimate as printed by ``python -m lightning_fpdt.memory`` and by ``fpdt-train fit``: a header
    line with the run's options, then :meth:`MemoryEstimate.table`. ``chunk_size="auto"`` is resolved
    against ``budget_gib`` when given, else estimated as one chunk with a note."""
    lines = []
    if options.get("chunk_size") == "auto":
        if budget_gib is not None:
            options.pop("chunk_size")
            options["chunk_size"] = auto_chunk_size(shape, seq_len, int(budget_gib * GIB), **options)
            lines.append(f"chunk_size='auto' with a budget of {budget_gib} GiB per rank picks {options['chunk_size']}")
        else:
            options["chunk_size"] = None
            lines.append("chunk_size='auto' is picked at the first batch from the device's free memory;"
                         " estimated here as one chunk (give a budget to resolve it)")
    settings = ", ".join(f"{k}={v}" for k, v in options.items())
    lines.insert(0, f"memory estimate per rank: {shape.num_params / 1e6:.1f}M parameters, seq_len {seq_len}, {settings}")
    lines.append(estimate(shape, seq_len, **options).table())
    return "\n".join(lines)


if __name__ == "__main__":
    main()
