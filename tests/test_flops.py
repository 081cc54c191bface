"""Training FLOPs per token: ``HFCausalLM`` counts from its transformers model as ``LlamaLM`` counts its own.

The count (forward and backward) is 6 x the parameters a token multiplies through plus 12 x ``heads x
head_dim`` x the keys a query attends to, per layer. The hand counts below spell out every matmul of the
family's decoder layer, so a miscounted projection, a routed expert counted in full, a GQA width or a window
shows as a different number.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from lightning.pytorch.callbacks import ThroughputMonitor

from lightning_fpdt.callbacks import TokenThroughputMonitor
from lightning_fpdt.models import HFCausalLM, LlamaConfig, LlamaLM

V, H, HEADS, KV, L = 64, 32, 4, 2, 2  # vocabulary, hidden, query heads, key/value heads, layers


@pytest.mark.parametrize("seq_len", [64, 4096])
@pytest.mark.parametrize("kv_heads", [HEADS, KV], ids=["mha", "gqa"])
def test_a_transformers_llama_counts_as_llama_lm(seq_len: int, kv_heads: int) -> None:
    shape = dict(vocab_size=V, hidden_size=H, intermediate_size=88, num_hidden_layers=3, num_attention_heads=HEADS,
                 num_key_value_heads=kv_heads)
    ours = LlamaLM(LlamaConfig(**shape)).flops_per_token(seq_len)
    theirs = HFCausalLM(transformers.LlamaConfig(**shape)).flops_per_token(seq_len)
    assert ours is not None and ours > 0
    assert theirs == pytest.approx(ours, rel=1e-15)


def test_lora_counts_its_frozen_base_without_weight_gradients() -> None:
    """Under LoRA the base weights run forward and pass gradients back (4 FLOPs per weight and token), but get no
    weight gradient; the adapters (and nothing else) count 6 per weight."""
    shape = dict(vocab_size=V, hidden_size=H, intermediate_size=88, num_hidden_layers=L, num_attention_heads=HEADS,
                 num_key_value_heads=KV)
    seq = 256
    full = HFCausalLM(transformers.LlamaConfig(**shape))
    adapted = HFCausalLM(transformers.LlamaConfig(**shape), lora=dict(r=4, target_modules=["q_proj", "v_proj"]))
    frozen = sum(p.numel() for n, p in full.model.named_parameters() if "embed_tokens" not in n)
    adapters = sum(p.numel() for p in adapted.model.parameters() if p.requires_grad)
    assert adapters == L * 4 * (H + HEADS * (H // HEADS)) + L * 4 * (H + KV * (H // HEADS))
    expected = full.flops_per_token(seq) - 6 * frozen + 4 * frozen + 6 * adapters
    assert adapted.flops_per_token(seq) == pytest.approx(expected, rel=1e-12)


def _attention_projections(head_dim: int, biases: bool = False) -> int:
    """q, k, v and o of one layer (GQA: k and v have ``KV`` heads), with their biases."""
    weights = H * HEADS * head_dim + 2 * H * KV * head_dim + HEADS * head_dim * H
    return weights + (HEADS * head_dim + 2 * KV * head_dim if biases else 0)


def test_mixture_of_experts_counts_the_active_experts_only() -> None:
    experts, top_k, inter, seq = 8, 2, 24, 256
    config = transformers.MixtralConfig(vocab_size=V, hidden_size=H, intermediate_size=inter, num_hidden_layers=L,
                                        num_attention_heads=HEADS, num_key_value_heads=KV, num_local_experts=experts,
                                        num_experts_per_tok=top_k, sliding_window=None)
    per_layer = (_attention_projections(H // HEADS)
                 + H * experts  # the router runs on every token
                 + top_k * 3 * H * inter  # gate, up and down of the top-k experts only
                 + 2 * H)  # the two RMSNorms
    active = L * per_layer + H + V * H  # final norm, output embedding
    attention = 12 * HEADS * (H // HEADS) * L * seq / 2  # QK^T and PV over the causal half, forward and backward
    assert HFCausalLM(config).flops_per_token(seq) == pytest.approx(6 * active + attention, rel=1e-15)


def test_gqa_wide_heads_tied_embeddings_and_a_sliding_layer() -> None:
    """Qwen2 with ``head_dim`` 16 (heads x head_dim = 64, not hidden 32), q/k/v biases, tied embeddings and
    layer 0 sliding (window 16 of 64 tokens: a query attends ``min(i + 1, 16)`` keys, ``16 - 16^2 / 128`` = 14
    on average in the count's continuous form) and layer 1 full (32 on average)."""
    head_dim, inter, window, seq = 16, 40, 16, 64
    config = transformers.Qwen2Config(
        vocab_size=V, hidden_size=H, intermediate_size=inter, num_hidden_layers=L, num_attention_heads=HEADS,
        num_key_value_heads=KV, head_dim=head_dim, tie_word_embeddings=True, use_sliding_window=True,
        sliding_window=window, layer_types=["sliding_attention", "full_attention"],
    )
    module = HFCausalLM(config)
    assert module.model.get_output_embeddings().weight is module.model.get_input_embeddings().weight
    per_layer = _attention_projections(head_dim, biases=True) + 3 * H * inter + 2 * H
    active = L * per_layer + H + V * H  # the tied output embedding is still a matmul
    attention = 12 * HEADS * head_dim * (14 + seq / 2)
    assert module.flops_per_token(seq) == pytest.approx(6 * active + attention, rel=1e-15)


@pytest.mark.filterwarnings("ignore:You are trying to `self.log\\(\\)`")  # a step outside a Trainer
def test_training_step_sets_flops_per_batch_of_the_global_sequence() -> None:
    module = HFCausalLM(transformers.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=88,
                                                 num_hidden_layers=L, num_attention_heads=HEADS))
    ids = torch.randint(0, V, (3, 32))
    module.training_step({"input_ids": ids}, 0)
    assert module.flops_per_batch == module.flops_per_token(32) * ids.numel()


@pytest.mark.filterwarnings("ignore:You are trying to `self.log\\(\\)`")  # a step outside a Trainer
def test_validation_step_sets_the_forward_s_flops_per_batch() -> None:
    """A validation batch counts its forward, a third of a training step's FLOPs; set without any training step
    (fpdt-eval), where Lightning's ThroughputMonitor warned that the module defines no flops_per_batch."""
    module = HFCausalLM(transformers.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=88,
                                                 num_hidden_layers=L, num_attention_heads=HEADS))
    ids = torch.randint(0, V, (3, 32))
    module.validation_step({"input_ids": ids}, 0)
    assert module.flops_per_batch == pytest.approx(module.flops_per_token(32) * ids.numel() / 3, rel=1e-15)


def test_throughput_monitor_takes_a_peak_for_mfu() -> None:
    assert isinstance(TokenThroughputMonitor(), ThroughputMonitor)
    assert TokenThroughputMonitor(available_flops=1e12).peak_flops == 1e12
    with pytest.raises(ValueError, match=r"available_flops must be a positive peak FLOP/s per device, got 0"):
        TokenThroughputMonitor(available_flops=0)


@pytest.mark.parametrize("family", ["qwen3_5_text", "nemotron_h"])
def test_a_hybrid_counts_attention_in_its_attention_layers_and_each_recurrence_linearly(family: str) -> None:
    """Qwen3.5 (a gated delta-net then an attention layer) and Nemotron-H (a Mamba-2 mixer then an attention
    layer): the keys term for the one attention layer only; each recurrence's kernel per token, linear in the
    length (delta rule: ``6 d_k d_v + 64 (5 d_k + 3 d_v)`` per value head; scan: ``4 p n + 2 c (n + p)`` per head,
    3x for training)."""
    seq = 1024
    if family == "qwen3_5_text":
        config = transformers.AutoConfig.for_model(
            family, vocab_size=V, hidden_size=H, intermediate_size=48, num_hidden_layers=2, num_attention_heads=HEADS,
            num_key_value_heads=KV, head_dim=8, layer_types=["linear_attention", "full_attention"],
            linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=16)
        core = 3 * 4 * (6 * 8 * 16 + 64 * (5 * 8 + 3 * 16))
    else:
        config = transformers.AutoConfig.for_model(
            family, vocab_size=V, hidden_size=H, num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=KV,
            head_dim=8, hybrid_override_pattern="M*", mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8,
            n_groups=1, chunk_size=32, expand=2)
        core = 3 * 4 * (4 * 16 * 8 + 2 * 32 * (8 + 16))
    module = HFCausalLM(config)
    model = module.model
    embeddings = {id(p) for p in model.get_input_embeddings().parameters()}
    active = sum(p.numel() for p in model.parameters() if id(p) not in embeddings)
    if model.get_output_embeddings().weight is model.get_input_embeddings().weight:
        active += V * H
    attention = 12 * HEADS * 8 * seq / 2  # one attention layer
    assert module.flops_per_token(seq) == pytest.approx(6 * active + attention + core, rel=1e-15)
