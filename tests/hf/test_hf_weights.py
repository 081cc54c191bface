"""Loading a safetensors checkpoint onto a meta-device ``HFCausalLM``: whole, and sharded (each rank its rows).

The oracle is transformers' own ``from_pretrained`` of the same directory (every parameter and buffer) and the
checkpoint's tensors sliced as FSDP2 shards them; the Trainer-level cases compare one training step of the
model loaded from the path with plain transformers in one process (float64, 1e-10).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader
from transformers import (
    AttentionInterface,
    AutoModelForCausalLM,
    Cohere2Config,
    Gemma2Config,
    Gemma3TextConfig,
    GptOssConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    OPTConfig,
    PretrainedConfig,
)

from lightning_fpdt import FPDTStrategy
from lightning_fpdt.hf import attention as hf_attention
from lightning_fpdt.hf import causal_lm as hf_causal_lm_module
from lightning_fpdt.hf import masks as hf_masks
from lightning_fpdt.models import HFCausalLM, LlamaLM
from lightning_fpdt.models.weight_files import SafetensorsFiles, owned_rows
from lightning_fpdt.strategy import launcher
from lightning_fpdt.strategy.sharding import load_shards_of, shard_module
from lightning_fpdt.testing import run_on_ranks
from tests.helpers import TokenDataset, assert_same_step
from tests.hf.test_hf_causal_lm import SEQ, VOCAB, Case, _config, _fit, _plain, _redraw, each_sample_alone
from tests.reference import rel_error

SIZES = dict(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)


def _saved(config: PretrainedConfig, directory: Path, seed: int, dtype: torch.dtype = torch.float32,
           max_shard_size: str | None = None) -> AutoModelForCausalLM:
    """A random model of ``config`` (weights std 1/sqrt(fan_in)) saved to ``directory``; returned."""
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    _redraw(model, seed)
    model.save_pretrained(str(directory), **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return model


def _checkpoint_tensor(directory: Path, names: list[str]) -> torch.Tensor:
    """The stored tensor of a parameter, under any of its (tied) names."""
    checkpoint = SafetensorsFiles.find(directory)
    key = next(name for name in names if name in checkpoint.files)
    with safe_open(str(directory / checkpoint.files[key]), framework="pt") as f:
        return f.get_tensor(key)


CONFIGS = {
    "llama-tied": lambda: LlamaConfig(tie_word_embeddings=True, **SIZES),
    "llama-untied": lambda: LlamaConfig(tie_word_embeddings=False, **SIZES),
    # computed buffers beyond RoPE's (Gemma's embed_scale), a softcapped head, sliding layers
    "gemma2": lambda: Gemma2Config(head_dim=8, sliding_window=4, **SIZES),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_whole_load_equals_from_pretrained(name: str, tmp_path: Path, fresh_seed: int) -> None:
    """Built on the meta device at construction; ``load_weights`` gives every parameter and buffer
    ``from_pretrained`` gives (a sharded index of several files), tied weights tied, and its logits are plain
    transformers' (float64)."""
    _saved(CONFIGS[name](), tmp_path, fresh_seed, dtype=torch.float64, max_shard_size="40KB")
    assert len(set(SafetensorsFiles.find(tmp_path).files.values())) > 1  # several files, one index
    module = HFCausalLM(str(tmp_path))
    assert module.weights_pending and all(p.is_meta for p in module.parameters())
    module.load_weights()
    assert not module.weights_pending
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    ours = dict(module.model.named_parameters(remove_duplicate=False))
    for key, value in ref.named_parameters(remove_duplicate=False):
        assert ours[key].dtype == value.dtype and torch.equal(ours[key], value), key
    for key, value in ref.named_buffers():
        assert torch.equal(module.model.get_buffer(key), value), key
    tied = module.model.get_output_embeddings().weight is module.model.get_input_embeddings().weight
    assert tied == ref.config.tie_word_embeddings
    ids = torch.randint(0, SIZES["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(fresh_seed))
    logits = _plain(module)(ids).logits
    assert rel_error(module(ids), logits) <= 1e-10


def test_dtype_option_and_first_forward_load(tmp_path: Path, fresh_seed: int) -> None:
    """``from_pretrained_kwargs={"dtype": ...}`` builds in that dtype; without a Trainer the first forward
    reads the weights on the input's device."""
    ref = _saved(CONFIGS["llama-untied"](), tmp_path, fresh_seed)
    module = HFCausalLM(str(tmp_path), from_pretrained_kwargs={"dtype": "float64"})
    assert {p.dtype for p in module.parameters()} == {torch.float64} and module.weights_pending
    module(torch.zeros(1, 4, dtype=torch.long))
    assert not module.weights_pending
    for key, value in ref.state_dict().items():
        assert torch.equal(module.model.state_dict()[key], value.double()), key


def test_load_state_dict_of_a_pending_model(tmp_path: Path, fresh_seed: int) -> None:
    """A strict ``load_state_dict`` (``load_from_checkpoint``, export) fills the meta-device model from the
    state dict alone; a non-strict one reads the checkpoint first, so no tensor is left uninitialised."""
    ref = _saved(CONFIGS["llama-untied"](), tmp_path, fresh_seed)
    state = {f"model.{k}": v + 1 for k, v in ref.state_dict().items()}
    strict = HFCausalLM(str(tmp_path))
    strict.load_state_dict(state)
    assert all(torch.equal(strict.state_dict()[k], v) for k, v in state.items())
    complete = HFCausalLM(str(tmp_path))  # non-strict, but every tensor given: nothing is read
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SafetensorsFiles, "read", lambda *args: pytest.fail("read a tensor the state dict has"))
        complete.load_state_dict(state, strict=False)
    assert all(torch.equal(complete.state_dict()[k], v) for k, v in state.items())
    partial = HFCausalLM(str(tmp_path))
    partial.load_state_dict({"model.model.norm.weight": state["model.model.norm.weight"]}, strict=False)
    assert torch.equal(partial.model.model.norm.weight, state["model.model.norm.weight"])
    assert torch.equal(partial.model.lm_head.weight, ref.lm_head.weight)


PROBED = {  # dense families with windows on some layers, and a mixture of experts (gpt-oss: stored as trained)
    **CONFIGS,
    "gemma3": lambda: Gemma3TextConfig(head_dim=8, sliding_window=4, **SIZES),
    "mistral": lambda: MistralConfig(sliding_window=4, **SIZES),
    "cohere2": lambda: Cohere2Config(sliding_window=4, **SIZES),
    "gpt_oss": lambda: GptOssConfig(num_local_experts=2, num_experts_per_tok=1, head_dim=8, sliding_window=4, **SIZES),
}


@pytest.mark.parametrize("name", list(PROBED))
def test_the_mask_probe_reads_the_same_on_the_meta_device(name: str, tmp_path: Path, fresh_seed: int,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The mask probe reads each layer's mask rule and window on the meta device at construction as it does on
    real tensors; a forward that needs values there (gpt-oss routes its experts by them) is probed once its
    weights are in, on real tensors."""
    config = PROBED[name]()
    _saved(config, tmp_path, fresh_seed)
    seen: list[tuple[str, dict]] = []

    def recording(model: Any, layers: list) -> bool:
        done = hf_masks.check_mask_windows(model, layers)
        seen.append((next(model.parameters()).device.type, {n: m._fpdt_seen for n, m in layers} if done else {}))
        return done

    monkeypatch.setitem(AttentionInterface._global_mapping, hf_masks._PROBE, _keeping(hf_masks._probe_attention))
    monkeypatch.setattr(hf_attention, "check_mask_windows", recording)
    monkeypatch.setattr(hf_causal_lm_module, "check_mask_windows", recording)
    module = HFCausalLM(str(tmp_path))
    module.load_weights()
    real = AutoModelForCausalLM.from_config(config)
    hf_attention.check_supported(real)  # the probe on real tensors: the oracle
    oracle = seen.pop()
    assert oracle[0] == "cpu" and len(oracle[1]) == config.num_hidden_layers
    expected = [("meta", oracle[1])] if _runs_on_meta(config) else [("meta", {}), ("cpu", oracle[1])]
    assert seen == expected


def _runs_on_meta(config: PretrainedConfig) -> bool:
    """Whether this torch runs the model's forward on meta tensors, with the probe's inputs (two tokens, an all-ones
    mask): gpt-oss's experts' grouped product refuses float32 there in torch 2.13 and takes it in 2.15, so its
    probe waits for the weights only on the former."""
    with torch.device("meta"):  # eager attention: sdpa's mask check reads values (the probe runs its own function)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    tokens = torch.zeros(1, 2, dtype=torch.long, device="meta")
    try:
        with torch.no_grad():
            model.base_model(input_ids=tokens, attention_mask=torch.ones_like(tokens), use_cache=False)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _keeping(probe: Any) -> Any:
    """The probe's attention function, also keeping what it records on the layer (the probe pops its own)."""
    def attention(module: Any, *args: Any, **kwargs: Any) -> Any:
        out = probe(module, *args, **kwargs)
        module.__dict__["_fpdt_seen"] = module.__dict__["_fpdt_probed"]
        return out
    return attention


def test_renamed_checkpoints_load_through_from_pretrained(tmp_path: Path, fresh_seed: int,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """Mixtral's experts are stored per expert and fused by transformers on load: the names do not match the
    modules', so the model loads through ``from_pretrained`` (named in the log), equal to it."""
    config = MixtralConfig(num_local_experts=2, num_experts_per_tok=1, **SIZES)
    _saved(config, tmp_path, fresh_seed)
    module = HFCausalLM(str(tmp_path))
    assert not module.weights_pending
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    for key, value in ref.state_dict().items():
        assert torch.equal(module.model.state_dict()[key], value), key


def _sharded_slices(rank: int, world: int, directory: str) -> dict[str, Any]:
    module = HFCausalLM(directory)
    assert module.weights_pending
    shard_module(module, init_device_mesh("cpu", (world,)), "32-true", offload_optimizer=False)
    load_shards_of(module, torch.device("cpu"))
    names: dict[int, list[str]] = {}
    for name, param in module.model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    checked, rows_held, held = 0, 0, 0
    for name, param in module.model.named_parameters():
        assert isinstance(param, DTensor), name
        full = _checkpoint_tensor(Path(directory), names[id(param)])
        start, end = owned_rows(param, name, "test")
        assert torch.equal(param.to_local(), full[start:end]), f"rank {rank}: {name} rows {start}:{end}"
        checked, rows_held = checked + 1, rows_held + end - start
        held += param.to_local().numel()
    return {"checked": checked, "rows": rows_held, "held": held,
            "tied": module.model.get_output_embeddings().weight is module.model.get_input_embeddings().weight}


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["llama-tied", "llama-untied", "gpt_oss"])
def test_each_rank_reads_exactly_its_shards(name: str, tmp_path: Path, fresh_seed: int) -> None:
    """3 ranks (vocabulary 100, 32-row projections and 2 experts do not divide: the last shards are shorter or
    empty): every parameter's local shard equals its checkpoint rows, and together the ranks hold each element
    once. gpt-oss is probed after loading, through FSDP2, and every layer is sharded again afterwards."""
    ref = _saved(PROBED[name](), tmp_path, fresh_seed)
    results = run_on_ranks(_sharded_slices, 3, str(tmp_path), start_method="fork")
    parameters = list(ref.parameters())
    assert {r["checked"] for r in results} == {len(parameters)}
    assert sum(r["held"] for r in results) == sum(p.numel() for p in parameters)
    assert all(r["tied"] == ref.config.tie_word_embeddings for r in results)


@pytest.mark.distributed
@pytest.mark.parametrize("stack", [True, False], ids=["sharded", "replicated"])
def test_fit_from_a_checkpoint_path_equals_plain_transformers(stack: bool, tmp_path: Path, fresh_seed: int) -> None:
    """One step of ``HFCausalLM(path)`` under FPDTStrategy at sp=2 (sharded: FSDP2, tiles, checkpointing; read
    shard by shard in setup; replicated: read whole in ``configure_model``) equals plain transformers on the
    same weights, each sample alone (float64, loss and every gradient)."""
    torch.manual_seed(fresh_seed)
    case = Case("llama", sp=2, chunk_size=8, kv_heads=1, offload="emulate", stack=stack)
    ref = _saved(_config("llama", 1), tmp_path / "ckpt", fresh_seed, dtype=torch.float64)
    tiles = dict(mlp_tiles=3, loss_tiles=5) if stack else dict(mlp_tiles=1, loss_tiles=1)
    module = HFCausalLM(str(tmp_path / "ckpt"), learning_rate=1e-3, warmup_steps=1, **tiles)
    assert module.weights_pending
    data = TokenDataset(2, SEQ, VOCAB, fresh_seed)
    results = _fit(module, data, case, tmp_path)
    eager = HFCausalLM(ref, **tiles)
    ref_loss, ref_grads = each_sample_alone(_plain(eager), data)
    assert_same_step(results, ref_loss, ref_grads, tol=1e-10, label=f"from path, stack={stack} seed={fresh_seed}")
    for r in results:
        assert r["sharded_layers"] == [stack] * ref.config.num_hidden_layers


@pytest.mark.distributed
def test_validate_of_a_sharded_checkpoint_never_gathers_the_model(tmp_path: Path, fresh_seed: int,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """``Trainer.validate`` with the fork launcher reads each rank's shards and sends no weights back: nothing
    gathers the full model (the gather the launcher does after ``fit`` raises here; forked ranks inherit it)."""
    _saved(CONFIGS["llama-untied"](), tmp_path / "ckpt", fresh_seed)
    monkeypatch.setattr(launcher, "get_model_state_dict",
                        lambda *args, **kwargs: pytest.fail("the full model was gathered"))
    module = HFCausalLM(str(tmp_path / "ckpt"))
    trainer = L.Trainer(accelerator="cpu", devices=2, limit_val_batches=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp_path),
                        strategy=FPDTStrategy(sequence_parallel_size=2, chunk_size=8, shard_parameters=True,
                                              start_method="fork"))
    data = TokenDataset(2, 16, SIZES["vocab_size"], fresh_seed)
    trainer.validate(module, DataLoader(data, batch_size=2), verbose=False)
    assert module.weights_pending  # this process got nothing: the ranks read their shards themselves


def test_a_pending_model_moves_and_casts_without_reading(tmp_path: Path, fresh_seed: int) -> None:
    """``.cpu()`` / ``.to(device)`` of a model whose weights are pending (Lightning's teardown in a launching
    process that never read them, a user's move before the first forward) leaves its tensors on the meta
    device; a dtype change applies, and the weights are then read in it."""
    ref = _saved(CONFIGS["llama-untied"](), tmp_path, fresh_seed)
    module = HFCausalLM(str(tmp_path))
    module.cpu()
    module.to("cpu", torch.float64)
    assert module.weights_pending and {p.dtype for p in module.parameters()} == {torch.float64}
    module.load_weights()
    for key, value in ref.state_dict().items():
        assert torch.equal(module.model.state_dict()[key], value.double()), key


# ---- a checkpoint that lacks a tensor, or a file that cannot be read ------------------------------------------


def _drop(directory: Path, names: list[str], rename: bool = False) -> None:
    """Remove (or rename) the tensors ``names`` from the safetensors files of ``directory``."""
    files = SafetensorsFiles.find(directory)
    for file in sorted({files.files[name] for name in names}):
        tensors = load_file(directory / file)
        for name in names:
            if name in tensors:
                tensor = tensors.pop(name)
                if rename:
                    tensors[f"{name}_renamed"] = tensor
        save_file(tensors, directory / file, metadata={"format": "pt"})
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        content = json.loads(index.read_text())
        for name in names:
            file = content["weight_map"].pop(name)
            if rename:
                content["weight_map"][f"{name}_renamed"] = file
        index.write_text(json.dumps(content))


@pytest.mark.parametrize("shards", [None, "40KB"], ids=["one-file", "index"])
def test_a_checkpoint_missing_tensors_is_refused_unless_random_values_are_meant(shards: str | None, tmp_path: Path,
                                                                                fresh_seed: int) -> None:
    """Before: built on the meta device failed its name check, loaded through from_pretrained, which drew the
    missing tensors at random, and training went on (the log said the tensors were being converted)."""
    ref = _saved(CONFIGS["llama-untied"](), tmp_path, fresh_seed, max_shard_size=shards)
    missing = ["model.layers.1.mlp.up_proj.weight", "model.norm.weight"]
    _drop(tmp_path, missing)
    with pytest.raises(ValueError) as err:
        HFCausalLM(str(tmp_path))
    assert (f"HFCausalLM: {tmp_path} lacks 2 tensors of LlamaForCausalLM (model.layers.1.mlp.up_proj.weight,"
            " model.norm.weight): from_pretrained would initialise them at random") in str(err.value)
    assert "from_pretrained_kwargs={'allow_missing_weights': True}" in str(err.value)
    with pytest.warns(UserWarning, match=r"lacks 2 tensors .* initialised at random \(allow_missing_weights=True\)"):
        module = HFCausalLM(str(tmp_path), from_pretrained_kwargs={"allow_missing_weights": True})
    for key, value in ref.state_dict().items():
        if key not in missing:
            assert torch.equal(module.model.state_dict()[key], value), key


def test_a_tensor_under_another_name_is_refused_through_from_pretrained(tmp_path: Path, fresh_seed: int) -> None:
    """A name the model does not have may be one transformers converts: from_pretrained loads it, and the tensors
    it still did not find are refused."""
    _saved(CONFIGS["llama-untied"](), tmp_path, fresh_seed)
    _drop(tmp_path, ["model.layers.0.self_attn.o_proj.weight"], rename=True)
    with pytest.raises(ValueError, match=r"lacks 1 tensor of LlamaForCausalLM \(model\.layers\.0\.self_attn\.o_proj"):
        HFCausalLM(str(tmp_path))


@pytest.mark.parametrize(("kind", "shards"), [("hf", None), ("hf", "40KB"), ("llama", "40KB")],
                         ids=["hf-one-file", "hf-index", "llama-index"])
def test_a_truncated_or_missing_safetensors_file_is_named(kind: str, shards: str | None, tmp_path: Path,
                                                         fresh_seed: int) -> None:
    """Before: safetensors' own error, naming no file (a truncated one), or a raw FileNotFoundError (a missing one)."""
    _saved(CONFIGS["llama-untied"](), tmp_path, fresh_seed, max_shard_size=shards)
    file = sorted(tmp_path.glob("*.safetensors"))[-1]
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    owner = "HFCausalLM" if kind == "hf" else "LlamaLM"
    build = (lambda: HFCausalLM(str(tmp_path))) if kind == "hf" else (lambda: LlamaLM(hf_checkpoint=str(tmp_path)))
    with pytest.raises(ValueError, match=rf"{owner}: the safetensors file {file} cannot be read \(.*\): it is"
                                         " truncated or corrupt"):
        build()
    if shards is not None:
        file.unlink()
        with pytest.raises(FileNotFoundError, match=f"{owner}: {file} does not exist, but model.safetensors.index"):
            build()


class _Modes(L.Callback):
    """The names of the modules in eval mode at each training batch."""

    def __init__(self) -> None:
        self.in_eval: list[list[str]] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        self.in_eval.append([name for name, m in pl_module.named_modules() if not m.training])


def test_fit_trains_every_module_of_a_model_loaded_in_eval_mode(tmp_path: Path, fresh_seed: int) -> None:
    """transformers' from_pretrained returns its model in eval mode, and Lightning keeps the modes it is given: a
    dropout would never apply. HFCausalLM reads a directory in training mode, and fit trains every module of a model
    handed over in eval mode."""
    _saved(LlamaConfig(**SIZES), tmp_path, fresh_seed)
    assert HFCausalLM(str(tmp_path)).model.training
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert not loaded.training
    modes = _Modes()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[modes])
    trainer.fit(HFCausalLM(loaded), DataLoader(TokenDataset(2, 16, SIZES["vocab_size"], fresh_seed), batch_size=2))
    assert modes.in_eval == [[]], modes.in_eval


def test_a_directory_is_refused_as_its_config_is(tmp_path: Path) -> None:
    """OPT's forward changes the base model's hidden states before its head. Read from a directory its probe runs on
    the meta device (before the weights are read), where it raised torch's "Tensor on device meta is not on the
    expected device cpu"; it is refused with the reason its config gets."""
    config = OPTConfig(vocab_size=100, hidden_size=32, ffn_dim=48, num_hidden_layers=2, num_attention_heads=4)
    with pytest.raises(NotImplementedError, match="transforms the base model's hidden states") as from_config:
        HFCausalLM(config)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path))
    with pytest.raises(NotImplementedError) as from_directory:
        HFCausalLM(str(tmp_path))
    assert str(from_directory.value) == str(from_config.value)

