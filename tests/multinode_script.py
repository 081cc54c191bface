"""One rank of a two-"node" run on one machine, for tests/test_multinode.py (launched by torchrun or as a SLURM task).

    python tests/multinode_script.py OUT_DIR RING_SIZE

Trains one ``Trainer.fit`` step of a tiny float64 Llama (``math`` backend) on the packed documents of
``tests/test_packed_training.py`` under ``Trainer(num_nodes=2, devices=2)`` and
``FPDTStrategy(sequence_parallel_size=4, ring_size=RING_SIZE)``: Ulysses inside each node, the ring across the two.
The initial weights and the data's seed are read from ``OUT_DIR/inputs.pt`` (written by the test). Every rank
writes its loss and gradients (``OUT_DIR/rank{r}.pt``, :class:`tests.helpers.CaptureStep`) and where it ran
(``OUT_DIR/rank{r}.json``: the cluster environment Lightning chose, node and local rank, the ranks of its Ulysses
group and ring).

Environment:
    FPDT_MULTINODE_HOST: the host name this process reports (``socket.gethostname``), so that the two "nodes" look
        like two machines to the strategy's record of which rank runs where (``lightning_fpdt.strategy.launcher``).
    FPDT_MULTINODE_DIE_RANK: the global rank that SIGKILLs itself at its first training batch (as the kernel's
        out-of-memory killer does: no error, no output).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L
import torch
import torch.distributed as dist

from lightning_fpdt import FPDTStrategy
from lightning_fpdt.models import LlamaConfig, LlamaLM
from tests.helpers import CaptureStep, dataloader
from tests.test_packed_training import PACKING, VOCAB, Packed

SP, CHUNK = 4, 16  # 32-token samples: 2 chunks, 8 tokens per rank


def tiny_llama() -> LlamaLM:
    """The model of every run here (4 heads, 2 KV heads: Ulysses of 2 fits both)."""
    config = LlamaConfig.tiny(num_attention_heads=4, num_key_value_heads=2, hidden_size=32, intermediate_size=64,
                              num_hidden_layers=2, vocab_size=VOCAB)
    return LlamaLM(config, learning_rate=1e-3, warmup_steps=1)


class Die(L.Callback):
    def __init__(self, rank: int | None) -> None:
        self.rank = rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank:
            os.kill(os.getpid(), signal.SIGKILL)


class RecordPlacement(L.Callback):
    """Where this rank ran, written once its groups exist."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_start(self, trainer, pl_module) -> None:
        strategy = trainer.strategy
        context = strategy.sequence_parallel_context
        record = {
            "cluster_environment": type(strategy.cluster_environment).__name__,
            "global_rank": trainer.global_rank, "node_rank": trainer.node_rank, "local_rank": trainer.local_rank,
            "world_size": trainer.world_size, "ring_size": strategy.ring_size,
            "ulysses_ranks": dist.get_process_group_ranks(context.ulysses_group),
            "ring_ranks": dist.get_process_group_ranks(context.ring_group),
        }
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def main(out: Path, ring_size: int | str) -> None:
    torch.set_num_threads(1)
    host = os.environ.get("FPDT_MULTINODE_HOST")
    if host:
        socket.gethostname = lambda: host  # one machine playing two: each "node" names itself
    die = os.environ.get("FPDT_MULTINODE_DIE_RANK")
    inputs = torch.load(out / "inputs.pt")
    module = tiny_llama()
    module.load_state_dict(inputs["state_dict"])
    data = Packed(PACKING, inputs["seed"])
    trainer = L.Trainer(
        accelerator="cpu", num_nodes=2, devices=2, precision="64-true", max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[CaptureStep(str(out)), RecordPlacement(out), Die(None if die is None else int(die))],
        # a dead peer must end the survivors' collectives long before this (the test waits 60 s at most)
        strategy=FPDTStrategy(sequence_parallel_size=SP, ring_size=ring_size, chunk_size=CHUNK,
                              attention_backend="math", timeout=timedelta(seconds=120)),
    )
    trainer.fit(module, dataloader(data, len(data)))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if sys.argv[2] == "auto" else int(sys.argv[2]))
