"""The online-softmax merge shared by every attention path, attention sinks included."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_fpdt.attention.kernels import accumulate_dtype
from lightning_fpdt.errors import FPDTError


def update_out_and_lse(
    out: Tensor | None, lse: Tensor | None, block_out: Tensor | None, block_lse: Tensor, in_place: bool = False
) -> tuple[Tensor, Tensor]:
    """Merge one key block's attention into the running result of a query block.

    Args:
        out: running output ``[batch, seq_q, heads, head_dim]`` in the accumulation dtype, or ``None``.
        lse: running log-sum-exp ``[batch, heads, seq_q]``, or ``None``.
        block_out: this block's output, normalised over this block's keys only; ``None`` for a block whose
            values are all zero (an attention sink: its logit joins the denominator, nothing the output).
        block_lse: this block's log-sum-exp.
        in_place: write the merged output into ``out`` (the caller owns it: the pipeline's running result), not a
            new tensor.

    Returns:
        The merged ``(out, lse)`` in float32 (float64 for float64 inputs).

    The update ``new = logaddexp(lse, block_lse)`` and weights ``exp(lse - new)``,
    ``exp(block_lse - new)`` never exponentiate a positive number, so it cannot overflow however far
    apart the two log-sum-exps are (``lse + log1p(exp(block_lse - lse))`` overflows once
    ``block_lse - lse`` exceeds ~88 in float32).
    """
    if out is None or lse is None:
        if block_out is None:
            raise FPDTError("update_out_and_lse: a zero-valued block (a sink) needs a running result to join.")
        acc = accumulate_dtype(block_out.dtype)
        return block_out.to(acc), block_lse.to(acc)
    block_lse = block_lse.to(lse.dtype)
    new_lse = torch.logaddexp(lse, block_lse)
    kept = torch.exp(lse - new_lse).transpose(1, 2).unsqueeze(-1)  # [b, s_q, h, 1] against out's [b, s_q, h, d]
    merged = out.mul_(kept) if in_place else out * kept
    if block_out is not None:  # one pass over the output for the product and the sum
        weight = torch.exp(block_lse - new_lse).transpose(1, 2).unsqueeze(-1)
        merged = merged.addcmul_(block_out.to(out.dtype), weight)
    return merged, new_lse


def merge_sink(out: Tensor, lse: Tensor, sink: Tensor) -> tuple[Tensor, Tensor]:
    """Join each head's sink logit to every query's softmax, once, after all its key blocks.

    As transformers' gpt-oss eager attention has it: the logit ``sink[h]`` (not scaled) is one more column
    of the scores, whose probability is dropped, so it only grows the denominator.

    Args:
        out: merged output ``[batch, seq_q, heads, head_dim]`` over every key block.
        lse: its log-sum-exp ``[batch, heads, seq_q]``.
        sink: ``[heads]``, the sink logits of these heads.

    Returns:
        ``(out, lse)`` with the sink in the denominator.
    """
    return update_out_and_lse(out, lse, None, sink.to(lse.dtype).view(1, -1, 1).expand_as(lse))


def sink_grad(dout: Tensor, out: Tensor, lse: Tensor, sink: Tensor) -> Tensor:
    """The gradient of the sink logits from the rows of one query chunk: ``[heads]``, accumulation dtype.

    The sink's column has probability ``p = exp(sink - lse)`` (``lse`` with the sink) and value zero, so its
    score gradient is ``p * (0 - D)`` with ``D = rowsum(dO * O)``, summed over the rows.

    Args:
        dout: ``[batch, seq_q, heads, head_dim]``, the output's gradient.
        out: the final output (sink included) ``[batch, seq_q, heads, head_dim]``.
        lse: its final log-sum-exp ``[batch, heads, seq_q]``.
        sink: ``[heads]``.
    """
    acc = lse.dtype
    delta = (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2)  # [b, h, s_q]
    p_sink = torch.exp(sink.to(acc).view(1, -1, 1) - lse)
    return -(p_sink * delta).sum(dim=(0, 2))
