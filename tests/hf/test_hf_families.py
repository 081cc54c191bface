"""Open model families as released: sliding windows, attention softcapping and sinks, trained exactly under FPDT.

Each family is built tiny from its config with the attention features its real checkpoints have switched on:
windows SHORTER than the test sequence (32 tokens, so they cut and skip blocks; none a multiple of the 8-token
chunks), the released softcaps, and the released mix of sliding and full layers (with each family's own
per-layer rule: Gemma-3's local RoPE base, Cohere2's RoPE on sliding layers only, EXAONE-4's global layers without
RoPE; Llama-4's chunked attention, 6-token attention chunks, with NoPE layers whose query scale depends on
position). One ``Trainer.fit`` step under ``FPDTStrategy`` equals plain transformers in one process (float64, loss
and every gradient within 1e-10), with the oracle of ``tests/hf/test_hf_causal_lm.py``: sdpa where the family has it,
else eager attention in float64 with transformers' own masks, so the window the FPDT path reads from the layer's
call is checked against the mask transformers builds, not against itself.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import pytest
import torch
from transformers import (
    Cohere2Config,
    Exaone4Config,
    Gemma2Config,
    Gemma3TextConfig,
    GptOssConfig,
    Llama4TextConfig,
    LlamaConfig,
    MistralConfig,
    Olmo3Config,
    PhimoeConfig,
    PretrainedConfig,
    Qwen2MoeConfig,
    masking_utils,
)
from transformers.models.cohere2.modeling_cohere2 import Cohere2LayerNorm
from transformers.models.llama4 import modeling_llama4

from lightning_fpdt.attention import fpdt_attention
from lightning_fpdt.hf import attention as hf_attention
from lightning_fpdt.hf.masks import MaskRule, read_mask_rule
from lightning_fpdt.models import HFCausalLM
from tests.helpers import TokenDataset, assert_same_step, in_float64
from tests.hf.test_hf_causal_lm import (
    HEADS,
    SEQ,
    SIZES,
    VOCAB,
    Packed,
    _fit,
    _max_error,
    _mean_ce,
    _plain,
    _redraw,
    gemma_norms_in_float64,  # noqa: F401 (an autouse fixture: Gemma's norms in float64 here too)
)

SLIDING, FULL = "sliding_attention", "full_attention"


def _released(family: str, kv_heads: int) -> PretrainedConfig:
    """A tiny ``family`` config with the attention features of its released checkpoints (windows shortened)."""
    gqa = dict(SIZES, num_key_value_heads=kv_heads)
    configs: dict[str, Callable[[], PretrainedConfig]] = {
        # softcaps 50 (attention) and 30 (final logits), window on alternate layers; query_pre_attn_scalar !=
        # head_dim so a wrong scale shows
        "gemma2": lambda: Gemma2Config(head_dim=8, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                                       sliding_window=6, layer_types=[SLIDING, FULL], query_pre_attn_scalar=16, **gqa),
        # five of six layers sliding, with their own RoPE base
        "gemma3": lambda: Gemma3TextConfig(head_dim=8, sliding_window=7, query_pre_attn_scalar=16,
                                           **dict(gqa, num_hidden_layers=6), layer_types=[SLIDING] * 5 + [FULL]),
        "mistral": lambda: MistralConfig(sliding_window=5, **gqa),  # v0.1: every layer windowed
        # three of four sliding (RoPE on those only); the head's logit_scale as released (0.0625, hf_guards)
        "cohere2": lambda: Cohere2Config(sliding_window=9, logit_scale=0.0625, **dict(gqa, num_hidden_layers=4),
                                         layer_types=[SLIDING] * 3 + [FULL]),
        "olmo3": lambda: Olmo3Config(sliding_window=10, **dict(gqa, num_hidden_layers=4),
                                     layer_types=[SLIDING] * 3 + [FULL]),
        # "LLLG": the global layer has no RoPE
        "exaone4": lambda: Exaone4Config(sliding_window=11, sliding_window_pattern="LLLG",
                                         **dict(gqa, num_hidden_layers=4), layer_types=[SLIDING] * 3 + [FULL]),
        # sinks, window on alternate layers; experts (H10's MoE support) with no auxiliary loss asked for
        "gpt_oss": lambda: GptOssConfig(head_dim=8, sliding_window=4, layer_types=[SLIDING, FULL], num_local_experts=4,
                                        num_experts_per_tok=2, output_router_logits=False, **gqa),
        # chunked attention (6 tokens, cut inside every 8-token pipeline chunk) on three RoPE layers, the fourth NoPE
        # with full attention and temperature tuning (floor_scale 4: the scale varies within each rank's tokens);
        # experts (sigmoid top-1 router, shared expert) on every second layer, as Maverick interleaves them
        "llama4": lambda: Llama4TextConfig(head_dim=8, attention_chunk_size=6, floor_scale=4, intermediate_size_mlp=64,
                                           interleave_moe_layer_step=2, num_local_experts=4,
                                           **dict(gqa, num_hidden_layers=4)),
    }
    config = configs[family]()
    config._experts_implementation = "eager"  # the per-expert loop (grouped_mm has no float64 kernel)
    return config


def _cohere_norm_in_input_dtype(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    centred = x - x.mean(-1, keepdim=True)
    return self.weight * centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


@pytest.fixture(autouse=True)
def cohere_norm_in_float64(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cohere2's LayerNorm multiplies by its weight in float32, so its weight gradient is a float32 sum over
    tokens, which any other grouping of the tokens moves by ~1e-8 (as Gemma's norms): the same maths in the
    input's dtype on both sides."""
    monkeypatch.setattr(Cohere2LayerNorm, "forward", _cohere_norm_in_input_dtype)


def _llama4_router_in_float64(self: torch.nn.Linear, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``Llama4Router.forward`` with its sigmoid in the input's dtype (written out: its ``super()`` call keeps
    ``in_float64`` from compiling it again)."""
    logits = torch.nn.functional.linear(hidden, self.weight, self.bias)
    top_value, top_index = torch.topk(logits, self.top_k, dim=1)
    return torch.sigmoid(torch.full_like(logits, float("-inf")).scatter_(1, top_index, top_value)), logits


@pytest.fixture(autouse=True)
def llama4_in_float64(monkeypatch: pytest.MonkeyPatch) -> None:
    """Llama-4's RMSNorm, q/k L2Norm, rotary and router sigmoid cast their input to float32 (and back): a float32
    rounding of each token's activations and gradients, which a sum in another order can push across a rounding
    boundary, and torch's float32 sigmoid on CPU differs by an ulp with the tensor's size (sigmoid(1.1009694) over
    16 elements or 64: seen on one token's router score, 3e-8 in the gradients, a document run alone against the
    packed batch). transformers' own code in float64 on both sides (``tests.helpers.in_float64``; the rotary angles
    stay its float32 ones)."""
    for cls in (modeling_llama4.Llama4TextRMSNorm, modeling_llama4.Llama4TextL2Norm):
        monkeypatch.setattr(cls, "forward", in_float64(cls.forward))
    monkeypatch.setattr(modeling_llama4.Llama4Router, "forward", _llama4_router_in_float64)
    monkeypatch.setattr(modeling_llama4, "apply_rotary_emb", in_float64(modeling_llama4.apply_rotary_emb))


@dataclass(frozen=True)
class FamilyCase:
    family: str
    packed: bool = False
    sp: int = 2
    chunk_size: int | None = 8
    kv_heads: int = 1  # below the SP size
    offload: bool | Literal["emulate"] = "emulate"
    stack: bool = False  # tiled MLP and loss, checkpointing with offload emulation, FSDP2 (as test_hf_causal_lm)
    ring_size: int | Literal["auto"] = "auto"

    @property
    def name(self) -> str:
        return "-".join([self.family, "packed" if self.packed else "plain", f"sp{self.sp}", f"C{self.chunk_size}",
                         f"kv{self.kv_heads}"] + (["stack"] if self.stack else [])
                        + ([f"ring{self.ring_size}"] if self.ring_size != "auto" else []))


FAMILIES = ["gemma2", "gemma3", "mistral", "cohere2", "olmo3", "exaone4", "gpt_oss", "llama4"]

CASES = [
    # every family at sp=2 with one KV head, 4 chunks of 8 tokens, offload emulation, on plain and packed batches
    *[FamilyCase(f, packed=packed) for f in FAMILIES for packed in (False, True)],
    # windows, softcaps and mixed layers at sp=4 (2 tokens per rank and chunk), and under the memory stack
    FamilyCase("gemma2", sp=4, kv_heads=2),
    FamilyCase("gemma2", packed=True, sp=4, kv_heads=2),
    FamilyCase("gemma2", stack=True),
    # attention chunks, the NoPE layer's temperature and the experts (tiled, flattened tokens) under the stack
    FamilyCase("llama4", packed=True, sp=4, stack=True),
    # sinks under the stack: streamed layers give the sinks their gradient from the attention backward
    FamilyCase("gpt_oss", packed=True, stack=True),
]


def _module(case: FamilyCase, seed: int) -> HFCausalLM:
    tiles = dict(mlp_tiles=3, loss_tiles=5) if case.stack else dict(mlp_tiles=1, loss_tiles=1)
    module = HFCausalLM(_released(case.family, case.kv_heads), learning_rate=1e-3, warmup_steps=1, **tiles)
    _redraw(module.model, seed)
    return module


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_released_family_fit_step_equals_plain_transformers(case: FamilyCase, tmp_path, fresh_seed: int) -> None:
    torch.manual_seed(fresh_seed)
    assert_fit_step_equals_plain(_module(case, fresh_seed), case, tmp_path, fresh_seed, case.name)


def assert_fit_step_equals_plain(module: HFCausalLM, case: FamilyCase, tmp_path, seed: int, label: str) -> None:
    """One ``Trainer.fit`` step of ``module`` under ``case`` equals plain transformers in one process (plain batches:
    each sample; packed: each document alone), loss and every gradient within 1e-10; under the memory stack every
    decoder layer was sharded and checkpointed through the host."""
    ref = _plain(module)
    if case.packed:  # documents of 1, 12, 19 and 20, 12 tokens, across chunk and rank boundaries
        data = Packed(seed)
        samples = data.documents()
    else:
        data = TokenDataset(2, SEQ, VOCAB, seed)
        samples = [(data.ids[i:i + 1], data.labels[i:i + 1]) for i in range(len(data))]
    results = _fit(module, data, case, tmp_path)
    ref_loss, ref_grads = _mean_ce(ref, samples)
    print(f"{label}: max rel. error {_max_error(results, ref_loss, ref_grads):.2e}")
    assert_same_step(results, ref_loss, ref_grads, tol=1e-10, label=f"{label} seed={seed}")
    if case.stack:
        layers = module.model.config.num_hidden_layers
        for r in results:
            assert r["sharded_layers"] == [True] * layers and r["local_numel"] < r["numel"], r["sharded_layers"]
            assert r["layer_input_bytes"] == layers * len(data) * (SEQ // case.sp) * SIZES["hidden_size"] * 8


ARRIVING = {  # per layer, in order: (window, softcap) the pipeline is called with
    "gemma2": [(6, 50.0), (None, 50.0)],
    "gemma3": [(7, None)] * 5 + [(None, None)],
    "mistral": [(5, None)] * 2,
    "cohere2": [(9, None)] * 3 + [(None, None)],
    "olmo3": [(10, None)] * 3 + [(None, None)],
    "exaone4": [(11, None)] * 3 + [(None, None)],
}


@pytest.mark.parametrize("family", list(ARRIVING))
def test_each_layer_passes_its_own_window_and_no_mask_is_built(family: str, monkeypatch, fresh_seed: int) -> None:
    """transformers builds no mask for the FPDT implementation (fpdt_attention_forward refuses one), so a sliding
    layer's window must arrive with its call: each layer's window and softcap as the family's layers give them."""
    calls: list[tuple[Any, Any]] = []

    def spy(*args: Any, window: Any = None, softcap: Any = None, **kwargs: Any) -> torch.Tensor:
        calls.append((window, softcap))
        return fpdt_attention(*args, window=window, softcap=softcap, **kwargs)

    monkeypatch.setattr(hf_attention, "fpdt_attention", spy)
    module = _module(FamilyCase(family), fresh_seed)
    module.forward(torch.randint(0, VOCAB, (2, SEQ)))
    assert calls == ARRIVING[family]


def test_a_sliding_window_value_a_llama_layer_ignores_is_not_refused(fresh_seed: int) -> None:
    """Llama's layers never read ``config.sliding_window``: the config value must not refuse the model, and the
    model must equal itself without the value (full causal attention)."""
    config = LlamaConfig(sliding_window=4, **dict(SIZES, num_key_value_heads=2))
    module = _module_from(config, fresh_seed)
    plain = _module_from(LlamaConfig(**dict(SIZES, num_key_value_heads=2)), fresh_seed)
    ids = torch.randint(0, VOCAB, (1, SEQ))
    torch.testing.assert_close(module.double().forward(ids), plain.double().forward(ids), rtol=0, atol=0)


def test_call_features_the_pipeline_does_not_compute_are_refused() -> None:
    """What a layer asks for in its attention call and the pipeline cannot compute is refused by name when the call
    arrives (a layer may pass ``is_causal`` or a ``position_bias`` per call): never computed otherwise."""
    module = HFCausalLM(_released("mistral", 2))
    layer = module.model.model.layers[1].self_attn
    q, kv = torch.randn(1, HEADS, 8, 8), torch.randn(1, 2, 8, 8)
    with pytest.raises(NotImplementedError, match=r"MistralAttention \(layer 1\) is bidirectional \(is_causal=False\)"):
        hf_attention.fpdt_attention_forward(layer, q, kv, kv, None, scaling=1.0, is_causal=False)
    with pytest.raises(NotImplementedError, match=r"\(layer 1\) adds a position bias \(tensor\(1, 4, 8, 8\)\)"):
        hf_attention.fpdt_attention_forward(layer, q, kv, kv, None, scaling=1.0, position_bias=torch.zeros(1, 4, 8, 8))
    with pytest.raises(NotImplementedError, match=r"\(layer 1\) uses attention dropout 0\.1 in training"):
        hf_attention.fpdt_attention_forward(layer, q, kv, kv, None, scaling=1.0, dropout=0.1)
    out, _ = hf_attention.fpdt_attention_forward(layer, q, kv, kv, None, scaling=1.0, is_causal=True, sliding_window=3)
    assert out.shape == (1, 8, HEADS, 8)


MASK_ONLY_WINDOWS = {  # families whose mask has a window their attention call does not pass (transformers 5.24)
    "qwen2_moe": lambda: Qwen2MoeConfig(use_sliding_window=True, sliding_window=5, max_window_layers=2, num_experts=2,
                                        num_experts_per_tok=1, moe_intermediate_size=8,
                                        shared_expert_intermediate_size=8, **dict(SIZES, num_key_value_heads=2)),
    "phimoe": lambda: PhimoeConfig(sliding_window=5, num_local_experts=2, num_experts_per_tok=1,
                                   **dict(SIZES, num_key_value_heads=2)),
}


@pytest.mark.parametrize("family", list(MASK_ONLY_WINDOWS))
def test_a_window_only_the_mask_has_is_refused(family: str) -> None:
    """Under FPDT no mask is built, so a layer whose window lives only in transformers' mask would silently attend
    to the whole causal context: the mask probe refuses it by name, before any step."""
    with pytest.raises(NotImplementedError, match=r"layer model\.layers\.0\.self_attn \(\w+Attention\): transformers'"
                                                  r" mask for this layer has a sliding window of 5, but its attention"
                                                  r" call passes sliding_window=None"):
        HFCausalLM(MASK_ONLY_WINDOWS[family]())


def test_mask_rules_are_read_from_transformers_mask_functions() -> None:
    causal = masking_utils.causal_mask_function
    assert read_mask_rule(causal) == MaskRule(causal=True, window=None)
    for window in (1, 5, 4096):
        sliding = masking_utils.and_masks(causal, masking_utils.sliding_window_overlay(window))
        assert read_mask_rule(sliding) == MaskRule(causal=True, window=window)
    chunked = masking_utils.and_masks(causal, masking_utils.chunked_overlay(8, torch.zeros(1, dtype=torch.long)))
    assert read_mask_rule(chunked) == MaskRule(causal=True, window=None, chunk=8)  # Llama-4's (test_chunked_attention)
    assert not read_mask_rule(masking_utils.bidirectional_mask_function).causal


def _module_from(config: PretrainedConfig, seed: int) -> HFCausalLM:
    module = HFCausalLM(config)
    _redraw(module.model, seed)
    return module


assert HEADS == 4  # the head counts the cases' kv_heads are chosen against


def _support_matrix_config(model_type: str) -> PretrainedConfig:
    """The support matrix's tiny config of ``model_type`` (benchmarks/support_matrix.py's own shrinker)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "support_matrix.py"
    spec = importlib.util.spec_from_file_location("support_matrix", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.tiny_config(model_type)


@pytest.mark.parametrize(("family", "mechanism", "module"), [
    ("deepseek_v32", "sparse attention: a lightning indexer scores every earlier key", "DeepseekV32Indexer"),
    ("deepseek_v4", "compressed attention: a compressor pools every few tokens' keys", "DeepseekV4HCACompressor"),
])
def test_attention_that_selects_or_pools_its_keys_is_refused_at_construction(family: str, mechanism: str,
                                                                             module: str) -> None:
    """DeepSeek-V3.2's indexer (each query attends to its top-k keys) and DeepSeek-V4's compressors (pooled keys
    beside a window) choose keys the pipeline does not: refused by name when the model is built, where V3.2 failed
    inside the mask probe (an AttributeError) and V4 at its first step (a shape error)."""
    with pytest.raises(NotImplementedError, match=re.escape(mechanism)) as refused:
        HFCausalLM(_support_matrix_config(family))
    assert f"({module} at model.layers.0.self_attn." in str(refused.value)
    assert "This family is not supported." in str(refused.value)
