"""``fpdt-export`` and ``HFExport`` write the output head as the model has it: a tied ``lm_head`` once (it is the
embedding), an untied one as its own tensor, for HFCausalLM, LlamaLM and GPTLM alike.

Single process, no training: each case's float64 module (weights drawn afresh) is saved as a ``.ckpt`` file (its
state dict and hyper-parameters, as Lightning writes them), exported with :func:`export` and with
``HFExport.write``, and reloaded with transformers: the head must be the module's own tensor (bitwise), the logits
the module's (1e-12 relative). An export that skipped an untied head as if it were tied would reload with a
freshly drawn head (transformers initializes a missing weight), which the suite's trained-run export test, whose
HFCausalLM and GPTLM are tied, does not see.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from safetensors import safe_open

transformers = pytest.importorskip("transformers")

from lightning_fpdt.export.hf_directory import HFExport, export  # noqa: E402
from lightning_fpdt.models import GPTLM, GPTConfig, HFCausalLM, LlamaConfig, LlamaLM  # noqa: E402
from tests.hf.test_hf import _init  # noqa: E402
from tests.reference import rel_error  # noqa: E402

VOCAB = 96

# name: (model kind, tie_word_embeddings)
CASES = {f"{kind}-{'tied' if tied else 'untied'}": (kind, tied)
         for kind in ("hf", "llama", "gpt") for tied in (True, False)}


def make_module(kind: str, tied: bool, source: Path) -> L.LightningModule:
    """A tiny float64 model; HFCausalLM from a transformers Llama saved to ``source``."""
    if kind == "hf":
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
        _init(transformers.AutoModelForCausalLM.from_config(config).double()).save_pretrained(source)
        module = HFCausalLM(str(source), from_pretrained_kwargs={"dtype": torch.float64})
        module.load_weights()  # built on the meta device: read the checkpoint now, not at the first forward
        return module
    if kind == "llama":  # transformers' LlamaRMSNorm computes in float32: ours too, so both sides match
        config = LlamaConfig.tiny(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                                  num_key_value_heads=2, norm_compute_dtype="float32", tie_word_embeddings=tied)
        module = LlamaLM(config)
    else:
        module = GPTLM(GPTConfig.tiny(vocab_size=VOCAB, n_positions=64, n_embd=32, n_head=4,
                                      tie_word_embeddings=tied))
    _init(module.model.double())
    return module


def heads(module: L.LightningModule) -> tuple[torch.Tensor, torch.Tensor]:
    """The module's (input embedding, output head) weights."""
    model = module.model
    if isinstance(module, HFCausalLM):
        return model.get_input_embeddings().weight, model.get_output_embeddings().weight
    embedding = model.embed_tokens if isinstance(module, LlamaLM) else model.wte
    return embedding.weight, model.lm_head.weight


def written(out: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in out.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    return tensors


@pytest.mark.parametrize("case", list(CASES))
def test_export_writes_the_head_as_the_model_has_it(case: str, tmp_path: Path, fresh_seed: int) -> None:
    kind, tied = CASES[case]
    torch.manual_seed(fresh_seed)
    module = make_module(kind, tied, tmp_path / "source").double().eval()
    embedding, head = heads(module)
    assert (head is embedding) == tied
    if not tied:
        assert not torch.equal(head, embedding)  # else a head taken from the embedding would pass
    ckpt = tmp_path / "run.ckpt"
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}, ckpt)
    export(ckpt, tmp_path / "export")
    trainer = SimpleNamespace(strategy=SimpleNamespace(barrier=lambda name: None), is_global_zero=True)
    HFExport(str(tmp_path / "callback")).write(trainer, module, tmp_path / "callback")

    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(fresh_seed))
    with torch.no_grad():
        expected = module(ids)
    for out in (tmp_path / "export", tmp_path / "callback"):
        hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64).eval()
        assert hf.config.tie_word_embeddings == tied
        assert torch.equal(hf.get_output_embeddings().weight, head.detach()), f"{case} {out.name}: reloaded head"
        assert torch.equal(hf.get_input_embeddings().weight, embedding.detach()), f"{case} {out.name}: embedding"
        with torch.no_grad():
            logits = hf(input_ids=ids).logits
        error = rel_error(logits, expected)
        assert error <= 1e-12, f"{case} {out.name}: logits rel. error {error:.2e}"
        tensors = written(out)
        has_head = "lm_head.weight" in tensors
        assert has_head == (not tied), (f"{case} {out.name}: lm_head.weight {'is' if has_head else 'is not'} written,"
                                        f" the model's head is {'tied' if tied else 'untied'}")
        if not tied:
            assert torch.equal(tensors["lm_head.weight"], head.detach()), f"{case} {out.name}: lm_head.weight"
