"""Mamba-1's selective scan (Jamba's ``mamba_selective_scan``) sequence-parallel and exact, chunk by chunk.

The scan keeps a state ``h [d_inner, d_state]`` per sample, ``h_t = exp(A dt_t) h_{t-1} + dt_t B_t x_t`` and
``y_t = C_t h_t``, each channel on its own: so the group splits the channels as attention splits its heads (an
all-to-all turns this rank's tokens of every channel into the whole chunk of ``d_inner / P`` channels; ``B`` and ``C``,
shared by every channel, are gathered whole), and the family's own kernel runs on each chunk.

transformers' torch kernel takes no state to start from (its cache path does not either), so a chunk's scan starts
from zero and the state the chunk before left is added by linearity: it decays along the chunk by the cumulative
``exp(A sum(dt))``, which adds ``C_t exp(A sum_{s<=t} dt_s) h_0`` to each output and ``exp(A sum(dt)) h_0`` to the final
state. ``D``'s skip and the ``z`` gate are applied after, as the kernel applies them. No ``[tokens, d_inner, d_state]``
tensor exists beyond one chunk's, as the kernel itself makes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_fpdt.hf.recurrent_heads import channel_split, refuse_split
from lightning_fpdt.parallel.comm import group_rank


def selective_scan(recurrence: Any, kernel: Any, skipped: tuple[str, ...], hidden_states: Tensor, dt: Tensor,
                   A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None, z: Tensor | None = None,
                   delta_bias: Tensor | None = None, delta_softplus: bool = False, return_last_state: bool = False,
                   **kwargs: Any) -> Any:
    """``mamba_selective_scan`` under ``recurrence`` (a
    :class:`~lightning_fpdt.hf.recurrent.SequenceParallelRecurrence`, whose chunk loop, checks and context it uses;
    ``skipped``: keywords not for the kernel): ``hidden_states``, ``dt`` and ``z`` ``[b, d_inner, s_local]``, ``A``
    ``[d_inner, d_state]``, ``B`` and ``C`` ``[b, d_state, s_local]``, ``D`` and ``delta_bias`` ``[d_inner]``;
    ``[b, d_inner, s_local]`` out."""
    options = {k: v for k, v in kwargs.items() if k not in skipped}
    if recurrence._plain():
        return kernel(hidden_states, dt, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus,
                      return_last_state=return_last_state, **options)
    recurrence._refuse_cached(return_last_state)
    if recurrence.position_wise:  # every position its own sequence
        b, d, s = hidden_states.shape
        alone = [t.transpose(1, 2).reshape(b * s, t.shape[1], 1) for t in (hidden_states, dt, B, C)]
        gate = None if z is None else z.transpose(1, 2).reshape(b * s, d, 1)
        out = kernel(*alone[:2], A, *alone[2:], D=D, z=gate, delta_bias=delta_bias, delta_softplus=delta_softplus,
                     **options)
        return out.reshape(b, s, d).transpose(1, 2)
    p, rank = recurrence._context.size, group_rank(recurrence._context.group)
    b, d, s_local = hidden_states.shape
    refuse_split(recurrence._where(), channel_split(d, p))  # as at construction, from the kernel's input
    local = slice(rank * d // p, (rank + 1) * d // p)
    by_channel = [t.transpose(1, 2).reshape(b, s_local, p, d // p) for t in (hidden_states, dt)]
    gated = z is not None
    by_channel += [z.transpose(1, 2).reshape(b, s_local, p, d // p)] if gated else []
    params = [A[local]] + [t[local] for t in (D, delta_bias) if t is not None]
    has_d, has_bias = D is not None, delta_bias is not None

    def run(pieces: list[Tensor], params: list[Tensor], state: Tensor | None) -> tuple[Tensor, Tensor]:
        x, step, *rest = pieces
        gate = rest.pop(0) if gated else None
        b_, c_ = rest
        a, more = params[0], list(params[1:])
        skip = more.pop(0) if has_d else None
        bias = more.pop(0) if has_bias else None
        channels_first = [t[:, :, 0].transpose(1, 2) for t in (x, step)]  # [b, d/P, L]
        y, final = kernel(*channels_first, a, b_.transpose(1, 2), c_.transpose(1, 2), delta_bias=bias,
                          delta_softplus=delta_softplus, return_last_state=True, **options)
        if state is not None:  # the carried state, decayed along the chunk
            y, final = _carried(y, final, state, channels_first[1], a, c_, bias, delta_softplus)
        if skip is not None:
            y = y + channels_first[0] * skip[None, :, None]
        if gate is not None:
            y = y * F.silu(gate[:, :, 0].transpose(1, 2))
        return y.transpose(1, 2).unsqueeze(2), final  # [b, L, 1, d/P]

    out = recurrence._chunk_by_chunk(run, by_channel, [B.transpose(1, 2), C.transpose(1, 2)], params)
    return out.reshape(b, s_local, d).transpose(1, 2)


def _carried(y: Tensor, final: Tensor, state: Tensor, dt: Tensor, A: Tensor, C: Tensor, bias: Tensor | None,
             softplus: bool) -> tuple[Tensor, Tensor]:
    """``y`` ``[b, d, L]`` and ``final`` ``[b, d, n]`` of a scan from zero, with what the state ``[b, d, n]`` it
    should have started from adds: ``C_t exp(A cumsum(dt)_t) h_0`` and ``exp(A sum(dt)) h_0``. ``dt`` ``[b, d, L]``
    is taken as the kernel takes it (the bias added, softplus where asked), ``C`` is ``[b, L, n]``."""
    acc = torch.promote_types(final.dtype, torch.float32)
    step = dt.to(acc) + (0 if bias is None else bias.to(acc)[None, :, None])
    step = F.softplus(step) if softplus else step
    decay = torch.exp(A.to(acc)[None, :, None, :] * step.cumsum(dim=-1)[..., None])  # [b, d, L, n]
    h0 = state.to(acc)
    added = torch.einsum("bdln,bdn,bln->bdl", decay, h0, C.to(acc))
    return (y.to(acc) + added).to(y.dtype), final.to(acc) + decay[:, :, -1] * h0
