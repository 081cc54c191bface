"""Two "nodes" on one machine: a real ``Trainer.fit`` step with the ring across the nodes, launched as users do.

``tests/multinode_script.py`` runs ``Trainer(num_nodes=2, devices=2)`` with ``FPDTStrategy(sequence_parallel_size=4,
ring_size=2)``: Ulysses groups of 2 consecutive ranks inside each node, rings of 2 ranks (one per node) across
them. It is launched by ``torchrun --nnodes 2`` once per node, and as four tasks with the environment ``srun`` gives
them (Lightning's ``SLURMEnvironment``, ``ring_size="auto"``). Every rank's loss and gradients must equal one process
training each packed document alone (float64, relative error <= 1e-10). A rank SIGKILLed on node 1 must stop node
0's processes, which name the lost peer (``lightning_fpdt.strategy.launcher``), instead of hanging until the
process-group timeout. Last, the multi-node recipe (``examples/multinode/``) parses and is sized as its comments say.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

from lightning_fpdt.cli import main as cli_main
from lightning_fpdt.memory.__main__ import main as memory_main
from lightning_fpdt.strategy import launcher
from lightning_fpdt.strategy.launcher import Peer, explain_peer_failure
from tests.helpers import assert_same_step
from tests.multinode_script import tiny_llama
from tests.test_packed_training import PACKING, Packed, each_document_alone

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "multinode_script.py"
NODES, PER_NODE = 2, 2
WAIT_S = 150  # each launch; a clean one takes ~20 s on 2 shared cores
# the launch environments must not leak in from the test process (an earlier in-process fit sets MASTER_PORT, ...)
_LAUNCH_PREFIXES = ("SLURM_", "TORCHELASTIC_", "FPDT_MULTINODE_")
_LAUNCH_NAMES = {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK",
                 "LOCAL_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE"}


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_NAMES and not k.startswith(_LAUNCH_PREFIXES)}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The initial weights and data every launch reads (``inputs.pt``), and the one-process loss and gradients."""
    seed = int(os.environ.get("FPDT_TEST_SEED", random.SystemRandom().randrange(2**30)))  # shown on a failure
    torch.manual_seed(seed)
    module = tiny_llama()
    inputs = tmp_path_factory.mktemp("multinode") / "inputs.pt"
    torch.save({"state_dict": module.state_dict(), "seed": seed}, inputs)
    loss, grads = each_document_alone(module, Packed(PACKING, seed).documents())
    return {"inputs": inputs, "loss": loss, "grads": grads, "seed": seed}


def _out_dir(tmp_path: Path, reference: dict) -> Path:
    out = tmp_path / "out"
    out.mkdir()
    (out / "inputs.pt").write_bytes(reference["inputs"].read_bytes())
    return out


def _wait(procs: list[subprocess.Popen], logs: list[Path]) -> list[int]:
    """Each process's exit code; fails if any is still running after ``WAIT_S``, killing each one's process group
    (a launcher and its workers)."""
    deadline = time.monotonic() + WAIT_S
    try:
        return [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        raise AssertionError(f"still running after {WAIT_S} s:\n" + _tails(logs)) from None


def _tails(logs: list[Path]) -> str:
    return "\n".join(f"--- {log.name}:\n{log.read_text()[-3000:]}" for log in logs)


def _launch(cmds_envs: list[tuple[list[str], dict[str, str]]], out: Path, name: str) -> tuple[list[int], list[Path]]:
    procs, logs = [], []
    for i, (cmd, env) in enumerate(cmds_envs):
        log = out / f"{name}{i}.log"
        with open(log, "w") as f:
            procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                          start_new_session=True))
        logs.append(log)
    return _wait(procs, logs), logs


def torchrun_nodes(out: Path, ring_size: int | str, **extra: str) -> tuple[list[int], list[Path]]:
    """``torchrun --nnodes 2 --node-rank N`` for N = 0, 1 (static rendezvous at 127.0.0.1), each node naming
    itself ``node{N}``; returns the two launchers' exit codes and logs (their workers' output included)."""
    port = str(_free_port())
    launches = []
    for node in range(NODES):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES), "--node-rank", str(node),
               "--nproc-per-node", str(PER_NODE), "--rdzv-backend", "static", "--master-addr", "127.0.0.1",
               "--master-port", port, "--monitor-interval", "0.1", str(SCRIPT), str(out), str(ring_size)]
        launches.append((cmd, _clean_env(FPDT_MULTINODE_HOST=f"node{node}", **extra)))
    return _launch(launches, out, "node")


def slurm_tasks(out: Path, ring_size: int | str) -> tuple[list[int], list[Path]]:
    """Four plain processes with the variables ``srun --nodes 2 --ntasks-per-node 2`` sets (and MASTER_ADDR/PORT,
    which a batch script exports); returns their exit codes and logs."""
    port, launches = str(_free_port()), []
    for rank in range(NODES * PER_NODE):
        node = rank // PER_NODE
        env = _clean_env(
            SLURM_NTASKS=str(NODES * PER_NODE), SLURM_NTASKS_PER_NODE=str(PER_NODE), SLURM_NNODES=str(NODES),
            SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank % PER_NODE), SLURM_NODEID=str(node),
            SLURM_JOB_ID="4242", SLURM_JOB_NAME="fpdt-multinode", SLURM_NODELIST="localhost",
            MASTER_ADDR="127.0.0.1", MASTER_PORT=port, FPDT_MULTINODE_HOST=f"node{node}",
        )
        launches.append(([sys.executable, str(SCRIPT), str(out), str(ring_size)], env))
    return _launch(launches, out, "task")


def check_step(out: Path, reference: dict, environment: str, label: str) -> None:
    """Every rank ran in ``environment`` on its node, with its Ulysses group inside the node and its ring across
    the nodes, and its loss and gradients equal the one-process reference."""
    world = NODES * PER_NODE
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    for r, rec in enumerate(records):
        assert rec["cluster_environment"] == environment, rec
        assert (rec["global_rank"], rec["node_rank"], rec["local_rank"]) == (r, r // PER_NODE, r % PER_NODE), rec
        assert (rec["world_size"], rec["ring_size"]) == (world, 2), rec
        assert {records[p]["node_rank"] for p in rec["ulysses_ranks"]} == {rec["node_rank"]}, rec  # inside a node
        assert {records[p]["node_rank"] for p in rec["ring_ranks"]} == set(range(NODES)), rec  # across the nodes
    results = [torch.load(out / f"rank{r}.pt") for r in range(world)]
    assert_same_step(results, reference["loss"], reference["grads"], tol=1e-10,
                     label=f"{label} seed={reference['seed']}")


PLACEMENT = ("FPDTStrategy: 4 processes on 2 node(s): sequence_parallel=4 as ulysses=2 (consecutive ranks, inside a"
             " node) x ring=2 (ranks 2 apart, across 2 nodes); data_parallel=1 outermost")


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_torchrun_on_two_nodes_equals_one_process(reference: dict, tmp_path: Path) -> None:
    out = _out_dir(tmp_path, reference)
    codes, logs = torchrun_nodes(out, 2)
    assert codes == [0, 0], _tails(logs)
    assert PLACEMENT in logs[0].read_text(), _tails(logs)
    quoted = next(line for line in (ROOT / "docs" / "multi-node.md").read_text().splitlines() if PLACEMENT in line)
    assert quoted in logs[0].read_text().splitlines(), "docs/multi-node.md quotes another log line"
    check_step(out, reference, "TorchElasticEnvironment", "torchrun 2 nodes x 2")


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_slurm_tasks_on_two_nodes_equal_one_process(reference: dict, tmp_path: Path) -> None:
    """As ``srun`` starts them: Lightning picks ``SLURMEnvironment`` and launches nothing; ``ring_size="auto"``
    resolves to the same ulysses=2 x ring=2 (the largest Ulysses degree that fits a node's 2 devices).

    Every task must exit 0. A task once aborted at interpreter exit after a correct step (SIGABRT, "terminate called
    without an active exception" from a gloo thread): these plain processes exit with the process group alive, and
    the interpreter's shutdown tore gloo's threads down in no set order while a peer was still closing its side.
    The strategy now destroys the group at exit (``lightning_fpdt.strategy.launcher.destroy_group_at_exit``)."""
    out = _out_dir(tmp_path, reference)
    codes, logs = slurm_tasks(out, "auto")
    assert codes == [0] * (NODES * PER_NODE), _tails(logs)
    assert PLACEMENT in logs[0].read_text(), _tails(logs)
    check_step(out, reference, "SLURMEnvironment", "SLURM 2 nodes x 2")


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_a_rank_lost_on_one_node_stops_the_other_node_with_a_clear_message(reference: dict, tmp_path: Path) -> None:
    """Rank 2 (node 1) is SIGKILLed at its first batch; torchrun ends node 1, and node 0's ranks fail in their next
    collective with the project's message and exit.

    The rank of node 0 whose collective involved node 1 says that a rank elsewhere is gone (node 1's ranks are on
    another host: listed, not checked). The other may have been waiting on its node-0 peer only (a Ulysses
    all-to-all); it then sees that peer exit with an error and names it, pointing at that peer's own message."""
    out = _out_dir(tmp_path, reference)
    start = time.monotonic()
    codes, logs = torchrun_nodes(out, 2, FPDT_MULTINODE_DIE_RANK="2")
    elapsed = time.monotonic() - start
    assert codes[0] != 0 and codes[1] != 0, _tails(logs)
    node0 = logs[0].read_text()
    # a rank the launcher stopped while it named the peer fails once more after it (Lightning's SIGTERM handler
    # broadcasts), printed after this one: "During handling of the above exception, another exception occurred"
    errors = {int(m.group(1)): m.group(2) for m in re.finditer(
        r"^\[rank(\d)\]: RuntimeError: (FPDTStrategy: rank \d lost a peer: .*)$", node0, re.M)}
    # torchrun SIGTERMs a node's other worker once one has failed: caught in a collective still inside DDP's setup
    # (before Lightning's handler exists: seen on a loaded machine), that worker ends without a word of its own
    stopped = {int(m.group(1)) for m in re.finditer(
        r"rank\s+: (\d) \(local_rank: \d\)\s*\n\s*exitcode\s+: -15 ", node0)}
    assert errors and set(errors) | stopped == {0, 1}, _tails(logs)
    first_loss = ("another rank's process died or closed its connection (none of the ranks on this host is gone)."
                  " Still running on node0: rank(s) [0, 1]; ranks on other hosts (not checked): [2, 3].")
    for rank, error in errors.items():
        other = 1 - rank
        cascade = (rf"the process of rank {other} \(pid \d+, (exited with status 1|gone)\) died, so this collective"
                   rf" cannot complete\. A rank that exits with an error may have lost a peer itself: its own error"
                   rf" names that peer\. Still running on node0: rank\(s\) \[{rank}\]; ranks on other hosts \(not"
                   rf" checked\): \[2, 3\]\.")
        assert error.startswith(f"FPDTStrategy: rank {rank} lost a peer: "), error
        assert first_loss in error or re.search(cascade, error), error
    assert any(first_loss in error for error in errors.values()), errors  # the loss itself is reported
    assert elapsed < 100, f"node 0 took {elapsed:.0f} s to stop: it waited for a timeout, not for the error"


def test_a_sigterm_while_the_peer_is_named_is_handled_after_the_message_is_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torchrun SIGTERMs a node's other workers once one has exited, often while they wait (up to 2 s) for a dead
    peer to show in /proc; the handler (Lightning's broadcasts, and fails) runs once the error names the peer."""
    monkeypatch.setattr(launcher, "_EXIT_WAIT_S", 0.5)  # no peer on this host dies: the survivor waits it all
    seen: list[str] = []
    error = RuntimeError("Connection closed by peer [127.0.0.1]:1234")
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(str(error)))
    timer = threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGTERM))
    try:
        timer.start()
        explain_peer_failure(error, (Peer(0, socket.gethostname(), os.getpid()), Peer(1, "node1", 1)), 0)
    finally:
        timer.join()
        signal.signal(signal.SIGTERM, previous)
    assert len(seen) == 1 and seen[0].startswith("FPDTStrategy: rank 0 lost a peer: another rank's process"), seen


RECIPE = ROOT / "examples" / "multinode" / "llama3_70b_4m.sbatch"


def _recipe_comment_command(text: str, program: str) -> list[str]:
    """The words of the command the recipe's comment quotes (``#   <program> ...`` and its ``#     ...`` lines)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"#   {program} "))
    words = lines[start][len(f"#   {program} "):].split()
    for line in lines[start + 1:]:
        if not line.startswith("#     "):
            break
        words += line[1:].split()
    return words


def _peaks(out: str) -> dict[str, str]:
    rows = {line[:24].strip(): line[24:].strip() for line in out.splitlines()}
    return {"device": rows["device peak"], "host": rows["host (pinned)"]}


def _traffic(out: str) -> dict[str, float]:
    moved = {"all-to-all": 0.0, "ring": 0.0}
    for line in out.splitlines():
        kind = line.strip().split(" ")[0]
        if kind in moved and line.strip().endswith("GiB"):
            moved[kind] += float(line.split()[-2])
    return moved


def test_the_multinode_recipe_parses_and_is_sized_as_its_comment_says(monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture) -> None:
    """examples/multinode: the sbatch script's node and task counts are its YAML's ``num_nodes`` and ``devices``, the
    Ulysses groups are a node's GPUs and the ring has one rank per node; its srun command line parses with the
    project's CLI; the memory command its comment quotes prints the peaks and traffic it states, and so does the
    YAML."""
    text = RECIPE.read_text()
    sbatch = dict(re.findall(r"^#SBATCH (--[\w-]+)=(\S+)", text, re.M))
    config_path = re.search(r"^CONFIG=(\S+)$", text, re.M).group(1)
    config = yaml.safe_load((ROOT / config_path).read_text())
    trainer, strategy = config["trainer"], config["trainer"]["strategy"]["init_args"]
    nodes, per_node = int(sbatch["--nodes"]), int(sbatch["--ntasks-per-node"])
    assert (trainer["num_nodes"], trainer["devices"], int(sbatch["--gpus-per-node"])) == (nodes, per_node, per_node)
    assert strategy["sequence_parallel_size"] == nodes * per_node and strategy["ring_size"] == nodes
    assert re.search(r'^ *--model\.hf_checkpoint "\$CHECKPOINT" --data\.path "\$TOKENS"', text, re.M)
    assert f"CKPT_DIR={config['trainer']['callbacks'][0]['init_args']['dirpath']} " in text
    # the Python lines it runs before srun import what they name (under set -e a wrong module ended every job)
    for module, name in re.findall(r"from (lightning_fpdt[\w.]*) import (\w+)", text):
        assert hasattr(importlib.import_module(module), name), (module, name)
    assert re.findall(r"from (lightning_fpdt[\w.]*) import", text), "the resume line was not found"

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["fpdt-train", "fit", "--config", config_path, "--model.hf_checkpoint", "ckpt",
                                      "--data.path", "tokens.bin", "--print_config"])
    with pytest.raises(SystemExit) as exit_:
        cli_main()
    printed = capsys.readouterr()
    assert exit_.value.code in (0, None), printed.err[-2000:]
    assert "hf_checkpoint: ckpt" in printed.out and "ring_size: 4" in printed.out

    command = _recipe_comment_command(text, "python -m lightning_fpdt.memory")
    memory_main(command)
    flags = capsys.readouterr().out
    memory_main(["--config", config_path])
    from_yaml = capsys.readouterr().out
    assert _peaks(flags) == _peaks(from_yaml), (flags, from_yaml)
    peaks, moved = _peaks(flags), _traffic(flags)
    assert f"prints: device peak {peaks['device']}, host (pinned) {peaks['host']} " in text, peaks
    memory_main([*command[:command.index("--ring")], "--ring", "1", *command[command.index("--ring") + 2:]])
    ring_1 = capsys.readouterr().out
    ulysses_only = _traffic(ring_1)
    stated = re.search(r"attention moves (\d+) GiB .* all-to-alls \(inside a node\) and (\d+) GiB through the ring",
                       " ".join(line.lstrip("# ") for line in text.splitlines()))
    assert (float(stated.group(1)), float(stated.group(2))) == (moved["all-to-all"], moved["ring"]), moved
    assert f"(--ring 1) would move {ulysses_only['all-to-all']:.0f} GiB in all-to-alls" in " ".join(
        line.lstrip("# ") for line in text.splitlines()), ulysses_only
    page = " ".join((ROOT / "docs" / "multi-node.md").read_text().split())  # docs/multi-node.md quotes them too
    assert f"a device peak of {peaks['device']} and {peaks['host']} of pinned host memory" in page, peaks
    assert (f"moves {moved['all-to-all']:.0f} GiB in all-to-alls inside each node and {moved['ring']:.0f} GiB through"
            f" the ring, where Ulysses 32 (`--ring 1`) moves {ulysses_only['all-to-all']:.0f} GiB") in page, moved
    assert _peaks(ring_1)["device"] == peaks["device"] and f"the device peak is the same ({peaks['device']})" in page
