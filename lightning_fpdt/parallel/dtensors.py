"""Plain tensors from possibly sharded ones: a ``DTensor`` (FSDP2 parameters and gradients) as this rank's
shard or as the whole tensor; any other tensor as it is."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a ``DTensor`` (no communication); other tensors unchanged."""
    return t.to_local() if isinstance(t, DTensor) else t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a ``DTensor`` (a collective over its mesh: call it on every rank); other tensors
    unchanged."""
    return t.full_tensor() if isinstance(t, DTensor) else t
