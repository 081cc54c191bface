"""RoPE scaling for context extension: the own schedules (lightning_fpdt.layers.rope) equal transformers' bit for bit,
an ``HFCausalLM`` given YaRN through ``config_overrides`` trains beyond its original context exactly like plain
transformers with the same scaling, the own ``Llama`` with YaRN equals its ``to_hf`` export, and the overrides
come in from a YAML."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from transformers import LlamaConfig as HFLlamaConfig
from transformers import LlamaForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from lightning_fpdt.layers.rope import RopeScaling, rope_frequencies
from lightning_fpdt.models import HFCausalLM, LlamaLM, llama_from_hf, to_hf
from lightning_fpdt.models.llama import LlamaConfig
from lightning_fpdt.parallel.binding import SequenceParallelContext
from tests.helpers import TokenDataset, assert_same_step
from tests.hf.test_hf_causal_lm import SIZES, VOCAB, Case, _fit, _redraw, each_sample_alone
from tests.reference import rel_error
from tests.test_cli import fpdt_train_here

ORIGINAL, LONG = 16, 48  # the pre-training context, and a training sequence 3x beyond it
SCHEDULES: dict[str, dict[str, Any]] = {
    "linear": dict(rope_type="linear", factor=4.0),
    "llama3": dict(rope_type="llama3", factor=8.0, original_max_position_embeddings=ORIGINAL, low_freq_factor=1.0,
                   high_freq_factor=4.0),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIGINAL),
    # DeepSeek-V3's form: the attention factor from mscale / mscale_all_dim, an untruncated correction range
    "yarn-deepseek": dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=16,
                          beta_slow=2, mscale=1.0, mscale_all_dim=0.707, truncate=False),
}


def _hf_config(schedule: dict[str, Any], head_dim: int, theta: float) -> HFLlamaConfig:
    original = schedule.get("original_max_position_embeddings", ORIGINAL)
    return HFLlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, max_position_embeddings=4 * original,
                         rope_parameters={**schedule, "rope_theta": theta})


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize(("head_dim", "theta"), [(16, 10000.0), (128, 500000.0)])
def test_frequencies_equal_transformers(name: str, head_dim: int, theta: float) -> None:
    schedule = SCHEDULES[name]
    theirs, their_scaling = ROPE_INIT_FUNCTIONS[schedule["rope_type"]](_hf_config(schedule, head_dim, theta), "cpu")
    ours, our_scaling = rope_frequencies(head_dim, theta, RopeScaling(**schedule))
    assert ours.dtype == theirs.dtype == torch.float32
    assert torch.equal(ours, theirs), (ours - theirs).abs().max()
    assert our_scaling == their_scaling
    default, _ = rope_frequencies(head_dim, theta)
    assert not torch.equal(ours, default)  # the schedule is scaled: a dropped scaling would fail above


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(rope_type="dynamic", factor=2.0), "rope_type 'dynamic' is not one of"),
        (dict(rope_type="yarn", factor=4.0), r"needs \['original_max_position_embeddings'\]"),
        (dict(rope_type="linear", factor=4.0, beta_fast=32), r"does not read \['beta_fast'\]"),
        (dict(rope_type="linear", factor=0.5), "factor must be >= 1"),
    ],
    ids=["unknown-type", "missing-field", "unused-field", "factor-below-1"],
)
def test_bad_schedule_is_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LlamaConfig.tiny(rope_scaling=fields)


# ---- HFCausalLM: YaRN from config_overrides, one Trainer.fit step at sp=2, chunked ------------------------------

YARN = {"rope_type": "yarn", "factor": 4.0}  # original_max_position_embeddings: the config's max (16)


@pytest.mark.distributed
def test_hf_yarn_fit_step_beyond_the_original_context_equals_plain_transformers(tmp_path, fresh_seed: int) -> None:
    torch.manual_seed(fresh_seed)
    case = Case("llama", sp=2, chunk_size=8, kv_heads=1, offload="emulate")  # 24 tokens per rank: 3 chunks
    config = HFLlamaConfig(**SIZES, num_key_value_heads=1, max_position_embeddings=ORIGINAL)
    module = HFCausalLM(config, config_overrides={"rope_parameters": YARN, "max_position_embeddings": 4 * ORIGINAL},
                        mlp_tiles=1, loss_tiles=1, learning_rate=1e-3, warmup_steps=1)
    assert config.max_position_embeddings == ORIGINAL  # the caller's config is not changed
    _redraw(module.model, fresh_seed)
    # the oracle: plain transformers given the same YaRN schedule in its config (its own RoPE buffers, sdpa)
    rope = {**YARN, "original_max_position_embeddings": ORIGINAL, "rope_theta": 10000.0}
    ref = LlamaForCausalLM(HFLlamaConfig(**SIZES, num_key_value_heads=1, max_position_embeddings=4 * ORIGINAL,
                                         rope_parameters=rope, attn_implementation="sdpa")).double()
    ref.load_state_dict(module.model.state_dict())
    assert torch.equal(module.model.model.rotary_emb.inv_freq, ref.model.rotary_emb.inv_freq)
    assert module.model.model.rotary_emb.attention_scaling == ref.model.rotary_emb.attention_scaling > 1
    data = TokenDataset(2, LONG, VOCAB, fresh_seed)
    results = _fit(module, data, case, tmp_path)
    ref_loss, ref_grads = each_sample_alone(ref, data)
    assert_same_step(results, ref_loss, ref_grads, tol=1e-10, label=f"yarn sp2 C8 seq{LONG} seed={fresh_seed}")


def test_unknown_override_is_refused_naming_the_key_and_the_config_class() -> None:
    config = HFLlamaConfig(**SIZES, num_key_value_heads=2)
    with pytest.raises(ValueError, match=r"\['rope_scalling'\] are not attributes of LlamaConfig"):
        HFCausalLM(config, config_overrides={"rope_scalling": YARN})
    with pytest.raises(ValueError, match="cannot apply to a built LlamaForCausalLM"):
        HFCausalLM(LlamaForCausalLM(config), config_overrides={"max_position_embeddings": 64})


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_length_dependent_rope_is_refused(rope_type: str) -> None:
    """transformers picks these frequencies from the largest position id a rank's rotary embedding sees: under
    sequence parallelism, one rank's shard."""
    config = HFLlamaConfig(**SIZES, num_key_value_heads=2, max_position_embeddings=ORIGINAL)
    half = SIZES["hidden_size"] // SIZES["num_attention_heads"] // 2
    fields = {"factor": 2.0} if rope_type == "dynamic" else {"short_factor": [1.0] * half, "long_factor": [2.0] * half}
    module = HFCausalLM(config, config_overrides={"rope_parameters": {"rope_type": rope_type, **fields}})
    module.bind_sequence_parallel(SequenceParallelContext(chunk_size=8))  # one process sees every position
    with pytest.raises(NotImplementedError, match=rf"RoPE type '{rope_type}' \(layers: all\) picks its frequencies"):
        module.bind_sequence_parallel(_TwoRanks(chunk_size=8))


class _TwoRanks(SequenceParallelContext):
    """A context that reports two ranks without a process group (what the strategy binds at sp=2)."""

    @property
    def size(self) -> int:
        return 2


def test_overrides_apply_before_the_weights_load_from_a_path(tmp_path, fresh_seed: int) -> None:
    torch.manual_seed(fresh_seed)
    LlamaForCausalLM(HFLlamaConfig(**SIZES, num_key_value_heads=2, max_position_embeddings=ORIGINAL)).save_pretrained(
        tmp_path)
    plain = HFCausalLM(str(tmp_path), from_pretrained_kwargs={"local_files_only": True})
    module = HFCausalLM(str(tmp_path), from_pretrained_kwargs={"local_files_only": True},
                        config_overrides={"rope_parameters": YARN, "max_position_embeddings": 4 * ORIGINAL})
    assert plain.weights_pending and module.weights_pending  # built on the meta device: read where needed
    plain.load_weights()
    module.load_weights()  # the computed RoPE buffers follow the overridden config
    c = module.model.config
    assert c.max_position_embeddings == 4 * ORIGINAL and c.rope_parameters["original_max_position_embeddings"] == 16
    expected, scaling = rope_frequencies(SIZES["hidden_size"] // SIZES["num_attention_heads"], 10000.0,
                                         RopeScaling(**YARN, original_max_position_embeddings=ORIGINAL))
    assert torch.equal(module.model.model.rotary_emb.inv_freq, expected)
    assert module.model.model.rotary_emb.attention_scaling == scaling
    for (n, p), (_, q) in zip(plain.named_parameters(), module.named_parameters(), strict=True):
        assert torch.equal(p, q), n  # the checkpoint's weights, loaded after the config changed
    assert module.hparams["config_overrides"]["rope_parameters"] == YARN  # a reload applies them again


# ---- the own Llama: YaRN equals transformers' Llama given the same scaling by to_hf -------------------------------


def test_llama_with_yarn_equals_its_to_hf_export(fresh_seed: int) -> None:
    torch.manual_seed(fresh_seed)
    yarn = {**YARN, "original_max_position_embeddings": ORIGINAL}
    config = LlamaConfig.tiny(rope_scaling=yarn, max_position_embeddings=4 * ORIGINAL, norm_compute_dtype="float32")
    module = LlamaLM(config)
    assert LlamaLM(module.hparams["config"]).config.rope_scaling == config.rope_scaling  # a checkpoint's reload
    ours = module.model.double()
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5 if p.dim() == 2 else 1 + 0.1 * torch.randn_like(p))
    hf = to_hf(ours).eval()
    hf.config._attn_implementation = "sdpa"
    assert hf.config.rope_parameters == {**yarn, "rope_theta": config.rope_theta}
    assert hf.config.max_position_embeddings == 4 * ORIGINAL
    assert torch.equal(ours.layers[0].attention.rope.inv_freq, hf.model.rotary_emb.inv_freq.float())
    ids = torch.randint(0, config.vocab_size, (2, LONG))
    error = rel_error(ours(ids), hf(input_ids=ids).logits)
    assert error <= 1e-10, f"LlamaLM with YaRN vs transformers: rel. error {error:.2e} (seed={fresh_seed})"
    back = llama_from_hf(hf)  # and back: the scaling and the context come along
    assert back.config.rope_scaling == config.rope_scaling and back.config.max_position_embeddings == 4 * ORIGINAL


# ---- from a YAML: config_overrides through the CLI parser -------------------------------------------------------

HF_TINY = Path(__file__).resolve().parent.parent / "examples" / "configs" / "hf_tiny_cpu.yaml"


def _with_overrides(tmp_path: Path, overrides: dict[str, Any]) -> str:
    document = yaml.safe_load(HF_TINY.read_text())
    document["model"]["init_args"]["config_overrides"] = overrides
    path = tmp_path / "extended.yaml"
    path.write_text(yaml.safe_dump(document))
    return str(path)


def test_config_overrides_from_a_yaml(tmp_path, monkeypatch, capsys) -> None:
    overrides = {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}, "max_position_embeddings": 4096}
    code, out, err = fpdt_train_here(monkeypatch, capsys, "fit", "--config", _with_overrides(tmp_path, overrides),
                                     "--print_config")
    assert code == 0, err[-3000:]
    printed = yaml.safe_load(out)["model"]["init_args"]["config_overrides"]
    assert printed == overrides
    # an unknown key is refused when the model is built, before any process starts
    code, _, err = fpdt_train_here(monkeypatch, capsys, "fit", "--config",
                                   _with_overrides(tmp_path, {"max_position_embedding": 4096}))
    assert code != 0 and "['max_position_embedding'] are not attributes of LlamaConfig" in err, err[-3000:]
