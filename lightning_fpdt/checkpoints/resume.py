"""Where the training data resumes after a checkpoint.

Lightning restores the model, the optimizers and the loops' progress, but a plain ``DataLoader``
starts its epoch again from the first batch. For an exact resume the training loader must skip the
batches of the unfinished epoch that the checkpoint had already trained on. The number comes from
the restored fit loop's progress (read when the strategy's ``process_dataloader`` hook runs, after
the checkpoint was loaded and before the first batch):

- a loader that is ``_Stateful`` (``state_dict``/``load_state_dict``, e.g. torchdata's
  ``StatefulDataLoader``) is restored by Lightning itself: nothing is skipped;
- any other loader, sized or streaming (an ``IterableDataset`` without ``__len__``), is wrapped in
  :class:`ResumableLoader`, which draws and drops that many batches, so the sampler's order stays
  that of the uninterrupted run. A streaming dataset must then produce the same batches in the same
  order each epoch for the resume to be exact (docs/configuration.md, "Checkpoints and resuming").
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.warnings import PossibleUserWarning


def batches_to_skip(trainer: pl.Trainer) -> int:
    """Training batches of the current epoch that the restored checkpoint had already trained on.

    Zero unless the fit loop is restarting from a checkpoint saved inside an epoch (a checkpoint
    saved after an epoch's last batch, or in ``on_train_epoch_end``, starts the next epoch afresh).
    """
    loop = trainer.fit_loop
    if not loop.restarting:
        return 0
    epochs = loop.epoch_progress.current
    if epochs.processed >= epochs.ready:  # saved once the epoch was processed: nothing of the next one ran
        return 0
    return int(loop.epoch_loop.batch_progress.current.ready)


def warn_if_saved_at_epoch_end(checkpoint: dict[str, Any]) -> None:
    """Warn that a checkpoint saved in ``on_train_epoch_end`` cannot resume exactly (Lightning's behaviour)."""
    loops = checkpoint.get("loops", {}).get("fit_loop", {})
    epochs = loops.get("epoch_progress", {}).get("current", {})
    if epochs.get("processed", 0) >= epochs.get("ready", 0) and epochs.get("completed", 0) < epochs.get("ready", 0):
        rank_zero_warn(
            "FPDTStrategy: this checkpoint was saved in on_train_epoch_end. Lightning resumes such a checkpoint"
            " with one batch of the next epoch and then starts another epoch (its own behaviour, with or"
            " without this strategy), so the run will not repeat an uninterrupted one exactly. Checkpoints"
            " saved during the epoch (every_n_train_steps, also after an epoch's last batch) resume exactly."
        )


def resumable(dataloader: Any, trainer: pl.Trainer) -> Any:
    """The training loader to iterate: ``dataloader`` itself, or a :class:`ResumableLoader` over it
    when a resume must skip batches that the loader cannot skip by itself."""
    skip = batches_to_skip(trainer)
    if skip == 0 or isinstance(dataloader, _Stateful) or not isinstance(dataloader, Iterable):
        return dataloader
    if not _has_len(dataloader):
        rank_zero_info(
            f"FPDTStrategy: resuming a streaming training loader (no __len__, no state_dict): its first {skip}"
            " batches of this epoch are drawn and dropped. This is exact when the stream yields the same batches"
            " in the same order every epoch; for other streams use a stateful loader (torchdata's"
            " StatefulDataLoader), whose position Lightning restores itself."
        )
    else:
        rank_zero_info(f"FPDTStrategy: resuming inside an epoch: the training loader's first {skip} batches are"
                       " drawn and dropped, so the data order is the uninterrupted run's.")
    # Lightning then warns that a loader without state_dict resumes unreliably: not this one, which skips what the
    # checkpoint trained on (the warning comes after this hook, when the epoch loop restarts)
    warnings.filterwarnings("ignore", message=_LIGHTNING_NOT_RESUMABLE, category=PossibleUserWarning)
    return ResumableLoader(dataloader, skip)


_LIGHTNING_NOT_RESUMABLE = "You're resuming from a checkpoint that ended before the epoch ended and your dataloader"


def _has_len(loader: Any) -> bool:
    try:
        len(loader)
    except (TypeError, NotImplementedError):
        return False
    return True


class ResumableLoader:
    """A training data loader whose first iteration skips ``skip`` batches (drawn, loaded and dropped).

    Attributes are the wrapped loader's (read and written), so Lightning's ``set_epoch`` reaches the
    distributed sampler and its ``worker_init_fn`` reaches the loader. Later iterations (the next
    epochs) skip nothing.
    """

    _OWN = ("loader", "_skip")

    def __init__(self, loader: Iterable, skip: int = 0) -> None:
        object.__setattr__(self, "loader", loader)
        object.__setattr__(self, "_skip", skip)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]  (a TypeError for streams, as for the loader itself)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["loader"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.loader, name, value)

    def __iter__(self) -> Iterator[Any]:
        # a generator: the inner iterator (and its workers' first indices) is made at the first next(),
        # after Lightning set the sampler's epoch
        skip = self._skip
        object.__setattr__(self, "_skip", 0)
        if _has_len(self.loader) and skip >= len(self):  # the checkpoint closed its epoch: nothing to skip
            skip = 0
        yield from itertools.islice(iter(self.loader), skip, None)
