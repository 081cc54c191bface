"""``benchmarks/gpu_mfu.py``'s profile tally on events shaped as torch.profiler gives them on CUDA (no GPU is lent to
record real ones): each phase and the step are counted once."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu_mfu

CUDA, CPU = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU


def _average(key: str, device_us: float = 0.0, count: int = 1, annotation: bool | None = None) -> SimpleNamespace:
    """A CPU-side average (a profiler range is a user annotation there too), or with ``annotation=True`` the
    range's GPU annotation."""
    return SimpleNamespace(key=key, device_time_total=device_us, cpu_time_total=0.0, count=count,
                           is_user_annotation=annotation is not None or key.startswith("fpdt/"),
                           device_type=CUDA if annotation else CPU)


def _event(name: str, device_us: float, annotation: bool = False) -> SimpleNamespace:
    return SimpleNamespace(name=name, device_type=CUDA, device_time=device_us, is_user_annotation=annotation)


def test_a_range_and_its_gpu_annotation_count_once() -> None:
    """Kineto gives each profiler range twice, as the CPU range (its kernels' device time) and as a GPU user
    annotation (its span): the phases and the step sum the kernels alone, the copies apart."""
    averages = [
        _average("fpdt/attention_chunk", 300.0), _average("fpdt/attention_chunk", 420.0, annotation=True),
        _average("fpdt/mlp_tile", 100.0), _average("fpdt/mlp_tile_backward", 200.0),
        _average("fpdt/mlp_tile_backward", 260.0, annotation=True),
        _average("cudaLaunchKernel", count=7), _average("cudaStreamSynchronize", count=2),
        _average("aten::to", count=3),
    ]
    events = [_event("flash_fwd_kernel", 300.0), _event("sm90_gemm", 300.0),
              _event("Memcpy HtoD (Pinned -> Device)", 50.0), _event("fpdt/attention_chunk", 420.0, annotation=True),
              _event("fpdt/mlp_tile_backward", 260.0, annotation=True)]
    phases, total, copies, host = gpu_mfu.tally(averages, events, None)
    assert phases == pytest.approx({"attention forward": 300e-6, "MLP tiles": 300e-6}, rel=1e-12)
    assert (total, copies) == pytest.approx((600e-6, 50e-6), rel=1e-12)
    assert host == {"launches": 7, "syncs": 2, "casts": 3}


def test_on_cpu_the_phases_are_cpu_time_and_the_step_its_wall_time() -> None:
    averages = [SimpleNamespace(key="fpdt/loss_tile", cpu_time_total=40.0, device_time_total=0.0, count=2,
                                is_user_annotation=True, device_type=CPU)]
    phases, total, copies, _ = gpu_mfu.tally(averages, [SimpleNamespace(name="aten::mm", device_type=CPU)], 0.5)
    assert (phases, total, copies) == ({"loss tiles": 40e-6}, 0.5, 0.0)
