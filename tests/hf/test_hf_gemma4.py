"""Gemma-4 (text) as released, trained exactly under FPDT: sliding and full layers of different head widths
(``global_head_dim``, partial "proportional" RoPE on the full layers), per-layer input embeddings, q/k/v norms,
the final-logit softcap, keys shared as values on full layers (``attention_k_eq_v``), the experts block beside the
dense MLP (its router called by the decoder layer itself, no auxiliary loss), and keys and values shared across
layers (``num_kv_shared_layers``: the last layers attend with the keys and values an earlier layer computed).

One ``Trainer.fit`` step under ``FPDTStrategy`` equals plain transformers in one process (float64, loss and every
gradient within 1e-10), plain and packed (each document alone), at sp=2 with 4 chunks per rank, and at sp=4 and
under the memory stack. Gemma-4's norms and router compute in float32
whatever their input: in float64 here, on both sides (their own source, one dtype changed).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import Gemma4TextConfig
from transformers.models.gemma4 import modeling_gemma4

from lightning_fpdt.models import HFCausalLM
from tests.helpers import TokenDataset, float32_classes, in_float64
from tests.hf.test_hf_causal_lm import SEQ, VOCAB, _fit, _redraw
from tests.hf.test_hf_families import FamilyCase, assert_fit_step_equals_plain

SLIDING, FULL = "sliding_attention", "full_attention"
VARIANTS: dict[str, dict[str, Any]] = {
    "dense": {},
    # 4 experts, 2 per token, beside the dense MLP in every layer
    "experts": dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16),
    # the full layers' keys are their values, with their own (single) KV head
    "k_eq_v": dict(attention_k_eq_v=True, num_global_key_value_heads=1),
    # layers 2 and 3 attend with the keys and values of layers 0 (sliding) and 1 (full)
    "kv_shared": dict(num_kv_shared_layers=2),
}


def _config(variant: str) -> Gemma4TextConfig:
    config = Gemma4TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=1, head_dim=8, global_head_dim=16, sliding_window=6, layer_types=[SLIDING, FULL] * 2,
        vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8, final_logit_softcapping=30.0,
        **VARIANTS[variant])
    config._experts_implementation = "eager"  # the per-expert loop (grouped_mm has no float64 kernel)
    return config


@pytest.fixture(autouse=True)
def gemma4_in_float64(monkeypatch: pytest.MonkeyPatch) -> None:
    for layer in float32_classes(modeling_gemma4):
        monkeypatch.setattr(layer, "forward", in_float64(layer.forward))


CASES = [
    *[FamilyCase(variant, packed=packed) for variant in VARIANTS for packed in (False, True)],
    # 2 tokens per rank and chunk, the one KV head replicated; the memory stack (tiled MLP and loss, checkpointed
    # layers through host-memory emulation, FSDP2 per decoder layer), the per-layer inputs an input of each
    # recomputed layer
    FamilyCase("experts", packed=True, sp=4, stack=True),
]


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_gemma4_fit_step_equals_plain_transformers(case: FamilyCase, tmp_path, fresh_seed: int) -> None:
    torch.manual_seed(fresh_seed)
    tiles = dict(mlp_tiles=3, loss_tiles=5) if case.stack else dict(mlp_tiles=1, loss_tiles=1)
    module = HFCausalLM(_config(case.family), learning_rate=1e-3, warmup_steps=1, **tiles)
    _redraw(module.model, fresh_seed)
    assert module.router_loss is None  # Gemma-4's forward adds no auxiliary loss
    assert_fit_step_equals_plain(module, case, tmp_path, fresh_seed, f"gemma4 {case.name}")


@pytest.mark.distributed
def test_keys_and_values_shared_across_checkpointed_layers_are_refused(tmp_path, fresh_seed: int) -> None:
    """A recomputed layer's first run records no graph: the keys and values it leaves for a later layer would carry
    no gradient back to it (the step is 1e-1 off). The later layer's read is refused in the first forward."""
    module = HFCausalLM(_config("kv_shared"), mlp_tiles=3, loss_tiles=5)
    _redraw(module.model, fresh_seed)
    with pytest.raises(Exception, match=r"decoder layer model\.model\.layers\.2 reads 'sliding_attention', which"
                                        r" decoder layer model\.model\.layers\.0 left for it .*activation"
                                        r" checkpointing recomputes layers"):
        _fit(module, TokenDataset(2, SEQ, VOCAB, fresh_seed), FamilyCase("kv_shared", stack=True), tmp_path)
