"""``fpdt-export`` and ``HFExport`` (lightning_fpdt.export.hf_directory): a 2-step run's checkpoint, replicated (a
``.ckpt`` file) and sharded (a DCP directory), becomes a directory transformers loads with the trained module's logits
(float64, 1e-12 relative), for HFCausalLM, LlamaLM and GPTLM; a bfloat16 export holds the trained weights cast;
the tokenizer files come along; a small shard size gives several files and a valid index."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors import safe_open

transformers = pytest.importorskip("transformers")

from lightning_fpdt import FPDTStrategy  # noqa: E402
from lightning_fpdt.data.toy import build_tokenizer  # noqa: E402
from lightning_fpdt.export import HFExport, export, main  # noqa: E402
from lightning_fpdt.models import GPTLM, GPTConfig, HFCausalLM, LlamaConfig, LlamaLM  # noqa: E402
from lightning_fpdt.testing import run_in_fork  # noqa: E402
from tests.helpers import TokenDataset, dataloader  # noqa: E402
from tests.hf.test_hf import _init  # noqa: E402
from tests.reference import rel_error  # noqa: E402

pytestmark = pytest.mark.distributed  # the runs fork 2 ranks
VOCAB = 384  # the toy tokenizer's
KINDS = ("hf", "llama", "gpt")


def make_module(kind: str, source: Path) -> L.LightningModule:
    """A tiny float64 model of ``kind``; HFCausalLM from the directory ``source`` (its weights and tokenizer)."""
    if kind == "hf":
        return HFCausalLM(str(source), mlp_tiles=2, loss_tiles=3, learning_rate=3e-3,
                          from_pretrained_kwargs={"dtype": torch.float64})
    if kind == "llama":  # transformers' LlamaRMSNorm computes in float32: ours too, so both sides match
        config = LlamaConfig.tiny(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                                  num_key_value_heads=2, norm_compute_dtype="float32")
        return LlamaLM(config, learning_rate=3e-3)
    return GPTLM(GPTConfig.tiny(vocab_size=VOCAB, n_positions=64, n_embd=32, n_head=4), learning_rate=3e-3)


def train(kind: str, shard: bool, source: Path, out: Path) -> None:
    """2 steps at sp=2 (2 forked ranks, float64), a checkpoint at step 2 (``run.ckpt``), ``HFExport`` at the end,
    and the trained weights in ``final.pt``."""
    torch.manual_seed(11)
    module = make_module(kind, source).double()  # in this process too: the trained weights come back into it
    if kind != "hf":
        _init(module.model)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, precision="64-true", max_steps=2,
        strategy=FPDTStrategy(sequence_parallel_size=2, attention_backend="math", shard_parameters=shard,
                              start_method="fork"),
        callbacks=[ModelCheckpoint(dirpath=out, filename="run", every_n_train_steps=2),
                   HFExport(str(out / "callback"), tokenizer=str(source))],
        logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    trainer.fit(module, dataloader(TokenDataset(4, 16, VOCAB, seed=3), 1))
    torch.save({k: v.detach().clone() for k, v in module.state_dict().items()}, out / "final.pt")


def jobs(shard: bool, source: Path, root: Path) -> None:
    for kind in KINDS:
        train(kind, shard, source, root / kind)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[bool, Path]:
    """The three models trained replicated and sharded; ``source`` holds HFCausalLM's weights and the tokenizer."""
    source = tmp_path_factory.mktemp("source")
    build_tokenizer(source)
    torch.manual_seed(5)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    _init(transformers.AutoModelForCausalLM.from_config(config).double()).save_pretrained(source)
    result = {"source": source}
    for shard in (False, True):
        root = tmp_path_factory.mktemp(f"shard{shard}")
        proc = run_in_fork(functools.partial(jobs, shard, source, root), ["export-jobs"], timeout=240)
        assert proc.returncode == 0, proc.stderr[-4000:]
        result[shard] = root
    return result


def trained_logits(kind: str, run: Path, source: Path, ids: torch.Tensor) -> torch.Tensor:
    module = make_module(kind, source).double().eval()
    module.load_state_dict(torch.load(run / "final.pt"))
    with torch.no_grad():
        return module(ids)


def reloaded(out: Path, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(out, dtype=dtype, attn_implementation="sdpa").eval()


def file_sizes(out: Path) -> dict[str, int]:
    """Bytes of tensor data per safetensors file."""
    sizes = {}
    for file in out.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            sizes[file.name] = sum(f.get_tensor(k).nbytes for k in f.keys())
    return sizes


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
@pytest.mark.parametrize("kind", KINDS)
def test_export_reloads_with_the_trained_logits(runs, kind: str, shard: bool, tmp_path: Path, fresh_seed) -> None:
    run, source = runs[shard] / kind, runs["source"]
    ckpt = run / "run.ckpt"
    assert ckpt.is_dir() == shard
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(fresh_seed))
    expected = trained_logits(kind, run, source, ids)
    out = tmp_path / "float64"
    # replicated: the saved hyper-parameters; sharded: the CLI, with a fit YAML for our models
    if shard:
        args = [str(ckpt), str(out), "--tokenizer", str(source)]
        if kind != "hf":
            module = make_module(kind, source)
            fit = tmp_path / "fit.yaml"
            fit.write_text(yaml.safe_dump({"model": {"class_path": f"lightning_fpdt.models.{type(module).__name__}",
                                                 "init_args": dict(module.hparams)}}))
            args += ["--config", str(fit)]
        main(args)
    else:
        export(ckpt, out, tokenizer=None if kind == "hf" else str(source))
    hf = reloaded(out)
    assert next(hf.parameters()).dtype == torch.float64
    with torch.no_grad():
        logits = hf(input_ids=ids).logits
    assert rel_error(logits, expected) <= 1e-12, rel_error(logits, expected)
    assert expected.std() > 0.1  # non-trivial logits
    # the callback wrote the same tensors from the module in memory (sharded: gathered tensor by tensor)
    from_callback = reloaded(run / "callback").state_dict()
    for name, tensor in hf.state_dict().items():
        assert torch.equal(from_callback[name], tensor), name
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"):
        assert (out / name).is_file() and (run / "callback" / name).is_file(), name
    for written in (out, run / "callback"):  # what the model's own save_pretrained writes: serving tools read it
        assert json.loads((written / "config.json").read_text())["architectures"] == [type(hf).__name__], written
    if kind == "gpt":  # GPT-2's <|endoftext|> id only in GPT-2's vocabulary, and no dropout the model never had
        assert (hf.config.bos_token_id, hf.config.eos_token_id) == (None, None) and VOCAB <= 50256
        assert (hf.config.resid_pdrop, hf.config.embd_pdrop, hf.config.attn_pdrop) == (0.0, 0.0, 0.0)
    assert transformers.AutoTokenizer.from_pretrained(out)("hello world").input_ids
    assert hf.config.tie_word_embeddings == (kind != "llama")
    if hf.config.tie_word_embeddings:
        assert hf.get_output_embeddings().weight is hf.get_input_embeddings().weight
        written = set()
        for file in out.glob("*.safetensors"):
            with safe_open(file, "pt") as f:
                written |= set(f.keys())
        assert "lm_head.weight" not in written  # a tied tensor is written once

    # bfloat16 in shards of at most `limit` bytes: the float64 export's weights cast, several files, a valid index
    largest = max(t.numel() for t in hf.state_dict().values()) * 2
    limit = largest + 1  # the largest tensor fits; two of the larger ones do not
    small = tmp_path / "bf16"
    main([str(ckpt), str(small), "--dtype", "bfloat16", "--max-shard-size", str(limit), "--tokenizer", str(source)])
    sizes = file_sizes(small)
    assert len(sizes) > 1 and max(sizes.values()) <= limit, sizes
    index = json.loads((small / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(sizes)
    assert index["metadata"]["total_size"] == sum(sizes.values())
    cast = reloaded(small, torch.bfloat16).state_dict()
    assert cast.keys() == hf.state_dict().keys()
    for name, tensor in hf.state_dict().items():
        assert torch.equal(cast[name], tensor.to(torch.bfloat16)), name


def test_export_errors_name_the_fix(runs, tmp_path: Path) -> None:
    ckpt = runs[False] / "llama" / "run.ckpt"
    with pytest.raises(ValueError, match="is not a size"):
        export(ckpt, tmp_path / "x", max_shard_size="big")
    wrong = tmp_path / "fit.yaml"  # another model than the checkpoint's
    wrong.write_text("model:\n  class_path: lightning_fpdt.models.GPTLM\n  init_args: {}\n")
    with pytest.raises(ValueError, match="the GPTLM of --config .* does not match the checkpoint"):
        export(ckpt, tmp_path / "y", config=wrong)
    assert not (tmp_path / "y").exists()  # refused before anything is written
    larger = build_tokenizer(tmp_path / "tokenizer-512", vocab_size=512)  # ids past the model's 384 rows
    with pytest.raises(ValueError, match=rf"the tokenizer of .*tokenizer-512 has {len(larger)} tokens, more than the"
                                         rf" model's vocab_size={VOCAB}: ids {VOCAB} to {len(larger) - 1} have no"):
        export(ckpt, tmp_path / "z", tokenizer=str(tmp_path / "tokenizer-512"))
    assert not (tmp_path / "z").exists()
    # the callback refuses it when fit starts (on every rank), not after training
    callback = HFExport(dirpath=str(tmp_path / "hf"), tokenizer=str(tmp_path / "tokenizer-512"))
    module = LlamaLM(LlamaConfig(**{**LlamaConfig.tiny().to_dict(), "vocab_size": VOCAB}))
    with pytest.raises(ValueError, match=rf"has {len(larger)} tokens, more than the model's vocab_size={VOCAB}"):
        callback.on_fit_start(SimpleNamespace(log_dir=None, default_root_dir=str(tmp_path)), module)
