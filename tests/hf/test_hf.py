"""Hugging Face import/export (lightning_fpdt.models.convert): same logits and loss as transformers in float64,
and the same gradients through Trainer(strategy=FPDTStrategy) with sequence parallelism and chunking."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from lightning_fpdt import FPDTStrategy  # noqa: E402
from lightning_fpdt.models import GPT, GPTLM, GPTConfig, LlamaLM, gpt_from_hf, llama_from_hf, to_hf  # noqa: E402
from tests.helpers import CaptureStep, TokenDataset, assert_same_step, dataloader  # noqa: E402
from tests.reference import rel_error  # noqa: E402


def _init(model: torch.nn.Module) -> torch.nn.Module:
    """Non-trivial weights (std ~ 1/sqrt(fan_in)), so a wrong scale or mask cannot hide (drawn from the global
    generator, which each test seeds with its ``fresh_seed``)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, p.shape[1] ** -0.5 if "wte" not in name and "embed" not in name else 1.0)
            else:
                p.normal_(1.0 if "norm" in name or "ln" in name else 0.0, 0.2)
    return model


def hf_llama() -> torch.nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, rope_theta=5000.0,
                                   max_position_embeddings=128, attn_implementation="sdpa")
    return _init(transformers.LlamaForCausalLM(cfg).double().eval())


def hf_gpt2() -> torch.nn.Module:
    cfg = transformers.GPT2Config(vocab_size=96, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                  attn_implementation="sdpa", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return _init(transformers.GPT2LMHeadModel(cfg).double().eval())


MODELS = {"llama": (hf_llama, llama_from_hf, LlamaLM), "gpt2": (hf_gpt2, gpt_from_hf, GPTLM)}


def _hf_loss(hf: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = hf(input_ids=ids).logits
    # HF's convention (shift inside the loss), computed in float64: transformers' own loss helper casts
    # logits with .float(), which would cap agreement at float32 rounding.
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)
    return logits, loss


@pytest.mark.parametrize("name", list(MODELS))
def test_from_hf_gives_the_same_logits_and_loss(name: str, tmp_path, fresh_seed: int) -> None:
    torch.manual_seed(fresh_seed)
    make_hf, from_hf, _ = MODELS[name]
    hf = make_hf()
    ours = from_hf(hf).double()
    ids = torch.randint(0, 96, (2, 40))
    labels = ids.clone()
    labels[0, 30:] = -100
    with torch.no_grad():
        ref_logits, ref_loss = _hf_loss(hf, ids, labels)
        logits = ours(ids)
        shifted = torch.full_like(labels, -100)
        shifted[:, :-1] = labels[:, 1:]
        loss = F.cross_entropy(logits.reshape(-1, 96), shifted.reshape(-1), ignore_index=-100)
    assert rel_error(logits, ref_logits) <= 1e-10
    assert rel_error(loss, ref_loss) <= 1e-10
    # a local checkpoint directory loads too, and export gives back transformers' weights
    hf.save_pretrained(tmp_path)
    from_dir = from_hf(tmp_path).double()
    with torch.no_grad():
        assert rel_error(from_dir(ids), ref_logits) <= 1e-10
        exported = to_hf(ours).double().eval()
        assert rel_error(_hf_loss(exported, ids, labels)[0], ref_logits) <= 1e-10


def test_from_hf_rejects_wrong_inputs(tmp_path, fresh_seed: int) -> None:
    torch.manual_seed(fresh_seed)
    with pytest.raises(FileNotFoundError, match="No Hugging Face checkpoint directory"):
        llama_from_hf(tmp_path / "missing")
    with pytest.raises(TypeError, match="Expected a transformers LlamaForCausalLM, got GPT2LMHeadModel"):
        llama_from_hf(hf_gpt2())
    with pytest.raises(NotImplementedError, match="to_hf: a GPT with rotary positions has no GPT-2 counterpart"):
        to_hf(GPT(GPTConfig.tiny(position_embedding="rotary")))
    with pytest.raises(TypeError, match="to_hf: expected a lightning_fpdt Llama or GPT, got Linear"):
        to_hf(torch.nn.Linear(2, 2))


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(MODELS))
def test_hf_model_trains_exactly_under_fpdt(name: str, tmp_path, fresh_seed: int) -> None:
    """sp=2 with 2 chunks: loss and every gradient equal transformers' on the whole batch."""
    torch.manual_seed(fresh_seed)
    make_hf, from_hf, lm_cls = MODELS[name]
    hf = make_hf()
    module = lm_cls(learning_rate=1e-3, warmup_steps=1)
    module.model = from_hf(hf).double()
    module.config = module.model.config
    ds = TokenDataset(2, 32, 96, seed=fresh_seed)
    # reference: transformers itself, float64, one process, whole batch
    hf.train()
    _, ref_loss = _hf_loss(hf, ds.ids, ds.labels)
    ref_loss.backward()
    grads_as_params = copy.deepcopy(hf)
    for p, src in zip(grads_as_params.parameters(), hf.parameters()):
        p.data = src.grad.clone()
    # mapped onto our parameter names by the same import code
    ref_grads = {f"model.{n}": p.detach() for n, p in from_hf(grads_as_params).double().named_parameters()}
    trainer = L.Trainer(
        accelerator="cpu", devices=2, precision="64-true", max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[CaptureStep(str(tmp_path))],
        strategy=FPDTStrategy(sequence_parallel_size=2, chunk_size=16, attention_backend="math", start_method="fork"),
    )
    trainer.fit(module, dataloader(ds, 2))
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    if name == "gpt2":  # tied: our lm_head.weight is the same tensor as wte.weight, listed once
        ref_grads.pop("model.lm_head.weight", None)
    assert_same_step(results, ref_loss.detach(), ref_grads, tol=1e-10, label=name)
