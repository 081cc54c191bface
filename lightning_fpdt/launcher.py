"""The spawn/fork launcher of ``FPDTStrategy``: it hands the parent process whole weights.

Lightning's multiprocessing launcher sends rank 0's ``state_dict()`` back to the parent, which loads
it into the user's module. With sharded parameters (FSDP2) rank 0 holds only its shards, so this
launcher gathers the full tensors first (a collective on every rank, received on rank 0's CPU).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule
from typing_extensions import override


class ShardAwareLauncher(_MultiProcessingLauncher):
    """:class:`_MultiProcessingLauncher` whose result for the parent holds full, not sharded, weights."""

    @override
    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> Any:
        module = trainer.lightning_module
        if not isinstance(module, FSDPModule):
            return super()._collect_rank_zero_results(trainer, results)
        full = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        module.state_dict = lambda *args, **kwargs: full  # what the base launcher sends to the parent
        try:
            return super()._collect_rank_zero_results(trainer, results)
        finally:
            del module.state_dict
