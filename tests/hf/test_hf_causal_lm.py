"""``HFCausalLM``: Hugging Face causal LMs trained under FPDT equal plain transformers in one process.

The oracle is the plain transformers model with the same weights in float64, ``attn_implementation="sdpa"``
(or, for families without sdpa such as Gemma-2 and gpt-oss, an eager attention in float64 registered as
``float64_reference`` with transformers' own eager masks: transformers' ``eager`` computes its softmax in float32,
about 1e-8 off), the logits of
its own forward (softcapped where the family is) and the mean cross-entropy over the same targets computed
here in float64; HF's own loss is not used. Weights are redrawn with std ``1/sqrt(fan_in)`` (norm weights
around 1 with noise, biases small) so a wrong scale, rotary fraction or mask cannot hide.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import lightning as L
import pytest
import torch
import torch.nn.functional as F
import transformers
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import Dataset
from transformers import (
    AttentionInterface,
    AttentionMaskInterface,
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    Olmo2Config,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)
from transformers.masking_utils import eager_mask
from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

from lightning_fpdt import FPDTStrategy
from lightning_fpdt.callbacks import FPDTMonitor
from lightning_fpdt.errors import FPDTError
from lightning_fpdt.hf.attention import ATTN_IMPLEMENTATION
from lightning_fpdt.models import HFCausalLM
from lightning_fpdt.parallel.binding import SequenceParallelContext, attention_records
from tests.helpers import CaptureStep, TokenDataset, assert_same_step, dataloader, step_errors

VOCAB, SEQ, HEADS = 64, 32, 4
SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=HEADS)
FULL = ["full_attention", "full_attention"]


def _config(family: str, kv_heads: int = 2, **overrides: Any) -> PretrainedConfig:
    """A tiny random config of ``family`` with full causal attention in every layer (unless overridden); the
    released forms, windows and softcaps on, are in ``tests/hf/test_hf_families.py``."""
    gqa = dict(SIZES, num_key_value_heads=kv_heads)
    configs: dict[str, Callable[[], PretrainedConfig]] = {
        "llama": lambda: LlamaConfig(**gqa),
        "qwen2": lambda: Qwen2Config(**gqa),
        "qwen3": lambda: Qwen3Config(head_dim=8, **gqa),  # q/k norms
        "mistral": lambda: MistralConfig(sliding_window=None, **gqa),
        "phi3": lambda: Phi3Config(pad_token_id=0, **gqa),  # fused qkv and gate_up projections
        "olmo2": lambda: Olmo2Config(**gqa),  # q/k norms over all heads, post-norms
        # partial rotary (half of each head), parallel residual; multi-head only
        "gpt_neox": lambda: GPTNeoXConfig(rotary_pct=0.5, use_parallel_residual=True, **SIZES),
        # final-logit softcapping (the loss applies it); attention softcapping off, no sliding layer (Gemma-2's
        # mask code, run by the float64 reference, needs sliding_window set even then)
        "gemma2": lambda: Gemma2Config(head_dim=8, attn_logit_softcapping=None, final_logit_softcapping=3.0,
                                       sliding_window=512, layer_types=FULL, query_pre_attn_scalar=16, **gqa),
        # no sliding layer (transformers' own mask code needs sliding_window set even then)
        "gemma3": lambda: Gemma3TextConfig(head_dim=8, sliding_window=512, layer_types=FULL,
                                           query_pre_attn_scalar=16, **gqa),
    }
    config = configs[family]()
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def _norm_in_input_dtype(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return self._norm(x) * (1.0 + self.weight)  # Gemma's maths without its float32 cast


@pytest.fixture(autouse=True)
def gemma_norms_in_float64(monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma's RMSNorm computes in float32 even for float64 inputs, including the weight gradient (a sum over
    tokens): any other grouping of the tokens (per rank, per sample) changes it by ~1e-8, a property of the
    model, not of FPDT. The same maths in the input's dtype, on both sides (forked workers inherit it)."""
    monkeypatch.setattr(Gemma2RMSNorm, "forward", _norm_in_input_dtype)
    monkeypatch.setattr(Gemma3RMSNorm, "forward", _norm_in_input_dtype)


def _redraw(model: torch.nn.Module, seed: int) -> None:
    """Matrices std 1/sqrt(fan_in); norm weights 1 + noise; biases small noise (all in place)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)
            if p.dim() >= 2:
                p.copy_(noise / p.shape[-1] ** 0.5)
            elif "norm" in name:
                p.copy_(1 + 0.1 * noise)
            else:
                p.copy_(0.1 * noise)


def _reference_attention(
    module: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: torch.Tensor,
    scaling: float, softcap: float | None = None, **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Eager attention in the input's dtype (transformers' ``eager`` softmaxes in float32): ``[b, h, s, d]`` in,
    ``[b, s, h, d]`` out. The mask is transformers' own (``eager_mask``: causal, with the sliding window of a
    sliding layer, as the model's mask code builds it), so the window is not read from the call's kwarg the FPDT
    path reads; softcapping as Gemma-2's eager applies it (before the mask); sinks as gpt-oss's eager reads
    them (the layer's ``sinks`` joins each row's softmax, then is dropped)."""
    b, h, s, _ = q.shape
    k = k.repeat_interleave(h // k.shape[1], dim=1)
    v = v.repeat_interleave(h // v.shape[1], dim=1)
    scores = q @ k.transpose(2, 3) * scaling  # [b, h, s, s]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores + attention_mask  # [b, 1, s, s]: 0 where attended, the dtype's minimum elsewhere
    sinks = getattr(module, "sinks", None)
    if sinks is not None:
        scores = torch.cat([scores, sinks.reshape(1, h, 1, 1).expand(b, h, s, 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., :s]
    return (probs @ v).transpose(1, 2), None


AttentionMaskInterface.register("float64_reference", eager_mask)
AttentionInterface.register("float64_reference", _reference_attention)


def _plain(module: HFCausalLM) -> torch.nn.Module:
    """The same weights in a plain transformers model (float64) with its own config copy."""
    config = copy.deepcopy(module.model.config)
    attention = "sdpa" if type(module.model)._supports_sdpa else "float64_reference"
    ref = AutoModelForCausalLM.from_config(config, attn_implementation=attention, dtype=torch.float64)
    ref.double()  # parameters a family makes in float32 whatever the default dtype (DeepSeek-style routers)
    ref.load_state_dict(module.model.state_dict())
    with torch.no_grad():  # non-persistent buffers too: RoPE's inv_freq, made in float32 in the module
        buffers = dict(ref.named_buffers())
        for name, buffer in module.model.named_buffers():
            buffers[name].copy_(buffer)
    return ref


def _mean_ce(ref: torch.nn.Module, samples: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, dict]:
    """Mean float64 cross-entropy of ``(ids [1, n], unshifted labels [1, n])`` samples and its gradients,
    keyed by HFCausalLM's parameter names (``model.`` + the transformers name)."""
    loss_sum, count = torch.zeros((), dtype=torch.float64), 0
    for ids, labels in samples:
        logits = ref(input_ids=ids, use_cache=False).logits.double()
        targets = labels[:, 1:]
        loss_sum = loss_sum + F.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(), reduction="sum")
        count += int((targets != -100).sum())
    loss = loss_sum / count
    loss.backward()
    return loss.detach(), {f"model.{n}": p.grad.detach().clone() for n, p in ref.named_parameters()}


@dataclass(frozen=True)
class Case:
    family: str
    sp: int
    chunk_size: int | None
    kv_heads: int = 2
    offload: bool | Literal["emulate"] = False
    stack: bool = False  # the memory stack: tiled MLP and loss, checkpointing with offload emulation, FSDP2

    @property
    def name(self) -> str:
        return "-".join([self.family, f"sp{self.sp}", f"C{self.chunk_size}", f"kv{self.kv_heads}"]
                        + (["offload"] if self.offload else []) + (["stack"] if self.stack else []))


FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "phi3", "olmo2", "gpt_neox", "gemma2", "gemma3"]


def _kv(family: str, kv_heads: int) -> int:
    return HEADS if family == "gpt_neox" else kv_heads  # GPT-NeoX has multi-head attention only


CASES = [
    # every family: sp=2 with kv heads < sp (GPT-NeoX: multi-head), 4 chunks of 8 tokens, offload emulation
    *[Case(f, sp=2, chunk_size=8, kv_heads=_kv(f, 1), offload="emulate") for f in FAMILIES],
    # every family: sp=4 (kv heads < sp), 2 chunks of 16 tokens
    *[Case(f, sp=4, chunk_size=16, kv_heads=_kv(f, 2)) for f in FAMILIES],
    Case("gemma2", sp=4, chunk_size=None, kv_heads=1),  # plain Ulysses, softcapped logits
    # the memory stack, for a GQA family, one with q/k norms, one with a GeLU MLP and parallel residual, one
    # with a fused gate-up MLP, and Gemma-2's softcapped loss in tiles
    *[Case(f, sp=2, chunk_size=8, kv_heads=_kv(f, 1), offload="emulate", stack=True)
      for f in ("llama", "qwen3", "gpt_neox", "phi3", "gemma2")],
]

MLP_TILES, LOSS_TILES = 3, 5  # uneven tiles of a rank's 16 tokens (2 x 16 for the loss)


def _module(case: Case, seed: int) -> HFCausalLM:
    tiles = dict(mlp_tiles=MLP_TILES, loss_tiles=LOSS_TILES) if case.stack else dict(mlp_tiles=1, loss_tiles=1)
    module = HFCausalLM(_config(case.family, case.kv_heads), learning_rate=1e-3, warmup_steps=1, **tiles)
    _redraw(module.model, seed)
    return module


class CaptureStack(CaptureStep):
    """Also records what the memory stack did: which decoder layers FSDP2 sharded, and the bytes of layer
    inputs this rank's layer input store copied to the host."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        super().on_before_optimizer_step(trainer, pl_module, optimizer)
        store = trainer.strategy._layer_input_store
        self._pending["sharded_layers"] = [isinstance(layer.module, FSDPModule) for layer in pl_module.decoder_layers()]
        self._pending["layer_input_bytes"] = 0 if store is None else store.stats.bytes_to_host


def _fit(module: HFCausalLM, data: Dataset, case: Case, tmp_path, precision: str = "64-true") -> list[dict]:
    stack = dict(activation_checkpointing=True, offload_checkpoints="emulate", shard_parameters=True) if case.stack \
        else {}
    trainer = L.Trainer(
        accelerator="cpu", devices=case.sp, precision=precision, max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[CaptureStack(str(tmp_path))],
        strategy=FPDTStrategy(sequence_parallel_size=case.sp, chunk_size=case.chunk_size, attention_backend="math",
                              offload=case.offload, start_method="fork", ring_size=getattr(case, "ring_size", "auto"),
                              **stack),
    )
    trainer.fit(module, dataloader(data, len(data)))
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(case.sp)]


def each_sample_alone(ref: torch.nn.Module, data: TokenDataset) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The plain model's mean token loss (and gradients) over ``data``'s samples, each run alone."""
    return _mean_ce(ref, [(data.ids[i:i + 1], data.labels[i:i + 1]) for i in range(len(data))])


def one_process_step(module: HFCausalLM, data: TokenDataset) -> dict[str, Any]:
    """``module``'s token-weighted loss over the whole of ``data`` in this process, back-propagated: the result
    ``assert_same_step`` compares."""
    loss_sum, count = module.loss_terms(data.full_batch())
    (loss_sum / count).backward()
    return {"loss": (loss_sum / count).detach(), "grads": {n: p.grad for n, p in module.named_parameters()}}


def _max_error(results: list[dict], loss: torch.Tensor, grads: dict) -> float:
    """The largest relative error (loss, every gradient), as ``assert_same_step`` measures them."""
    return max(err for _, _, err in step_errors(results, loss, grads))


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_fit_step_equals_plain_transformers(case: Case, tmp_path, fresh_seed: int) -> None:
    torch.manual_seed(fresh_seed)
    module = _module(case, fresh_seed)
    ref = _plain(module)
    data = TokenDataset(2, SEQ, VOCAB, fresh_seed)
    results = _fit(module, data, case, tmp_path)
    ref_loss, ref_grads = each_sample_alone(ref, data)
    print(f"{case.name}: max rel. error {_max_error(results, ref_loss, ref_grads):.2e}")
    assert_same_step(results, ref_loss, ref_grads, tol=1e-10, label=f"{case.name} seed={fresh_seed}")
    layers = module.model.config.num_hidden_layers
    for r in results:
        if case.stack:  # every decoder layer sharded; each layer's input [2, 16, 32] float64 went to the host
            assert r["sharded_layers"] == [True] * layers and r["local_numel"] < r["numel"], r["sharded_layers"]
            assert r["layer_input_bytes"] == layers * 2 * (SEQ // case.sp) * SIZES["hidden_size"] * 8
        else:
            assert r["sharded_layers"] == [False] * layers and r["layer_input_bytes"] == 0


@pytest.mark.distributed
def test_bf16_mixed_memory_stack_is_close_to_float64(tmp_path, fresh_seed: int) -> None:
    """The GPU recipe's precision on CPU: bf16 autocast over float32 weights, FSDP2's mixed-precision policy
    (its forward-input casting walks the FPDT context in every decoder layer's kwargs), checkpointed and tiled
    layers. bf16 rounding gives up to about 5% (largest error relative to each gradient's largest element, 5
    seeds: 3.9e-2 to 5.0e-2); a softmax scale off by 1.5x gives 1.0, a dropped gradient 1.0."""
    torch.manual_seed(fresh_seed)
    case = Case("llama", sp=2, chunk_size=8, kv_heads=1, offload="emulate", stack=True)
    module = _module(case, fresh_seed)
    ref = _plain(module)
    data = TokenDataset(2, SEQ, VOCAB, fresh_seed)
    results = _fit(module, data, case, tmp_path, precision="bf16-mixed")
    ref_loss, ref_grads = each_sample_alone(ref, data)
    results = [{**r, "loss": r["loss"].double(), "grads": {n: g.double() for n, g in r["grads"].items()}}
               for r in results]
    error = _max_error(results, ref_loss, ref_grads)
    print(f"bf16-mixed {case.name}: max rel. error {error:.2e}")
    assert all(r["sharded_layers"] == [True, True] for r in results)
    assert error < 0.2, f"bf16-mixed stack vs float64: max rel. error {error:.2e} (seed={fresh_seed})"


PACKING = [[1, 12, 19], [20, 12]]  # one-token document; documents across chunk (8) and rank (16) boundaries


class Packed(Dataset):
    """Packed samples: ``position_ids`` restart at 0 at every document."""

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (len(PACKING), SEQ), generator=g)
        self.pos = torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in PACKING])

    def __len__(self) -> int:
        return len(PACKING)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.ids[i], "position_ids": self.pos[i], "index": i}

    def documents(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        docs = []
        for i, lengths in enumerate(PACKING):
            start = 0
            for n in lengths:
                ids = self.ids[i:i + 1, start:start + n]
                docs.append((ids, ids.clone()))
                start += n
        return docs


@pytest.mark.distributed
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_fit_step_equals_each_document_alone(family: str, tmp_path, fresh_seed: int) -> None:
    torch.manual_seed(fresh_seed)
    case = Case(family, sp=2, chunk_size=8, kv_heads=_kv(family, 2))
    module = _module(case, fresh_seed)
    ref = _plain(module)
    data = Packed(fresh_seed)
    results = _fit(module, data, case, tmp_path)
    ref_loss, ref_grads = _mean_ce(ref, data.documents())
    print(f"packed {case.name}: max rel. error {_max_error(results, ref_loss, ref_grads):.2e}")
    assert_same_step(results, ref_loss, ref_grads, tol=1e-10, label=f"packed {case.name} seed={fresh_seed}")


# ---- one process -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [None, 8])
def test_unbound_one_process_loss_and_grads_equal_plain_transformers(chunk_size: int | None, fresh_seed: int) -> None:
    torch.manual_seed(fresh_seed)
    module = _module(Case("gemma2", sp=1, chunk_size=None), fresh_seed).double()
    if chunk_size is not None:  # bound as the strategy would in one process: 4 chunks
        module.bind_sequence_parallel(SequenceParallelContext(chunk_size=chunk_size, attention_backend="math"))
    ref = _plain(module)
    data = TokenDataset(2, SEQ, VOCAB, fresh_seed)
    result = one_process_step(module, data)
    ref_loss, ref_grads = each_sample_alone(ref, data)
    assert_same_step([result], ref_loss, ref_grads, tol=1e-10, label=f"one process C{chunk_size} seed={fresh_seed}")


class MonitorToFile(FPDTMonitor):
    """FPDTMonitor, then this rank's fpdt/* scalars and attention records saved for the test process."""

    def __init__(self, out_dir: str) -> None:
        super().__init__()
        self.out_dir = out_dir

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("fpdt/")}
        records = [(r.seq_len_local, r.chunks, r.stats.bytes_to_host) for r in attention_records(pl_module)]
        torch.save({"metrics": metrics, "records": records}, Path(self.out_dir) / f"monitor{trainer.global_rank}.pt")


@pytest.mark.distributed
def test_fpdt_monitor_reports_the_hf_attention_layers(tmp_path, fresh_seed: int) -> None:
    """FPDTMonitor's fpdt/* scalars come from each transformers attention layer's latest call too."""
    torch.manual_seed(fresh_seed)
    module = _module(Case("llama", sp=2, chunk_size=8), fresh_seed)
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[MonitorToFile(str(tmp_path))],
                        strategy=FPDTStrategy(sequence_parallel_size=2, chunk_size=8, offload="emulate",
                                              attention_backend="math", start_method="fork"))
    trainer.fit(module, dataloader(TokenDataset(2, SEQ, VOCAB, fresh_seed), 2))
    saved = torch.load(tmp_path / "monitor0.pt")
    assert [(s, c) for s, c, _ in saved["records"]] == [(SEQ // 2, 4), (SEQ // 2, 4)]  # layers 0 and 1
    assert saved["metrics"]["fpdt/seq_len"] == SEQ and saved["metrics"]["fpdt/chunks"] == 4
    moved = sum(b for _, _, b in saved["records"])
    assert moved > 0 and saved["metrics"]["fpdt/offload_bytes_to_host"] == moved


def test_other_models_in_the_process_keep_their_attention(fresh_seed: int) -> None:
    torch.manual_seed(fresh_seed)
    config = _config("llama")
    config._attn_implementation = "sdpa"
    other = AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    ids = torch.randint(0, VOCAB, (1, SEQ))
    before = other(ids).logits
    module = HFCausalLM(config)
    later = AutoModelForCausalLM.from_config(_config("llama"), dtype=torch.float64)
    assert module.model.config._attn_implementation == ATTN_IMPLEMENTATION
    assert other.config._attn_implementation == "sdpa" and config._attn_implementation == "sdpa"
    assert later.config._attn_implementation != ATTN_IMPLEMENTATION
    torch.testing.assert_close(other(ids).logits, before, rtol=0, atol=0)


def test_parameters_keep_hf_names_and_export_with_save_pretrained(tmp_path, fresh_seed: int) -> None:
    module = _module(Case("qwen2", sp=1, chunk_size=None), fresh_seed)
    names = {n for n, _ in module.named_parameters()}
    assert names == {f"model.{n}" for n, _ in module.model.named_parameters()}
    assert "model.model.layers.0.self_attn.q_proj.weight" in names
    module.save_pretrained(str(tmp_path))
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert loaded.config._attn_implementation != ATTN_IMPLEMENTATION
    for (n, p), (m, q) in zip(module.model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert n == m and torch.equal(p, q), n
    assert module.attention_heads() == [(f"model.model.layers.{i}.self_attn", HEADS, 2) for i in range(2)]


def test_model_from_a_local_path(tmp_path, fresh_seed: int) -> None:
    module = _module(Case("llama", sp=1, chunk_size=None), fresh_seed)
    module.save_pretrained(str(tmp_path))
    again = HFCausalLM(str(tmp_path), from_pretrained_kwargs={"local_files_only": True})
    assert again.weights_pending  # built on the meta device (tests/hf/test_hf_weights.py): read on demand
    again.load_weights()
    for (n, p), (_, q) in zip(module.named_parameters(), again.named_parameters(), strict=True):
        assert torch.equal(p, q), n


# ---- refused features: a clear error at construction, naming the feature and the layer ----------------------

REFUSED = {  # sliding windows, attention softcapping and sinks are computed: tests/hf/test_hf_families.py
    "bidirectional": lambda: _config("gemma3", use_bidirectional_attention=True, sliding_window=512),
    "attention dropout": lambda: _config("llama", attention_dropout=0.1),
}
MESSAGES = {
    "bidirectional": r"layers\.0\.self_attn .*bidirectional attention \(is_causal=False\).* causal only",
    "attention dropout": r"layers\.0\.self_attn .*attention dropout 0\.1 .*draws no dropout mask",
}


@pytest.mark.parametrize("feature", list(REFUSED))
def test_unsupported_feature_raises_naming_it_and_the_layer(feature: str) -> None:
    with pytest.raises(NotImplementedError, match=MESSAGES[feature]):
        HFCausalLM(REFUSED[feature]())


def test_experts_without_a_declared_router_are_refused_naming_the_layer() -> None:
    """Mixtral, Qwen3-MoE and OLMoE train (tests/hf/test_hf_moe.py); experts whose router the model does not
    declare (no router_logits output) cannot have their routing checked."""
    model = AutoModelForCausalLM.from_config(_config("llama"))
    model.model.layers[0].mlp.experts = type("SparseExperts", (torch.nn.Module,), {})()
    with pytest.raises(NotImplementedError, match=r"layer model\.model\.layers\.0 \(LlamaDecoderLayer\) has experts"
                                                  r" \(mlp\.experts: SparseExperts\) but LlamaForCausalLM declares no"
                                                  r" router_logits output"):
        HFCausalLM(model)


def test_an_experts_setting_the_family_never_reads_is_not_refused(fresh_seed: int) -> None:
    """Llama's layers never read ``num_experts``: no expert runs, so nothing is refused, and the model equals
    itself without the setting."""
    module, plain = HFCausalLM(_config("llama", num_experts=4)), HFCausalLM(_config("llama"))
    _redraw(module.model, fresh_seed)
    _redraw(plain.model, fresh_seed)
    ids = torch.randint(0, VOCAB, (1, SEQ))
    torch.testing.assert_close(module.double().forward(ids), plain.double().forward(ids), rtol=0, atol=0)


def test_attention_outside_decoder_layers_is_refused() -> None:
    model = AutoModelForCausalLM.from_config(_config("llama"))
    layer = model.model.layers[1]  # a decoder layer class the memory stack would not recognise
    layer.__class__ = type("CustomDecoderLayer", (torch.nn.Module,), {"forward": type(layer).forward})
    with pytest.raises(NotImplementedError, match=r"has 2 attention layers but 1 decoder layers that hold them"):
        HFCausalLM(model)


def test_dropout_in_recomputed_layers_is_refused() -> None:
    """Checkpointing recomputes a decoder layer, tiling recomputes an MLP tile: dropout there would draw
    another mask in backward. Residual dropout outside the MLP is fine without checkpointing."""
    module = HFCausalLM(_config("gpt_neox", hidden_dropout=0.1), mlp_tiles=2)  # the dropout is outside the MLP
    with pytest.raises(NotImplementedError, match=r"model\.gpt_neox\.layers\.0\.post_attention_dropout is a"
                                                  r" dropout with p=0\.1; activation_checkpointing recomputes"):
        module.bind_sequence_parallel(SequenceParallelContext(activation_checkpointing=True))
    module.bind_sequence_parallel(SequenceParallelContext(chunk_size=8))  # without checkpointing: accepted
    model = AutoModelForCausalLM.from_config(_config("llama"))
    model.model.layers[1].mlp.dropout = torch.nn.Dropout(0.2)  # a dropout inside the MLP: refused when tiled
    with pytest.raises(NotImplementedError, match=r"model\.model\.layers\.1\.mlp\.dropout is a dropout with p=0\.2;"
                                                  r" the tiled MLP recomputes each tile"):
        HFCausalLM(model)
    HFCausalLM(model, mlp_tiles=1)  # untiled: accepted


def test_bad_tile_counts_raise() -> None:
    for name in ("mlp_tiles", "loss_tiles"):
        with pytest.raises(ValueError, match=f"HFCausalLM: {name} must be a positive int or None .*got 0"):
            HFCausalLM(_config("llama"), **{name: 0})


def test_unsupported_model_argument_raises() -> None:
    with pytest.raises(TypeError, match="PreTrainedModel, a PretrainedConfig"):
        HFCausalLM(3)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["./tiny-chat2", "missing/dir/here", "~/checkpoints/tiny"])
def test_a_model_path_that_is_no_directory_is_refused_before_the_hub_is_asked(
        name: str, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A path that is not a directory and cannot be a Hub id is refused at once, naming it and the working directory
    (transformers asked the Hub for it, retried for a minute without a network and did not name it)."""
    monkeypatch.chdir(tmp_path)

    def hub(*args, **kwargs):
        raise AssertionError("the Hub was asked")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", hub)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", hub)
    with pytest.raises(FPDTError, match=re.escape(f"HFCausalLM: model {name!r} is not a directory (working directory"
                                                  f" {tmp_path}), nor a Hugging Face Hub id")):
        HFCausalLM(model=name)


def test_a_name_the_hub_cannot_give_is_refused_naming_it(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A name that could be a Hub id and is no directory here goes to the Hub; its failure names the argument and
    the working directory (a mistyped local directory's name reads as one), with transformers' whole reason, its
    lines joined (a gated repository's link, a token's hint)."""
    monkeypatch.chdir(tmp_path)

    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files.\nCheck your connection")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", offline)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", offline)
    with pytest.raises(FPDTError, match=re.escape(
            f"HFCausalLM: model 'tiny-chat2' is not a directory here (working directory {tmp_path}), and the Hugging"
            " Face Hub did not give it: We couldn't connect to 'https://huggingface.co' to load the files. Check your"
            " connection (a local checkpoint: give its directory as seen from here).")):
        HFCausalLM(model="tiny-chat2")
