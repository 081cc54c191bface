"""Where a rank's host memory goes in ``Trainer.fit``: resident set, allocator and live tensors, phase by phase.

    python benchmarks/fit_memory.py                        # 44M Llama, 8192 tokens, sp=2, full memory stack
    python benchmarks/fit_memory.py --shard-parameters     # the same under FSDP2
    python benchmarks/fit_memory.py --tensors              # + the peak of live tensors in the last step
    python benchmarks/fit_memory.py --mmap-threshold 131072  # glibc: large blocks mmapped, returned when freed
    python benchmarks/fit_memory.py --steps 3 --release-gradients  # gradients freed between steps
    python benchmarks/fit_memory.py --hidden 64 --layers 1 --vocab 256 --seq 256  # a tiny model (a smoke run)

The model of ``benchmarks/training.py`` (Llama-style, hidden 512, 8 heads, 4 KV heads, 4 layers,
intermediate 1408, vocabulary 32000, float32, batch 1; ``--hidden``, ``--layers``, ``--vocab`` change it) trained
by ``Trainer.fit`` on 2 CPU (gloo) processes with
``FPDTStrategy(sequence_parallel_size=2, chunk_size=2048, activation_checkpointing=True)`` (tiled MLP and loss: the
full memory stack) for ``--steps`` optimizer steps. Each rank is its own process (Lightning's default launcher), as
in any real run.

Printed per rank, at each phase (the script's start, after the imports, the model built, DDP or FSDP2
set up, and in every step after the forward, the backward, the optimizer step):

- ``rss``: the resident set now; ``peak``: ``ru_maxrss`` so far (the high-water mark);
- ``file``: resident pages mapped from files (the shared libraries' code and data); ``anon``: the rest;
- glibc's ``malloc`` (``mallinfo2``, all arenas): ``in use`` (bytes handed out and not freed, mmapped
  blocks included), ``free held`` (freed inside the arenas but kept by the process) and ``mmapped``;
- ``tensors``: the parameters, the gradients and the optimizer state (each storage once; DDP's buckets
  are the gradients' storage with ``gradient_as_bucket_view``).

With ``--tensors`` the last step runs under :class:`~lightning_fpdt.offload.memtrack.TensorMemoryTracker` (slower):
its peak of live tensors (parameters, gradients, optimizer state and activations), what was alive at that
moment and the operator that reached it are printed, with the estimate of :mod:`lightning_fpdt.memory` for
the run. ``--release-gradients`` frees the gradients (DDP's buckets) after each optimizer step and gives them
back before each backward (``benchmarks/gradient_release.py``, from a callback here);
use ``--steps 3`` or more to see a step after DDP's bucket rebuild (second step). ``--trim`` calls glibc's
``malloc_trim`` before each backward and after each step.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_memory import MIB, fix_mmap_threshold, format_rows, sample, trim

_ROWS = [sample("script start")]

import argparse  # noqa: E402  (the first sample is taken before torch is imported)

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from gradient_release import GradientRelease  # noqa: E402
from tensor_peak import PeakSnapshot  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from lightning_fpdt import FPDTStrategy  # noqa: E402
from lightning_fpdt.memory import ModelShape, estimate  # noqa: E402
from lightning_fpdt.models import LlamaConfig, LlamaLM  # noqa: E402

_ROWS.append(sample("imports"))


class RandomTokens(Dataset):
    """``n`` fixed random sequences of ``seq`` token ids (the loss is on every next token)."""

    def __init__(self, n: int, seq: int, vocab: int) -> None:
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i]}


def _storages_mib(tensors: list[torch.Tensor]) -> float:
    """MiB of the distinct storages behind ``tensors`` (a DTensor counts its local shard)."""
    seen: dict[int, int] = {}
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values()) / MIB


class ReleaseGradients(L.Callback):
    """What ``benchmarks/gradient_release.py`` does once a strategy calls it: the gradients
    (DDP's buckets, with ``gradient_as_bucket_view``) freed after each optimizer step, back before each backward."""

    def __init__(self) -> None:
        self.release = GradientRelease(bucket_views=True)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.release.release(pl_module.parameters())

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self.release.restore()


class Trim(L.Callback):
    """glibc's free pages given back (:func:`host_memory.trim`) before each backward and after each step."""

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        trim()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        trim()


class PhaseMemory(L.Callback):
    """Samples :func:`sample` at each phase of a fit, with the parameters', gradients' and optimizer
    state's storages; with ``track``, the last step's peak of live tensors."""

    def __init__(self, track_step: int | None) -> None:
        self.rows = _ROWS
        self.track_step = track_step
        self.tracker: PeakSnapshot | None = None
        self.tensor_peak: str | None = None

    def _add(self, phase: str, trainer: L.Trainer, module: L.LightningModule) -> None:
        row = sample(phase)
        params = list(module.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        states = [t for opt in trainer.optimizers for s in opt.state.values() for t in s.values()
                  if isinstance(t, torch.Tensor) and t.dim() > 0]
        row.update(params=_storages_mib(params), grads=_storages_mib(grads), optimizer=_storages_mib(states))
        self.rows.append(row)

    def setup(self, trainer, pl_module, stage) -> None:
        self._add("model built", trainer, pl_module)

    def on_fit_start(self, trainer, pl_module) -> None:
        self._add("strategy set up", trainer, pl_module)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.started = time.perf_counter()
        if batch_idx == self.track_step:
            named = {"parameters": list(pl_module.parameters()),
                     "gradients": [p.grad for p in pl_module.parameters() if p.grad is not None],
                     "optimizer state": [t for opt in trainer.optimizers for s in opt.state.values()
                                         for t in s.values() if isinstance(t, torch.Tensor)]}
            local = {k: [t.to_local() if hasattr(t, "to_local") else t for t in v] for k, v in named.items()}
            labels = {t.untyped_storage().data_ptr(): k for k, v in local.items() for t in v}
            self.tracker = PeakSnapshot(labels).__enter__()
            self.tracker.track(*[t for v in local.values() for t in v])

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self._add(f"step {trainer.global_step + 1}: forward", trainer, pl_module)

    def on_after_backward(self, trainer, pl_module) -> None:
        self._add(f"step {trainer.global_step + 1}: backward", trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.tracker is not None:
            self.tracker.__exit__(None, None, None)
            self.tensor_peak, self.tracker = self.tracker.describe(), None
        self._add(f"step {trainer.global_step}: optimizer step", trainer, pl_module)
        self.rows[-1]["seconds"] = time.perf_counter() - self.started


def _gather(report: dict) -> list[dict]:
    """Every rank's ``report``, in rank order, through a gloo group of its own, destroyed before returning.

    The exchange is the script's last collective, and a gloo worker thread releases a collective's tensors after
    ``all_gather_object`` has returned. Still doing so while the interpreter exits, it needs the GIL, is made to
    exit, unwinds through C++ and aborts the process: "terminate called without an active exception". Freeing the
    group joins its worker threads. The groups Lightning made cannot be freed here: its trainer holds them, and
    under FSDP2 torch's caches of device meshes hold the world group; their last collectives ended in the fit.
    """
    group = dist.new_group(backend="gloo")
    reports: list = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report, group=group)
    dist.barrier(group)  # no rank tears the group down while another still talks to it
    dist.destroy_process_group()  # every group: Lightning's launcher never does
    del group  # the last reference: ~ProcessGroupGloo joins the worker threads
    return reports


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--chunk-size", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=512, help="model width (intermediate: 11/4 of it)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--shard-parameters", action="store_true", help="FSDP2 instead of DDP")
    parser.add_argument("--no-bucket-view", action="store_true", help="gradient_as_bucket_view=False (DDP)")
    parser.add_argument("--tensors", action="store_true", help="track live tensors in the last step (slow)")
    parser.add_argument("--mmap-threshold", type=int, default=None, metavar="BYTES",
                        help="glibc: mmap each allocation of at least BYTES (host_memory.fix_mmap_threshold)")
    parser.add_argument("--trim", action="store_true", help="malloc_trim before each backward and after each step")
    parser.add_argument("--release-gradients", action="store_true",
                        help="free the gradients (DDP's buckets) between steps (ReleaseGradients)")
    args = parser.parse_args()
    if args.mmap_threshold is not None:
        fix_mmap_threshold(args.mmap_threshold)

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                         rope_theta=10000.0, mlp_tiles=None)
    torch.manual_seed(0)
    module = LlamaLM(config, loss_tiles=None)  # tiled MLP (mlp_tiles=None) and tiled loss
    _ROWS.append(sample("model created"))
    kwargs = {} if args.shard_parameters else {"gradient_as_bucket_view": not args.no_bucket_view}
    strategy = FPDTStrategy(sequence_parallel_size=2, chunk_size=args.chunk_size, activation_checkpointing=True,
                            shard_parameters=args.shard_parameters, **kwargs)
    callback = PhaseMemory(args.steps - 1 if args.tensors else None)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[callback, *([ReleaseGradients()] if args.release_gradients else []),
                                   *([Trim()] if args.trim else [])])
    start = time.perf_counter()
    trainer.fit(module, DataLoader(RandomTokens(args.steps, args.seq, config.vocab_size), batch_size=1))
    seconds = time.perf_counter() - start

    shape, tiling = ModelShape.from_module(module)
    est = estimate(shape, args.seq, strategy.estimate_options.replace(**tiling))
    reports = _gather({"rank": trainer.global_rank, "rows": callback.rows, "tensor_peak": callback.tensor_peak})
    if trainer.global_rank != 0:
        return
    print(f"\n{args}; fit {seconds:.0f} s; estimate (lightning_fpdt.memory, MiB): parameters"
          f" {est.parameters / MIB:.0f}, gradients {est.gradients / MIB:.0f}, optimizer {est.optimizer / MIB:.0f},"
          f" saved activations {est.saved_activations / MIB:.0f}, peak transient {est.peak_transient / MIB:.0f},"
          f" device_peak {est.device_peak / MIB:.0f}")
    for rep in reports:
        peak = rep["tensor_peak"]
        tensors = "" if peak is None else f", peak of live tensors in the last step {peak}"
        seconds = " ".join(f"{r['seconds']:.1f}" for r in rep["rows"] if "seconds" in r)
        print(f"\nrank {rep['rank']} (MiB): peak RSS {max(r['peak'] for r in rep['rows']):.0f}{tensors}; step seconds"
              f" {seconds}")
        print(format_rows(rep["rows"]))


if __name__ == "__main__":
    main()
