"""GradientRelease frees the gradients between optimizer steps, DDP's buckets included, and training stays
bit-for-bit what it was (float64, 2 gloo ranks, several buckets, through DDP's bucket rebuild)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from benchmarks.gradient_release import GradientRelease
from lightning_fpdt.testing import run_on_ranks

STEPS = 4


def _train(rank: int, world: int, release: bool, bucket_views: bool) -> dict:
    """``STEPS`` AdamW steps of a small MLP under DDP, in Lightning's order (forward, zero_grad, backward, step),
    the gradients released after each step and restored before each backward when ``release``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8)).double()
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=bucket_views, bucket_cap_mb=0.02)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    releaser = GradientRelease(bucket_views)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    g = torch.Generator().manual_seed(rank)
    freed, emptied = [], []
    for _ in range(STEPS):
        loss = ddp(torch.randn(32, 16, generator=g, dtype=torch.float64)).square().mean()
        optimizer.zero_grad(set_to_none=True)
        if release:
            releaser.restore()
        loss.backward()
        optimizer.step()
        if release:
            storages = {p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage() for p in model.parameters()}
            releaser.release(model.parameters())
            freed.append(releaser.freed_bytes)
            emptied.append((len(storages), all(s.nbytes() == 0 for s in storages.values())))
            assert all(p.grad is None for p in model.parameters())
    return {"params": [p.detach().clone() for p in model.parameters()], "freed": freed, "emptied": emptied,
            "grad_bytes": grad_bytes}


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("bucket_views", [True, False], ids=["bucket_views", "copies"])
def test_released_gradients_train_exactly_as_kept_ones(bucket_views: bool) -> None:
    kept = run_on_ranks(_train, 2, False, bucket_views)
    released = run_on_ranks(_train, 2, True, bucket_views)
    for rank in range(2):
        for a, b in zip(kept[rank]["params"], released[rank]["params"]):
            assert torch.equal(a, b)  # bit for bit: DDP writes every bucket view whole in each backward
        if bucket_views:  # every step, every bucket emptied: all the gradients' bytes
            assert released[rank]["freed"] == [released[rank]["grad_bytes"]] * STEPS
            # one bucket in the first step (DDP's first bucket is 1 MiB), several once DDP rebuilt them in the second
            # step's forward: the buckets released before the rebuild are DDP's no longer and are not restored
            counts, all_empty = zip(*released[rank]["emptied"])
            assert counts[0] == 1 and min(counts[1:]) > 1 and all(all_empty), released[rank]["emptied"]
        else:  # copied gradients: dropping .grad frees them; DDP's buckets are separate and stay
            assert released[rank]["freed"] == [0] * STEPS
