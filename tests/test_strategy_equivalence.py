"""Real ``Trainer.fit`` steps under FPDTStrategy equal one process on the whole batch (float64)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Literal

import lightning as L
import pytest
import torch

from lightning_fpdt import FPDTStrategy
from lightning_fpdt.models import GPTLM, GPTConfig, LlamaConfig, LlamaLM
from tests.helpers import CaptureStep, TokenDataset, assert_same_step, dataloader, reference_step

pytestmark = pytest.mark.distributed  # every test here starts several processes


@dataclass(frozen=True)
class Case:
    dp: int
    sp: int
    seq_len: int
    kv_heads: int = 4
    chunk_size: int | None = None
    labels: bool = True
    offload: bool | Literal["emulate"] = False  # CPU: "emulate" (offload=True is CUDA only)
    model: str = "llama"
    tiles: int | None = None  # MLP and loss tiles (None: automatic, 1 tile at these sizes)
    checkpointing: bool = False
    offload_checkpoints: bool | Literal["emulate"] = False
    shard: bool = False  # shard_parameters (FSDP2 over the data x sequence mesh)

    @property
    def name(self) -> str:
        flags = [f for f, on in (("nolabels", not self.labels), ("offload", self.offload),
                                 (f"tiles{self.tiles}", self.tiles), ("ckpt", self.checkpointing),
                                 ("ckpt-offload", self.offload_checkpoints), ("sharded", self.shard)) if on]
        return "-".join([self.model, f"{self.dp}x{self.sp}", f"S{self.seq_len}", f"kv{self.kv_heads}",
                         f"C{self.chunk_size}", *flags])


CASES = [
    # plain Ulysses (one chunk)
    Case(dp=1, sp=2, seq_len=32),
    Case(dp=2, sp=1, seq_len=32),
    Case(dp=2, sp=2, seq_len=31, kv_heads=1, labels=False),  # GQA with kv_heads < sp, padded length
    Case(dp=1, sp=4, seq_len=30, kv_heads=2),  # kv_heads < sp, 30 -> 32
    # FPDT chunking: 2 and 4 chunks
    Case(dp=1, sp=2, seq_len=32, chunk_size=16),
    Case(dp=1, sp=2, seq_len=32, chunk_size=8, kv_heads=1),
    Case(dp=2, sp=2, seq_len=32, chunk_size=16),
    Case(dp=2, sp=2, seq_len=29, chunk_size=8, kv_heads=2),  # 29 -> 30: chunks 8, 8, 8, 6
    Case(dp=1, sp=4, seq_len=32, chunk_size=16, kv_heads=1),
    Case(dp=1, sp=4, seq_len=32, chunk_size=8),
    # attention chunks offloaded to host
    Case(dp=1, sp=2, seq_len=32, chunk_size=8, kv_heads=2, offload="emulate"),
    Case(dp=2, sp=2, seq_len=29, chunk_size=8, offload="emulate"),
    # the whole FPDT memory design: tiled MLP and loss, checkpointing with host-offloaded block inputs,
    # for Llama and GPT, sp 1/2/4, chunk counts 1 and 4
    *[
        Case(dp=1, sp=sp, seq_len=32, kv_heads=kv, chunk_size=chunk, model=model, tiles=3, checkpointing=True,
             offload_checkpoints="emulate", offload="emulate" if chunk is not None else False)
        for model, kv in (("llama", 2), ("gpt", 4))
        for sp in (1, 2, 4)
        for chunk in (None, 8)
    ],
    Case(dp=2, sp=2, seq_len=30, chunk_size=8, model="gpt", tiles=2, checkpointing=True),
    # parameters, gradients and optimizer state sharded over all ranks (FSDP2)
    Case(dp=1, sp=2, seq_len=32, shard=True),
    Case(dp=2, sp=2, seq_len=29, chunk_size=8, kv_heads=2, shard=True),
    Case(dp=2, sp=2, seq_len=32, chunk_size=8, tiles=3, checkpointing=True, shard=True),
    Case(dp=1, sp=2, seq_len=32, chunk_size=16, model="gpt", shard=True),
]

BATCH_PER_RANK = 2


def run_case(
    case: Case, tmp_path, seed: int, precision: str = "64-true"
) -> tuple[list[dict], LlamaLM, TokenDataset]:
    torch.manual_seed(seed)
    if case.model == "llama":
        config = LlamaConfig.tiny(num_attention_heads=4, num_key_value_heads=case.kv_heads, hidden_size=32,
                                  intermediate_size=64, vocab_size=64, mlp_tiles=case.tiles)
        module = LlamaLM(config, loss_tiles=case.tiles, learning_rate=1e-3, warmup_steps=1)
    else:
        config = GPTConfig.tiny(n_head=4, n_embd=32, vocab_size=64, n_positions=64, mlp_tiles=case.tiles)
        module = GPTLM(config, loss_tiles=case.tiles, learning_rate=1e-3, warmup_steps=1)
    ds = TokenDataset(case.dp * BATCH_PER_RANK, case.seq_len, config.vocab_size, seed, with_labels=case.labels)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=case.dp * case.sp,
        strategy=FPDTStrategy(sequence_parallel_size=case.sp, chunk_size=case.chunk_size,
                              attention_backend="math", offload=case.offload,
                              activation_checkpointing=case.checkpointing,
                              offload_checkpoints=case.offload_checkpoints, shard_parameters=case.shard,
                              start_method="fork"),
        precision=precision,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[CaptureStep(str(tmp_path))],
    )
    initial = copy.deepcopy(module)  # the launcher loads rank 0's trained weights back into `module`
    trainer.fit(module, dataloader(ds, BATCH_PER_RANK))
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(case.dp * case.sp)]
    return results, initial, ds


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_fit_step_matches_single_process(case: Case, tmp_path, fresh_seed: int) -> None:
    results, module, ds = run_case(case, tmp_path, fresh_seed)
    ref_loss, ref_grads = reference_step(module, ds.full_batch())
    assert_same_step(results, ref_loss, ref_grads, tol=1e-10, label=case.name)
    # data: every rank of an SP group read the same samples, different DP groups different ones
    seen = [tuple(r["indices"]) for r in results]
    for rank, idx in enumerate(seen):
        assert idx == seen[rank - rank % case.sp], f"rank {rank} of an SP group saw other samples: {seen}"
    assert sorted(i for g in seen[:: case.sp] for i in g) == list(range(len(ds)))
    # each rank held its shard of the padded sequence, and non-sequence keys passed through
    padded = -(-case.seq_len // case.sp) * case.sp
    assert results[0]["shapes"]["input_ids"] == (BATCH_PER_RANK, padded // case.sp)
    assert results[0]["shapes"]["index"] == (BATCH_PER_RANK,)
    # sharded: each rank holds about 1/world of the parameters (FSDP2 pads the last shard)
    world = case.dp * case.sp
    for res in results:
        if case.shard:
            assert res["local_numel"] <= res["numel"] // world + 64 * world, (res["local_numel"], res["numel"])
        else:
            assert res["local_numel"] == res["numel"]
