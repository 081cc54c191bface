"""The analytic memory model: what each FPDT feature removes, and chunk_size='auto' selection."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
import transformers
import yaml
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import register_fsdp_forward_method

from lightning_fpdt import FPDTStrategy
from lightning_fpdt.layers.block import FPDTAttention, FPDTBlock, fpdt_blocks
from lightning_fpdt.layers.loss import cross_entropy_sum, token_weighted_loss
from lightning_fpdt.layers.rope import RotaryEmbedding
from lightning_fpdt.memory import EstimateOptions, ModelShape, auto_chunk_size, estimate
from lightning_fpdt.memory.__main__ import main, shape_from_config
from lightning_fpdt.memory.estimate_options import PRECISION_BYTES
from lightning_fpdt.models import GPT, GPTConfig, HFCausalLM, Llama, LlamaConfig, LlamaLM
from lightning_fpdt.models.init import init_weights
from lightning_fpdt.offload.memtrack import TensorMemoryTracker
from lightning_fpdt.offload.tiling import TiledMLP, largest_tile, mlp_tile_tokens
from lightning_fpdt.parallel.batches import shard_batch
from lightning_fpdt.parallel.binding import SequenceParallelContext, bind
from lightning_fpdt.strategy.sharding import shard_module
from lightning_fpdt.testing import run_on_ranks
from tests.helpers import TokenDataset, dataloader, training_step_peak

SHAPE = shape_from_config(LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                                           num_attention_heads=8, num_key_value_heads=4, vocab_size=32000))


class GeluMLP(nn.Module):
    """A user's own MLP: ``fc_out(gelu(fc_in(x)))``, exact GELU, biases."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.fc_in, self.fc_out = nn.Linear(hidden, inner), nn.Linear(inner, hidden)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc_out(nn.functional.gelu(self.fc_in(x)))


class OwnDecoder(nn.Module):
    """A user's own decoder from FPDTBlock (docs/own-model.md): head_dim != hidden / heads, LayerNorm, a GELU
    MLP, an output projection with a bias, optionally tied to the embedding."""

    def __init__(self, vocab: int = 96, hidden: int = 48, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                 head_dim: int = 16, inner: int = 80, tiled: bool = True, tied: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(
            FPDTBlock(FPDTAttention(hidden, heads, kv_heads, head_dim=head_dim, rope=RotaryEmbedding(head_dim)),
                      mlp=TiledMLP(GeluMLP(hidden, inner)) if tiled else GeluMLP(hidden, inner),
                      attention_norm=nn.LayerNorm(hidden), mlp_norm=nn.LayerNorm(hidden))
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=not tied)
        init_weights(self, None)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, input_ids: Tensor, position_ids: Tensor) -> Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, position_ids)
        return self.norm(x)


class OwnLM(L.LightningModule):
    """Trains an :class:`OwnDecoder` with its own loss (full logits: no loss tiling)."""

    def __init__(self, **model: Any) -> None:
        super().__init__()
        self.model = OwnDecoder(**model)

    def loss_terms(self, batch: dict[str, Any]) -> tuple[Tensor, Tensor]:
        hidden = self.model(batch["input_ids"], batch["position_ids"])
        return cross_entropy_sum(self.model.head(hidden), batch["shift_labels"])

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        return token_weighted_loss(*self.loss_terms(batch))[0]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def gpt_params(c: GPTConfig) -> int:
    """GPT's parameters counted by hand: token and position embeddings, per block the attention (with
    biases), the MLP (with biases) and two LayerNorms, the final LayerNorm (weight and bias), the output
    projection unless tied."""
    h, inner = c.n_embd, c.n_inner
    block = 4 * h * h + 4 * h + 2 * h * inner + inner + h + 2 * 2 * h
    positions = c.n_positions * h if c.position_embedding == "learned" else 0
    return c.vocab_size * h + positions + c.n_layer * block + 2 * h + (0 if c.tie_word_embeddings else c.vocab_size * h)


@pytest.mark.parametrize("config", [
    LlamaConfig.tiny(), LlamaConfig.tiny(tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
    GPTConfig.tiny(), GPTConfig.tiny(tie_word_embeddings=False), GPTConfig.tiny(position_embedding="rotary"),
], ids=["llama", "llama_tied_bias", "gpt_tied", "gpt_untied", "gpt_rotary"])
def test_parameter_count_matches_the_model(config: LlamaConfig | GPTConfig) -> None:
    model = (Llama if isinstance(config, LlamaConfig) else GPT)(config)
    counted = shape_from_config(config).num_params
    assert counted == sum(p.numel() for p in model.parameters()) == ModelShape.from_module(model)[0].num_params
    if isinstance(config, GPTConfig):  # position embeddings and the final LayerNorm's bias included
        assert counted == gpt_params(config)


def test_shape_of_the_bundled_models() -> None:
    llama = shape_from_config(LlamaConfig.tiny(tie_word_embeddings=True))
    assert (llama.hidden_size, llama.num_layers, llama.num_heads, llama.num_kv_heads, llama.head_dim) == (
        64, 2, 4, 2, 16)
    assert (llama.intermediate_size, llama.mlp_intermediates, llama.vocab_size, llama.tied_embeddings) == (
        176, 4 * 176, 256, True)
    assert llama.norm_extras == 2  # RMSNorms
    gpt = shape_from_config(GPTConfig.tiny(tie_word_embeddings=False))  # n_positions 2048 > vocab 256
    assert (gpt.num_heads, gpt.num_kv_heads, gpt.intermediate_size, gpt.mlp_intermediates) == (4, 4, 256, 2 * 256)
    assert (gpt.vocab_size, gpt.tied_embeddings) == (256, False)


def _saved_wide(module: nn.Module, x: Tensor) -> int:
    """Elements per token of the activations autograd saves in ``module(x)``, besides ``x`` and the parameters
    (per-token statistics left out: only tensors at least as wide as ``x``)."""
    known = {t.untyped_storage().data_ptr() for t in (x, *module.parameters())}
    saved: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        if t.untyped_storage().data_ptr() not in known and t.shape[-1] >= x.shape[-1]:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes() // t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(saved.values()) // (x.numel() // x.shape[-1])


@pytest.mark.parametrize("model", [Llama(LlamaConfig.tiny()), GPT(GPTConfig.tiny()), OwnDecoder(tiled=False)],
                         ids=["llama", "gpt", "own_model"])
def test_mlp_and_norm_rules_match_what_autograd_saves(model: nn.Module) -> None:
    shape, _ = ModelShape.from_module(model)
    block = fpdt_blocks(model)[0][1]
    mlp = block.mlp.mlp if isinstance(block.mlp, TiledMLP) else block.mlp
    x = torch.randn(2, 8, shape.hidden_size, requires_grad=True)
    assert _saved_wide(mlp, x) == shape.mlp_intermediates
    norms = (block.attention_norm, block.mlp_norm)
    assert sum(_saved_wide(norm, x) for norm in norms) == shape.norm_extras * x.shape[-1]


@pytest.mark.parametrize("tiled", [True, False], ids=["tiled_mlp", "plain_mlp"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_shape_of_an_own_model(tiled: bool, tied: bool) -> None:
    module = OwnLM(tiled=tiled, tied=tied)
    shape, tiling = ModelShape.from_module(module)
    assert (shape.hidden_size, shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim) == (
        48, 2, 4, 2, 16)
    assert (shape.intermediate_size, shape.mlp_projections, shape.vocab_size, shape.tied_embeddings) == (
        80, 1, 96, tied)
    assert shape.norm_extras == 0  # LayerNorms
    assert shape.num_params == sum(p.numel() for p in module.parameters())  # the tied weight once
    assert shape.num_params == 96 * 48 + 2 * shape.block_params + 2 * 48 + (0 if tied else 96 * 48 + 96)
    assert shape.block_params == 48 * 64 * 2 + 48 * 32 * 2 + 2 * 48 * 80 + 80 + 48 + 2 * 2 * 48
    assert tiling == {"mlp_tiled": tiled, "loss_tiled": False}  # no loss_tiles anywhere: full logits
    module.model.loss_tiles = None  # a declared, automatic loss tiling
    assert ModelShape.from_module(module)[1]["loss_tiled"]
    # the estimate follows head_dim, not hidden / heads: q, k, v and out are 4 x 16 and 2 x 16 wide, not 48 and 24
    narrow = dataclasses.replace(shape, head_dim=12)
    assert estimate(shape, 512).saved_activations > estimate(narrow, 512).saved_activations


def test_each_feature_lowers_the_device_peak() -> None:
    seq = 1 << 17
    plain = estimate(SHAPE, seq, EstimateOptions(sequence_parallel_size=4))
    tiled = EstimateOptions(sequence_parallel_size=4, chunk_size=1 << 14, mlp_tiled=True, loss_tiled=True)
    chunked = estimate(SHAPE, seq, tiled)
    ckpt = estimate(SHAPE, seq, tiled.replace(activation_checkpointing=True))
    offloaded = estimate(SHAPE, seq, tiled.replace(activation_checkpointing=True, offload=True,
                                                   offload_checkpoints=True))
    assert plain.device_peak > chunked.device_peak > ckpt.device_peak > offloaded.device_peak
    assert offloaded.host > 0 and plain.host == 0
    # saved activations grow linearly with the sequence; parameters do not depend on it
    double = estimate(SHAPE, 2 * seq, EstimateOptions(sequence_parallel_size=4))
    assert double.parameters == plain.parameters
    assert double.saved_activations == pytest.approx(2 * plain.saved_activations, rel=0.01)


def test_auto_chunk_size_fits_the_budget_or_refuses() -> None:
    seq = 1 << 16
    options = EstimateOptions(sequence_parallel_size=2, activation_checkpointing=True, mlp_tiled=True,
                              loss_tiled=True)
    whole = estimate(SHAPE, seq, options).device_peak
    assert auto_chunk_size(SHAPE, seq, whole + 1, options) is None  # one chunk fits
    budget = whole - 1
    chunk = auto_chunk_size(SHAPE, seq, budget, options)
    assert chunk is not None and chunk % 2 == 0 and chunk < seq
    assert estimate(SHAPE, seq, options.replace(chunk_size=chunk)).device_peak <= budget
    with pytest.raises(
        ValueError, match=r"chunk_size='auto': nothing fits a budget of 102.4 MiB per rank at 65536 tokens"
    ):
        auto_chunk_size(SHAPE, seq, int(0.1 * 2**30), options)


def test_estimate_options_follow_the_strategys_rules() -> None:
    """A YAML's strategy section and the strategy itself give one EstimateOptions: ``"auto"`` sequence-parallel
    size is the strategy's own rule (the processes of a node), only ``True`` offload frees device memory."""
    init = {"chunk_size": 64, "offload": "emulate", "activation_checkpointing": True, "offload_checkpoints": True,
            "shard_parameters": True}
    config = {"trainer": {"devices": 4, "num_nodes": 2, "precision": "bf16-mixed",
                          "strategy": {"class_path": "lightning_fpdt.FPDTStrategy", "init_args": init}},
              "data": {"init_args": {"batch_size": 3}}}
    strategy = FPDTStrategy(**init)
    strategy.num_nodes, strategy.parallel_devices = 2, [torch.device("cpu")] * 4
    from_yaml = EstimateOptions.from_yaml(config, mlp_tiled=True)
    assert from_yaml == strategy.estimate_options.replace(batch_size=3, precision="bf16-mixed", mlp_tiled=True)
    assert (strategy.sequence_parallel_size, strategy.data_parallel_size) == (4, 2)
    assert (from_yaml.sequence_parallel_size, from_yaml.data_parallel_size, from_yaml.chunk_size) == (4, 2, 64)
    assert (from_yaml.offload, from_yaml.offload_checkpoints, from_yaml.shard_parameters) == (False, True, True)
    with pytest.raises(ValueError, match=r"estimate needs a chunk size: resolve chunk_size='auto'"):
        estimate(SHAPE, 1024, EstimateOptions(chunk_size="auto"))
    with pytest.raises(ValueError, match=r"precision='fp8' is not one of"):
        EstimateOptions(precision="fp8")


def test_ddp_gradient_buckets_are_views_by_default_and_counted_when_not() -> None:
    """``FPDTStrategy`` passes ``gradient_as_bucket_view=True`` to DDP unless told otherwise; the estimate counts
    DDP's buckets (a second copy of the gradients) only when they are not views, and never under FSDP2."""
    assert FPDTStrategy()._ddp_kwargs["gradient_as_bucket_view"] is True
    assert FPDTStrategy().estimate_options.gradient_as_bucket_view is True
    copies = FPDTStrategy(gradient_as_bucket_view=False)
    assert copies._ddp_kwargs["gradient_as_bucket_view"] is False
    assert copies.estimate_options.gradient_as_bucket_view is False
    yaml_init = {"trainer": {"strategy": {"init_args": {"gradient_as_bucket_view": False}}}}
    assert EstimateOptions.from_yaml(yaml_init).gradient_as_bucket_view is False
    gradient_bytes = SHAPE.num_params * 4
    for sharded, extra in ((False, gradient_bytes), (True, 0)):
        views, buckets = (estimate(SHAPE, 1024, EstimateOptions(shard_parameters=sharded, gradient_as_bucket_view=v))
                          for v in (True, False))
        assert buckets.device_peak - views.device_peak == extra, sharded
        assert buckets.gradients - views.gradients == extra, sharded


def _measured_and_estimated(rank: int, world: int, seq: int, full: bool, model: str = "llama") -> tuple[int, int]:
    """One training step of a small Llama (``model="own_model"``: an :class:`OwnLM`, whose loss is never tiled;
    ``"hf"``: ``HFCausalLM`` around a transformers Llama of the same shape) at sp=``world``: measured peak of
    live tensors (parameters, gradients, AdamW state and activations) and the estimator's device peak, for the
    shape and tiling :meth:`ModelShape.from_module` reads."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, mlp_tiles=None if full else 1)
    loss_tiles = None if full else 1
    if model == "own_model":
        module: Any = OwnLM(vocab=1024, hidden=128, heads=4, kv_heads=2, head_dim=48, inner=352, tiled=full)
    elif model == "hf":
        module = HFCausalLM(transformers.LlamaConfig(
            vocab_size=config.vocab_size, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2), mlp_tiles=config.mlp_tiles, loss_tiles=loss_tiles)
    else:
        module = LlamaLM(config, loss_tiles=loss_tiles)
    shape, tiling = ModelShape.from_module(module)
    assert tiling == {"mlp_tiled": full, "loss_tiled": full and model != "own_model"}
    return _measured_step(module, shape, tiling, rank, world, seq, full)


def _measured_step(module: Any, shape: ModelShape, tiling: dict[str, bool], rank: int, world: int, seq: int,
                   full: bool, keep: bool = False) -> tuple[int, int]:
    """The measured peak of live tensors of one training step of ``module`` at sp=``world`` (chunks of a quarter
    of the sequence and checkpointing when ``full``, else plain Ulysses; ``keep``: recomputed layers keep their
    attention answers), and the estimate's device peak."""
    chunk = seq // 4 if full else None
    context = SequenceParallelContext(group=dist.group.WORLD, chunk_size=chunk, attention_backend="sdpa",
                                      activation_checkpointing=full, keep_attention=keep)
    bind(module, context)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    ids = torch.randint(0, shape.vocab_size, (1, seq), generator=torch.Generator().manual_seed(seq))
    batch = shard_batch({"input_ids": ids}, world, rank, chunk)

    measured = training_step_peak(module, batch, optimizer)
    estimated = estimate(shape, seq, EstimateOptions(sequence_parallel_size=world, chunk_size=chunk,
                                                     activation_checkpointing=full, keep_attention=keep,
                                                     **tiling)).device_peak
    return measured, estimated


def _kept_answers_step(rank: int, world: int, seq: int, keep: bool) -> tuple[int, int]:
    torch.manual_seed(0)
    module = LlamaLM(LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=352, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, mlp_tiles=None), loss_tiles=None)
    shape, tiling = ModelShape.from_module(module)
    return _measured_step(module, shape, tiling, rank, world, seq, True, keep)


@pytest.mark.distributed
def test_estimate_counts_the_kept_attention_answers() -> None:
    """Attention answers kept on the device (no offload) for four checkpointed layers at sp=2: the measured peak with
    them matches the estimate with them, and what they add is what the estimate says they add."""
    seq = 4096
    kept = run_on_ranks(_kept_answers_step, 2, seq, True)[0]
    recomputed = run_on_ranks(_kept_answers_step, 2, seq, False)[0]
    assert abs(kept[1] / kept[0] - 1) <= 0.15, (kept[0] / 2**20, kept[1] / 2**20)
    added, estimated_added = kept[0] - recomputed[0], kept[1] - recomputed[1]
    assert estimated_added > 0 and abs(added / estimated_added - 1) <= 0.3, (added / 2**20, estimated_added / 2**20)


@pytest.mark.distributed
@pytest.mark.parametrize("model", ["llama", "own_model", "hf"])
@pytest.mark.parametrize("full", [False, True], ids=["ulysses", "chunked_tiled_checkpointed"])
def test_estimate_matches_a_measured_step_at_two_lengths(full: bool, model: str) -> None:
    for seq in (1024, 4096):
        measured, estimated = run_on_ranks(_measured_and_estimated, 2, seq, full, model)[0]
        assert abs(estimated / measured - 1) <= 0.15, (seq, measured / 2**20, estimated / 2**20)


def _measured_with_gradients(rank: int, world: int, variant: str) -> tuple[int, int]:
    """A step whose peak is a checkpointed layer's backward late in the backward, with most gradients made: an
    ``HFCausalLM`` heavy in parameters (8 layers, intermediate 2048, hidden 128) at 1024 tokens per rank, sp=2.
    ``variant``: ``untiled`` / ``tiled`` MLP with replicated parameters, or ``fsdp`` / ``fsdp_bf16`` (FSDP2 per
    layer, as the strategy shards, in float32 or bf16-mixed). Measured peak of live tensors and the estimate."""
    torch.manual_seed(0)
    module = HFCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2), mlp_tiles=1 if variant == "untiled" else None, loss_tiles=None)
    shape, tiling = ModelShape.from_module(module)
    seq, chunk = 2048, 512
    bind(module, SequenceParallelContext(group=dist.group.WORLD, chunk_size=chunk, attention_backend="sdpa",
                                         activation_checkpointing=True))
    sharded, precision = variant.startswith("fsdp"), "bf16-mixed" if variant == "fsdp_bf16" else "32-true"
    if sharded:
        shard_module(module, init_device_mesh("cpu", (world,)), precision, offload_optimizer=False)
        register_fsdp_forward_method(module, "loss_terms")
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    ids = torch.randint(0, shape.vocab_size, (1, seq), generator=torch.Generator().manual_seed(seq))
    batch = shard_batch({"input_ids": ids}, world, rank, chunk)
    measured = training_step_peak(module, batch, optimizer, reduce_gradients=not sharded,
                                  bf16=precision == "bf16-mixed", resizable=sharded)
    options = EstimateOptions(sequence_parallel_size=world, chunk_size=chunk, activation_checkpointing=True,
                              shard_parameters=sharded, precision=precision, **tiling)
    return measured, estimate(shape, seq, options).device_peak


@pytest.mark.distributed
@pytest.mark.parametrize("variant", ["untiled", "tiled", "fsdp", "fsdp_bf16"])
def test_estimate_counts_the_gradients_made_during_backward(variant: str) -> None:
    """Where a layer's recomputation sets the peak late in the backward, the gradients made so far (and under
    FSDP2 the unsharded gradients of the output projection and of a layer) are part of it: without them the
    estimate was 0.79-0.91x of the measured peak here."""
    measured, estimated = run_on_ranks(_measured_with_gradients, 2, variant)[0]
    print(f"{variant}: measured {measured / 2**20:.1f} MiB, estimate {estimated / 2**20:.1f} MiB"
          f" ({estimated / measured:.2f}x)")  # the table of docs/performance.md (pytest -s)
    assert 0.98 <= estimated / measured <= 1.1, (variant, measured / 2**20, estimated / 2**20)


class _PeakOfStep(L.Callback):
    """Rank 0's picked chunk size and peak of live tensors over the first training step."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.tracker = TensorMemoryTracker().__enter__()
        self.tracker.track(*pl_module.parameters())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.tracker.__exit__(None, None, None)
        if trainer.global_rank == 0 and batch_idx == 0:
            torch.save({"peak": self.tracker.peak_bytes, "chunk_size": trainer.strategy.chunk_size,
                        "budget": trainer.strategy.memory_budget_bytes}, self.out)


# attention-heavy (small MLP, no GQA) so that the chunk size decides the peak
AUTO_CONFIG = LlamaConfig.tiny(num_attention_heads=4, num_key_value_heads=4, hidden_size=64, intermediate_size=32,
                               vocab_size=64)
AUTO_OPTIONS = EstimateOptions(batch_size=2, sequence_parallel_size=2, activation_checkpointing=True, mlp_tiled=True,
                               loss_tiled=True, precision="64-true", attention_backend="sdpa")
# the same for a user's own model, with wider heads (head_dim 32, not 64 / 4)
AUTO_MODELS = {"llama": lambda: LlamaLM(AUTO_CONFIG),
               "own_model": lambda: OwnLM(vocab=64, hidden=64, heads=4, kv_heads=4, head_dim=32, inner=32),
               # a transformers Llama of AUTO_CONFIG's shape (sized from its decoder layers)
               "hf": lambda: HFCausalLM(transformers.LlamaConfig(
                   vocab_size=64, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=4))}


def _fit_auto(budget_gib: float, tmp_path, module: L.LightningModule | None = None) -> dict:
    out = str(tmp_path / "auto.pt")
    trainer = L.Trainer(
        accelerator="cpu", devices=2, precision="64-true", max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[_PeakOfStep(out)],
        strategy=FPDTStrategy(sequence_parallel_size=2, chunk_size="auto", memory_budget=budget_gib,
                              activation_checkpointing=True, attention_backend="sdpa", start_method="fork"),
    )
    module = module or LlamaLM(AUTO_CONFIG)
    trainer.fit(module, dataloader(TokenDataset(2, 256, ModelShape.from_module(module)[0].vocab_size, seed=0), 2))
    return torch.load(out)


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("model", sorted(AUTO_MODELS))
def test_auto_chunk_size_in_training_fits_the_budget(model: str, tmp_path) -> None:
    module = AUTO_MODELS[model]()
    shape, tiling = ModelShape.from_module(module)
    assert tiling == {"mlp_tiled": True, "loss_tiled": model != "own_model"}  # the own model's loss is not tiled
    peak = {c: estimate(shape, 256, AUTO_OPTIONS.replace(chunk_size=c, **tiling)).device_peak for c in (128, 64)}
    budget = (peak[128] + peak[64]) / 2  # 128-token chunks do not fit, 64-token chunks do
    result = _fit_auto(budget / 2**30, tmp_path, module)
    assert result["chunk_size"] == 64
    assert result["budget"] == int(budget)
    assert result["peak"] <= budget, (result["peak"], budget)  # measured, not estimated


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_auto_chunk_size_refuses_when_nothing_fits(tmp_path) -> None:
    with pytest.raises(Exception, match=r"FPDTStrategy: chunk_size='auto': nothing fits a budget of 1 KiB per rank"
                                        r" at 256 tokens; the smallest chunk \(2\) still needs 2.7 MiB"):
        _fit_auto(1024 / 2**30, tmp_path)


def _with_blocks(blocks: nn.ModuleList) -> OwnDecoder:
    model = OwnDecoder()
    model.blocks = blocks
    return model


def test_auto_needs_a_model_it_can_size_and_sane_options() -> None:
    with pytest.raises(ValueError, match="Linear has no FPDTBlock and no Hugging Face decoder layer .*, so its"
                                         " memory cannot be estimated.*explicit chunk_size"):
        ModelShape.from_module(torch.nn.Linear(2, 2))
    blocks = OwnDecoder().blocks
    with pytest.raises(ValueError, match=r"ModuleList has neither an output projection \(an nn.Linear from"
                                         r" hidden_size=48 .*nor a token embedding.*explicit chunk_size"):
        ModelShape.from_module(blocks)
    blocks[1].mlp = TiledMLP(GeluMLP(48, 96))
    with pytest.raises(ValueError, match=r"OwnDecoder: its decoder layers differ in shape .*intermediate, MLP"
                                         r" projections, experts per token: \[\(80, 1, 1\), \(96, 1, 1\)\].*explicit"
                                         r" chunk_size"):
        ModelShape.from_module(_with_blocks(blocks))
    blocks[1].mlp = nn.GELU()
    with pytest.raises(
        ValueError, match=r"blocks\.1: its MLP \(GELU\) has no nn.Linear back to hidden_size=48.*explicit"
    ):
        ModelShape.from_module(_with_blocks(blocks))
    with pytest.raises(TypeError, match="shape_from_config takes a LlamaConfig or GPTConfig, got dict; .*from_module"):
        shape_from_config({"hidden_size": 64})
    shape, tiling = ModelShape.from_module(LlamaLM(AUTO_CONFIG))
    assert shape == shape_from_config(AUTO_CONFIG) and tiling == {"mlp_tiled": True, "loss_tiled": True}
    with pytest.raises(ValueError, match="memory_budget=4 only applies to chunk_size='auto', but chunk_size=64"):
        FPDTStrategy(chunk_size=64, memory_budget=4)
    with pytest.raises(ValueError, match="memory_budget must be a positive number of GiB, got -1"):
        FPDTStrategy(chunk_size="auto", memory_budget=-1)
    with pytest.raises(ValueError, match="chunk_size must be a positive int, None or 'auto', got 'big'"):
        FPDTStrategy(chunk_size="big")


def test_memory_cli_builds_the_yaml_model_on_the_meta_device(tmp_path, capsys) -> None:
    """``python -m lightning_fpdt.memory --config`` reads any model the YAML names, here a user's own."""
    shape, tiling = ModelShape.from_module(OwnLM(vocab=96, tied=True))
    # "emulate" offload: nothing leaves the device
    options = EstimateOptions(batch_size=2, sequence_parallel_size=2, activation_checkpointing=True, **tiling)
    whole = estimate(shape, 4096, options).device_peak
    budget = (whole + estimate(shape, 4096, options.replace(chunk_size=1024)).device_peak) / 2 / 2**30  # must chunk
    strategy = {"sequence_parallel_size": 2, "chunk_size": "auto", "memory_budget": budget, "offload": "emulate",
                "activation_checkpointing": True}
    config = {"model": {"class_path": "tests.test_memory_model.OwnLM", "init_args": {"vocab": 96, "tied": True}},
              "trainer": {"devices": 2, "strategy": {"init_args": strategy}},
              "data": {"init_args": {"seq_len": 4096, "batch_size": 2}}}
    (tmp_path / "own.yaml").write_text(yaml.safe_dump(config))
    main(["--config", str(tmp_path / "own.yaml")])
    out = capsys.readouterr().out
    chunk = auto_chunk_size(shape, 4096, int(budget * 2**30), options)
    assert chunk is not None and chunk < 4096
    assert f"memory estimate per rank: {shape.num_params / 1e6:.1f}M parameters, seq_len 4096, batch_size=2," in out
    assert "offload=False" in out and "mlp_tiled=True, loss_tiled=False" in out
    assert f"chunk_size='auto' with a budget of {budget} GiB per rank picks {chunk}" in out
    assert estimate(shape, 4096, options.replace(chunk_size=chunk)).table() in out


def test_memory_cli_sizes_a_hugging_face_checkpoint_from_its_config(tmp_path, capsys) -> None:
    """The HF GPU example (Llama-3-8B at 1M tokens, the whole memory stack) is sized from the checkpoint's
    config.json alone (no weights are read), like the own LlamaLM of the same shape in llama3_8b_1m.yaml."""
    checkpoint = tmp_path / "Meta-Llama-3-8B"
    transformers.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                             num_attention_heads=32, num_key_value_heads=8).save_pretrained(checkpoint)
    assert [p.name for p in checkpoint.iterdir()] == ["config.json"]
    config = yaml.safe_load(open("examples/configs/hf_llama_gpu.yaml"))
    config["model"]["init_args"]["model"] = str(checkpoint)
    (tmp_path / "hf.yaml").write_text(yaml.safe_dump(config))
    main(["--config", str(tmp_path / "hf.yaml")])
    hf = capsys.readouterr().out
    main(["--config", "examples/configs/llama3_8b_1m.yaml"])
    own = capsys.readouterr().out
    assert "memory estimate per rank: 8030.3M parameters, seq_len 1048576" in hf, hf
    assert "chunk_size=65536" in hf and "mlp_tiled=True, loss_tiled=True" in hf and "offload_checkpoints=True" in hf

    def peak(out: str) -> float:
        return float(next(line for line in out.splitlines() if line.startswith("device peak")).split()[2])

    # the same run: both models' layers stream, q/k/v projected chunk by chunk (transformers' layers too); the
    # transformers model's rotary cos/sin of every local token (128K x 2 x 128 x 2 bytes: 64 MiB) is the difference
    assert 1.0 < peak(hf) / peak(own) < 1.01, (hf, own)


def test_the_70b_plan_is_sized_from_its_config_json_alone(capsys) -> None:
    """examples/configs/llama3_70b holds Llama-3.1-70B's published config.json and nothing else; the memory CLI
    sizes llama3_70b_4m.yaml from it, and the YAML's header and docs/hf-models.md quote what it prints."""
    directory = Path("examples/configs/llama3_70b")
    assert [p.name for p in directory.iterdir()] == ["config.json"]
    config = transformers.AutoConfig.from_pretrained(directory)
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.vocab_size, config.max_position_embeddings) == (
        8192, 28672, 80, 64, 8, 128256, 131072)
    assert config.rope_parameters == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                                      "rope_theta": 500000.0}
    assert (config.rms_norm_eps, config.tie_word_embeddings) == (1e-5, False)
    main(["--config", "examples/configs/llama3_70b_4m.yaml"])
    out = capsys.readouterr().out
    assert "memory estimate per rank: 70553.7M parameters, seq_len 4194304" in out, out
    assert "sequence_parallel_size=32, data_parallel_size=1" in out and "shard_parameters=True" in out, out
    rows = {line[:24].strip(): line[24:].strip() for line in out.splitlines()[1:]}
    device, host = rows["device peak"], rows["host (pinned)"]
    header = Path("examples/configs/llama3_70b_4m.yaml").read_text()
    assert f"gives a device peak of {device} and {host} of pinned host memory per rank" in header, (device, host)
    docs = Path("docs/hf-models.md").read_text()
    assert f"**Device: {device} per rank**" in docs and f"**Pinned host memory: {host} per rank**" in docs


def _tiled_module(model: str, tiles: int) -> nn.Module:
    if model == "hf":
        config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2)
        return HFCausalLM(config, mlp_tiles=tiles, loss_tiles=tiles)
    return LlamaLM(LlamaConfig.tiny(mlp_tiles=tiles), loss_tiles=tiles)


@pytest.mark.parametrize("model", ["llama", "hf"])
@pytest.mark.parametrize("tiles", [2, 5, 16])  # not 3: the automatic count of the MLP here
def test_explicit_tile_counts_change_the_estimate_as_the_tiling_rule_says(model: str, tiles: int) -> None:
    """The memory model reads the configured tile counts (``TiledMLP.num_tiles`` / ``HFCausalLM.mlp_tiles``,
    ``loss_tiles``) and sizes a tile with tiling.py's own rule: an explicit count moves the estimate by exactly
    the difference between its largest tile and the automatic one's."""
    shape, tiling = ModelShape.from_module(_tiled_module(model, tiles))
    assert (shape.mlp_tiles, shape.loss_tiles) == (tiles, tiles)
    assert tiling == {"mlp_tiled": True, "loss_tiled": True}
    seq, batch, e = 3000, 2, 4  # 32-true: 4 bytes per activation
    t = batch * seq  # tokens of the one rank; the loss tiles them all, the MLP each sample's sequence
    # the loss (no checkpointing: it sets the transient): one float32 [tile, vocab] tensor, the logits overwritten
    # by their softmax
    options = EstimateOptions(batch_size=batch, mlp_tiled=True, loss_tiled=True)
    auto_loss = dataclasses.replace(shape, loss_tiles=None)
    moved = estimate(shape, seq, options).peak_transient - estimate(auto_loss, seq, options).peak_transient
    assert largest_tile(t, tiles) != largest_tile(t, None)
    assert moved == 4 * shape.vocab_size * (largest_tile(t, tiles) - largest_tile(t, None))
    # the MLP (a checkpointed layer's recomputation sets the transient, with an intermediate wide enough to
    # outweigh the attention's working set): one tile's intermediates and their gradients; for a layer recomputed
    # whole, whose tiles cut the local sequence (a streamed layer's cut its chunk)
    options = options.replace(activation_checkpointing=True, chunk_size=64, streaming=False)
    shape = dataclasses.replace(shape, intermediate_size=8 * shape.intermediate_size)
    auto_mlp = dataclasses.replace(shape, mlp_tiles=None)
    moved = estimate(shape, seq, options).peak_transient - estimate(auto_mlp, seq, options).peak_transient
    tile, auto_tile = (largest_tile(seq, n, mlp_tile_tokens(shape.hidden_size)) for n in (tiles, None))
    assert tile != auto_tile
    assert moved == (shape.mlp_intermediates + 2 * shape.intermediate_size) * batch * (tile - auto_tile) * e


def test_experts_count_every_weight_and_each_routed_expert_activations() -> None:
    """Mixtral's fused 3-D experts (gate_up [E, 2I, H], down [E, H, I]): every expert's weights are parameters,
    and a token keeps one expert MLP's intermediates per expert it is routed to (top_k)."""
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, sliding_window=None)
    module = HFCausalLM(config, mlp_tiles=1)
    shape, tiling = ModelShape.from_module(module)
    experts = 4 * (2 * 24 * 32 + 32 * 24)  # gate_up and down of every expert, per layer
    assert (shape.intermediate_size, shape.mlp_projections, shape.experts_per_token) == (24, 2, 2)
    assert shape.num_params == sum(p.numel() for p in module.parameters())
    assert shape.block_params >= experts and shape.mlp_intermediates == 2 * 2 * 24 * 2
    dense = dataclasses.replace(shape, experts_per_token=1)
    options = EstimateOptions(chunk_size=None, mlp_tiled=False)
    more = estimate(shape, 256, options).saved_activations - estimate(dense, 256, options).saved_activations
    per_value = PRECISION_BYTES[options.precision][1]  # one more routed expert's values per token, every layer
    assert more == 2 * options.batch_size * 256 * dense.mlp_intermediates * per_value > 0


HYBRID_SHAPES: dict[str, dict[str, Any]] = {  # 4 layers each, hidden 128
    "qwen3_5_text": dict(layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=2,
                         linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
                         intermediate_size=352, head_dim=32),
    "nemotron_h": dict(hybrid_override_pattern="M-M*", mamba_num_heads=4, mamba_head_dim=32, ssm_state_size=16,
                       n_groups=2, chunk_size=64, expand=1, intermediate_size=352, head_dim=32),
}


def _hybrid_measured_and_estimated(rank: int, world: int, seq: int, full: bool, family: str) -> tuple[int, int]:
    """One training step of a small hybrid (Qwen3.5's gated delta-nets, Nemotron-H's Mamba-2 mixers, mixer-only,
    MLP-only and attention-only layers) at sp=``world``, as :func:`_measured_and_estimated` measures it."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(family, vocab_size=1024, hidden_size=128, num_hidden_layers=4,
                                               num_attention_heads=4, num_key_value_heads=2, **HYBRID_SHAPES[family])
    module = HFCausalLM(config, mlp_tiles=None if full else 1, loss_tiles=None if full else 1)
    shape, tiling = ModelShape.from_module(module)
    return _measured_step(module, shape, tiling, rank, world, seq, full)


@pytest.mark.distributed
@pytest.mark.parametrize("family", list(HYBRID_SHAPES))
@pytest.mark.parametrize("full", [False, True], ids=["ulysses", "chunked_tiled_checkpointed"])
def test_estimate_of_a_hybrid_matches_a_measured_step_at_two_lengths(full: bool, family: str) -> None:
    """The gated delta-net and Mamba-2 layers' chunk inputs, conv windows, states and kernel buffers counted
    (``lightning_fpdt.hf.recurrent_memory.RecurrenceMemory``), with layers of different kinds."""
    for seq in (1024, 2048):
        measured, estimated = run_on_ranks(_hybrid_measured_and_estimated, 2, seq, full, family)[0]
        print(f"{family} full={full} seq={seq}: measured {measured / 2**20:.1f} MiB, estimate/measured"
              f" {estimated / measured:.3f}")
        assert abs(estimated / measured - 1) <= 0.15, (seq, measured / 2**20, estimated / 2**20)


def test_memory_cli_flags_replace_the_yaml_s_run_settings(capsys) -> None:
    """With --config a run flag given replaces the YAML's value (they were silently ignored: "what if the sequence
    doubles" read the YAML's run); model sizes are refused with it (the YAML's model is sized), a missing file and
    a chunk the ranks cannot split are one line each."""
    main(["--config", "examples/configs/tiny_cpu.yaml", "--seq", "4096", "--batch", "1", "--chunk-size", "256",
          "--checkpointing", "--precision", "bf16-mixed", "--sp", "4"])
    head = capsys.readouterr().out.splitlines()[0]
    for part in ("seq_len 4096", "batch_size=1", "chunk_size=256", "sequence_parallel_size=4",
                 "activation_checkpointing=True", "precision=bf16-mixed"):
        assert part in head, (part, head)
    main(["--config", "examples/configs/tiny_cpu.yaml"])  # nothing given: the YAML's run
    head = capsys.readouterr().out.splitlines()[0]
    assert "seq_len 256, batch_size=32, chunk_size=128, sequence_parallel_size=2" in head, head
    for argv, message in [
        (["--hidden", "64"], r"--hidden: the sizes of a Llama without --config; with --config the YAML's model is"),
        (["--sp", "3"], r"chunk_size=128 is not divisible by 6 \(sequence_parallel_size=3, ring_size=3\)"),
    ]:
        with pytest.raises(SystemExit, match=message):
            main(["--config", "examples/configs/tiny_cpu.yaml", *argv])
    with pytest.raises(SystemExit, match=r"--config 'nope.yaml' cannot be read \(No such file or directory\)"):
        main(["--config", "nope.yaml"])
