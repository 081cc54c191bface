"""A small training run for the crash/resume tests (tests/test_resume.py), run as its own process group.

    python tests/resume_job.py --out DIR --dp 1 --sp 2 --max-steps 12 [--shard] [--resume latest|PATH]
        [--die-at-step N] [--die-in-save-at-step N] [--model hf] [--checkpointing]

``--model hf`` trains ``HFCausalLM`` around a transformers Llama of the same tiny shape (tiled MLP and
loss); ``--checkpointing`` adds activation checkpointing with host-offload emulation.

Checkpoints every 2 steps into ``DIR/ckpt`` (``step=N.ckpt``) and at every epoch's end into
``DIR/epoch_ckpt`` (``epoch=E.ckpt``); the loader has 8 samples, so 12 steps at dp=1 cross an epoch.
``--die-at-step N`` SIGKILLs the whole process group at the start of step N; ``--die-in-save-at-step N``
does it inside the save of step N's checkpoint, after the data is (partly) written and before it is
committed. At the end the parent writes the final weights to ``DIR/final.pt``; every step's logged loss
goes to ``DIR/losses.txt``. Every rank seeds its random number generators with a seed of its own and
writes their states when it saves a checkpoint and when it has loaded one (``DIR/rng``, :class:`RecordRNG`).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_fpdt.checkpoints.files as fpdt_checkpoint
from lightning_fpdt import FPDTStrategy
from lightning_fpdt.models import LlamaConfig, LlamaLM
from tests.helpers import TokenDataset


def _die() -> None:
    os.killpg(os.getpgrp(), signal.SIGKILL)


class Crash(L.Callback):
    def __init__(self, step: int | None) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.step is not None and trainer.global_step == self.step and trainer.is_global_zero:
            _die()


class RecordLoss(L.Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.is_global_zero:
            with open(self.path, "a") as f:
                f.write(f"{trainer.global_step} {trainer.callback_metrics['train/loss'].item()!r}\n")


class RecordRNG(L.Callback):
    """Seeds every rank's generators (Python, torch, numpy) differently, before any checkpoint is loaded, and
    writes each rank's states when it saves a checkpoint (``saved-step{N}-rank{r}.pt``) and right after it has
    loaded one (``restored-step{N}-rank{r}.pt``): a resumed rank must hold the states it saved, not another's."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def setup(self, trainer, pl_module, stage) -> None:
        seed = 1000 * (trainer.global_rank + 1)
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)

    def _write(self, name: str, trainer) -> None:
        self.out.mkdir(exist_ok=True)
        states = {"python": random.getstate(), "torch": torch.get_rng_state(), "numpy": np.random.get_state()}
        torch.save(states, self.out / f"{name}-rank{trainer.global_rank}.pt")

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self._write(f"saved-step{trainer.global_step}", trainer)

    def on_load_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self._write(f"restored-step{checkpoint['global_step']}", trainer)


class Stream(torch.utils.data.IterableDataset):
    """The samples of a dataset as a stream without ``__len__``, in the same shuffled order every epoch."""

    def __init__(self, data: torch.utils.data.Dataset, seed: int) -> None:
        self.data, self.order = data, torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))

    def __iter__(self):
        return (self.data[int(i)] for i in self.order)


def crash_inside_saves(step: int) -> None:
    """Make the save of ``step=<step>.ckpt`` die half-way: a file checkpoint after half of its bytes
    reached the temporary file, a sharded one after every rank wrote its shards (before the commit)."""
    name = f"step={step}.ckpt"
    real_atomic_save = fpdt_checkpoint.atomic_save

    def atomic_save(obj, path) -> None:
        if name in str(path):
            tmp = Path(str(path) + ".tmp-crash")
            torch.save(obj, tmp)
            data = tmp.read_bytes()
            tmp.write_bytes(data[: len(data) // 2])
            _die()
        real_atomic_save(obj, path)

    fpdt_checkpoint.atomic_save = atomic_save
    import torch.distributed.checkpoint as dcp

    real_dcp_save = dcp.save

    def dcp_save(state, *args, checkpoint_id=None, **kwargs):
        out = real_dcp_save(state, *args, checkpoint_id=checkpoint_id, **kwargs)
        if name in str(checkpoint_id):
            torch.distributed.barrier()
            if torch.distributed.get_rank() == 0:
                _die()
            torch.distributed.barrier()  # never returns: rank 0 killed the group
        return out

    dcp.save = dcp_save


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--sp", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1, help="samples per data-parallel rank")
    parser.add_argument("--chunk-size", type=int, default=None)
    parser.add_argument("--shard", action="store_true")
    parser.add_argument("--skip-nonfinite", action="store_true", help="nonfinite_loss='skip'")
    parser.add_argument("--stream", action="store_true", help="an IterableDataset without __len__")
    parser.add_argument("--max-steps", type=int, default=12)
    parser.add_argument("--model", choices=["llama", "hf"], default="llama")
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing, offload emulated")
    parser.add_argument("--resume", default=None)
    parser.add_argument("--die-at-step", type=int, default=None)
    parser.add_argument("--die-in-save-at-step", type=int, default=None)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    if args.die_in_save_at_step is not None:
        crash_inside_saves(args.die_in_save_at_step)

    L.seed_everything(1234)
    config = LlamaConfig.tiny(num_attention_heads=4, num_key_value_heads=2, hidden_size=32, intermediate_size=64,
                              vocab_size=64)
    if args.model == "hf":
        import transformers  # the optional extra, only for this model

        from lightning_fpdt.models import HFCausalLM

        hf_config = transformers.LlamaConfig(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_key_value_heads,
        )
        module = HFCausalLM(hf_config, mlp_tiles=2, loss_tiles=3, learning_rate=3e-3, warmup_steps=2)
    else:
        module = LlamaLM(config, learning_rate=3e-3, warmup_steps=2)
    data = TokenDataset(8, 24, config.vocab_size, seed=7)  # 8 batches per epoch at dp=1: runs cross epochs
    if args.stream:
        loader = torch.utils.data.DataLoader(Stream(data, seed=5), batch_size=args.batch)
    else:
        loader = torch.utils.data.DataLoader(data, batch_size=args.batch, shuffle=True)
    trainer = L.Trainer(
        accelerator="cpu", devices=args.dp * args.sp, precision="64-true", max_steps=args.max_steps,
        strategy=FPDTStrategy(sequence_parallel_size=args.sp, chunk_size=args.chunk_size, attention_backend="math",
                              shard_parameters=args.shard, start_method="fork",
                              activation_checkpointing=args.checkpointing,
                              offload_checkpoints="emulate" if args.checkpointing else False,
                              nonfinite_loss="skip" if args.skip_nonfinite else "raise"),
        callbacks=[ModelCheckpoint(dirpath=out / "ckpt", filename="{step}", every_n_train_steps=2, save_top_k=-1),
                   # and one at the end of every epoch (saved in on_train_epoch_end)
                   ModelCheckpoint(dirpath=out / "epoch_ckpt", filename="{epoch}", every_n_epochs=1, save_top_k=-1,
                                   save_on_train_epoch_end=True),
                   Crash(args.die_at_step), RecordLoss(out / "losses.txt"), RecordRNG(out / "rng")],
        logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    resume = args.resume
    if resume == "latest":
        resume = str(fpdt_checkpoint.latest_checkpoint(out / "ckpt"))
    trainer.fit(module, loader, ckpt_path=resume)
    torch.save({k: v.detach().clone() for k, v in module.state_dict().items()}, out / "final.pt")


if __name__ == "__main__":
    main()
