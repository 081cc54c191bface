"""``fpdt-export`` at the edges: what it refuses before it writes, and what it replaces.

Single process, no training: a tiny ``LlamaLM`` (and an ``HFCausalLM`` read from a directory) saved as a ``.ckpt``
file (its state dict and hyper-parameters, as Lightning writes them) or as a sharded directory
(``torch.distributed.checkpoint`` without a process group, and ``meta.pt``). Each case was silently wrong or a raw
traceback before: a ``--config`` of another model wrote a model without the layers it lacks; an export into an
older one left its ``model.safetensors`` beside the new index (``from_pretrained`` loaded the old weights);
``--dtype int8`` wrote zeros and ``--dtype bf16`` died in ``getattr(torch, "bf16")``; a missing, truncated or
partly copied checkpoint, a mistyped size and a moved source directory ended in tracebacks.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml
from safetensors import safe_open

transformers = pytest.importorskip("transformers")

from lightning_fpdt.export import HFExport, export, main  # noqa: E402
from lightning_fpdt.models import HFCausalLM, LlamaConfig, LlamaLM  # noqa: E402

VOCAB = 96


def llama(layers: int = 2, hidden: int = 32, **kwargs) -> LlamaLM:
    return LlamaLM(LlamaConfig.tiny(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=48, num_attention_heads=4,
                                    num_key_value_heads=2, num_hidden_layers=layers), **kwargs)


def save_ckpt(module: torch.nn.Module, path: Path) -> Path:
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}, path)
    return path


def save_sharded(module: torch.nn.Module, path: Path) -> Path:
    """A sharded checkpoint directory as ``shard_parameters=True`` writes it (one rank's files)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process": it is
        dcp.save({"state_dict": dict(module.state_dict())}, checkpoint_id=path, no_dist=True)
    torch.save({"hyper_parameters": dict(module.hparams), "epoch": 0}, path / "meta.pt")
    return path


def fit_yaml(module: LlamaLM, path: Path) -> Path:
    path.write_text(yaml.safe_dump({"model": {"class_path": "lightning_fpdt.models.LlamaLM",
                                              "init_args": dict(module.hparams)}}))
    return path


def refused(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str]:
    """``main(argv)``'s exit status and its stderr, which must be one line (no traceback)."""
    capsys.readouterr()  # what came before (transformers' progress bars)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert err.startswith("fpdt-export: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return exit_info.value.code, err


def stored(out: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in out.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    return tensors


# ---- A: the export plan against the checkpoint's tensors ---------------------------------------------------


@pytest.mark.parametrize(("other", "expected"), [
    (dict(layers=1), r"9 tensors of the checkpoint would not be exported \(model\.layers\.1\."),
    (dict(layers=3), r"tensors of the model are not in the checkpoint \(model\.layers\.2\."),
    (dict(hidden=64), r"have another shape \(model\.embed_tokens\.weight \(checkpoint \[96, 32\], model \[96, 64\]\)"),
], ids=["fewer-layers", "more-layers", "wider"])
def test_a_config_of_another_model_is_refused_before_anything_is_written(other: dict, expected: str,
                                                                         tmp_path: Path) -> None:
    ckpt = save_ckpt(llama(), tmp_path / "run.ckpt")
    wrong = fit_yaml(llama(**other), tmp_path / "other.yaml")
    with pytest.raises(ValueError, match=expected) as err:
        export(ckpt, tmp_path / "out", config=wrong)
    assert f"the LlamaLM of --config {wrong} does not match the checkpoint {ckpt}" in str(err.value)
    assert "Pass the YAML of the run that wrote this checkpoint (--config)" in str(err.value)
    assert not (tmp_path / "out").exists()
    export(ckpt, tmp_path / "out", config=fit_yaml(llama(), tmp_path / "right.yaml"))  # the run's own YAML exports
    assert len(stored(tmp_path / "out")) == len(llama().state_dict())


def test_a_sharded_checkpoint_is_checked_against_the_plan_too(tmp_path: Path, capsys) -> None:
    ckpt = save_sharded(llama(), tmp_path / "run.ckpt")
    code, err = refused([str(ckpt), str(tmp_path / "out"), "--config", str(fit_yaml(llama(1), tmp_path / "a.yaml"))],
                        capsys)
    assert code == 1 and "would not be exported (model.layers.1." in err, err
    assert not (tmp_path / "out").exists()


# ---- B: an output directory that holds a model --------------------------------------------------------------


def test_b_an_older_export_is_refused_then_replaced_whole(tmp_path: Path, capsys) -> None:
    old, new = llama(), llama()
    assert not torch.equal(old.model.embed_tokens.weight, new.model.embed_tokens.weight)
    out = tmp_path / "out"
    export(save_ckpt(old, tmp_path / "old.ckpt"), out)  # one model.safetensors
    (out / "notes.txt").write_text("mine")
    (out / "step=10").mkdir()
    ckpt = save_ckpt(new, tmp_path / "new.ckpt")
    code, err = refused([str(ckpt), str(out), "--max-shard-size", "20KB"], capsys)
    assert code == 1 and f"{out} already holds a model (config.json" in err and "--overwrite" in err, err
    main([str(ckpt), str(out), "--max-shard-size", "20KB", "--overwrite"])  # several files and an index
    assert not (out / "model.safetensors").exists()
    assert (out / "model.safetensors.index.json").is_file()
    assert (out / "notes.txt").read_text() == "mine" and (out / "step=10").is_dir()  # not a model's: kept
    assert not list(tmp_path.glob(".out.tmp-export-*"))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(reloaded.model.embed_tokens.weight, new.model.embed_tokens.weight)


def test_b_the_model_source_directory_is_never_replaced(tmp_path: Path) -> None:
    source = tmp_path / "source"
    transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2)).save_pretrained(source)
    module = HFCausalLM(str(source))
    module.load_weights()
    before = sorted(p.name for p in source.iterdir())
    with pytest.raises(FileExistsError, match="is the model's source directory"):
        export(save_ckpt(module, tmp_path / "run.ckpt"), source, overwrite=True)
    assert sorted(p.name for p in source.iterdir()) == before


def test_b_the_callback_replaces_its_own_directory_whole(tmp_path: Path) -> None:
    """``HFExport`` writes into its own directory again (a resumed run): the old files go, none is left beside the
    new ones; the model's source directory is refused when fit starts."""
    trainer = SimpleNamespace(strategy=SimpleNamespace(barrier=lambda name: None), is_global_zero=True)
    out = tmp_path / "hf"
    first, second = llama(), llama()
    HFExport(str(out), max_shard_size="20KB").write(trainer, first, out)
    assert (out / "model.safetensors.index.json").is_file()
    HFExport(str(out)).write(trainer, second, out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    assert torch.equal(stored(out)["model.embed_tokens.weight"], second.model.embed_tokens.weight.detach())
    source = tmp_path / "source"
    transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2)).save_pretrained(source)
    with pytest.raises(FileExistsError, match="is the model's source directory"):
        HFExport(str(source)).on_fit_start(trainer, HFCausalLM(str(source)))


def test_b_an_export_into_the_working_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = save_ckpt(llama(), tmp_path / "run.ckpt")
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    main([str(ckpt), "."])
    assert sorted(os.listdir(".")) == ["config.json", "generation_config.json", "model.safetensors"]


# ---- C: the export dtype ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "dtype"), [("bf16", torch.bfloat16), ("fp16", torch.float16),
                                             ("FP32", torch.float32), ("torch.float64", torch.float64)])
def test_c_dtype_aliases(name: str, dtype: torch.dtype, tmp_path: Path) -> None:
    module = llama()
    main([str(save_ckpt(module, tmp_path / "run.ckpt")), str(tmp_path / "out"), "--dtype", name])
    tensors = stored(tmp_path / "out")
    assert {t.dtype for t in tensors.values()} == {dtype}
    assert torch.equal(tensors["model.embed_tokens.weight"], module.model.embed_tokens.weight.detach().to(dtype))
    assert HFExport(str(tmp_path), dtype=name).dtype == dtype


@pytest.mark.parametrize("name", ["int8", "bool", "complex64", "float8_e4m3fn", "bfloat"])
def test_c_a_dtype_that_is_not_floating_is_refused(name: str, tmp_path: Path, capsys) -> None:
    ckpt = save_ckpt(llama(), tmp_path / "run.ckpt")
    code, err = refused([str(ckpt), str(tmp_path / "out"), "--dtype", name], capsys)
    assert code == 2 and f"dtype {name!r} is not an export dtype; use float32 (fp32), bfloat16 (bf16)" in err, err
    with pytest.raises(ValueError, match="is not an export dtype"):
        export(ckpt, tmp_path / "out", dtype=getattr(torch, name, name))
    with pytest.raises(ValueError, match="is not an export dtype"):
        HFExport(str(tmp_path), dtype=name)
    assert not (tmp_path / "out").exists()


# ---- D: every failure is one line naming the problem and the fix ---------------------------------------------


def test_d_checkpoint_failures_are_one_line(tmp_path: Path, capsys) -> None:
    out = str(tmp_path / "out")
    code, err = refused([str(tmp_path / "nothere.ckpt"), out], capsys)
    assert code == 1 and "no checkpoint at" in err and "pass the .ckpt file or the sharded" in err, err

    ckpt = save_ckpt(llama(), tmp_path / "run.ckpt")
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(ckpt.read_bytes()[:20000])
    code, err = refused([str(truncated), out], capsys)
    assert code == 1 and f"the checkpoint {truncated} is truncated or corrupt (20000 bytes" in err, err
    assert "export an earlier checkpoint" in err

    for size in ("5XB", "big", "-1GB", "0"):
        code, err = refused([str(ckpt), out, f"--max-shard-size={size}"], capsys)
        assert code == 2 and f"max shard size {size!r} is not a size; give e.g. 5GB" in err, err

    code, err = refused([str(ckpt), out, "--config", str(tmp_path / "fit.yaml")], capsys)
    assert code == 1 and "fit.yaml: no such file" in err, err
    code, err = refused([str(ckpt), out, "--tokenizer", str(tmp_path / "tok")], capsys)
    assert code == 1 and "tok is not a directory" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage", ["missing", "truncated", "corrupt"])
def test_d_a_partly_copied_sharded_checkpoint_is_refused(damage: str, tmp_path: Path, capsys) -> None:
    """A missing or short file is found from the metadata before anything is read; a corrupt one (the right length)
    when its tensor is read, with nothing left in OUT or beside it."""
    ckpt = save_sharded(llama(), tmp_path / "run.ckpt")
    [shard] = ckpt.glob("*.distcp")
    data = shard.read_bytes()
    if damage == "missing":
        shard.unlink()
    else:
        shard.write_bytes(data[:5000] if damage == "truncated" else data[:100] + bytes(2900) + data[3000:])
    code, err = refused([str(ckpt), str(tmp_path / "out")], capsys)
    expected = {"missing": "lacks files that hold model tensors (__0_0.distcp)",
                "truncated": "has files shorter than its .metadata says (__0_0.distcp (5000 of",
                "corrupt": "cannot give model.embed_tokens.weight (__0_0.distcp: RuntimeError: "}[damage]
    assert code == 1 and f"the sharded checkpoint {ckpt} {expected}" in err and "Copy the whole directory" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.ckpt"]


def test_d_a_moved_source_directory_is_named(tmp_path: Path, capsys) -> None:
    source = tmp_path / "source"
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(source)
    hf = HFCausalLM(str(source))
    hf.load_weights()
    hf_ckpt = save_ckpt(hf, tmp_path / "hf.ckpt")
    bundled = LlamaLM(hf_checkpoint=str(source))
    bundled.load_weights()
    bundled_ckpt = save_ckpt(bundled, tmp_path / "llama.ckpt")
    shutil.move(source, tmp_path / "moved")

    code, err = refused([str(hf_ckpt), str(tmp_path / "out")], capsys)
    assert code == 1 and (f"the model directory {source}, named by the checkpoint's hyper-parameters, does not"
                          " exist (moved or deleted?)") in err, err
    assert "pass the fit's YAML (--config FIT_YAML) with where it is now (model.init_args.model)" in err
    fit = tmp_path / "fit.yaml"
    fit.write_text(yaml.safe_dump({"model": {"class_path": "lightning_fpdt.models.HFCausalLM",
                                             "init_args": {"model": str(source)}}}))
    code, err = refused([str(hf_ckpt), str(tmp_path / "out"), "--config", str(fit)], capsys)
    assert code == 1 and f"the model directory {source}, named by --config {fit}, does not exist" in err, err
    code, err = refused([str(bundled_ckpt), str(tmp_path / "out")], capsys)
    assert code == 1 and f"the pretrained directory {source} (hf_checkpoint), named by" in err, err
    assert "Pass --tokenizer DIR" in err
    main([str(bundled_ckpt), str(tmp_path / "out"), "--tokenizer", str(tmp_path / "moved")])  # the fix
    assert (tmp_path / "out" / "config.json").is_file()
