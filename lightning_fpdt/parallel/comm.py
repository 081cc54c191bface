"""All-to-all between sequence-sharded and head-sharded tensors (DeepSpeed Ulysses).

Sequence-sharded: ``[batch, seq_local, heads, head_dim]`` on each of the ``P`` ranks, rank ``r``
holding the ``r``-th slice of a (chunk of the) sequence. Head-sharded: ``[batch, seq_local * P,
heads / P, head_dim]``, rank ``r`` holding heads ``r * heads / P ...`` of the whole (chunk of the)
sequence, in rank order along the sequence.

``seq_to_head`` / ``head_to_seq`` are plain (no autograd) and used inside the FPDT pipeline's own
autograd function. ``SeqToHead`` / ``HeadToSeq`` are their autograd versions (each one's backward is
the other), used by plain Ulysses attention. :class:`Exchange` runs the same two all-to-alls as
asynchronous collectives, so that the pipeline can issue the next chunk's before computing the current
one and wait for it after (``dist.all_to_all_single(..., async_op=True)``; gloo and NCCL).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_fpdt.errors import FPDTError


def group_size(group: ProcessGroup | None) -> int:
    """Number of ranks in ``group``; ``None`` means one process."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    """This process's rank in ``group``; ``None`` means one process (rank 0)."""
    return 0 if group is None else dist.get_rank(group)


def all_gather_autograd(x: Tensor, dim: int, group: ProcessGroup | None) -> Tensor:
    """Every rank's ``x`` concatenated along ``dim`` (rank order), differentiable: the backward reduce-scatters the
    gradient. torch's functional collective under its current name (``all_gather_single_autograd``), or under the
    name older releases have (``all_gather_tensor_autograd``, deprecated since)."""
    gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
    return gather(x.contiguous(), gather_dim=dim, group=group)


def _seq_to_head_send(x: Tensor, p: int, contiguous: bool = True) -> tuple[Tensor, Callable[[Tensor], Tensor]]:
    """The send buffer of :func:`seq_to_head` (a strided view of ``x`` unless ``contiguous``) and the map from the
    received buffer to its result."""
    b, s_local, h, d = x.shape
    if h % p != 0:
        raise FPDTError(f"seq_to_head: {h} heads cannot be split over {p} sequence-parallel ranks.")
    # [P (destination rank = head group), b, s_local, h/P, d]
    send = x.reshape(b, s_local, p, h // p, d).permute(2, 0, 1, 3, 4)
    send = send.contiguous() if contiguous else send
    # received: [P (source rank = sequence slice), b, s_local, h/P, d]
    return send, lambda recv: recv.permute(1, 0, 2, 3, 4).reshape(b, p * s_local, h // p, d)


def _head_to_seq_send(x: Tensor, p: int, contiguous: bool = True) -> tuple[Tensor, Callable[[Tensor], Tensor]]:
    """The send buffer of :func:`head_to_seq` (a strided view of ``x`` unless ``contiguous``) and the map from the
    received buffer to its result."""
    b, s, h_local, d = x.shape
    if s % p != 0:
        raise FPDTError(f"head_to_seq: sequence length {s} cannot be split over {p} ranks.")
    # [P (destination rank = sequence slice), b, s/P, h_local, d]
    send = x.reshape(b, p, s // p, h_local, d).transpose(0, 1)
    send = send.contiguous() if contiguous else send
    # received: [P (source rank = head group), b, s/P, h_local, d]
    return send, lambda recv: recv.permute(1, 2, 0, 3, 4).reshape(b, s // p, p * h_local, d)


Direction = Callable[..., tuple[Tensor, Callable[[Tensor], Tensor]]]
"""``_seq_to_head_send`` or ``_head_to_seq_send``: ``(x, P, contiguous=True) -> (send buffer, finish)``."""


def _all_to_all(
    x: Tensor, direction: Direction, group: ProcessGroup | None, async_op: bool = False
) -> tuple[Any, Tensor, Tensor, Callable[[Tensor], Tensor]]:
    """Start the all-to-all of ``x`` in ``direction`` (``_seq_to_head_send`` or ``_head_to_seq_send``), along
    dim 0 of its send buffer, one equal block per rank: ``(work, recv, send, finish)``, where ``work`` is
    ``None`` unless ``async_op`` and ``finish(recv)`` is the result once the collective is complete."""
    send, finish = direction(x, group_size(group))
    recv = torch.empty_like(send)
    work = dist.all_to_all_single(recv, send, group=group, async_op=async_op)
    return work, recv, send, finish


def seq_to_head(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """``[b, s_local, h, d]`` sequence-sharded -> ``[b, s_local * P, h / P, d]`` head-sharded."""
    if group_size(group) == 1:
        return x
    _, recv, _, finish = _all_to_all(x, _seq_to_head_send, group)
    return finish(recv)


def head_to_seq(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """``[b, s_local * P, h_local, d]`` head-sharded -> ``[b, s_local, h_local * P, d]`` sequence-sharded."""
    if group_size(group) == 1:
        return x
    _, recv, _, finish = _all_to_all(x, _head_to_seq_send, group)
    return finish(recv)


class PendingAllToAll:
    """One all-to-all in flight, from :class:`Exchange`. :meth:`wait` once, after the compute it overlaps."""

    def __init__(self, exchange: Exchange, what: str, result: Tensor | None = None, work: Any = None,
                 recv: Tensor | None = None, send: Tensor | None = None,
                 finish: Callable[[Tensor], Tensor] | None = None) -> None:
        self._exchange, self.what = exchange, what
        self._result, self._work, self._recv, self._send, self._finish = result, work, recv, send, finish
        self.done = False
        self.serial = -1

    def wait(self) -> Tensor:
        """The result; blocks until the collective is complete (on CUDA the current stream waits, not the host).

        Raises:
            RuntimeError: waited for twice (the result was handed out already).
        """
        if self.done:
            raise RuntimeError(f"Exchange: the all-to-all {self.what} was already waited for; wait() hands its"
                               " result out once. Keep the tensor it returned.")
        self.done = True
        self._exchange._finished(self)
        if self._result is not None:
            return self._result
        assert self._recv is not None and self._finish is not None
        if self._work is not None:
            self._work.wait()
        result = self._finish(self._recv)
        self._work = self._recv = self._send = self._finish = None  # the send buffer lives until here
        return result


class Exchange:
    """The all-to-alls of one pass of the FPDT pipeline, as steps: issue before compute, wait after.

    ``seq_to_head(x)`` / ``head_to_seq(x)`` start an all-to-all (an asynchronous collective) and return
    a :class:`PendingAllToAll`; its ``wait()`` gives the result. Every rank of ``group`` must issue the
    same all-to-alls in the same order (collectives match by order). :meth:`close` checks that every
    issued one was waited for: one left in flight would hold its buffers and, if never waited on, hide
    a schedule bug.

    Args:
        group: the sequence-parallel group; ``None`` (one process) makes every step a no-op.
        overlap: ``False`` runs each all-to-all to completion when it is issued (for comparisons).
    """

    def __init__(self, group: ProcessGroup | None, overlap: bool = True) -> None:
        self.group, self.overlap = group, overlap
        self._p = group_size(group)
        self._in_flight: dict[int, str] = {}  # serial -> what, of the issued all-to-alls not waited for yet
        self._serials = itertools.count()
        self._closed = False

    def seq_to_head(self, x: Tensor, what: str = "seq_to_head") -> PendingAllToAll:
        """Start ``[b, s_local, h, d]`` -> ``[b, s_local * P, h / P, d]`` (see :func:`seq_to_head`)."""
        return self._issue(x, _seq_to_head_send, what)

    def head_to_seq(self, x: Tensor, what: str = "head_to_seq") -> PendingAllToAll:
        """Start ``[b, s_local * P, h_local, d]`` -> ``[b, s_local, h_local * P, d]`` (see :func:`head_to_seq`)."""
        return self._issue(x, _head_to_seq_send, what)

    def seq_to_head_many(self, xs: Sequence[Tensor], what: str = "seq_to_head") -> tuple[PendingAllToAll, ...]:
        """:meth:`seq_to_head` of each of ``xs`` (one dtype; any shapes), as one collective: a chunk's q, k and v."""
        return self._issue_many(xs, _seq_to_head_send, what)

    def head_to_seq_many(self, xs: Sequence[Tensor], what: str = "head_to_seq") -> tuple[PendingAllToAll, ...]:
        """:meth:`head_to_seq` of each of ``xs`` (one dtype; any shapes), as one collective: a chunk's dk and dv."""
        return self._issue_many(xs, _head_to_seq_send, what)

    def _issue_many(self, xs: Sequence[Tensor], direction: Direction, what: str) -> tuple[PendingAllToAll, ...]:
        """One all-to-all for several tensors: each one's send buffer ``[P, ...]`` written into its columns of one
        ``[P, total]`` buffer (the copy :func:`_all_to_all` makes anyway), each result read from its columns of the
        received one. A collective costs a fixed time besides its bytes (on gloo about 1 ms for 1 MB, 2 ms for 3 MB
        at once against 3 ms one by one), and a pass issues one per chunk and tensor."""
        if self._p == 1 or len(xs) == 1 or len({x.dtype for x in xs}) > 1:
            return tuple(self._issue(x, direction, f"{what}[{n}]") for n, x in enumerate(xs))
        if self._closed:
            raise RuntimeError(f"Exchange: {what} issued after close(); make a new Exchange for the next pass.")
        views = [direction(x, self._p, contiguous=False) for x in xs]
        widths = [v.numel() // self._p for v, _ in views]
        send = torch.empty(self._p, sum(widths), dtype=xs[0].dtype, device=xs[0].device)
        columns = list(itertools.accumulate(widths, initial=0))
        for (view, _), lo, hi in zip(views, columns, columns[1:]):
            send[:, lo:hi].view(view.shape).copy_(view)
        recv = torch.empty_like(send)
        work = dist.all_to_all_single(recv, send, group=self.group, async_op=self.overlap)
        sent = []
        for n, ((view, finish), lo, hi) in enumerate(zip(views, columns, columns[1:])):
            pending = PendingAllToAll(self, f"{what}[{n}]", work=work, recv=recv[:, lo:hi].view(view.shape),
                                      send=send, finish=finish)
            pending.serial = next(self._serials)
            self._in_flight[pending.serial] = pending.what
            sent.append(pending)
        return tuple(sent)

    def _issue(self, x: Tensor, direction: Direction, what: str) -> PendingAllToAll:
        if self._closed:
            raise RuntimeError(f"Exchange: {what} issued after close(); make a new Exchange for the next pass.")
        if self._p == 1:
            pending = PendingAllToAll(self, what, result=x)
        else:
            work, recv, send, finish = _all_to_all(x, direction, self.group, self.overlap)
            pending = PendingAllToAll(self, what, work=work, recv=recv, send=send, finish=finish)
        pending.serial = next(self._serials)
        self._in_flight[pending.serial] = what
        return pending

    def _finished(self, pending: PendingAllToAll) -> None:
        self._in_flight.pop(pending.serial, None)

    def close(self) -> None:
        """End the pass.

        Raises:
            RuntimeError: an issued all-to-all was never waited for (names them).
        """
        self._closed = True
        if self._in_flight:
            names = ", ".join(self._in_flight.values())
            self._in_flight.clear()
            raise RuntimeError(f"Exchange: all-to-alls issued but never waited for: {names}. Every issue() needs"
                               " its wait() before the pass ends.")


class SeqToHead(torch.autograd.Function):
    """Autograd :func:`seq_to_head`; its gradient goes back through :func:`head_to_seq`."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup | None) -> Tensor:
        ctx.group = group
        return seq_to_head(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return head_to_seq(grad.contiguous(), ctx.group), None


class HeadToSeq(torch.autograd.Function):
    """Autograd :func:`head_to_seq`; its gradient goes back through :func:`seq_to_head`."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup | None) -> Tensor:
        ctx.group = group
        return head_to_seq(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return seq_to_head(grad.contiguous(), ctx.group), None


def heads_fit(n_heads: int, n_kv_heads: int, ulysses: int) -> bool:
    """Whether :func:`check_heads` accepts these head counts over a Ulysses degree of ``ulysses``."""
    kv_fits = n_kv_heads % ulysses == 0 or ulysses % n_kv_heads == 0
    return n_heads % n_kv_heads == 0 and n_heads % ulysses == 0 and kv_fits


def check_heads(n_heads: int, n_kv_heads: int, sp_size: int, ring_size: int = 1) -> None:
    """Raise a ``ValueError`` naming the numbers if these head counts cannot be sharded over ``sp_size`` ranks
    of which ``ring_size`` form a ring (the all-to-all runs over ``U = sp_size / ring_size``).

    Query heads are split evenly over the ``U`` ranks of a Ulysses group. Key/value heads are either split too
    (``n_kv_heads % U == 0``) or replicated so that every rank gets the one KV head its query heads use
    (``U % n_kv_heads == 0``). The message names the ring sizes that would fit.
    """
    if n_heads % n_kv_heads != 0:
        raise FPDTError(f"n_heads={n_heads} is not a multiple of n_kv_heads={n_kv_heads}.")
    u = sp_size // ring_size
    if heads_fit(n_heads, n_kv_heads, u):
        return
    rings = [r for r in range(1, sp_size + 1) if sp_size % r == 0 and heads_fit(n_heads, n_kv_heads, sp_size // r)]
    degree = (f"sequence_parallel_size={sp_size}" if ring_size == 1 else
              f"the Ulysses degree {u} (sequence_parallel_size={sp_size} / ring_size={ring_size})")
    sizes = [p for p in range(1, n_heads + 1) if heads_fit(n_heads, n_kv_heads, p)]
    fix = (f"Use ring_size={rings[0]} (Ulysses {sp_size // rings[0]} x ring {rings[0]}; ring_size='auto' picks it),"
           f" or any ring_size in {rings}; plain Ulysses needs a sequence_parallel_size in {sizes}")
    if n_heads % u != 0:
        raise FPDTError(
            f"n_heads={n_heads} is not divisible by {degree}: Ulysses gives each rank of its group n_heads / {u}"
            f" heads. {fix}."
        )
    raise FPDTError(
        f"n_kv_heads={n_kv_heads} and {degree}: KV heads must either divide evenly over the Ulysses ranks or be"
        f" replicated evenly (a Ulysses degree that is a multiple of n_kv_heads). {fix}."
    )


def expand_kv_heads(x: Tensor, sp_size: int) -> Tensor:
    """Replicate KV heads so they shard over ``sp_size`` ranks: ``[b, s, g, d] -> [b, s, P, d]``.

    Only when ``g < P``: rank ``r``'s query heads all use KV head ``r // (P / g)``, which is what
    ``repeat_interleave`` puts in slot ``r``. Autograd sums the replicas' gradients back.
    """
    g = x.shape[2]
    if g >= sp_size:
        return x
    return x.repeat_interleave(sp_size // g, dim=2)


def sum_kv_replicas(dx: Tensor, kv_heads: int) -> Tensor:
    """The adjoint of :func:`expand_kv_heads`: ``[b, s, P, d] -> [b, s, g, d]``, each KV head's replicas summed
    (unchanged when nothing was replicated)."""
    if dx.shape[2] == kv_heads:
        return dx
    b, s, p, d = dx.shape
    return dx.view(b, s, kv_heads, p // kv_heads, d).sum(3)
