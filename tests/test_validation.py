"""Configuration validation: every error is raised on every rank, before any collective, without a hang."""

from __future__ import annotations

import multiprocessing
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import lightning_fpdt.backends as backends
from lightning_fpdt import FPDTStrategy
from lightning_fpdt.layers.block import FPDTAttention, FPDTBlock
from lightning_fpdt.models import LlamaConfig, LlamaLM
from lightning_fpdt.options import HALF_PRECISIONS, FPDTOptions, check_model
from lightning_fpdt.parallel.batches import shard_batch
from tests.helpers import TokenDataset, dataloader


class RecordingStrategy(FPDTStrategy):
    """An FPDTStrategy whose ranks each write the error they raise to ``{rank}.txt`` in ``error_dir``.

    The launcher terminates all ranks as soon as one fails, so a rank that has written its file waits
    (bounded) at a barrier for the others before re-raising: every rank that raises gets to record it.
    """

    def __init__(self, error_dir: Path, barrier: Any, **kwargs: Any) -> None:
        super().__init__(start_method="fork", **kwargs)
        self.error_dir = error_dir
        self.error_barrier = barrier

    def _record(self, err: BaseException) -> None:
        # global_rank is only set inside setup_environment, so compute it as Lightning will
        rank = self.node_rank * self.num_processes + self.local_rank
        initialized = torch.distributed.is_available() and torch.distributed.is_initialized()
        # the built-in kind of the error (the package's FPDTError is a ValueError)
        kind = next(c.__name__ for c in type(err).__mro__ if c.__module__ == "builtins")
        (self.error_dir / f"{rank}.txt").write_text(f"{kind}: {err}\nprocess group: {initialized}")
        try:
            self.error_barrier.wait(timeout=30)
        except threading.BrokenBarrierError:
            pass  # another rank did not raise: the test sees its file missing

    def setup_environment(self) -> None:
        try:
            super().setup_environment()
        except Exception as err:
            self._record(err)
            raise

    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        try:
            return super().batch_to_device(batch, device, dataloader_idx)
        except Exception as err:
            self._record(err)
            raise


class NoBlocks(L.LightningModule):
    """A model with no FPDTBlock: under sequence parallelism its attention would see only a shard."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 8)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.embed(batch["input_ids"]).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class ShortFirstDataset(Dataset):
    """Sample 0 has one token, sample 1 sixteen: at dp=2 only the first data-parallel group is refused."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.arange(1 if i == 0 else 16)}


class RankDependent(Dataset):
    """Samples that differ between the ranks of one sequence-parallel group (a broken custom sampler)."""

    def __init__(self, lengths: bool) -> None:
        self.lengths = lengths

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        rank = torch.distributed.get_rank()
        if self.lengths:
            return {"input_ids": torch.arange(16 + 2 * rank) % 64}
        return {"input_ids": (torch.arange(16) + rank) % 64}


class Items(Dataset):
    """Fixed samples: a list of dicts."""

    def __init__(self, items: list[dict[str, Any]]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.items[i]


def _items(**columns: Any) -> Callable[[], DataLoader]:
    """Two samples per key's value (each a tensor for one sample)."""
    return lambda: dataloader(Items([{k: v for k, v in columns.items()}] * 2), 2)


class OneTokenDataset(Dataset):
    """Samples of a single token: fewer than one per rank for sequence_parallel_size=2."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.tensor([i])}


def _llama(heads: int = 4, kv: int = 2, hidden: int = 32) -> LlamaLM:
    return LlamaLM(LlamaConfig.tiny(num_attention_heads=heads, num_key_value_heads=kv, hidden_size=hidden,
                                    intermediate_size=32, num_hidden_layers=1, vocab_size=64))


def _tokens() -> DataLoader:
    return dataloader(TokenDataset(4, 16, 64, 0), 2)


@dataclass(frozen=True)
class ErrorCase:
    id: str
    strategy: dict[str, Any]
    match: str
    where: str  # "setup" (setup_environment) or "batch" (batch_to_device)
    devices: int = 2
    model: Callable[[], L.LightningModule] = _llama
    data: Callable[[], DataLoader] = field(default=_tokens)
    error: str = "ValueError"


CASES = [
    ErrorCase("sp-not-dividing-world", dict(sequence_parallel_size=3),
              r"sequence_parallel_size=3 does not divide the world size 2 \(1 node\(s\) x 2 device\(s\)\);"
              r" use one of \[1, 2\]",
              "setup"),
    ErrorCase("chunk-not-multiple-of-sp", dict(sequence_parallel_size="auto", chunk_size=3),
              r"chunk_size=3 is not divisible by sequence_parallel_size=2.*Use a multiple of 2, e\.g\. 2 or 4",
              "setup"),
    # plain Ulysses asked for (ring_size=1); "auto" would make the group a ring
    ErrorCase("heads-not-divisible", dict(sequence_parallel_size=2, ring_size=1),
              r"n_heads=3 is not divisible by sequence_parallel_size=2.*Use ring_size=2 \(Ulysses 1 x ring 2;"
              r" ring_size='auto' picks it\), or any ring_size in \[2\]; plain Ulysses needs a"
              r" sequence_parallel_size in \[1, 3\]\. \(attention layer 'model\.layers\.0' of"
              r" LlamaLM\)",
              "setup", model=lambda: _llama(heads=3, kv=3, hidden=24)),
    ErrorCase("kv-heads-not-shardable", dict(sequence_parallel_size=2, ring_size=1),
              r"n_kv_heads=3 and sequence_parallel_size=2: KV heads must either divide evenly", "setup",
              model=lambda: _llama(heads=6, kv=3, hidden=48)),
    ErrorCase("ring-not-dividing-sp", dict(sequence_parallel_size=2, ring_size=4),
              r"ring_size=4 does not divide sequence_parallel_size=2 \(the group is ulysses x ring ranks\); use one of"
              r" \[1, 2\], or ring_size='auto'", "setup"),
    ErrorCase("no-fpdt-block", dict(sequence_parallel_size=2),
              r"sequence_parallel_size=2 but NoBlocks has no FPDTBlock", "setup", model=NoBlocks),
    ErrorCase("flash-attn-on-cpu", dict(sequence_parallel_size=2, attention_backend="flash_attn"),
              r"attention_backend='flash_attn' needs a CUDA device, but this run is on cpu\."
              r" Use attention_backend='sdpa'",
              "setup"),
    ErrorCase("offload-on-cpu", dict(sequence_parallel_size=2, offload=True),
              r"offload=True moves saved attention chunks from device to pinned host memory; on cpu there is no device"
              r" memory to save\. Use offload=False, or offload='emulate'", "setup"),
    ErrorCase("offload-checkpoints-on-cpu",
              dict(sequence_parallel_size=2, activation_checkpointing=True, offload_checkpoints=True),
              r"offload_checkpoints=True moves checkpointed block inputs .* Use offload_checkpoints=False, or"
              r" offload_checkpoints='emulate'", "setup"),
    ErrorCase("offload-optimizer-on-cpu", dict(sequence_parallel_size=2, shard_parameters=True, offload_optimizer=True),
              r"offload_optimizer=True moves the sharded optimizer state from the device to host memory; on cpu it is"
              r" there already", "setup"),
    ErrorCase("auto-chunk-nothing-fits", dict(sequence_parallel_size=2, chunk_size="auto", memory_budget=1e-6),
              r"chunk_size='auto': nothing fits a budget of 1 KiB per rank at 16 tokens; the smallest chunk \(2\)",
              "batch"),
    ErrorCase("one-data-parallel-group-refused", dict(sequence_parallel_size=2),
              r"the sequence length 1 is shorter than sequence_parallel_size=2|another data-parallel group's batch"
              r" was refused", "batch", devices=4, data=lambda: dataloader(ShortFirstDataset(), 1)),
    ErrorCase("sp-ranks-different-lengths", dict(sequence_parallel_size=2),
              r"the ranks \[0, 1\] of one sequence-parallel group hold different input_ids shapes \(rank 0: \[2, 16\],"
              r" rank 1: \[2, 18\]\)\. Every rank of a group must get the same batch", "batch",
              data=lambda: dataloader(RankDependent(lengths=True), 2)),
    ErrorCase("sp-ranks-different-tokens", dict(sequence_parallel_size=2),
              r"the ranks \[0, 1\] of one sequence-parallel group hold different token ids \(same shape\)", "batch",
              data=lambda: dataloader(RankDependent(lengths=False), 2)),
    ErrorCase("ids-outside-vocab", dict(sequence_parallel_size=2),
              r"batch\['input_ids'\] holds values from 0 to 64, but the model's vocabulary has 64 tokens: allowed are"
              r" \[0, 64\)", "batch", data=_items(input_ids=torch.arange(16) * 64 // 15)),
    ErrorCase("labels-outside-vocab", dict(sequence_parallel_size=2),
              r"batch\['labels'\] holds values from -5 to 3, but .* allowed are \[0, 64\) or -100 \(ignored\)", "batch",
              data=_items(input_ids=torch.arange(16), labels=torch.arange(16) % 9 - 5)),
    ErrorCase("float-ids", dict(sequence_parallel_size=2),
              r"batch\['input_ids'\] has dtype torch.float32; token ids must be integers", "batch",
              data=_items(input_ids=torch.arange(16.0)), error="TypeError"),
    ErrorCase("empty-batch", dict(sequence_parallel_size=2),
              r"batch\['input_ids'\] is empty \(shape \(2, 0\)\)", "batch",
              data=_items(input_ids=torch.zeros(0, dtype=torch.long))),
    ErrorCase("left-padded-attention-mask", dict(sequence_parallel_size=2),
              r"'attention_mask' is not right-padded in sample\(s\) \[0, 1\].*padding_side='right'", "batch",
              data=_items(input_ids=torch.arange(16), attention_mask=(torch.arange(16) >= 3).long())),
    ErrorCase("4d-attention-mask", dict(sequence_parallel_size=2),
              r"'attention_mask' has shape \(2, 1, 16, 16\); only the Hugging Face 2-D padding mask", "batch",
              data=_items(input_ids=torch.arange(16), attention_mask=torch.ones(1, 16, 16, dtype=torch.long))),
    ErrorCase("loss-mask-wrong-shape", dict(sequence_parallel_size=2),
              r"sequence key 'loss_mask' has shape \(2, 13\), expected \[2, 16\] like 'input_ids'", "batch",
              data=_items(input_ids=torch.arange(16), loss_mask=torch.ones(13, dtype=torch.long))),
    ErrorCase("sequence-shorter-than-sp", dict(sequence_parallel_size=2),
              r"the sequence length 1 is shorter than sequence_parallel_size=2.*at least 2 tokens", "batch",
              data=lambda: dataloader(OneTokenDataset(), 2)),
]


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_configuration_error_is_raised_on_every_rank(case: ErrorCase, tmp_path: Path) -> None:
    barrier = multiprocessing.get_context("fork").Barrier(case.devices)
    strategy = RecordingStrategy(tmp_path, barrier, **case.strategy)
    trainer = L.Trainer(accelerator="cpu", devices=case.devices, strategy=strategy, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(Exception, match=case.match):
        trainer.fit(case.model(), case.data())
    for rank in range(case.devices):
        path = tmp_path / f"{rank}.txt"
        assert path.exists(), (
            f"rank {rank} did not raise (ranks that did: {sorted(p.name for p in tmp_path.iterdir())})"
        )
        message, group = path.read_text().rsplit("\n", 1)
        assert message.startswith(f"{case.error}: FPDTStrategy: "), message
        assert re.search(case.match, message), f"rank {rank}: {message}"
        # setup errors come before the process group exists, so no collective can have run
        assert group == f"process group: {case.where == 'batch'}", f"rank {rank}: {group}"


# ---- errors that need CUDA to reach, checked without a process launch ------------------------------------

def validate_setup(*, world_size: int, num_nodes: int, num_processes: int, sequence_parallel_size: int,
                   chunk_size: int | None, device_type: str, model: Any, attention_backend: str, precision: str,
                   offload: Any = False, offload_checkpoints: Any = False) -> None:
    """The setup checks of a strategy with these arguments (FPDTOptions.check_run), without a process launch."""
    options = FPDTOptions(sequence_parallel_size=sequence_parallel_size, chunk_size=chunk_size,
                          attention_backend=attention_backend, offload=offload,
                          activation_checkpointing=offload_checkpoints is not False,
                          offload_checkpoints=offload_checkpoints)
    options.check_run(world_size=world_size, num_nodes=num_nodes, num_processes=num_processes,
                      sequence_parallel_size=sequence_parallel_size, precision=precision, device_type=device_type,
                      model=model)


_CUDA_OK = dict(world_size=8, num_nodes=1, num_processes=8, sequence_parallel_size=4, chunk_size=65536,
                device_type="cuda", model=None)


def test_flash_attn_on_cuda_without_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backends, "flash_attn_available", lambda: False)
    with pytest.raises(ValueError, match=r"attention_backend='flash_attn' but the flash-attn package is not installed;"
                                         r" install the 'flash' extra"):
        validate_setup(**_CUDA_OK, attention_backend="flash_attn", precision="bf16-mixed")


@pytest.mark.parametrize("precision", ["32-true", "64-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true"])
def test_flash_attn_needs_half_precision(monkeypatch: pytest.MonkeyPatch, precision: str) -> None:
    monkeypatch.setattr(backends, "flash_attn_available", lambda: True)
    if precision in HALF_PRECISIONS:
        validate_setup(**_CUDA_OK, attention_backend="flash_attn", precision=precision)
        return
    with pytest.raises(ValueError, match=rf"'flash_attn' needs float16/bfloat16 attention inputs, but"
                                         rf" precision='{precision}'\. Use precision='bf16-mixed'"):
        validate_setup(**_CUDA_OK, attention_backend="flash_attn", precision=precision)


def test_every_other_backend_runs_float64_on_cuda() -> None:
    for backend in ("math", "auto", "sdpa"):  # sdpa computes float64 with the math kernel on CUDA
        validate_setup(**_CUDA_OK, attention_backend=backend, precision="64-true")


def test_offload_true_is_fine_on_cuda_and_emulate_everywhere() -> None:
    validate_setup(**_CUDA_OK, attention_backend="auto", precision="bf16-mixed", offload=True, offload_checkpoints=True)
    for device_type in ("cpu", "cuda"):
        validate_setup(**{**_CUDA_OK, "device_type": device_type}, attention_backend="math", precision="32-true",
                       offload="emulate", offload_checkpoints="emulate")


def test_emulate_is_the_offload_code_path() -> None:
    strategy = FPDTStrategy(sequence_parallel_size=1, offload="emulate", activation_checkpointing=True,
                            offload_checkpoints="emulate")
    assert strategy.sequence_parallel_context.offload is True
    assert FPDTStrategy(sequence_parallel_size=1, offload=False).sequence_parallel_context.offload is False


def test_bad_offload_values_are_refused_at_construction() -> None:
    with pytest.raises(ValueError, match=r"FPDTStrategy: offload must be True, False or 'emulate', got 'yes'\."):
        FPDTStrategy(offload="yes")
    with pytest.raises(ValueError, match=r"offload_checkpoints must be True, False or 'emulate', got 1\."):
        FPDTStrategy(activation_checkpointing=True, offload_checkpoints=1)
    with pytest.raises(ValueError, match=r"offload_checkpoints='emulate' needs activation_checkpointing=True"):
        FPDTStrategy(offload_checkpoints="emulate")


def test_model_checks() -> None:
    check_model(_llama(heads=4, kv=1), 4)  # one KV head replicated over 4 ranks: fine
    check_model(NoBlocks(), 1)  # no FPDT block is fine without sequence parallelism

    class BuildsLater(NoBlocks):
        def configure_model(self) -> None:  # the blocks appear after setup_environment: checked at binding
            pass

    check_model(BuildsLater(), 2)
    with pytest.raises(ValueError, match="sequence_parallel_size=2 but NoBlocks has no FPDTBlock"):
        check_model(NoBlocks(), 2)
    # an own model built from FPDTBlock with an invalid GQA head count (LlamaConfig refuses it earlier)
    own = torch.nn.Sequential(FPDTBlock(FPDTAttention(48, n_heads=8, n_kv_heads=3, head_dim=6), torch.nn.Identity(),
                                        torch.nn.Identity(), torch.nn.Identity()))
    with pytest.raises(
        ValueError, match=r"FPDTStrategy: n_heads=8 is not a multiple of n_kv_heads=3\. \(attention layer '0'"
    ):
        check_model(own, 1)


def test_shard_batch_refuses_sequences_shorter_than_sp() -> None:
    ids = torch.zeros(2, 3, dtype=torch.long)
    assert shard_batch({"input_ids": ids}, 3, 2)["input_ids"].shape == (2, 1)  # one token per rank: fine
    with pytest.raises(ValueError, match=r"shard_batch: the sequence length 3 is shorter than sequence_parallel_size=4:"
                                         r" .* or a smaller sequence_parallel_size \(at most 3\)\."):
        shard_batch({"input_ids": ids}, 4, 0)
