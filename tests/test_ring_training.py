"""Ulysses x ring through ``Trainer.fit``: one step at sp=4 equals one process (float64, loss and every gradient,
relative 1e-10).

- Ulysses 2 x ring 2 and ring 4, with chunks, offload emulated, packed documents and a sliding window, on a
  Hugging Face family with one KV head (Mistral v0.1: every layer windowed), so every remote block is cut by a
  window edge or a document or skipped; Llama-4 (attention chunks, temperature at each token's true position) and
  gpt-oss (sinks) likewise;
- a 6-head model at sp=4, which plain Ulysses refuses: ``ring_size="auto"`` makes it Ulysses 2 x ring 2 (the own
  Llama, packed documents, chunks, offload emulated, activation checkpointing);
- data parallel 2 x (Ulysses 2 x ring 2) on 8 processes (the own Llama, packed documents, chunks, offload emulated);
- the hybrid layers (Qwen3.5's gated delta-nets and convolutions, Nemotron-H's Mamba-2 scans, LFM2's short
  convolutions) under a ring, on packed documents.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import lightning as L
import pytest
import torch

# the autouse fixtures imported below run the families' own float32 steps (norms, rotary, router sigmoids, kernels)
# in float64 on both sides, as in the families' own tests: a float32 rounding moved by a sum in another order is
# not an error of the pipeline's
from lightning_fpdt.models import LlamaConfig, LlamaLM
from tests.helpers import assert_same_step
from tests.hf.test_hf_causal_lm import Case as HFCase
from tests.hf.test_hf_causal_lm import Packed as HFPacked
from tests.hf.test_hf_causal_lm import _fit, gemma_norms_in_float64  # noqa: F401
from tests.hf.test_hf_families import (
    FamilyCase,
    _module,
    assert_fit_step_equals_plain,
    cohere_norm_in_float64,  # noqa: F401
    llama4_in_float64,  # noqa: F401
)
from tests.hf.test_recurrent import _hybrid, _oracle, kernels_in_float64  # noqa: F401
from tests.hf.test_short_conv import _lfm2
from tests.test_packed_training import PACKING, VOCAB, Case, Packed, each_document_alone, fit_one_step

RING_CASES = [  # packed, sp=4, chunks of 8, offload emulated, one KV head
    FamilyCase("mistral", packed=True, sp=4, ring_size=2),  # every layer windowed
    FamilyCase("mistral", packed=True, sp=4, ring_size=4),
    # attention chunks, the NoPE layer's temperature, experts, under the memory stack (tiled MLP and loss,
    # checkpointing with offload emulation, FSDP2)
    FamilyCase("llama4", packed=True, sp=4, stack=True, ring_size=2),
    FamilyCase("gpt_oss", packed=True, sp=4, ring_size=4),  # sinks (their gradient over the ring), windows, experts
]


@pytest.mark.distributed
@pytest.mark.parametrize("case", RING_CASES, ids=lambda c: c.name)
def test_released_family_at_ulysses_x_ring_equals_plain_transformers(case: FamilyCase, tmp_path,
                                                                     fresh_seed: int) -> None:
    torch.manual_seed(fresh_seed)
    assert_fit_step_equals_plain(_module(case, fresh_seed), case, tmp_path, fresh_seed, case.name)


class RingSize(L.Callback):
    """Rank 0 writes the ring size the strategy resolved."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank == 0:
            self.path.write_text(str(trainer.strategy.ring_size))


@pytest.mark.distributed
def test_six_heads_at_sp4_train_as_ulysses2_x_ring2(tmp_path, fresh_seed: int) -> None:
    torch.manual_seed(fresh_seed)
    data = Packed(PACKING, fresh_seed)
    config = LlamaConfig.tiny(num_attention_heads=6, num_key_value_heads=2, hidden_size=48, intermediate_size=64,
                              vocab_size=VOCAB)
    module = LlamaLM(config, learning_rate=1e-3, warmup_steps=1)
    case = Case(dp=1, sp=4, chunk_size=16, offload="emulate", checkpointing=True)
    results, initial = fit_one_step(case, data, tmp_path, module, callbacks=[RingSize(tmp_path / "ring")])
    assert (tmp_path / "ring").read_text() == "2"  # "auto": the largest Ulysses degree dividing 6 heads and 4 ranks
    ref_loss, ref_grads = each_document_alone(initial, data.documents())
    assert_same_step(results, ref_loss, ref_grads, tol=1e-10, label=f"6 heads at sp=4 seed={fresh_seed}")


@dataclass(frozen=True)
class HybridCase(HFCase):
    ring_size: int = 2

    @property
    def name(self) -> str:
        return f"{super().name}-ring{self.ring_size}"


HYBRID_CASES = [  # sp=4, packed documents across chunk, piece and rank boundaries, offload emulated
    HybridCase("qwen3_5_text", sp=4, chunk_size=8, offload="emulate", ring_size=2),  # gated delta-nets, convolutions
    HybridCase("nemotron_h", sp=4, chunk_size=16, offload="emulate", ring_size=4),  # Mamba-2 scans
    HybridCase("lfm2", sp=4, chunk_size=16, kv_heads=2, offload="emulate", ring_size=4),  # short convolutions
]


@pytest.mark.distributed
@pytest.mark.parametrize("case", HYBRID_CASES, ids=lambda c: c.name)
def test_hybrid_layers_under_a_ring_equal_each_document_alone(case: HybridCase, tmp_path, fresh_seed: int) -> None:
    """The recurrences' all-to-all over the whole group gathers a chunk in the zigzag's order, sorted for the kernel
    and back; a convolution's taps read the tokens before them from whichever rank holds them."""
    torch.manual_seed(fresh_seed)
    module = _lfm2(fresh_seed) if case.family == "lfm2" else _hybrid(case.family, fresh_seed)
    assert module.recurrences or module.short_convs
    data = HFPacked(fresh_seed)
    ref_loss, ref_grads = _oracle(module, data.documents())
    results = _fit(module, data, case, tmp_path)
    assert_same_step(results, ref_loss, ref_grads, tol=1e-10, label=f"{case.name} seed={fresh_seed}")


@pytest.mark.distributed
def test_data_parallel_2_x_ulysses_2_x_ring_2_on_8_processes(tmp_path, fresh_seed: int) -> None:
    """dp=2 outermost, each sequence-parallel group of 4 as Ulysses 2 x ring 2: the rings are ranks {0, 2}, {1, 3},
    {4, 6}, {5, 7}; one step equals one process (packed documents, chunks, offload emulated)."""
    torch.manual_seed(fresh_seed)
    data = Packed(PACKING, fresh_seed)
    case = Case(dp=2, sp=4, chunk_size=16, offload="emulate")
    results, initial = fit_one_step(case, data, tmp_path, ring_size=2)
    ref_loss, ref_grads = each_document_alone(initial, data.documents())
    assert_same_step(results, ref_loss, ref_grads, tol=1e-10, label=f"dp2 x ulysses2 x ring2 seed={fresh_seed}")
