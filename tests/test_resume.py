"""Checkpoints survive crashes and changes of parallelism: SIGKILLed runs resume to the same weights, bitwise, every
rank with the random number generator states it saved.

Each run is ``tests/resume_job.py`` in its own process group, forked from the test process (2 or 4 CPU
processes, each seeded differently, float64, a shuffled loader of 8 batches per epoch that the 12-step runs
cross, a warm-up + cosine LR schedule, AdamW).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_fpdt.checkpoints.files import is_complete, latest_checkpoint
from lightning_fpdt.testing import run_in_fork
from tests import resume_job

pytestmark = pytest.mark.distributed  # every test here starts several processes



def job(out: Path, *args: str) -> subprocess.CompletedProcess:
    """``python tests/resume_job.py --out OUT ARGS`` in its own session (it may SIGKILL its process group),
    forked from this process rather than started anew: the same run without the interpreter's imports."""
    argv = ["--out", str(out), *args]
    return run_in_fork(lambda: resume_job.main(argv), ["tests/resume_job.py", *argv], timeout=240)


def losses(out: Path) -> dict[int, float]:
    """Step -> logged loss (a resumed run's file holds both attempts; the later line wins)."""
    result = {}
    for line in (out / "losses.txt").read_text().splitlines():
        step, value = line.split()
        result[int(step)] = float(value)
    return result


def _rng(out: Path, name: str, rank: int) -> dict:
    return torch.load(out / "rng" / f"{name}-rank{rank}.pt", weights_only=False)


def assert_rng_restored(reference: Path, resumed: Path, step: int) -> None:
    """Right after loading the step-``step`` checkpoint, each rank ``r`` of the resumed run holds the random
    number generator states rank ``r % saved ranks`` had when the reference run saved that step. Every rank
    was seeded differently (``resume_job.RecordRNG``), so one rank's states restored on every rank fail here."""
    saved_ranks = len(list((reference / "rng").glob(f"saved-step{step}-rank*.pt")))
    resumed_ranks = len(list((resumed / "rng").glob(f"restored-step{step}-rank*.pt")))
    assert saved_ranks >= 2 and resumed_ranks >= 1, (saved_ranks, resumed_ranks)
    saved = [_rng(reference, f"saved-step{step}", r) for r in range(saved_ranks)]
    assert saved[0]["python"] != saved[1]["python"], "the ranks were meant to be seeded differently"
    for rank in range(resumed_ranks):
        got, expected = _rng(resumed, f"restored-step{step}", rank), saved[rank % saved_ranks]
        assert got["python"] == expected["python"], f"rank {rank}: Python's random state"
        assert torch.equal(got["torch"], expected["torch"]), f"rank {rank}: torch's CPU generator"
        for a, b in zip(got["numpy"], expected["numpy"], strict=True):
            assert np.array_equal(a, b), f"rank {rank}: numpy's random state"


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = torch.load(a / "final.pt"), torch.load(b / "final.pt")
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), f"{name}: max diff {(wa[name] - wb[name]).abs().max().item():.3e}"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[bool, Path]:
    """The reference runs, replicated and sharded: 12 steps without a crash."""
    runs = {}
    for shard in (False, True):
        out = tmp_path_factory.mktemp(f"reference-shard{shard}")
        proc = job(out, "--max-steps", "12", *(["--shard"] if shard else []))
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs[shard] = out
    return runs


@pytest.mark.timeout(300)
@pytest.mark.parametrize("shard", [False, True], ids=["replicated-file", "sharded-dcp"])
@pytest.mark.parametrize("crash", ["mid-training", "mid-save"])
def test_killed_run_resumes_to_the_same_weights(uninterrupted, tmp_path: Path, shard: bool, crash: str) -> None:
    flags = ["--shard"] if shard else []
    kill = ["--die-at-step", "5"] if crash == "mid-training" else ["--die-in-save-at-step", "6"]
    proc = job(tmp_path, "--max-steps", "12", *flags, *kill)
    assert proc.returncode == -9, f"the run was meant to be SIGKILLed: rc={proc.returncode}\n{proc.stderr[-3000:]}"
    ckpts = tmp_path / "ckpt"
    if crash == "mid-save":  # step 6's save died: nothing complete under its name, step 4 is the latest
        assert not is_complete(ckpts / "step=6.ckpt")
        assert any(p.name.startswith("step=6.ckpt.tmp") for p in ckpts.iterdir()), sorted(ckpts.iterdir())
        assert latest_checkpoint(ckpts).name == "step=4.ckpt"
    else:
        assert latest_checkpoint(ckpts).name == "step=4.ckpt"
    proc = job(tmp_path, "--max-steps", "12", *flags, "--resume", "latest")
    assert proc.returncode == 0, proc.stderr[-4000:]
    said = proc.stdout + proc.stderr
    # the batches step 4 trained on are skipped, said once; Lightning's warning that the loader is not resumable is
    # not shown, since this one is
    assert said.count("resuming inside an epoch: the training loader's first 4 batches") == 1, said[-4000:]
    assert "dataloader is not resumable" not in said, said[-4000:]
    assert_same_weights(uninterrupted[shard], tmp_path)
    assert losses(tmp_path) == losses(uninterrupted[shard])  # every step's loss, bitwise, data order included
    assert_rng_restored(uninterrupted[shard], tmp_path, 4)


@pytest.mark.timeout(300)
def test_streaming_loader_trains_and_resumes(tmp_path: Path) -> None:
    """An IterableDataset without __len__ (it used to fail at the first batch: the resume wrapper called len)
    trains, and a SIGKILLed run resumes to the same weights: the consumed batches of the epoch are skipped."""
    reference = tmp_path / "reference"
    proc = job(reference, "--stream", "--max-steps", "12")
    assert proc.returncode == 0, proc.stderr[-4000:]
    crashed = tmp_path / "crashed"
    proc = job(crashed, "--stream", "--max-steps", "12", "--die-at-step", "5")
    assert proc.returncode == -9, f"the run was meant to be SIGKILLed: rc={proc.returncode}\n{proc.stderr[-3000:]}"
    proc = job(crashed, "--stream", "--max-steps", "12", "--resume", "latest")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resuming a streaming training loader" in proc.stdout + proc.stderr
    assert_same_weights(reference, crashed)
    assert losses(crashed) == losses(reference)
    assert_rng_restored(reference, crashed, 4)


@pytest.mark.timeout(300)
def test_resume_after_the_last_batch_of_an_epoch(uninterrupted, tmp_path: Path) -> None:
    """Saved after epoch 0's last batch (every_n_train_steps=2, 8 batches): epoch 1 runs whole, in its order.

    (A checkpoint saved in on_train_epoch_end resumes with one batch of epoch 1 and then a new epoch:
    that is Lightning's own loop behaviour, with or without this strategy; the strategy warns.)
    """
    proc = job(tmp_path, "--max-steps", "12", "--resume", str(uninterrupted[False] / "ckpt" / "step=8.ckpt"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert_same_weights(uninterrupted[False], tmp_path)
    reference = losses(uninterrupted[False])
    assert losses(tmp_path) == {step: reference[step] for step in range(9, 13)}
    proc = job(tmp_path / "epoch-end", "--max-steps", "9", "--resume",
               str(uninterrupted[False] / "epoch_ckpt" / "epoch=0.ckpt"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "this checkpoint was saved in on_train_epoch_end" in proc.stderr


@pytest.mark.timeout(300)
def test_checkpoint_resumes_with_another_parallelism(uninterrupted, tmp_path: Path) -> None:
    """1x2 replicated -> 1x4 with chunks; 2x2 sharded -> 1x1 replicated: the next step's loss matches."""
    reference = losses(uninterrupted[False])
    # sp = 2 -> sp = 4 (and a chunk size), from the replicated run's step-4 file checkpoint
    out = tmp_path / "sp4"
    proc = job(out, "--sp", "4", "--chunk-size", "8", "--max-steps", "6", "--resume",
               str(uninterrupted[False] / "ckpt" / "step=4.ckpt"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "saved at data_parallel=1 x sequence_parallel=2" in proc.stdout + proc.stderr
    resumed = losses(out)
    for step in (5, 6):
        assert abs(resumed[step] - reference[step]) <= 1e-12 * abs(reference[step]), (
            step, resumed[step], reference[step])
    assert_rng_restored(uninterrupted[False], out, 4)  # ranks 2 and 3 take the states of ranks 0 and 1

    # a replicated file checkpoint into sharded parameters (same parallelism, so the same data)
    out = tmp_path / "sharded-from-file"
    proc = job(out, "--shard", "--max-steps", "6", "--resume", str(uninterrupted[False] / "ckpt" / "step=4.ckpt"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    resumed = losses(out)
    for step in (5, 6):
        assert abs(resumed[step] - reference[step]) <= 1e-12 * abs(reference[step]), (
            step, resumed[step], reference[step])

    # dp x sp = 2 x 2 sharded (1 sample per rank) -> 1 x 1 replicated (2 samples): the same global batches
    sharded = tmp_path / "2x2"
    proc = job(sharded, "--dp", "2", "--sp", "2", "--shard", "--max-steps", "4")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (sharded / "ckpt" / "step=4.ckpt").is_dir()  # a distributed checkpoint
    single = tmp_path / "1x1"
    proc = job(single, "--dp", "1", "--sp", "1", "--batch", "2", "--max-steps", "6", "--resume",
               str(sharded / "ckpt" / "step=4.ckpt"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    continued = tmp_path / "2x2-continued"
    proc = job(continued, "--dp", "2", "--sp", "2", "--shard", "--max-steps", "6", "--resume",
               str(sharded / "ckpt" / "step=4.ckpt"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    a, b = losses(single), losses(continued)
    for step in (5, 6):
        assert abs(a[step] - b[step]) <= 1e-12 * abs(b[step]), (step, a[step], b[step])


@pytest.mark.timeout(300)
def test_hf_model_resumes_bitwise_and_with_another_parallelism(tmp_path: Path) -> None:
    """HFCausalLM (a transformers Llama) with the memory stack (tiled MLP and loss, checkpointed decoder layers
    with host-offload emulation, FSDP2 per decoder layer): SIGKILLed mid-training, it resumes to the same
    weights, bitwise; its sharded checkpoint resumes replicated at sp=4 with chunks, next losses within 1e-12."""
    stack = ["--model", "hf", "--checkpointing", "--shard", "--max-steps", "8"]
    reference = tmp_path / "reference"
    proc = job(reference, *stack)
    assert proc.returncode == 0, proc.stderr[-4000:]
    killed = tmp_path / "killed"
    proc = job(killed, *stack, "--die-at-step", "5")
    assert proc.returncode == -9, f"the run was meant to be SIGKILLed: rc={proc.returncode}\n{proc.stderr[-3000:]}"
    assert latest_checkpoint(killed / "ckpt").name == "step=4.ckpt"
    proc = job(killed, *stack, "--resume", "latest")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert_same_weights(reference, killed)
    assert losses(killed) == losses(reference)
    assert_rng_restored(reference, killed, 4)

    other = tmp_path / "sp4"
    proc = job(other, "--model", "hf", "--sp", "4", "--chunk-size", "8", "--max-steps", "6", "--resume",
               str(reference / "ckpt" / "step=4.ckpt"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "saved at data_parallel=1 x sequence_parallel=2" in proc.stdout + proc.stderr
    resumed, expected = losses(other), losses(reference)
    for step in (5, 6):
        assert abs(resumed[step] - expected[step]) <= 1e-12 * abs(expected[step]), (step, resumed[step], expected[step])
