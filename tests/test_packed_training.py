"""Real ``Trainer.fit`` steps on packed batches equal training each document alone (float64).

A packed sample holds documents one after another, marked by ``position_ids`` restarting at 0. The
reference runs every document as its own sequence in one process (no strategy) and takes the mean
cross-entropy over all of their targets; the FPDT step must give the same loss and every gradient.
Right-padded batches with an ``attention_mask`` must equal the unpadded samples.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import lightning as L
import pytest
import torch
from torch.utils.data import Dataset

from lightning_fpdt import FPDTStrategy
from lightning_fpdt.layers.loss import cross_entropy_sum
from lightning_fpdt.models import GPTLM, GPTConfig, LlamaConfig, LlamaLM
from tests.helpers import CaptureStep, assert_same_step, dataloader

pytestmark = pytest.mark.distributed  # every test here starts several processes

VOCAB = 64
SEQ = 32
# document lengths per sample (each sums to SEQ): one-token documents, documents across chunk (8) and
# rank boundaries, one longer than a chunk; the samples differ so per-sample segmentation is exercised
PACKING = [[1, 5, 11, 2, 13], [16, 1, 1, 14], [3, 29], [32]]


class Packed(Dataset):
    """``input_ids`` and ``position_ids`` that restart at every document (labels derived from the ids)."""

    def __init__(self, packing: list[list[int]], seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (len(packing), SEQ), generator=g)
        self.pos = torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in packing])
        self.packing = packing

    def __len__(self) -> int:
        return len(self.packing)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.ids[i], "position_ids": self.pos[i], "index": i}

    def documents(self) -> list[torch.Tensor]:
        docs = []
        for i, lengths in enumerate(self.packing):
            start = 0
            for n in lengths:
                docs.append(self.ids[i, start:start + n])
                start += n
        return docs


class RightPadded(Dataset):
    """Samples of different lengths, right-padded to SEQ with an ``attention_mask``."""

    LENGTHS = [32, 20, 27, 9]

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (len(self.LENGTHS), SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.LENGTHS)

    def __getitem__(self, i: int) -> dict[str, Any]:
        n = self.LENGTHS[i]
        ids = self.ids[i].clone()
        ids[n:] = 0  # the pad token
        return {"input_ids": ids, "attention_mask": (torch.arange(SEQ) < n).long(), "index": i}

    def documents(self) -> list[torch.Tensor]:
        return [self.ids[i, :n] for i, n in enumerate(self.LENGTHS)]


@dataclass(frozen=True)
class Case:
    dp: int
    sp: int
    chunk_size: int | Literal["auto"] | None
    model: str = "llama"
    kv_heads: int = 2
    offload: bool | Literal["emulate"] = False
    checkpointing: bool = False

    @property
    def name(self) -> str:
        flags = [f for f, on in (("offload", self.offload), ("ckpt", self.checkpointing)) if on]
        return "-".join([self.model, f"{self.dp}x{self.sp}", f"C{self.chunk_size}", f"kv{self.kv_heads}", *flags])


CASES = [
    Case(dp=1, sp=2, chunk_size=None),
    Case(dp=1, sp=2, chunk_size=8),
    Case(dp=1, sp=4, chunk_size=8, kv_heads=1),  # kv heads < sp
    Case(dp=2, sp=2, chunk_size=8),
    Case(dp=1, sp=2, chunk_size=8, offload="emulate"),
    Case(dp=1, sp=2, chunk_size=8, checkpointing=True),
    Case(dp=1, sp=2, chunk_size=8, model="gpt", kv_heads=4),
    Case(dp=1, sp=4, chunk_size=16, model="gpt", kv_heads=4, checkpointing=True, offload="emulate"),
]


def _module(case: Case) -> L.LightningModule:
    if case.model == "llama":
        config = LlamaConfig.tiny(num_attention_heads=4, num_key_value_heads=case.kv_heads, hidden_size=32,
                                  intermediate_size=64, vocab_size=VOCAB)
        return LlamaLM(config, learning_rate=1e-3, warmup_steps=1)
    config = GPTConfig.tiny(n_head=4, n_embd=32, vocab_size=VOCAB, n_positions=64)
    return GPTLM(config, learning_rate=1e-3, warmup_steps=1)


def fit_one_step(
    case: Case, data: Dataset, tmp_path, module: L.LightningModule | None = None,
    callbacks: Sequence[L.Callback] = (), **strategy: Any,
) -> tuple[list[dict], L.LightningModule]:
    """One ``Trainer.fit`` step of ``module`` (default: the case's bundled model) under ``FPDTStrategy`` in
    float64 with the ``math`` backend; returns every rank's :class:`CaptureStep` result and the module as it
    was before the step. ``strategy``: further ``FPDTStrategy`` arguments (``memory_budget``)."""
    module = _module(case) if module is None else module
    per_rank = len(data) // case.dp
    trainer = L.Trainer(
        accelerator="cpu", devices=case.dp * case.sp, precision="64-true", max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[CaptureStep(str(tmp_path)), *callbacks],
        strategy=FPDTStrategy(sequence_parallel_size=case.sp, chunk_size=case.chunk_size, attention_backend="math",
                              offload=case.offload, activation_checkpointing=case.checkpointing,
                              start_method="fork", **strategy),
    )
    initial = copy.deepcopy(module)
    trainer.fit(module, dataloader(data, per_rank))
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(case.dp * case.sp)], initial


def each_document_alone(module: L.LightningModule, documents: list[torch.Tensor]) -> tuple[torch.Tensor, dict]:
    """One process, no strategy: every document as its own sequence; the mean cross-entropy over all of
    their targets (each token predicts the next one of its own document), and its gradients. ``module`` is a
    ``CausalLM``; its model is called as the contract says (``model.hidden_states``, ``model.lm_head``)."""
    ref = copy.deepcopy(module).double()
    loss_sum, count = torch.zeros((), dtype=torch.float64), 0
    for doc in documents:
        if doc.numel() < 2:
            continue  # a one-token document has no target (it still attends to itself when packed)
        ids = doc.unsqueeze(0)
        hidden = ref.model.hidden_states(ids, torch.arange(ids.shape[1]).unsqueeze(0))
        targets = torch.full_like(ids, -100)
        targets[:, :-1] = ids[:, 1:]
        s, n = cross_entropy_sum(ref.model.lm_head(hidden), targets)
        loss_sum, count = loss_sum + s, count + int(n)
    loss = loss_sum / count
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in ref.named_parameters()}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_packed_step_equals_each_document_alone(case: Case, tmp_path, fresh_seed: int) -> None:
    torch.manual_seed(fresh_seed)
    data = Packed(PACKING, fresh_seed)
    results, module = fit_one_step(case, data, tmp_path)
    ref_loss, ref_grads = each_document_alone(module, data.documents())
    assert_same_step(results, ref_loss, ref_grads, tol=1e-10, label=f"{case.name} seed={fresh_seed}")


@pytest.mark.parametrize("case", [Case(dp=1, sp=2, chunk_size=8), Case(dp=2, sp=2, chunk_size=None)],
                         ids=lambda c: c.name)
def test_right_padded_batch_equals_the_unpadded_samples(case: Case, tmp_path, fresh_seed: int) -> None:
    torch.manual_seed(fresh_seed)
    data = RightPadded(fresh_seed)
    results, module = fit_one_step(case, data, tmp_path)
    ref_loss, ref_grads = each_document_alone(module, data.documents())
    assert_same_step(results, ref_loss, ref_grads, tol=1e-10, label=f"{case.name} seed={fresh_seed}")
