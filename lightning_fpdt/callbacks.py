"""Callbacks: FPDT's own figures for the logger, throughput/MFU wiring, and a console loss printer."""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_fpdt.backends import route_description
from lightning_fpdt.errors import FPDTError
from lightning_fpdt.offload.stats import OffloadStats
from lightning_fpdt.options import attention_dtype
from lightning_fpdt.parallel.binding import attention_records


class FPDTMonitor(pl.Callback):
    """Logs what the FPDT pipeline did each training step, summed over the model's attention layers (its FPDT
    blocks, or the transformers attention layers of an ``HFCausalLM``).

    Scalars (under ``fpdt/``): ``seq_len`` (global tokens per sample), ``chunks`` (per block),
    ``offload_bytes_to_host``, ``offload_bytes_to_device``, ``offload_gbps`` (bytes moved per second
    of step time), ``prefetch_wait_s`` (compute time spent waiting for copies), ``prefetch_stalls``
    (chunks used without a prefetch), ``pipeline_peak_device_mib`` (largest device footprint of
    one block's saved chunks) and, on CUDA, ``peak_device_memory_mib``
    (``torch.cuda.max_memory_allocated``, reset every step). Text, once at the start of training (loggers that take
    text, TensorBoard's): ``fpdt/attention_route``, the attention route the run takes and its library's version (what
    the strategy logs at setup), so that a fallback shows beside the figures it explains; after the first step,
    ``fpdt/attention_calls``, the kernels its attention calls ran on, with why any block left the route
    (:mod:`lightning_fpdt.attention.routes`).

    Args:
        log_every_n_steps: log every n-th optimizer step.
    """

    def __init__(self, log_every_n_steps: int = 1) -> None:
        self.log_every_n_steps = log_every_n_steps
        self._start = 0.0
        self._calls_written = False

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        options = getattr(trainer.strategy, "options", None)  # FPDTStrategy's
        if trainer.global_rank != 0 or options is None:
            return
        route = route_description(options.attention_backend, trainer.strategy.root_device.type,
                                  attention_dtype(str(trainer.precision)))
        _add_text(trainer, "fpdt/attention_route", route)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._start = time.perf_counter()
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(trainer.strategy.root_device)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        watched = getattr(trainer.strategy, "first_step_attention", None)  # FPDTStrategy's
        if not self._calls_written and watched is not None and watched.said is not None and trainer.global_rank == 0:
            _add_text(trainer, "fpdt/attention_calls", watched.said)
            self._calls_written = True
        if trainer.global_step % self.log_every_n_steps != 0:
            return
        records = attention_records(pl_module)
        if not records:
            return
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        total = OffloadStats()
        for record in records:
            total.merge(record.stats)
        sp = getattr(trainer.strategy, "sequence_parallel_size", 1)
        metrics = {
            "fpdt/seq_len": float(records[0].seq_len_local * sp),
            "fpdt/chunks": float(records[0].chunks),
            "fpdt/offload_bytes_to_host": float(total.bytes_to_host),
            "fpdt/offload_bytes_to_device": float(total.bytes_to_device),
            "fpdt/offload_gbps": (total.bytes_to_host + total.bytes_to_device) / elapsed / 1e9,
            "fpdt/prefetch_wait_s": total.wait_seconds,
            "fpdt/prefetch_stalls": float(total.stalls),
            "fpdt/pipeline_peak_device_mib": total.peak_device_bytes / 2**20,
        }
        if trainer.strategy.root_device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(trainer.strategy.root_device)
            metrics["fpdt/peak_device_memory_mib"] = peak / 2**20
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, sync_dist=False, rank_zero_only=True)


def _add_text(trainer: pl.Trainer, tag: str, text: str) -> None:
    """``text`` to every logger that takes text (TensorBoard's ``add_text``)."""
    for logger in trainer.loggers:
        add_text = getattr(getattr(logger, "experiment", None), "add_text", None)
        if callable(add_text):
            add_text(tag, text, trainer.global_step)


def tokens_in_batch(batch: Any) -> int:
    """This rank's tokens in a (sharded) dict batch: ``input_ids.numel()``."""
    return int(batch["input_ids"].numel())


def samples_in_batch(batch: Any) -> int:
    return int(batch["input_ids"].shape[0])


class TokenThroughputMonitor(ThroughputMonitor):
    """Lightning's ``ThroughputMonitor`` counting tokens of dict batches (usable by name in YAML).

    Under sequence parallelism each rank counts its shard's tokens and Lightning multiplies by the
    world size, which gives the true tokens per second. The module's ``flops_per_batch`` (set by
    :class:`~lightning_fpdt.models.causal_lm.CausalLM` every step from its model's ``flops_per_token``, the bundled
    models' and ``HFCausalLM``'s alike) gives FLOP/s (``train/flops_per_sec``, ``train/device/flops_per_sec``)
    and MFU (``train/device/mfu``) against the device's peak: Lightning's table of GPUs, or ``available_flops``.

    Args:
        window_size: batches averaged over.
        separator: between the stage and the metric name in logged keys.
        available_flops: peak FLOP/s of one device for MFU, where Lightning does not know the device (a CPU, a
            GPU missing from its table) or to override it; ``None``: Lightning's figure (none on a CPU: no MFU).
        prog_bar: also show the tokens per second (``tok/s``) in the progress bar, once a window is measured.
    """

    def __init__(self, window_size: int = 20, separator: str = "/", available_flops: float | None = None,
                 prog_bar: bool = True) -> None:
        super().__init__(batch_size_fn=samples_in_batch, length_fn=tokens_in_batch, window_size=window_size,
                         separator=separator)
        if available_flops is not None and not available_flops > 0:
            raise FPDTError(f"TokenThroughputMonitor: available_flops must be a positive peak FLOP/s per device,"
                            f" got {available_flops!r}; leave it None to use Lightning's table of GPUs.")
        self.peak_flops = available_flops
        self.prog_bar = prog_bar

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        super().on_train_batch_end(trainer, pl_module, *args)  # rank zero measures
        throughput = self._throughputs.get(trainer.state.stage)
        if not (self.prog_bar and trainer.is_global_zero and throughput is not None and self._batches.get(
                trainer.state.stage)):
            return
        measured = throughput.compute()  # every rank's shard counted: the world's tokens once a window is full
        rate = measured.get("items_per_sec", measured.get(f"device{throughput.separator}items_per_sec"))
        if rate is not None:
            pl_module.log("tok/s", float(rate), prog_bar=True, logger=False, rank_zero_only=True)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if self.peak_flops is not None:  # the user's peak wins over Lightning's table
            self.available_flops = self.peak_flops
            for throughput in self._throughputs.values():
                throughput.available_flops = self.peak_flops


class LossPrinter(pl.Callback):
    """Prints ``step N  loss X`` on rank zero every ``every_n_steps`` steps (for terminals and CI logs)."""

    def __init__(self, every_n_steps: int = 10) -> None:
        self.every_n_steps = every_n_steps

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        loss = trainer.callback_metrics.get("train/loss")
        if loss is not None and (step % self.every_n_steps == 0 or step == 1):
            rank_zero_info(f"step {step:5d}  loss {float(loss):.4f}")

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        shown = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
        if shown and not trainer.sanity_checking:
            rank_zero_info("validation  " + "  ".join(f"{k} {v:.4f}" for k, v in sorted(shown.items())))
