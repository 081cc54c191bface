"""The own-model path of docs/own-model.md, with the model code taken from the doc itself.

The doc's Python block that defines ``TinyLM`` is executed here, so the test breaks when the doc drifts
from the code. It trains under ``FPDTStrategy`` (sp=2, chunks) on packed batches whose documents cross
chunk and rank boundaries, and equals each document trained alone in one process (float64, ``math``
backend, 1e-10), with an explicit chunk size and with ``chunk_size="auto"``, which the memory model must
size from the module. A model whose ``hidden_states`` takes no ``documents`` is refused on packed batches,
on every rank, and the contract's missing members are named at construction.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import re
import threading
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import Dataset

from lightning_fpdt.memory import ModelShape, estimate
from lightning_fpdt.memory.estimate_options import EstimateOptions
from lightning_fpdt.models import GPTLM, CausalLM, GPTConfig, LlamaConfig, LlamaLM
from lightning_fpdt.parallel.batches import shard_batch
from tests.helpers import assert_same_step
from tests.test_packed_training import PACKING, SEQ, VOCAB, Case, Packed, each_document_alone, fit_one_step

DOC = Path(__file__).resolve().parents[1] / "docs" / "own-model.md"


def doc_example() -> dict[str, Any]:
    """The namespace of the Python block of docs/own-model.md that defines ``TinyLM``, as the doc writes it."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    defining = [b for b in blocks if "class TinyLM(CausalLM)" in b]
    assert len(defining) == 1, f"docs/own-model.md: expected one Python block defining TinyLM, found {len(defining)}"
    namespace: dict[str, Any] = {"__name__": "own_model_doc"}
    exec(compile(defining[0], str(DOC), "exec"), namespace)
    return namespace


EXAMPLE = doc_example()
TinyLM, TinyDecoder = EXAMPLE["TinyLM"], EXAMPLE["TinyDecoder"]


def tiny_lm(**kwargs: Any) -> CausalLM:
    """The doc's ``TinyLM`` at test size, with non-trivial norm weights and biases (the defaults are 1 and 0)."""
    module = TinyLM(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, learning_rate=1e-3, warmup_steps=1,
                    **kwargs)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1:
                p.normal_(1.0 if "norm" in name else 0.0, 0.2)
    return module


class ChunkOfStep(L.Callback):
    """Rank 0 writes the chunk size the strategy used in the first step."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_rank == 0 and batch_idx == 0:
            self.path.write_text(str(trainer.strategy.chunk_size))


@pytest.mark.distributed
def test_doc_model_trains_exactly_on_packed_batches(tmp_path, fresh_seed: int) -> None:
    torch.manual_seed(fresh_seed)
    data = Packed(PACKING, fresh_seed)
    module = tiny_lm(loss_tiles=3)
    case = Case(dp=1, sp=2, chunk_size=8)  # 4 chunks of 8 tokens: documents cross chunk and rank boundaries
    results, initial = fit_one_step(case, data, tmp_path, module)
    ref_loss, ref_grads = each_document_alone(initial, data.documents())
    assert_same_step(results, ref_loss, ref_grads, tol=1e-10, label=f"own model seed={fresh_seed}")


@pytest.mark.distributed
def test_auto_chunk_size_sizes_the_doc_model(tmp_path, fresh_seed: int) -> None:
    torch.manual_seed(fresh_seed)
    module = tiny_lm()
    shape, tiling = ModelShape.from_module(module)
    assert (shape.hidden_size, shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim) == (
        32, 2, 4, 4, 8)
    assert (shape.intermediate_size, shape.mlp_projections, shape.vocab_size, shape.tied_embeddings) == (
        128, 1, VOCAB, False)
    assert shape.num_params == sum(p.numel() for p in module.parameters())
    assert tiling == {"mlp_tiled": True, "loss_tiled": True}  # TiledMLP, and CausalLM's loss_tiles=None
    # a budget between the estimates of one chunk and of 16-token chunks: the strategy must pick 16 (2 chunks)
    options = EstimateOptions(batch_size=len(PACKING), sequence_parallel_size=2, precision="64-true",
                              attention_backend="math", **tiling)
    peak = {c: estimate(shape, SEQ, options.replace(chunk_size=c)).device_peak for c in (None, 16)}
    assert peak[None] > peak[16], peak
    data = Packed(PACKING, fresh_seed)
    results, initial = fit_one_step(Case(dp=1, sp=2, chunk_size="auto"), data, tmp_path, module,
                                    callbacks=[ChunkOfStep(tmp_path / "chunk.txt")],
                                    memory_budget=(peak[None] + peak[16]) / 2 / 2**30)
    assert (tmp_path / "chunk.txt").read_text() == "16"
    ref_loss, ref_grads = each_document_alone(initial, data.documents())
    assert_same_step(results, ref_loss, ref_grads, tol=1e-10, label=f"own model, auto chunk, seed={fresh_seed}")


# ---- a model without documents, and the contract's errors ---------------------------------------------------

class NoDocuments(TinyDecoder):
    """The doc's decoder with the two-argument ``hidden_states`` of a model that ignores packing."""

    def hidden_states(self, input_ids: Tensor, position_ids: Tensor) -> Tensor:
        return super().hidden_states(input_ids, position_ids)


RECORD: dict[str, Any] = {}  # set by a test before the fork: the error directory and a barrier of the ranks


class NoDocumentsLM(CausalLM):
    """Trains :class:`NoDocuments`; each rank writes the error its step raises to ``RECORD["dir"]``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(learning_rate=1e-3, warmup_steps=1, **kwargs)
        self.model = NoDocuments(VOCAB, 32, 2, 4)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        try:
            return super().training_step(batch, batch_idx)
        except ValueError as err:
            (RECORD["dir"] / f"{self.global_rank}.txt").write_text(str(err))
            try:
                RECORD["barrier"].wait(timeout=30)  # the launcher stops every rank once one fails: let all write
            except threading.BrokenBarrierError:
                pass  # another rank did not raise: the test sees its file missing
            raise


def test_a_model_without_documents_trains_unpacked_and_refuses_packed_batches(fresh_seed: int) -> None:
    torch.manual_seed(fresh_seed)
    module = NoDocumentsLM().double()
    assert not module.model_takes_documents
    ids = torch.randint(0, VOCAB, (2, SEQ))
    plain = shard_batch({"input_ids": ids}, 1, 0)
    with_documents = TinyLM(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4).double()
    with_documents.model.load_state_dict(module.model.state_dict())
    assert torch.equal(module.hidden_states(plain), with_documents.hidden_states(plain))
    packed = {"input_ids": ids, "position_ids": torch.cat([torch.arange(10), torch.arange(SEQ - 10)]).repeat(2, 1)}
    with pytest.raises(ValueError, match=r"NoDocumentsLM: this batch holds packed documents .* but"
                                         r" NoDocuments.hidden_states takes no 'documents'.*hidden_states\(input_ids,"
                                         r" position_ids, documents=None\)"):
        module.loss_terms(packed)


class OnePacked(Dataset):
    """Two samples: the first holds two documents, the second one."""

    def __init__(self, seed: int) -> None:
        self.ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> dict[str, Any]:
        positions = torch.cat([torch.arange(12), torch.arange(SEQ - 12)]) if i == 0 else torch.arange(SEQ)
        return {"input_ids": self.ids[i], "position_ids": positions, "index": i}


@pytest.mark.distributed
def test_packed_documents_on_one_rank_are_refused_on_every_rank(tmp_path, fresh_seed: int) -> None:
    """dp=2: rank 0's batch is packed, rank 1's is not; both raise, before any gradient is exchanged."""
    RECORD.update(dir=tmp_path, barrier=multiprocessing.get_context("fork").Barrier(2))
    with pytest.raises(Exception, match="packed documents"):
        fit_one_step(Case(dp=2, sp=1, chunk_size=None), OnePacked(fresh_seed), tmp_path, NoDocumentsLM())
    files = {rank: tmp_path / f"{rank}.txt" for rank in range(2)}
    messages = {rank: path.read_text() for rank, path in files.items() if path.exists()}
    assert sorted(messages) == [0, 1], f"ranks that raised: {sorted(messages)}"
    assert messages[0].startswith("NoDocumentsLM: this batch holds packed documents"), messages[0]
    assert messages[1].startswith("NoDocumentsLM: another rank's batch holds packed documents"), messages[1]


class _Own(CausalLM):
    def __init__(self, model: nn.Module, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.model = model


class _Head(nn.Module):
    def __init__(self, hidden_states: Any = None, lm_head: Any = None) -> None:
        super().__init__()
        if hidden_states is not None:
            self.hidden_states = hidden_states
        if lm_head is not None:
            self.lm_head = lm_head


def test_the_contract_is_checked_at_construction() -> None:
    def one_argument(input_ids: Tensor) -> Tensor:
        return input_ids

    def two_arguments(input_ids: Tensor, position_ids: Tensor) -> Tensor:
        return input_ids

    with pytest.raises(TypeError, match=r"_Own: the model _Head has no hidden_states\(input_ids, position_ids,"
                                        r" documents=None\) method .*docs/own-model.md"):
        _Own(_Head(lm_head=nn.Linear(4, 8)))
    with pytest.raises(TypeError, match=r"_Own: _Head.hidden_states\(input_ids: 'Tensor'\) -> 'Tensor' cannot be"
                                        r" called as hidden_states\(input_ids, position_ids\)"):
        _Own(_Head(one_argument, nn.Linear(4, 8)))
    with pytest.raises(TypeError, match=r"_Own: the model _Head has no lm_head; CausalLM needs model.lm_head, the"
                                        r" output projection as an nn.Linear\(hidden, vocab\)"):
        _Own(_Head(two_arguments))
    with pytest.raises(TypeError, match="_Own: the model _Head has lm_head of type Embedding"):
        _Own(_Head(two_arguments, nn.Embedding(8, 4)))
    with pytest.raises(ValueError, match=r"_Own: _Head.lm_head has a bias, which the tiled loss \(loss_tiles=None\)"
                                         r" does not add; build lm_head with bias=False, or set loss_tiles=1"):
        _Own(_Head(two_arguments, nn.Linear(4, 8)))
    assert not _Own(_Head(two_arguments, nn.Linear(4, 8)), loss_tiles=1).model_takes_documents
    with pytest.raises(ValueError, match=r"_Own: loss_tiles must be a positive int or None \(automatic\), got 0"):
        _Own(_Head(two_arguments, nn.Linear(4, 8, bias=False)), loss_tiles=0)


@pytest.mark.parametrize("lm_cls, config_cls", [(LlamaLM, LlamaConfig), (GPTLM, GPTConfig)], ids=["llama", "gpt"])
def test_loss_tiles_live_on_the_lightning_module(lm_cls: type, config_cls: type) -> None:
    assert "loss_tiles" not in {f.name for f in dataclasses.fields(config_cls)}
    module = lm_cls(loss_tiles=2)
    assert (module.loss_tiles, module.hparams["loss_tiles"]) == (2, 2)
    assert ModelShape.from_module(module)[1]["loss_tiled"]
    assert not ModelShape.from_module(lm_cls(loss_tiles=1))[1]["loss_tiled"]
    # an older checkpoint's or YAML's config.loss_tiles moves to the module
    old = {**config_cls.tiny().to_dict(), "loss_tiles": 3}
    assert lm_cls(old).loss_tiles == 3
    with pytest.raises(ValueError, match=r"CausalLM: loss_tiles=1 and config.loss_tiles=3 disagree"):
        lm_cls(old, loss_tiles=1)


@pytest.mark.parametrize("lm_cls, config", [
    (GPTLM, GPTConfig(vocab_size=256, n_embd=64, n_layer=2, n_head=4, tie_word_embeddings=True)),
    (LlamaLM, LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    (LlamaLM, LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)),
], ids=["gpt-tied", "llama-tied", "llama"])
def test_a_fresh_model_starts_near_the_uniform_loss(lm_cls: type, config: Any, fresh_seed: int) -> None:
    """With the default init a fresh model's loss on random tokens is about ln(vocab): a tied embedding is the output
    layer too and gets its scale (at std 1 every logit had a std of sqrt(width): gpt_cpu.yaml started at 39)."""
    torch.manual_seed(fresh_seed)
    model = lm_cls(config).model
    ids = torch.randint(0, 256, (4, 64))
    logits = model(ids)[:, :-1]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), ids[:, 1:].reshape(-1))
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 1.0, loss.item()
