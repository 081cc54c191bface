"""Nothing that mixes tokens runs unguarded (lightning_fpdt.layers.token_mixing, hf/mixing.py, models/mixing.py).

Every hybrid family transformers 5.24 ships as a causal LM either runs its token-mixing layers sequence-parallel
(gated delta-net, Kimi delta attention, Mamba-1 and Mamba-2, MiniMax's lightning attention and short-convolution
layers: nothing is refused) or is refused by name, layer and module when bound to more than one rank of a
sequence-parallel group, and trains at one rank (RecurrentGemma's RG-LRU); dense families are not refused; a
hand-written causal convolution in an otherwise supported model (a transformers Llama, or the bundled Llama) is
found too, from its behaviour alone; through ``Trainer.fit`` at sp=2 every rank raises before any optimizer step.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import Tensor, nn

transformers = pytest.importorskip("transformers")

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402
from transformers.models.qwen3_next import modeling_qwen3_next  # noqa: E402

from lightning_fpdt import FPDTStrategy  # noqa: E402
from lightning_fpdt.hf.experts import RouterTap, router_class  # noqa: E402
from lightning_fpdt.layers.token_mixing import PROBE_LENGTH  # noqa: E402
from lightning_fpdt.models import GPTLM, GPTConfig, HFCausalLM, LlamaConfig, LlamaLM  # noqa: E402
from lightning_fpdt.parallel.binding import SequenceParallelContext  # noqa: E402
from tests.helpers import TokenDataset, assert_same_step, dataloader  # noqa: E402
from tests.hf.test_hf_causal_lm import _redraw, one_process_step  # noqa: E402
from tests.hf.test_hf_guards import StepMarker  # noqa: E402
from tests.hf.test_hf_moe import _float64_source, _oracle, _router_in_input_dtype  # noqa: E402

SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8)
DELTA_NET = dict(layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4, linear_num_key_heads=2,
                 linear_key_head_dim=8, linear_value_head_dim=8)
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
MAMBA = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=8, mamba_expand=2)

# family: (its tiny config's fields, the first module the guard names; "" for a family whose layers run
# sequence-parallel: tests/hf/test_short_conv.py, tests/hf/test_recurrent.py)
HYBRIDS: dict[str, tuple[dict[str, Any], str]] = {
    "qwen3_5_text": (DELTA_NET, ""),
    "qwen3_5_moe_text": ({**DELTA_NET, **EXPERTS}, ""),
    "qwen3_next": ({**DELTA_NET, **EXPERTS}, ""),
    "olmo_hybrid": (dict(pad_token_id=0, layer_types=["linear_attention", "full_attention"]), ""),
    "falcon_h1": (dict(mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, mamba_n_groups=1,
                       mamba_chunk_size=8), ""),
    "bamba": (dict(attn_layer_indices=[1], **MAMBA), ""),
    "granitemoehybrid": (dict(layer_types=["mamba", "attention"], num_local_experts=0, shared_intermediate_size=48,
                              **MAMBA), ""),
    "nemotron_h": (dict(hybrid_override_pattern="M*", mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8,
                        n_groups=1, chunk_size=8, expand=2), ""),
    "zamba2": (dict(layers_block_type=["mamba", "hybrid"], mamba_headdim=8, mamba_d_state=8, mamba_ngroups=1,
                    chunk_size=8, num_mem_blocks=1), ""),
    "kimi_linear": (dict(pad_token_id=0, layer_types=["linear_attention", "full_attention"],
                         mlp_layer_types=["dense", "dense"], linear_num_heads=4, linear_head_dim=8,
                         num_key_value_heads=4, kv_lora_rank=8, q_lora_rank=None, qk_rope_head_dim=4,
                         qk_nope_head_dim=4, v_head_dim=6), ""),
    "jamba": (dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=100, expert_layer_offset=99,
                   num_experts=1, mamba_d_state=8, mamba_expand=2), ""),
    "minimax": (dict(layer_types=["linear_attention", "full_attention"], num_local_experts=2, num_experts_per_tok=1),
                ""),
    "recurrent_gemma": (dict(num_hidden_layers=3, lru_width=32, attention_window_size=16,
                             block_types=["recurrent", "recurrent", "attention"]),
                        "model.model.layers.0.temporal_block.rg_lru (RecurrentGemmaRglru)"),
}
REFUSED = [f for f, (_, first) in HYBRIDS.items() if first]
SEQUENCE_PARALLEL = [f for f, (_, first) in HYBRIDS.items() if not first]


def hybrid_config(family: str) -> Any:
    fields, _ = HYBRIDS[family]
    defaults = AutoConfig.for_model(family)
    kwargs = {k: v for k, v in SIZES.items() if hasattr(defaults, k)}
    config = AutoConfig.for_model(family, **{"num_hidden_layers": 2, **kwargs, **fields})
    config._experts_implementation = "eager"  # the per-expert loop (grouped_mm has no float64 kernel)
    return config


def _quiet(module: Any) -> Any:
    with warnings.catch_warnings():  # the families' "falling back to the torch implementation" notices
        warnings.simplefilter("ignore")
        return module()


@pytest.mark.parametrize("family", REFUSED)
def test_every_other_hybrid_family_is_refused_by_name_beyond_one_rank(family: str) -> None:
    torch.manual_seed(0)
    module = _quiet(lambda: HFCausalLM(hybrid_config(family)).double())
    first = HYBRIDS[family][1]
    with pytest.raises(NotImplementedError) as refused:
        module.refuse_token_mixers(2)
    message = str(refused.value)
    assert f"{first} mixes tokens outside attention" in message or f"{first};" in message, message
    assert "sequence_parallel_size=2" in message and "sequence_parallel_size=1" in message
    module.bind_sequence_parallel(SequenceParallelContext(chunk_size=8))  # one rank sees every position: accepted
    module.refuse_token_mixers(1)


@pytest.mark.parametrize("family", SEQUENCE_PARALLEL)
def test_gated_delta_net_and_mamba2_families_run_sequence_parallel(family: str) -> None:
    """Their recurrences run sequence-parallel (tests/hf/test_recurrent.py) and nothing else mixes: nothing is
    refused."""
    module = _quiet(lambda: HFCausalLM(hybrid_config(family)).double())
    assert module.recurrences and module.token_mixers() == []
    module.refuse_token_mixers(2)


@pytest.mark.parametrize("family", ["lfm2", "lfm2_moe"])
def test_short_convolution_families_run_sequence_parallel(family: str) -> None:
    """LFM2's short convolutions run sequence-parallel (tests/hf/test_short_conv.py): nothing is refused."""
    config = AutoConfig.for_model(family, **SIZES, num_hidden_layers=2, layer_types=["conv", "full_attention"],
                                  **({"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                                      "num_dense_layers": 1} if family == "lfm2_moe" else {}))
    config._experts_implementation = "eager"
    module = HFCausalLM(config).double()
    assert module.short_convs == ["model.layers.0.conv"] and module.token_mixers() == []
    module.refuse_token_mixers(2)


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2", "mixtral", "qwen3_moe", "gpt_oss"])
def test_dense_and_moe_families_mix_tokens_in_attention_only(family: str) -> None:
    defaults = AutoConfig.for_model(family)
    fields = {**SIZES, "num_hidden_layers": 2, "num_local_experts": 4, "num_experts": 4, "num_experts_per_tok": 2,
              "sliding_window": 4}
    config = AutoConfig.for_model(family, **{k: v for k, v in fields.items() if hasattr(defaults, k)})
    config._experts_implementation = "eager"
    module = HFCausalLM(config).double()
    assert module.token_mixers() == []


class CausalConv(nn.Module):
    """A depthwise causal convolution over the sequence (kernel 3), then the feed-forward it wraps: mixes tokens."""

    def __init__(self, width: int, inner: nn.Module) -> None:
        super().__init__()
        self.conv = nn.Conv1d(width, width, kernel_size=3, groups=width, padding=2)
        self.inner = inner

    def forward(self, x: Tensor) -> Tensor:
        mixed = self.conv(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)  # [b, s, width], causal
        return self.inner(mixed)


def test_a_hand_written_convolution_in_a_transformers_llama_is_found() -> None:
    model = AutoModelForCausalLM.from_config(transformers.LlamaConfig(**{**SIZES, "num_hidden_layers": 2})).double()
    model.model.layers[1].mlp = CausalConv(32, model.model.layers[1].mlp).double()
    module = HFCausalLM(model)
    # the convolution's own output is longer (its padding), so the module that holds it is the one named
    assert [m.describe() for m in module.token_mixers()] == ["layer model.layers.1: model.layers.1.mlp (CausalConv)"]
    with pytest.raises(NotImplementedError, match=r"layer model\.model\.layers\.1: model\.model\.layers\.1\.mlp"
                                                  r" \(CausalConv\) mixes tokens outside attention"):
        module.refuse_token_mixers(2)


def test_a_hand_written_convolution_in_the_own_llama_is_found() -> None:
    module = LlamaLM(LlamaConfig.tiny(mlp_tiles=1))
    assert module.token_mixers() == []
    assert GPTLM(GPTConfig.tiny()).token_mixers() == []
    block = module.model.layers[1]
    block.mlp = CausalConv(64, block.mlp)
    assert [m.describe() for m in module.token_mixers()] == ["layer layers.1: layers.1.mlp (CausalConv)"]
    with pytest.raises(NotImplementedError, match=r"LlamaLM: layer model\.layers\.1: model\.layers\.1\.mlp"
                                                  r" \(CausalConv\) mixes tokens outside attention"):
        module.refuse_token_mixers(2)
    module.refuse_token_mixers(1)


def test_every_mixer_is_named_not_only_the_first() -> None:
    """A mixer spreads the changed position to every later one, which hides the next mixer: the probe silences
    each one found and looks again."""
    config = hybrid_config("recurrent_gemma")
    config.num_hidden_layers, config.block_types = 4, ["recurrent"] * 3 + ["attention"]
    module = HFCausalLM(config).double()
    assert [m.module for m in module.token_mixers()] == [f"model.layers.{i}.temporal_block.rg_lru" for i in range(3)]


def test_a_model_read_from_a_directory_is_probed_once_its_weights_are_in(tmp_path: Path) -> None:
    _quiet(lambda: AutoModelForCausalLM.from_config(hybrid_config("qwen3_5_text"))).save_pretrained(tmp_path)
    module = HFCausalLM(str(tmp_path))
    # on the meta device: nothing to run yet, so nothing installed or probed
    assert module.weights_pending and module.recurrences == [] and module.token_mixers() is None
    module.load_weights()
    assert module.recurrences == ["model.layers.0.linear_attn"] and module.token_mixers() == []


def test_the_router_loss_counts_the_routers_of_every_layer() -> None:
    """Qwen3-Next's linear-attention layers route their MoE too: each router feeds the auxiliary loss."""
    config = hybrid_config("qwen3_next")
    config.output_router_logits = True
    module = HFCausalLM(config)
    routers = [m for m in module.modules() if isinstance(m, router_class(module.model)[0])]
    assert len(routers) == 2 and all(isinstance(r.__dict__.get("forward"), RouterTap) for r in routers)


def test_qwen3_next_trains_in_one_process_with_the_router_loss_of_every_layer(monkeypatch, fresh_seed: int) -> None:
    """At sequence_parallel_size=1 Qwen3-Next trains exactly: its auxiliary loss over the routers of its
    linear-attention layers too (they were left out: 0.055 off), equal to transformers' own loss (float64, the
    router's softmax and the auxiliary loss's float32 steps in float64 on both sides, as tests/hf/test_hf_moe.py)."""
    router = next(c for n, c in vars(modeling_qwen3_next).items() if n.endswith("TopKRouter"))
    monkeypatch.setattr(router, "forward", _router_in_input_dtype)
    monkeypatch.setattr(modeling_qwen3_next, "load_balancing_loss_func",
                        _float64_source(modeling_qwen3_next.load_balancing_loss_func))
    config = hybrid_config("qwen3_next")
    config.output_router_logits, config.router_aux_loss_coef = True, 0.5
    module = HFCausalLM(config, mlp_tiles=1, loss_tiles=1)
    _redraw(module.model, fresh_seed)
    module = module.double()
    data = TokenDataset(2, 32, 64, fresh_seed)
    ref_loss, ref_grads = _oracle(module, "plain", data)
    ours = one_process_step(module, data)
    assert_same_step([ours], ref_loss, ref_grads, tol=1e-10, label=f"qwen3_next seed={fresh_seed}")


def test_the_probe_length_is_no_model_dimension() -> None:
    assert PROBE_LENGTH not in SIZES.values()


def _own_conv_model() -> LlamaLM:
    module = LlamaLM(LlamaConfig.tiny(vocab_size=64, mlp_tiles=1))
    module.model.layers[1].mlp = CausalConv(64, module.model.layers[1].mlp)
    return module


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["recurrent_gemma", "own-conv"])
def test_fit_at_sp2_refuses_on_every_rank_before_any_step(kind: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = _quiet(lambda: HFCausalLM(hybrid_config(kind))) if kind != "own-conv" else _own_conv_model()
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[StepMarker(str(tmp_path))],
                        strategy=FPDTStrategy(sequence_parallel_size=2, chunk_size=8, attention_backend="math",
                                              start_method="fork"))
    with pytest.raises(Exception, match=r"mixes tokens outside attention.*sequence_parallel_size=2"):
        trainer.fit(module, dataloader(TokenDataset(2, 32, 64, 0), 2))
    assert not list(tmp_path.glob("step*"))  # no rank reached an optimizer step


def test_dropout_is_not_mixing_and_the_modes_come_back() -> None:
    """The probe runs in eval mode (dropout would make the runs differ everywhere) and leaves each module's mode as
    it was."""
    config = transformers.LlamaConfig(**{**SIZES, "num_hidden_layers": 2, "attention_dropout": 0.0})
    model = AutoModelForCausalLM.from_config(config).double()
    model.model.layers[0].mlp.act_fn = nn.Sequential(nn.SiLU(), nn.Dropout(0.5))
    model.train()
    model.model.layers[1].eval()
    module = HFCausalLM(model, mlp_tiles=1)
    assert module.token_mixers() == []
    assert model.model.layers[0].training and not model.model.layers[1].training
