"""Misconfigurations fail fast, on every rank, with the numbers in the message and no hang."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch

import lightning_fpdt
from lightning_fpdt import FPDTStrategy
from lightning_fpdt.errors import described, first_line, one_line
from lightning_fpdt.models import LlamaConfig, LlamaLM
from lightning_fpdt.options import FPDTOptions
from lightning_fpdt.parallel.batches import shard_batch
from lightning_fpdt.parallel.comm import check_heads
from lightning_fpdt.strategy.launcher import Peer, explain_peer_failure, peer_failure_message, process_state
from lightning_fpdt.testing import RENDEZVOUS_VARIABLES
from tests.helpers import TokenDataset, dataloader

ROOT = Path(__file__).resolve().parents[1]


def test_strategy_names_resolve() -> None:
    for name, start in (("fpdt", "popen"), ("fpdt_spawn", "spawn"), ("fpdt_fork", "fork")):
        trainer = L.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)
        assert isinstance(trainer.strategy, FPDTStrategy)
        assert trainer.strategy._start_method == start
    assert lightning_fpdt.FPDTStrategy is FPDTStrategy


def _fit(strategy: FPDTStrategy, devices: int, config: LlamaConfig, data) -> None:
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(LlamaLM(config), data)


class _NoIds(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> dict:
        return {"tokens": torch.zeros(8, dtype=torch.long)}


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("sp", "devices", "heads", "kv", "data", "match"),
    [
        (3, 2, 4, 4, "ok", r"sequence_parallel_size=3 does not divide the world size 2.*use one of \[1, 2\]"),
        (4, 4, 2, 2, "ok", r"n_heads=2 is not divisible by sequence_parallel_size=4"),
        (4, 4, 4, 3, "ok", r"not a multiple of num_key_value_heads=3"),
        (2, 2, 4, 4, "no_ids", r"the batch has no 'input_ids'; its keys are \['tokens'\]"),
    ],
    ids=["sp-not-dividing-world", "heads-not-divisible", "bad-gqa", "missing-input_ids"],
)
def test_misconfiguration_fails_on_every_rank(sp, devices, heads, kv, data, match) -> None:
    data_loader = dataloader(_NoIds(), 2) if data == "no_ids" else dataloader(TokenDataset(4, 16, 64, 0), 2)
    with pytest.raises(Exception, match=match):
        config = LlamaConfig.tiny(num_attention_heads=heads, num_key_value_heads=kv, hidden_size=8 * heads * 3,
                                  vocab_size=64)
        # plain Ulysses (ring_size=1): with a ring, 2 heads do divide over the Ulysses groups of 4 ranks
        _fit(FPDTStrategy(sequence_parallel_size=sp, ring_size=1, start_method="fork"), devices, config, data_loader)


def _check_run(options: FPDTOptions, world_size: int, sequence_parallel_size: int) -> None:
    options.check_run(world_size=world_size, num_nodes=1, num_processes=world_size,
                      sequence_parallel_size=sequence_parallel_size, precision="32-true", device_type="cpu")


def test_bad_arguments_are_refused_at_construction() -> None:
    # chunk_size against sequence_parallel_size needs the world first (below), so it is checked at setup
    with pytest.raises(ValueError, match=r"chunk_size=10 is not divisible by sequence_parallel_size=4.*e.g. 8 or 12"):
        _check_run(FPDTStrategy(sequence_parallel_size=4, chunk_size=10).options, 4, 4)
    with pytest.raises(ValueError, match="sequence_parallel_size must be a positive int or 'auto', got 0"):
        FPDTStrategy(sequence_parallel_size=0)
    with pytest.raises(ValueError, match="attention_backend='cuda' is not one of"):
        FPDTStrategy(attention_backend="cuda")


def test_head_checks_name_the_numbers() -> None:
    check_heads(8, 2, 4)  # kv heads replicated: fine
    check_heads(8, 8, 4)
    with pytest.raises(ValueError, match=r"n_heads=6 is not divisible by sequence_parallel_size=4.*Use ring_size=2 "
                                         r"\(Ulysses 2 x ring 2.*sequence_parallel_size in \[1, 2, 3, 6\]"):
        check_heads(6, 6, 4)
    with pytest.raises(ValueError, match="n_kv_heads=3 and sequence_parallel_size=2"):
        check_heads(6, 3, 2)


def test_non_dict_batch_under_sequence_parallelism() -> None:
    strategy = FPDTStrategy(sequence_parallel_size=2)
    with pytest.raises(TypeError, match="needs dict batches with 'input_ids'.*got a tuple"):
        strategy.shard_batch((torch.zeros(2, 8),))


def test_a_sequence_parallel_size_that_does_not_divide_the_devices_is_reported_before_the_chunk_size() -> None:
    # tiny_cpu.yaml's chunk_size=128 with sequence_parallel_size=3 on 2 devices: the size is the problem
    options = FPDTStrategy(sequence_parallel_size=3, chunk_size=128).options
    with pytest.raises(ValueError, match=r"sequence_parallel_size=3 does not divide the world size 2.*one of \[1, 2\]"):
        _check_run(options, 2, 3)
    with pytest.raises(ValueError, match=r"chunk_size=128 is not divisible by sequence_parallel_size=3.*126 or 129"):
        _check_run(options, 3, 3)


@pytest.mark.parametrize("shape", [(2, 29), (2, 32, 2), (32,)], ids=["short", "extra-dim", "no-batch-dim"])
def test_a_loss_mask_of_the_wrong_shape_names_the_key_and_the_shape(shape: tuple[int, ...]) -> None:
    batch = {"input_ids": torch.zeros(2, 32, dtype=torch.long), "loss_mask": torch.ones(shape, dtype=torch.long)}
    expected = rf"FPDTStrategy: sequence key 'loss_mask' has shape {re.escape(str(shape))}, expected \[2, 32\] like"
    for sp in (1, 2):  # before, a raw "shape '[2, 32]' is invalid for input of size 58" from mask_targets
        with pytest.raises(ValueError, match=expected + r" 'input_ids'; it marks each target token"):
            shard_batch(batch, sp, 0, owner="FPDTStrategy")
    with pytest.raises(ValueError, match=r"LlamaLM: sequence key 'loss_mask' has shape"):
        LlamaLM(LlamaConfig.tiny(vocab_size=64)).training_step(batch, 0)


@pytest.mark.distributed  # the benchmark runs its steps on 2 gloo ranks
def test_training_benchmark_with_one_length_prints_no_slope() -> None:
    """One ``--seq``: the memory-per-token columns, which need two lengths, are "-" (before: ZeroDivisionError)."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "training.py"), "--seq", "128", "--hidden", "64", "--heads", "4",
         "--layers", "1", "--vocab", "256", "--repeats", "1", "--variants", "ulysses", "--models", "llama"],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in proc.stdout.splitlines() if line[:1] == "|"]
    header, row = rows[0], rows[2]
    assert row[:3] == ["llama", "ulysses", "128"], proc.stdout
    assert row[header.index("RSS KiB/token")] == "-" and row[header.index("tensors KiB/token")] == "-", proc.stdout


def test_a_peer_failure_names_the_dead_rank_and_the_ranks_still_running() -> None:
    reaped = subprocess.Popen(["sleep", "60"])
    reaped.kill()
    reaped.wait()  # gone from the process table
    zombie = subprocess.Popen(["sleep", "60"])
    zombie.send_signal(signal.SIGKILL)  # dead, not yet reaped: /proc still says how it died
    deadline = time.monotonic() + 10
    while process_state(zombie.pid) == "running" and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        host = socket.gethostname()
        peers = (Peer(0, host, os.getpid()), Peer(1, host, zombie.pid), Peer(2, host, reaped.pid),
                 Peer(3, "another-host", 1))
        error = RuntimeError("[pair.cc:537] Read error [127.0.0.1]:27303: Connection reset by peer. GLHF!")
        explain_peer_failure(error, peers, 0)
        message = str(error)
        assert message.startswith(
            f"FPDTStrategy: rank 0 lost a peer: the process of rank 1 (pid {zombie.pid}, killed by SIGKILL), rank 2"
            f" (pid {reaped.pid}, gone) died"), message
        assert f"Still running on {host}: rank(s) [0]; ranks on other hosts (not checked): [3]." in message
        assert "out-of-memory killer" in message and message.endswith("Connection reset by peer. GLHF!")
        other = ValueError("FPDTStrategy: something else")
        explain_peer_failure(other, peers, 0)
        assert str(other) == "FPDTStrategy: something else"  # only peer failures are rewritten
        assert peer_failure_message(RuntimeError("Connection reset by peer"), (), 0) is None  # no peers recorded
    finally:
        zombie.wait()


_KILLED_FIT = """
import os, signal, sys
import lightning as L
import torch
from torch.utils.data import DataLoader
from lightning_fpdt import FPDTStrategy
from lightning_fpdt.models import LlamaConfig, LlamaLM

class KillRankOne(L.Callback):
    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if batch_idx == 1 and trainer.global_rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # as the out-of-memory killer does: no error, no output

if __name__ == "__main__":
    torch.set_num_threads(1)
    data = DataLoader([{"input_ids": torch.arange(16) % 64} for _ in range(4)], batch_size=1)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=FPDTStrategy(sequence_parallel_size=2), max_steps=3,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[KillRankOne()])
    trainer.fit(LlamaLM(LlamaConfig.tiny(vocab_size=64, num_hidden_layers=1)), data)
"""


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_when_a_rank_is_killed_the_survivor_names_it(tmp_path: Path) -> None:
    """Rank 1 of a 2-process fit (the default subprocess launcher, as fpdt-train runs) is SIGKILLed at its second
    batch; rank 0 fails in its next collective and says which rank died, instead of gloo's words alone."""
    script = tmp_path / "killed_fit.py"
    script.write_text(_KILLED_FIT)
    start = time.monotonic()
    # a fresh rendezvous: earlier fits in this process left MASTER_PORT and friends in os.environ
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_VARIABLES}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100, cwd=tmp_path,
                          env=env)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert re.match(r"\[rank0\]: RuntimeError: FPDTStrategy: rank 0 lost a peer: the process of rank 1 \(pid \d+,"
                    r" killed by SIGKILL\) died, so this collective cannot complete\. Still running on .*: rank\(s\)"
                    r" \[0\]\.", last), proc.stderr[-3000:]
    # the backend's words are kept at the end (gloo words it one of three ways, depending on where it noticed)
    assert re.search(r"Connection (reset|closed) by peer|caused by a remote worker crashing", last), last
    assert time.monotonic() - start < 90  # the survivor exits at once, not at the process-group timeout


@pytest.mark.parametrize(("error", "line", "whole"), [
    (TypeError("empty() received an invalid combination of arguments:\n * (tuple of ints size)\n * (int size)"),
     "empty() received an invalid combination of arguments", "TypeError: empty() received an invalid combination of"
     " arguments"),
    (ValueError("\n  the reason, after a blank line  \nmore"), "the reason, after a blank line",
     "ValueError: the reason, after a blank line"),
    (AssertionError(), "AssertionError", "AssertionError"),
    (KeyError("x"), "'x'", "KeyError: 'x'"),
])
def test_another_librarys_error_is_quoted_in_one_line(error: BaseException, line: str, whole: str) -> None:
    """A refusal quotes a foreign error by its first line (no overload list, no trailing colon); an error without a
    message is its class name once, not "AssertionError: AssertionError"."""
    assert first_line(error) == line
    assert described(error) == whole


def test_an_error_whose_detail_is_on_later_lines_is_quoted_whole_on_one_line() -> None:
    """``one_line`` keeps every line of a foreign error (a YAML error's position, the Hub's link), joined by single
    spaces; an error without a message is its class name."""
    error = ValueError("while parsing a flow sequence\n  in 'bad.yaml', line 2, column 14\nexpected ',' or ']'")
    assert one_line(error) == "while parsing a flow sequence in 'bad.yaml', line 2, column 14 expected ',' or ']'"
    assert one_line(AssertionError()) == "AssertionError"

