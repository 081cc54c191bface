"""Gradients freed between optimizer steps, DDP's gradient buckets included: a measured experiment.

Not part of the library: ``FPDTStrategy`` does not call it. It resizes the storages DDP's reducer keeps to
zero bytes and back, which is exact in what ``tests/test_gradient_release.py`` runs (DDP on CPU, several
buckets, through DDP's bucket rebuild) but rests on how DDP uses its buckets, untested with ``no_sync``
accumulation, ``find_unused_parameters``, ``static_graph`` and NCCL's asynchronous reductions.
``benchmarks/fit_memory.py --release-gradients`` measures it (docs/performance.md).

Lightning zeroes gradients in a training step after its forward (``training_step``, then ``zero_grad``, then
``backward``), so the previous step's gradients are alive through the next forward and loss. Under DDP with
``gradient_as_bucket_view=True`` (``FPDTStrategy``'s default) every gradient is a view into one of DDP's
buckets, which DDP keeps for the whole run: dropping ``.grad`` frees nothing. :class:`GradientRelease` frees
them after the optimizer step and gives DDP its buckets back before the next backward:

- :meth:`GradientRelease.release` drops every ``.grad`` and resizes the storage of each bucket to zero bytes
  (the tensors DDP holds keep their shape and strides; only their memory goes);
- :meth:`GradientRelease.restore` re-allocates those storages (uninitialised) before the next backward.

Exact: DDP writes every bucket view whole in each backward (it copies each parameter's gradient into its
view and zeroes the views of parameters without one) and reads a bucket only after that. A bucket DDP
replaced meanwhile (it rebuilds them once, in the second step's forward, in the order gradients arrived) is
not restored: it is no longer DDP's, and the new one was allocated whole. A gradient kept elsewhere (a callback
holding ``p.grad`` past the step) would view an empty storage: read gradients in ``on_before_optimizer_step``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.multiprocessing.reductions import StorageWeakRef


class GradientRelease:
    """Frees gradients after an optimizer step; with ``bucket_views``, DDP's buckets too, until :meth:`restore`.

    Args:
        bucket_views: the gradients are views into storages someone else keeps (DDP's buckets with
            ``gradient_as_bucket_view=True``): resize those storages to zero bytes. ``False``: only drop ``.grad``
            (plain, FSDP2's sharded or DDP's copied gradients: nothing else holds them).
    """

    def __init__(self, bucket_views: bool) -> None:
        self.bucket_views = bucket_views
        self._freed: list[tuple[StorageWeakRef, int]] = []

    @property
    def freed_bytes(self) -> int:
        """Bytes of bucket storage released and not yet restored."""
        return sum(nbytes for ref, nbytes in self._freed if not ref.expired())

    def release(self, parameters: Iterable[torch.Tensor]) -> None:
        """Drop every parameter's ``.grad`` and, with ``bucket_views``, empty the storages they viewed."""
        storages: dict[int, torch.UntypedStorage] = {}
        for p in parameters:
            if p.grad is None:
                continue
            if self.bucket_views:
                storage = p.grad.untyped_storage()
                if storage.nbytes():
                    storages[storage.data_ptr()] = storage
            p.grad = None  # before the storage empties: no tensor DDP could copy from may point into it
        for storage in storages.values():
            self._freed.append((StorageWeakRef(storage), storage.nbytes()))
            storage.resize_(0)

    def restore(self) -> None:
        """Give every released storage that is still alive (still DDP's) its bytes back; before a backward."""
        for ref, nbytes in self._freed:
            storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)  # None once it has died
            if storage is not None:
                storage.resize_(nbytes)
        self._freed = []
