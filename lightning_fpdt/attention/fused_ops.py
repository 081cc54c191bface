"""What the kernels share below the kernel interface: GQA's key/value heads as each op takes them, the
window's edge as a mask, and torch's fused CUDA attention ops (FlashAttention-2, memory-efficient, cuDNN), each
called as torch's autograd formula calls it.

The fused ops' backward gets what their forward returned (``derivatives.yaml``); tests/test_cuda_calls.py
checks every call on meta tensors. :class:`~lightning_fpdt.attention.kernels.SdpaKernel` routes to them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_fpdt.errors import FPDTError


def repeat_kv(x: Tensor, n_heads: int) -> Tensor:
    """``[b, s, g, d] -> [b, s, n_heads, d]``: query head ``i`` uses KV head ``i // (n_heads / g)``."""
    g = x.shape[2]
    return x if g == n_heads else x.repeat_interleave(n_heads // g, dim=2)


def sum_kv_grad(dx: Tensor, kv_heads: int) -> Tensor:
    """Inverse of :func:`repeat_kv` for gradients: sum over the query heads sharing a KV head."""
    b, s, h, d = dx.shape
    return dx if h == kv_heads else dx.view(b, s, kv_heads, h // kv_heads, d).sum(dim=3)


def check_shapes(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> None:
    """Raises ``FPDTError`` unless q, k and v have the layouts of the kernel interface (``kernels``) and a causal
    block is square."""
    if (q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or v.shape[:3] != k.shape[:3] or q.shape[0] != k.shape[0]
            or q.shape[3] != k.shape[3]):
        raise FPDTError(
            f"Attention expects q [batch, seq, heads, head_dim], k [batch, seq_k, kv_heads, head_dim] and v"
            f" [batch, seq_k, kv_heads, v_head_dim] (v's width may differ, q's and k's may not); got"
            f" q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}."
        )
    if q.shape[2] % k.shape[2] != 0:
        raise FPDTError(f"{q.shape[2]} query heads are not a multiple of {k.shape[2]} key/value heads.")
    if causal and q.shape[1] != k.shape[1]:
        raise FPDTError(f"A causal block must be square; got seq_q={q.shape[1]}, seq_k={k.shape[1]}.")


def last_dim_contiguous(x: Tensor) -> Tensor:
    """The fused CUDA kernels take any strides except in the head dim."""
    return x if x.stride(-1) == 1 else x.contiguous()


def padded_width(*widths: int, multiple: int = 8) -> int:
    """The widest of ``widths`` rounded up to a multiple of ``multiple``."""
    return -(-max(widths) // multiple) * multiple


def common_head_dim(q: Tensor, v: Tensor, multiple: int = 8) -> int:
    """The one head width a fused op gets q, k and v at: the wider of q's (and k's) and v's, rounded up to a
    multiple of ``multiple``. The fused kernels take a single head width (flash-attn, torch's flash ops);
    multi-head latent attention (DeepSeek-V2/V3, MiniCPM3) has v narrower than q and k, and any model may have it
    wider: :func:`dense_head_dim` pads the others to it."""
    return padded_width(q.shape[-1], v.shape[-1], multiple=multiple)


def dense_head_dim(x: Tensor, width: int | None = None) -> Tensor:
    """Last dim contiguous and padded with zeros to ``width`` (default: a multiple of 8), as the flash kernels
    require (:func:`common_head_dim` gives q, k and v one width).

    Zero columns change no score (the scale is always passed explicitly), give zero output columns and
    zero gradient columns; callers slice them off.
    """
    x = last_dim_contiguous(x)
    d = x.shape[-1]
    width = padded_width(d) if width is None else width
    return x if d == width else F.pad(x, (0, width - d))


def visible_keys(
    s_q: int, s_k: int, causal: bool, lower: int | None, device: torch.device, first_row: int = 0
) -> Tensor | None:
    """``[s_q, s_k]`` bool, True where row ``a`` sees key ``b`` (``b <= a`` if ``causal``, ``b - a >= lower``
    if ``lower`` is given), the rows being the block's from ``first_row`` on (a band of them); ``None`` when every
    row sees every key."""
    if not causal and lower is None:
        return None
    a = torch.arange(first_row, first_row + s_q, device=device).unsqueeze(1)
    b = torch.arange(s_k, device=device).unsqueeze(0)
    seen = torch.ones(s_q, s_k, dtype=torch.bool, device=device)
    if causal:
        seen &= b <= a
    if lower is not None:
        seen &= b - a >= lower
    return seen


def edge_bias(s_q: int, s_k: int, lower: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The window's edge as the additive mask the fused ops take: 0 where seen, -inf elsewhere."""
    seen = visible_keys(s_q, s_k, False, lower, device)
    assert seen is not None
    return torch.zeros(s_q, s_k, dtype=dtype, device=device).masked_fill_(~seen, float("-inf"))


def efficient_lse_len(s_q: int) -> int:
    """Length of the lse the memory-efficient CUDA op returns for ``s_q`` queries (torch's meta function).

    The CUDA kernel pads it to a multiple of 32 and writes +inf in the padding, so that its backward can
    read whole 32-row tiles without bound checks; ROCm's kernel returns exactly ``s_q``.
    """
    return s_q if torch.version.hip else -(-s_q // 32) * 32


def unused_rng_state(flash_op: bool, device: torch.device) -> tuple[Tensor, Tensor]:
    """The philox seed/offset pair a forward without dropout returns: its dtypes and shapes, unread contents.

    The CUDA backward reads them only when ``dropout_p > 0`` (flash: ``if (is_dropout) params.rng_state =
    ...``; efficient: ``if (use_dropout)``), but they must be defined tensors, as the forward's are: ROCm's
    backward takes their data pointer unconditionally.
    """
    if flash_op and not torch.version.hip:  # the flash op returns (rng_state uint64[2], unused uint64[])
        return torch.empty(2, dtype=torch.uint64, device=device), torch.empty((), dtype=torch.uint64, device=device)
    return torch.empty((), dtype=torch.int64, device=device), torch.empty((), dtype=torch.int64, device=device)


def efficient_bias(q: Tensor, k: Tensor, lower: int | None) -> Tensor | None:
    """The window's edge as the memory-efficient op's ``attn_bias`` ``[b, h, s_q, s_k]`` (``None`` without one).

    Its rows start at multiples of 16 elements, as the kernel requires and torch's own sdpa arranges
    (``preprocess_mask``): padded, then sliced back; expanded over batch and heads without copies.
    """
    if lower is None:
        return None
    (b, s_q, h, _), s_k = q.shape, k.shape[1]
    bias = edge_bias(s_q, s_k, lower, q.dtype, q.device)
    if s_k % 16:
        bias = F.pad(bias, (0, 16 - s_k % 16))[:, :s_k]
    return bias.expand(b, h, s_q, s_k)


def flash_op_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    width = common_head_dim(q, v)
    qt, kt, vt = (dense_head_dim(x, width).transpose(1, 2) for x in (q, k, v))  # [b, heads or kv_heads, s, d8]
    # -> (output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused, debug_attn_mask)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(qt, kt, vt, 0.0, causal, False, scale=scale)[:2]
    return out.transpose(1, 2)[..., :v.shape[-1]], lse  # lse [b, h, s_q] float32


def flash_op_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    d, width = q.shape[-1], common_head_dim(q, v)
    dot, qt, kt, vt, ot = (dense_head_dim(x.to(q.dtype), width).transpose(1, 2) for x in (dout, q, k, v, out))
    rng_state, unused = unused_rng_state(True, q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dot, qt, kt, vt, ot, lse.to(torch.float32).contiguous(),
        None, None,  # cum_seq_q/k: the dense forward returns them undefined; defined ones select the varlen kernel
        q.shape[1], k.shape[1],  # max_q/max_k: the dense forward returns the two sequence lengths
        0.0, causal, rng_state, unused, scale=scale,
    )
    return dq.transpose(1, 2)[..., :d], dk.transpose(1, 2)[..., :d], dv.transpose(1, 2)[..., :v.shape[-1]]


def efficient_op_forward(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, bias: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    s_q, h, width = q.shape[1], q.shape[2], common_head_dim(q, v)
    # [b, h, s, d8] with equal head counts; the head dim padded as for the flash op (torch's sdpa sends this op
    # only head dims of a multiple of 8 in half precision, 4 in float32), v to the same width
    qt, kt, vt = (dense_head_dim(x, width).transpose(1, 2) for x in (q, repeat_kv(k, h), repeat_kv(v, h)))
    # -> (output, log_sumexp, philox_seed, philox_offset)
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        qt, kt, vt, bias, True, 0.0, causal, scale=scale
    )[:2]
    if lse.shape[-1] != efficient_lse_len(s_q):
        raise RuntimeError(
            f"SdpaKernel: the memory-efficient op returned an lse of length {lse.shape[-1]} for {s_q} queries,"
            f" not the {efficient_lse_len(s_q)} its backward is fed; this torch build changed its padding."
        )
    return out.transpose(1, 2)[..., :v.shape[-1]], lse[..., :s_q]


def efficient_op_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float,
    bias: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    s_q, h, g, d, width = q.shape[1], q.shape[2], k.shape[2], q.shape[3], common_head_dim(q, v)
    qt, kt, vt, dot = (
        dense_head_dim(x, width).transpose(1, 2) for x in (q, repeat_kv(k, h), repeat_kv(v, h), dout.to(q.dtype))
    )
    # The kernel is given only out's batch and head strides and assumes the rest of the forward's output
    # strides, [b, s, h, d8] contiguous (dense_head_dim pads into a fresh contiguous tensor, or keeps a dense one).
    ot = dense_head_dim(out.to(q.dtype).contiguous(), width).transpose(1, 2)
    # The merged lse [b, h, s_q] re-padded to the forward's length. The kernel reads whole 32-row tiles
    # without bound checks; +inf, what the forward writes there, makes P = exp(S - lse) = 0 on those rows.
    lse_padded = F.pad(lse.to(torch.float32), (0, efficient_lse_len(s_q) - s_q), value=math.inf)
    philox_seed, philox_offset = unused_rng_state(False, q.device)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dot, qt, kt, vt,
        bias,  # attn_bias: the forward's (a window's edge), or undefined as it was there
        ot, lse_padded, philox_seed, philox_offset, 0.0, [True, True, True, False], causal, scale=scale,
    )
    dq, dk, dv = (x.transpose(1, 2)[..., :n] for x, n in ((dq, d), (dk, d), (dv, v.shape[-1])))
    return dq, sum_kv_grad(dk, g), sum_kv_grad(dv, g)


def contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    """The strides of a freshly allocated contiguous tensor of ``shape`` (size-1 dims included)."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def cudnn_layout(x: Tensor, width: int) -> Tensor:
    """``[b, s, h, d] -> [b, h, s, width]``: a view of ``[b, s, h, width]`` with exactly contiguous strides, size-1
    dims included, padded as :func:`dense_head_dim` pads.

    cuDNN's graphs are cached by q's, k's and v's sizes and strides alone, and the backward's graph takes out's and
    dout's layout from q's: a pipeline hands in views (a chunk of a longer sequence, one batch row's stride) and
    fresh tensors in turn, which one cached graph would read with another call's strides. A dense tensor whose
    size-1 dims have other strides is only restrided (the same addresses); any other layout is copied."""
    x = dense_head_dim(x, width)
    strides = contiguous_strides(x.shape)
    if x.stride() != strides:
        x = x.as_strided(x.shape, strides) if x.is_contiguous() else x.contiguous()
    return x.transpose(1, 2)


CUDNN_MAX_HEAD_DIM = 128  # what cuDNN's fused attention takes forward and backward on every GPU it runs on


def cudnn_op_takes(q: Tensor, v: Tensor) -> bool:
    """Whether cuDNN's op computes a block of these heads: one padded head width of at most
    :data:`CUDNN_MAX_HEAD_DIM`."""
    return common_head_dim(q, v) <= CUDNN_MAX_HEAD_DIM


def cudnn_op_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """cuDNN's fused attention of q ``[b, s_q, h, d]``, k/v ``[b, s_k, kv_heads, d]``: ``(out, lse [b, h, s_q]
    float32)``. k/v repeated to q's heads (GQA is not taken natively on every cuDNN release torch loads)."""
    h, width = q.shape[2], common_head_dim(q, v)
    qt, kt, vt = (cudnn_layout(x, width) for x in (q, repeat_kv(k, h), repeat_kv(v, h)))
    # -> (output, logsumexp [b, h, s_q, 1], cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset, debug)
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        qt, kt, vt, None, True, 0.0, causal, False, scale=scale
    )[:2]
    return out.transpose(1, 2)[..., :v.shape[-1]], lse.reshape(lse.shape[:3])  # the trailing 1 dropped


def cudnn_op_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    h, g, d, width = q.shape[2], k.shape[2], q.shape[3], common_head_dim(q, v)
    # out and dout in q's layout, as the forward returned out; the lse with its trailing 1 again
    qt, kt, vt, ot, dot = (
        cudnn_layout(x, width) for x in (q, repeat_kv(k, h), repeat_kv(v, h), out.to(q.dtype), dout.to(q.dtype))
    )
    philox_seed, philox_offset = unused_rng_state(False, q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dot, qt, kt, vt, ot, lse.to(torch.float32).contiguous().unsqueeze(-1), philox_seed, philox_offset,
        None,  # attn_bias: none, as the forward had
        None, None,  # cum_seq_q/k: the dense forward returns them undefined
        q.shape[1], k.shape[1], 0.0, causal, scale=scale,
    )
    dq, dk, dv = (x.transpose(1, 2)[..., :n] for x, n in ((dq, d), (dk, d), (dv, v.shape[-1])))
    return dq, sum_kv_grad(dk, g), sum_kv_grad(dv, g)
