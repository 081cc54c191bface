"""The online-softmax merge shared by every attention path."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_fpdt.attention.kernels import accumulate_dtype


def update_out_and_lse(
    out: Tensor | None, lse: Tensor | None, block_out: Tensor, block_lse: Tensor
) -> tuple[Tensor, Tensor]:
    """Merge one key block's attention into the running result of a query block.

    Args:
        out: running output ``[batch, seq_q, heads, head_dim]`` in the accumulation dtype, or ``None``.
        lse: running log-sum-exp ``[batch, heads, seq_q]``, or ``None``.
        block_out: this block's output, normalised over this block's keys only.
        block_lse: this block's log-sum-exp.

    Returns:
        The merged ``(out, lse)`` in float32 (float64 for float64 inputs).

    The update ``new = logaddexp(lse, block_lse)`` and weights ``exp(lse - new)``,
    ``exp(block_lse - new)`` never exponentiate a positive number, so it cannot overflow however far
    apart the two log-sum-exps are (``lse + log1p(exp(block_lse - lse))`` overflows once
    ``block_lse - lse`` exceeds ~88 in float32).
    """
    acc = accumulate_dtype(block_out.dtype)
    if out is None or lse is None:
        return block_out.to(acc), block_lse.to(acc)
    block_lse = block_lse.to(acc)
    new_lse = torch.logaddexp(lse, block_lse)
    w_old = torch.exp(lse - new_lse).transpose(1, 2).unsqueeze(-1)  # [b, s_q, h, 1]
    w_new = torch.exp(block_lse - new_lse).transpose(1, 2).unsqueeze(-1)
    return out * w_old + block_out.to(acc) * w_new, new_lse
