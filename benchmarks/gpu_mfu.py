"""The step-time sections of ``gpu_check.py``: MFU of Llama shapes, the full stack against the unbound model, and
where a step's time goes.

- **MFU** in two conventions. *Strict* (the field's usual one, and ``LlamaModel.flops_per_token``'s): 6 x matmul
  parameters per token plus attention's ``QK^T`` and ``PV`` halved by causality, x3 for forward and backward;
  recomputation not counted. *Megatron* (FPDT's and Megatron-LM's papers): attention not halved and activation
  checkpointing's recomputation counted, so 4 forward passes' worth: ``8 x params + 16 x layers x S x hidden`` per
  token. Long sequences read about 2.5x higher in the second.
- **Full stack vs unbound**: the same Llama-1B shape at 16K tokens in one chunk, once with every FPDT feature
  (checkpointed layers with offloaded inputs, offloaded attention chunks, tiled MLP and loss) and once unbound
  (whole-sequence attention, nothing checkpointed, tiled or offloaded): the price of the memory savings.
- **Phases**: one full-stack step under ``torch.profiler``, its device time by the package's profiler ranges
  (attention forward and backward, MLP tiles, loss tiles), the copies on the side streams (overlapped, not part of
  the sum), the rest; and the host's share: kernel launches, stream synchronisations, ``aten::to`` calls.

Every row names the attention route its run used (:func:`lightning_fpdt.backends.route_description`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from typing import Any

import torch
from common import is_oom, release_memory, synchronize

from lightning_fpdt.backends import route_description
from lightning_fpdt.layers.activation_checkpoint import new_layer_input_store
from lightning_fpdt.layers.loss import token_weighted_loss
from lightning_fpdt.models import LlamaConfig, LlamaLM
from lightning_fpdt.offload.copy_engine import release_copy_engines
from lightning_fpdt.parallel.batches import shard_batch
from lightning_fpdt.parallel.binding import SequenceParallelContext, bind

LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0, tie_word_embeddings=False)
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0, tie_word_embeddings=False)
SHAPES = {"llama-1b": LLAMA_1B, "llama3-8b": LLAMA3_8B}
# profiler ranges (lightning_fpdt.profiling.named_range) -> phase
PHASES = {"fpdt/attention_chunk": "attention forward", "fpdt/attention_chunk_backward": "attention backward",
          "fpdt/mlp_tile": "MLP tiles", "fpdt/mlp_tile_backward": "MLP tiles",
          "fpdt/loss_tile": "loss tiles", "fpdt/loss_tile_backward": "loss tiles"}
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def flops_per_token(config: LlamaConfig, seq: int) -> tuple[float, float]:
    """``(strict, megatron)`` training FLOPs per token at length ``seq`` (module docstring)."""
    with torch.device("meta"):  # only counts parameters
        strict = LlamaLM(config).model.flops_per_token(seq)
    attention_strict = 6 * config.num_hidden_layers * seq * config.hidden_size
    matmul_params = (strict - attention_strict) / 6
    return strict, 8 * matmul_params + 16 * config.num_hidden_layers * seq * config.hidden_size


class LlamaStep:
    """One forward+backward of a Llama on one device (P = 1), bf16 autocast on CUDA; ``bound``: every FPDT feature
    (``chunk`` tokens per chunk, offloaded chunks and checkpoints, tiled MLP and loss), else the unbound model."""

    def __init__(self, device: torch.device, config: LlamaConfig, seq: int, chunk: int | None, backend: str,
                 bound: bool) -> None:
        self.device, self.autocast = device, device.type == "cuda"
        torch.manual_seed(0)
        if not bound:
            config = dataclasses.replace(config, mlp_tiles=1)
        with device:  # initialised where it runs: a large model's initialisation on the host takes a while
            self.module = LlamaLM(config, loss_tiles=None if bound else 1)
        self.context: SequenceParallelContext | None = None
        if bound:
            self.context = SequenceParallelContext(chunk_size=chunk, attention_backend=backend, offload=True,
                                                   activation_checkpointing=True,
                                                   layer_input_store=new_layer_input_store(device), keep_attention=True)
            bind(self.module, self.context)
        else:
            bind(self.module, SequenceParallelContext(attention_backend=backend))
        ids = torch.randint(0, config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(seq))
        batch = shard_batch({"input_ids": ids}, 1, 0, chunk if bound else None)
        self.batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    def __call__(self) -> None:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            loss, _ = token_weighted_loss(*self.module.loss_terms(self.batch))
        loss.backward()
        for p in self.module.parameters():
            p.grad = None

    def timed(self) -> tuple[float, float]:
        """Seconds of one step after a warm-up, and its peak device memory (bytes; NaN on CPU)."""
        self()
        synchronize(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        start = time.perf_counter()
        self()
        synchronize(self.device)
        seconds = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else float("nan")
        return seconds, peak

    def close(self) -> None:
        if self.context is not None and self.context.layer_input_store is not None:
            self.context.layer_input_store.close()
        release_copy_engines()


def run_step(device: torch.device, config: LlamaConfig, seq: int, chunk: int | None, backend: str,
             bound: bool = True) -> tuple[float, float] | None:
    """:meth:`LlamaStep.timed`, or ``None`` when it does not fit the device."""
    step = None
    try:
        step = LlamaStep(device, config, seq, chunk, backend, bound)
        return step.timed()
    except (torch.OutOfMemoryError, RuntimeError) as err:
        if not is_oom(err):
            raise
        return None
    finally:
        if step is not None:
            step.close()
        del step
        release_memory(device)


def mfu_rows(device: torch.device, runs: list[tuple[str, int]], chunk: int, backend: str, nominal: float | None,
             measured: float, deadline: float, cpu: bool) -> list[list]:
    """One row per ``(shape name, tokens)`` of ``runs``: step time, peak, TFLOP/s and MFU in both conventions."""
    dtype = torch.float32 if cpu else torch.bfloat16
    rows, rates = [], {}
    for name, seq in runs:
        config = LlamaConfig.tiny() if cpu else LlamaConfig(**SHAPES[name])
        strict, megatron = flops_per_token(config, seq)
        rate = rates.get(name, 0.0)
        predicted = 2.5 * strict * seq / rate if rate and not cpu else 0.0  # build, warm-up, timed step
        if time.perf_counter() + predicted > deadline:
            rows.append([name, seq, "-", "-", "-", "-", "-", "-", f"skipped: ~{predicted:.0f} s would overrun"])
            continue
        found = run_step(device, config, seq, chunk, backend)
        if found is None:
            rows.append([name, seq, "OOM", "-", "-", "-", "-", "-", ""])
            continue
        seconds, peak = found
        rates[name] = strict * seq / seconds
        rows.append([name, seq, seconds, peak / 2**30, strict * seq / seconds / 1e12,
                     _share(strict * seq / seconds, nominal), _share(megatron * seq / seconds, nominal),
                     _share(strict * seq / seconds, measured), route_description(backend, device.type, dtype)])
        print(f"  {name} S={seq}: {seconds:.2f} s per forward+backward", flush=True)
    return rows


def _share(rate: float, of: float | None) -> str:
    return "-" if of is None else f"{100 * rate / of:.1f}%"


def baseline_rows(device: torch.device, seq: int, backend: str, deadline: float, cpu: bool) -> list[list]:
    """The full stack against the unbound model at ``seq`` tokens in one chunk, and their ratio."""
    config = LlamaConfig.tiny() if cpu else LlamaConfig(**LLAMA_1B)
    dtype = torch.float32 if cpu else torch.bfloat16
    rows, times = [], {}
    for label, bound in (("full stack", True), ("unbound", False)):
        if time.perf_counter() > deadline:
            rows.append([label, seq, "-", "-", "skipped: the time budget is spent"])
            continue
        found = run_step(device, config, seq, None, backend, bound)
        if found is None:
            rows.append([label, seq, "OOM", "-", ""])
            continue
        times[label] = found[0]
        rows.append([label, seq, found[0], found[1] / 2**30, route_description(backend, device.type, dtype)])
    if len(times) == 2:
        rows.append(["full stack / unbound", seq, f"{times['full stack'] / times['unbound']:.2f}x", "-", ""])
    return rows


def _device_time(event: Any) -> float:
    """Microseconds on the device of a profiler event (its kernels; ``device_time_total`` in newer torch)."""
    return float(getattr(event, "device_time_total", getattr(event, "cuda_time_total", 0.0)))


def _on_device(event: Any) -> bool:
    return getattr(event, "device_type", None) == torch.autograd.DeviceType.CUDA


def tally(averages: Iterable[Any], events: Iterable[Any], wall: float | None) -> tuple[
        dict[str, float], float, float, dict[str, int]]:
    """A profile's ``(seconds by phase, step seconds, side-stream copy seconds, host counts)``.

    ``averages`` are ``prof.key_averages()``, ``events`` ``prof.events()``; ``wall``: the step's wall time on CPU
    (phases in CPU time), ``None`` on CUDA (phases in device time, the step the sum of its kernels, copies apart).
    Kineto records each profiler range twice on CUDA, as the CPU range (its kernels' time) and as a GPU user
    annotation (its span on the device; both are user annotations, told apart by device type): only the first is
    counted, as torch's own table does, or every phase and the step would read about twice their time."""
    phases: dict[str, float] = {}
    host = dict.fromkeys(("launches", "syncs", "casts"), 0)
    for event in averages:
        if _on_device(event) and getattr(event, "is_user_annotation", False):
            continue
        if event.key in PHASES:
            seconds = (event.cpu_time_total if wall is not None else _device_time(event)) / 1e6
            phases[PHASES[event.key]] = phases.get(PHASES[event.key], 0.0) + seconds
        elif event.key in SYNCS:
            host["syncs"] += event.count
        elif event.key == "aten::to":
            host["casts"] += event.count
        elif event.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"):
            host["launches"] += event.count
    kernels = [e for e in events if _on_device(e) and not getattr(e, "is_user_annotation", False)]
    copies = sum(e.device_time for e in kernels if "Memcpy" in e.name) / 1e6
    total = wall if wall is not None else sum(e.device_time for e in kernels if "Memcpy" not in e.name) / 1e6
    return phases, total, copies, host


def phase_rows(device: torch.device, seq: int, chunk: int | None, backend: str, cpu: bool) -> list[list]:
    """One full-stack step of the Llama-1B shape under ``torch.profiler``: device time by phase (CPU time on CPU),
    copies, and the host's share (module docstring)."""
    from torch.profiler import ProfilerActivity, profile

    config = LlamaConfig.tiny() if cpu else LlamaConfig(**LLAMA_1B)
    step = LlamaStep(device, config, seq, chunk, backend, bound=True)
    try:
        step()  # warm-up
        synchronize(device)
        activities = [ProfilerActivity.CPU] + ([] if cpu else [ProfilerActivity.CUDA])
        start = time.perf_counter()
        with profile(activities=activities) as prof:
            step()
            synchronize(device)
        wall = time.perf_counter() - start
    finally:
        step.close()
        release_memory(device)
    phases, total, copies, host = tally(prof.key_averages(), prof.events(), wall if cpu else None)
    rows = [[phase, seconds * 1e3, f"{100 * seconds / total:.1f}%"] for phase, seconds in sorted(phases.items())]
    rows.append(["the rest", (total - sum(phases.values())) * 1e3, f"{100 * (1 - sum(phases.values()) / total):.1f}%"])
    rows.append(["step (device, copies excluded)" if not cpu else "step (wall)", total * 1e3, "100%"])
    rows.append(["copies (side streams, overlapped)", copies * 1e3, "-"])
    rows.append([f"host: {host['launches']} kernel launches, {host['syncs']} stream synchronisations,"
                 f" {host['casts']} aten::to", "-", "-"])
    return rows
