"""``LlamaLM`` / ``GPTLM(hf_checkpoint=...)``: our models built on the meta device, their weights read from a Hugging
Face checkpoint directory where they are needed (lightning_fpdt.models.pretrained).

Oracles: ``llama_from_hf`` / ``gpt_from_hf`` of the same directory (whole: every parameter and buffer; sharded: each
FSDP2 local shard is the rows of the converted tensor, and the ranks together read each stored element once), and
one process's training step of a ``LlamaLM`` holding ``llama_from_hf``'s weights (float64, 1e-10).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import transformers
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from lightning_fpdt import FPDTStrategy
from lightning_fpdt.cli import FPDTCLI
from lightning_fpdt.export.hf_directory import export
from lightning_fpdt.models import GPTLM, CausalLM, LlamaLM, gpt_from_hf, llama_from_hf
from lightning_fpdt.models.weight_files import SafetensorsFiles, owned_rows
from lightning_fpdt.strategy.sharding import load_shards_of, shard_module
from lightning_fpdt.testing import run_on_ranks
from tests.helpers import CaptureStep, TokenDataset, assert_same_step, dataloader, reference_step
from tests.reference import rel_error

VOCAB = 100  # 34 + 34 + 32 rows over 3 ranks
LLAMA = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 5000.0}
GPT2 = dict(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4)  # q/k/v: 11 + 11 + 10 rows


CASES = {  # (LightningModule, converter, transformers config); a scaled RoPE: its buffers are computed, not read
    "llama-tied": (LlamaLM, llama_from_hf, lambda: transformers.LlamaConfig(tie_word_embeddings=True, **LLAMA)),
    "llama-untied": (LlamaLM, llama_from_hf,
                     lambda: transformers.LlamaConfig(tie_word_embeddings=False, rope_parameters=YARN, **LLAMA)),
    "gpt2-tied": (GPTLM, gpt_from_hf, lambda: transformers.GPT2Config(tie_word_embeddings=True, **GPT2)),
    "gpt2-untied": (GPTLM, gpt_from_hf, lambda: transformers.GPT2Config(tie_word_embeddings=False, **GPT2)),
}


def _saved(config: Any, directory: Path, seed: int) -> None:
    """A float64 model of ``config`` saved to ``directory`` in several safetensors files: matrices std
    1/sqrt(fan_in) (GPT-2's ``Conv1D`` weights are ``[in, out]``), norms 1 + noise, biases small noise."""
    model = transformers.AutoModelForCausalLM.from_config(config).double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64)
            if p.dim() == 2:
                conv1d = name.startswith("transformer.h.") and "weight" in name and "ln_" not in name
                p.copy_(noise / (p.shape[0] if conv1d else p.shape[1]) ** 0.5)
            else:
                p.copy_(1 + 0.1 * noise if "norm" in name or "ln_" in name else 0.1 * noise)
    model.save_pretrained(str(directory), max_shard_size="20KB")


def _counting_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the elements each ``SafetensorsFiles.read`` returns."""
    counts: list[int] = []
    read = SafetensorsFiles.read

    def counted(self: SafetensorsFiles, *args: Any, **kwargs: Any) -> torch.Tensor:
        tensor = read(self, *args, **kwargs)
        counts.append(tensor.numel())
        return tensor

    monkeypatch.setattr(SafetensorsFiles, "read", counted)
    return counts


@pytest.mark.parametrize("name", list(CASES))
def test_whole_load_equals_the_converted_model(name: str, tmp_path: Path, fresh_seed: int,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Built on the meta device in torch's default dtype; the first forward reads every parameter the converter
    gives (several files, one index), each stored element once, with the same buffers, tied weights tied, and
    the converter's logits."""
    cls, convert, config = CASES[name]
    _saved(config(), tmp_path, fresh_seed)
    assert len(set(SafetensorsFiles.find(tmp_path).files.values())) > 1
    module = cls(hf_checkpoint=str(tmp_path))
    assert module.weights_pending and all(p.is_meta and p.dtype == torch.float32 for p in module.parameters())
    counts = _counting_reads(monkeypatch)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(fresh_seed))
    logits = module.double()(ids)  # the first forward reads the weights
    assert not module.weights_pending
    ref = convert(str(tmp_path))
    assert module.config == ref.config
    ours = dict(module.model.named_parameters(remove_duplicate=False))
    assert ours.keys() == dict(ref.named_parameters(remove_duplicate=False)).keys()
    for key, value in ref.named_parameters(remove_duplicate=False):
        assert ours[key].dtype == value.dtype and torch.equal(ours[key], value), key
    for key, value in ref.named_buffers():
        assert torch.equal(module.model.get_buffer(key), value), key
    tied = module.model.lm_head.weight is next(module.model.parameters())  # the token embedding comes first
    assert tied == module.config.tie_word_embeddings
    assert sum(counts) == sum(p.numel() for p in ref.parameters())  # each element once (GPT-2: c_attn in thirds)
    assert torch.equal(logits, ref(ids))


def _sharded_shards(rank: int, world: int, directories: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Per case: shard the meta-device module over ``world`` ranks, read its shards, compare each with the rows of
    the converted tensor, and count the elements this rank read."""
    results = {}
    for name, directory in directories.items():
        cls, convert, _ = CASES[name]
        module = cls(hf_checkpoint=directory).double()
        shard_module(module, init_device_mesh("cpu", (world,)), "64-true", offload_optimizer=False)
        with pytest.MonkeyPatch.context() as patch:
            counts = _counting_reads(patch)
            load_shards_of(module, torch.device("cpu"))
        full = dict(convert(directory).named_parameters())
        held = 0
        for key, param in module.model.named_parameters():
            assert isinstance(param, DTensor), key
            start, end = owned_rows(param, key, "test")
            assert torch.equal(param.to_local(), full[key][start:end]), f"rank {rank}: {name} {key} rows {start}:{end}"
            held += param.to_local().numel()
        buffers = dict(convert(directory).named_buffers())
        assert all(torch.equal(b, buffers[k]) for k, b in module.model.named_buffers()), name
        # the validation's metric kept its zero defaults (to_empty of the root gave them uninitialised memory)
        accuracy = module.val_answer_accuracy
        accuracy.reset()
        accuracy.update(torch.tensor([1, 2, 3]), torch.tensor([1, 2, 0]))
        assert accuracy.compute().item() == pytest.approx(2 / 3), (name, accuracy.correct, accuracy.total)
        results[name] = {"read": sum(counts), "held": held, "total": sum(p.numel() for p in full.values()),
                         "tied": module.model.lm_head.weight is next(module.model.parameters())}
    return results


def _shards_on_host(rank: int, world: int, directory: str) -> dict[str, list[str]]:
    module = LlamaLM(hf_checkpoint=directory).double()
    shard_module(module, init_device_mesh("cpu", (world,)), "64-true", offload_optimizer=False)
    load_shards_of(module, torch.device("meta"), on_host=True)  # "meta" stands for the GPU: only buffers go there
    full = dict(llama_from_hf(directory).named_parameters())
    for key, param in module.model.named_parameters():
        start, end = owned_rows(param, key, "test")
        assert torch.equal(param.to_local(), full[key][start:end]), key
    return {"parameters": sorted({f"{p.device.type}/{p.to_local().device.type}" for p in module.parameters()}),
            "buffers": sorted({b.device.type for b in module.buffers()}),
            "metric": module.val_answer_accuracy.correct.device.type}


@pytest.mark.distributed
def test_offload_optimizer_makes_the_shards_on_the_host_and_the_buffers_on_the_device(tmp_path: Path,
                                                                                       fresh_seed: int) -> None:
    """With ``offload_optimizer`` a meta-device model's shards are made and read in host memory (FSDP2's CPU offload
    refuses a sharded parameter whose DTensor says it is on the GPU, which one made there keeps saying after its
    shard moves to the host) and only its buffers (RoPE's frequencies) and its metric's states go to the device."""
    _saved(CASES["llama-untied"][2](), tmp_path / "llama", fresh_seed)
    placed = run_on_ranks(_shards_on_host, 1, str(tmp_path / "llama"), start_method="fork")[0]
    assert placed == {"parameters": ["cpu/cpu"], "buffers": ["meta"], "metric": "meta"}, placed


def test_offload_optimizer_on_gpus_asks_for_nccl_and_gloo() -> None:
    """Host-side shards and gradients need a CPU backend for clipping's all-reduce and a full state dict's
    all-gather: ``cuda:nccl,cpu:gloo`` unless the user names a backend; NCCL alone without offload."""
    from lightning.pytorch.plugins.environments import LightningEnvironment

    def backend(**options: Any) -> str:
        gpus = [torch.device("cuda", 0), torch.device("cuda", 1)]  # named only: nothing asks CUDA
        strategy = FPDTStrategy(parallel_devices=gpus, cluster_environment=LightningEnvironment(), **options)
        return strategy._get_process_group_backend()

    assert backend(shard_parameters=True, offload_optimizer=True) == "cuda:nccl,cpu:gloo"
    assert backend(shard_parameters=True, offload_optimizer=True, process_group_backend="nccl") == "nccl"
    assert backend(shard_parameters=True) == "nccl"
    assert not torch.cuda.is_initialized()


@pytest.mark.distributed
def test_each_rank_reads_exactly_its_shards(tmp_path: Path, fresh_seed: int) -> None:
    """3 ranks (vocabulary 100, 32-row projections, GPT-2's fused and transposed c_attn: uneven shards): every local
    shard equals its rows of the converted tensor, each rank reads exactly the elements it holds, and together
    the ranks read each element once; tied weights stay tied."""
    directories = {}
    for i, (name, (_, _, config)) in enumerate(CASES.items()):
        _saved(config(), tmp_path / name, fresh_seed + i)
        directories[name] = str(tmp_path / name)
    results = run_on_ranks(_sharded_shards, 3, directories, start_method="fork")
    for name, (_, _, config) in CASES.items():
        per_rank = [r[name] for r in results]
        assert all(r["read"] == r["held"] for r in per_rank), (name, per_rank)
        assert sum(r["read"] for r in per_rank) == per_rank[0]["total"], (name, per_rank)
        assert all(r["tied"] == config().tie_word_embeddings for r in per_rank), name


@pytest.mark.distributed
@pytest.mark.parametrize("shard", [True, False], ids=["sharded", "replicated"])
def test_fit_step_from_a_checkpoint_equals_the_converted_model(shard: bool, tmp_path: Path, fresh_seed: int) -> None:
    """One step of ``LlamaLM(hf_checkpoint=...)`` at sp=2, chunked (sharded: ``shard_parameters=True``, read shard
    by shard in setup; replicated: read whole in ``configure_model``) equals one process's
    step of a LlamaLM holding ``llama_from_hf``'s weights (float64, loss and every gradient); its checkpoint (a
    sharded directory, or a file) reloads from the saved hyper-parameters and ``fpdt-export`` writes a directory
    transformers loads with the trained logits."""
    source = tmp_path / "source"
    _saved(CASES["llama-untied"][2](), source, fresh_seed)
    # float64 in this process too (free on the meta device): the trained weights come back into it
    module = LlamaLM(hf_checkpoint=str(source), learning_rate=1e-3, warmup_steps=1, loss_tiles=3).double()
    data = TokenDataset(2, 32, VOCAB, fresh_seed)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, precision="64-true", max_steps=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[CaptureStep(str(tmp_path)), ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="run")],
        strategy=FPDTStrategy(sequence_parallel_size=2, chunk_size=8, attention_backend="math", shard_parameters=shard,
                              start_method="fork"),
    )
    trainer.fit(module, dataloader(data, 2))
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    ref = LlamaLM(learning_rate=1e-3, warmup_steps=1, loss_tiles=3)
    ref.model = llama_from_hf(str(source)).double()
    ref_loss, ref_grads = reference_step(ref, data.full_batch())
    assert_same_step(results, ref_loss, ref_grads, tol=1e-10, label=f"hf_checkpoint shard={shard} seed={fresh_seed}")
    assert all((r["local_numel"] < r["numel"]) == shard for r in results)  # sharded: each rank held its shards only
    # the parent holds the trained weights (the launcher's full state dict); the export reloads with its logits
    assert not module.weights_pending
    out = export(tmp_path / "ckpt" / "run.ckpt", tmp_path / "hf")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float64)
    with torch.no_grad():
        assert rel_error(reloaded(input_ids=data.ids).logits, module(data.ids)) <= 1e-12
    assert out == tmp_path / "hf"


def test_configure_model_reads_in_the_precision_dtype(tmp_path: Path, fresh_seed: int) -> None:
    """Under a Trainer without sharding, ``configure_model`` sets a ``*-true`` precision's dtype on the meta-device
    model before reading: a float32-built LlamaLM validated at 64-true holds the float64 checkpoint's values
    exactly (read through float32 first, they would be rounded)."""
    _saved(CASES["llama-tied"][2](), tmp_path, fresh_seed)
    module = LlamaLM(hf_checkpoint=str(tmp_path))
    assert {p.dtype for p in module.parameters()} == {torch.float32}
    trainer = L.Trainer(accelerator="cpu", devices=1, precision="64-true", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.validate(module, dataloader(TokenDataset(2, 16, VOCAB, fresh_seed), 2), verbose=False)
    assert not module.weights_pending
    ref = dict(llama_from_hf(str(tmp_path)).named_parameters())
    for key, param in module.model.named_parameters():
        assert param.dtype == torch.float64 and torch.equal(param, ref[key]), key


def test_cli_yaml_and_saved_hyper_parameters(tmp_path: Path, fresh_seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The LightningCLI YAML form (``hf_checkpoint``, ``config_overrides``) builds the pending model; its saved
    hyper-parameters (the config with the overrides applied, the directory) rebuild the same model."""
    _saved(CASES["gpt2-tied"][2](), tmp_path / "gpt2", fresh_seed)
    fit = {"model": {"class_path": "lightning_fpdt.models.GPTLM",
                     "init_args": {"hf_checkpoint": str(tmp_path / "gpt2"), "config_overrides": {"mlp_tiles": 2},
                                   "learning_rate": 0.01}},
           "data": {"class_path": "lightning_fpdt.data.PasskeyDataModule"}, "trainer": {"logger": False}}
    (tmp_path / "fit.yaml").write_text(yaml.safe_dump(fit))
    monkeypatch.setattr(sys, "argv", ["fpdt-train"])
    cli = FPDTCLI(CausalLM, L.LightningDataModule, subclass_mode_model=True, subclass_mode_data=True, run=False,
                  args=["--config", str(tmp_path / "fit.yaml")])
    module = cli.model
    assert isinstance(module, GPTLM) and module.weights_pending and module.config.mlp_tiles == 2
    assert module.config.n_embd == GPT2["n_embd"] and module.learning_rate == 0.01
    again = GPTLM(**module.hparams)
    assert again.config == module.config and again.weights_pending
    again.load_weights()
    assert torch.equal(again.model.wte.weight, gpt_from_hf(str(tmp_path / "gpt2")).wte.weight.float())


def test_errors_name_the_fix(tmp_path: Path, fresh_seed: int) -> None:
    _saved(CASES["gpt2-tied"][2](), tmp_path / "gpt2", fresh_seed)
    _saved(CASES["llama-tied"][2](), tmp_path / "llama", fresh_seed)
    with pytest.raises(FileNotFoundError, match="LlamaLM: no Hugging Face checkpoint directory at"):
        LlamaLM(hf_checkpoint=str(tmp_path / "missing"))
    with pytest.raises(TypeError, match=r"LlamaLM: .* holds a 'gpt2' checkpoint .*Train it with HFCausalLM"):
        LlamaLM(hf_checkpoint=str(tmp_path / "gpt2"))
    with pytest.raises(ValueError, match=r"config_overrides \['hidden'\] are not fields of LlamaConfig"):
        LlamaLM(hf_checkpoint=str(tmp_path / "llama"), config_overrides={"hidden": 64})
    with pytest.raises(ValueError, match=r"does not hold the weights .*model.embed_tokens.weight \(stored \[100, 32\]"):
        LlamaLM(hf_checkpoint=str(tmp_path / "llama"), config_overrides={"vocab_size": 128})
    for file in (tmp_path / "llama").glob("*.safetensors*"):
        file.unlink()
    with pytest.raises(FileNotFoundError, match=r"holds no model.safetensors .*llama_from_hf\(path\)"):
        LlamaLM(hf_checkpoint=str(tmp_path / "llama"))
