"""Attention computed once per step: a recomputed decoder layer answers its attention from what its forward kept.

A decoder layer under activation checkpointing runs its forward twice: once without a graph, and again in backward
(:mod:`lightning_fpdt.offload.recompute`, :mod:`lightning_fpdt.layers.streaming`). Everything in it is cheap to
recompute except attention, whose work grows with the square of the sequence. So the first run keeps each chunk's
attention *answer*, its output ``o`` ``[batch, C_i / R, heads / U, v_head_dim]`` and log-sum-exp ``lse``
``[batch, heads / U, C_i / R]`` (head-sharded, exactly what FPDT's attention backward reads), in a
:class:`~lightning_fpdt.offload.chunk_store.ChunkStore` (host memory when the pipeline offloads), and the
recomputation takes them back instead of running attention's forward kernels again. The recomputation still
projects q, k and v and sends them through the all-to-alls (the backward needs them, and the layer's work before
attention must be differentiated); it sends the kept output back through the inverse all-to-all in place of a
fresh one. Both are bitwise what the first run computed, so the gradients are unchanged.

A layer's calls are told apart by order: the :class:`AnswerKeeper` of one recomputed call records the answers of
each attention call of its first run (``"record"``) and hands them out in the same order in its second
(``"replay"``). Attention finds the keeper of the layer it runs in with :func:`active_keeper` (a context variable,
set only while a layer's run is on the stack, like autocast's state).

Costs: the answers of every recomputed attention layer stay from its forward to its backward (the memory model's
``kept answers``: ``t * (heads * v_head_dim * bytes + heads * 4)`` per layer, ``t`` the rank's tokens), so
:class:`~lightning_fpdt.FPDTStrategy`'s ``keep_attention`` turns it on where the memory model says there is room.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from lightning_fpdt.offload.chunk_store import ChunkStore

_KEEPER: ContextVar[AnswerKeeper | None] = ContextVar("fpdt_answer_keeper", default=None)

ANSWER_KINDS = ("o", "lse")
"""The store kinds of an attention answer (:mod:`lightning_fpdt.attention.pipeline`'s query side)."""


class AnswerKeeper:
    """The attention answers of one recomputed call of a decoder layer: one store per attention call of its run,
    recorded by the first run and replayed, in the same order, by the second.

    ``mode``: ``"record"`` until the first run ends, then ``"replay"``; ``None`` after the replay (a third run, if
    anything ever made one, computes attention as usual).
    """

    def __init__(self) -> None:
        self.stores: list[ChunkStore | None] = []
        self.mode: str | None = "record"
        self._next = 0  # replay: the next attention call's store
        # no backward will come if the graph is dropped: the stores not handed out are closed then (at the next safe
        # point: a finalizer must not take the host pool's lock)
        weakref.finalize(self, _close_later, self.stores)

    def record(self, store: ChunkStore | None) -> None:
        """Keep ``store`` (holding only ``o`` and ``lse`` chunks) as the answers of the run's next attention call;
        ``None`` for a call that kept none (every call records, so that the replay's order is the run's)."""
        self.stores.append(store)

    def replay(self) -> ChunkStore | None:
        """The answers of the run's next attention call (the store becomes the caller's: its backward closes it), or
        ``None`` when the first run kept none for it. Every attention call of the replay takes its turn, whether it
        uses the answers or not."""
        if self._next >= len(self.stores):
            return None
        store = self.stores[self._next]
        self.stores[self._next] = None  # the caller's now
        self._next += 1
        return store

    def wrap(self, run: Callable[..., Any]) -> Callable[..., Any]:
        """``run`` with this keeper active: its first call records, its second replays."""

        def kept_run(*args: Any, **kwargs: Any) -> Any:
            with keeping(self):
                return run(*args, **kwargs)

        return kept_run

    def release(self) -> None:
        """Give back every store the replay did not hand out."""
        for store in self.stores[self._next:]:
            if store is not None:
                store.close()
        del self.stores[self._next:]


def _close_later(stores: list[ChunkStore | None]) -> None:
    for store in stores:
        if store is not None:
            store.close_later()


@contextmanager
def keeping(keeper: AnswerKeeper) -> Iterator[None]:
    """Make ``keeper`` the active one for one run of its layer; a recording run turns it to replay at the end."""
    token = _KEEPER.set(keeper)
    replaying = keeper.mode == "replay"
    try:
        yield
    finally:
        _KEEPER.reset(token)
        keeper.mode = "replay" if keeper.mode == "record" else None
        if replaying:
            keeper.release()


def active_keeper() -> AnswerKeeper | None:
    """The keeper of the recomputed layer whose run is on the stack, if it keeps attention answers."""
    keeper = _KEEPER.get()
    return keeper if keeper is not None and keeper.mode is not None else None
