"""The FlashAttention packages' kernels: flash-attn 2 (``flash_attn``), FlashAttention-3 (``flash_attn_3``, the
Hopper build) and FlashAttention-4 (``flash_attn_4``, the CuTe DSL build), each behind the kernel interface of
:mod:`lightning_fpdt.attention.kernels`, each called through the package's private forward and backward functions,
which return and take the log-sum-exp that the FPDT merge needs (the public ``flash_attn_func`` hides it from the
backward).

All three take GQA's key/value heads as they are, a window's edge as the bottom-right aligned ``window_size`` pair
(:func:`flash_window`), Gemma-2's logit cap, and float16/bfloat16 only (configuration refuses other precisions). q,
k and v go in at one head width (``fused_ops.common_head_dim``: a narrower v is padded with zero columns, exact),
last dim contiguous. Which package versions load is decided in :mod:`lightning_fpdt.backends`: flash-attn 2 by its
release range, FlashAttention-3/4 by their functions' argument lists (:data:`~lightning_fpdt.backends.FLASH_PACKAGES`
names every keyword passed here).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from types import ModuleType
from typing import Protocol

import torch
from torch import Tensor

from lightning_fpdt.attention import routes
from lightning_fpdt.attention.fused_ops import check_shapes, common_head_dim, dense_head_dim
from lightning_fpdt.backends import FLASH_ATTN_FIX, FLASH_PACKAGES, load_flash_attn, load_flash_package
from lightning_fpdt.errors import FPDTError


def flash_window(s_q: int, s_k: int, causal: bool, lower: int | None) -> tuple[int, int]:
    """flash-attn's ``(window_size_left, window_size_right)`` for a block's window edge (``-1``: unbounded).

    flash-attn aligns its window to the bottom-right corner: row ``a`` sees keys ``a + s_k - s_q - left`` to
    ``a + s_k - s_q + right`` (its README, "sliding window"; FlashAttention-3 and -4 align theirs the same way).
    ``b - a >= lower`` is ``left = s_k - s_q - lower``; the causal diagonal is its ``causal`` flag. A rectangle of
    ``blocks.BlockRules`` has ``left >= 0``.
    """
    if lower is None:
        return -1, -1
    left = s_k - s_q - lower
    if left < 0:
        raise FPDTError(f"FlashAttnKernel: a window edge lower={lower} on a {s_q} x {s_k} block leaves its last"
                        " rows without keys; trim the block to the rows that see one (blocks.BlockRules).")
    return left, -1


class _FlashKernel(ABC):
    """What the three packages' kernels share: the checks, one head width, the window; ``_forward``/``_backward``
    make the package's own call on ``[batch, seq, heads, width]`` tensors with the last dim contiguous."""

    name: str
    edge_band = None  # window_size: the edge inside one call

    def __init__(self, interface: ModuleType) -> None:
        self._fa = interface

    @abstractmethod
    def _forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, left: int, right: int,
                 softcap: float) -> tuple[Tensor, Tensor]: ...

    @abstractmethod
    def _backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                  scale: float, left: int, right: int, softcap: float) -> tuple[Tensor, Tensor, Tensor]: ...

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, lower: int | None = None,
        softcap: float | None = None,
    ) -> tuple[Tensor, Tensor]:
        return self.forward_declined(q, k, v, causal, scale, lower, softcap)

    def forward_declined(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, lower: int | None, softcap: float | None,
        declined: str = "",
    ) -> tuple[Tensor, Tensor]:
        """:meth:`forward`, noted (:mod:`routes`) with why the run's own route did not take the block (``declined``:
        cuDNN's op, when this package runs the blocks it declines)."""
        check_shapes(q, k, v, causal)
        routes.note(self.name, declined)
        width = common_head_dim(q, v)  # one head width: v padded to q's, or q and k to v's
        left, right = flash_window(q.shape[1], k.shape[1], causal, lower)
        q8, k8, v8 = (dense_head_dim(x, width) for x in (q, k, v))  # k/v keep their kv_heads
        out, lse = self._forward(q8, k8, v8, causal, scale, left, right, softcap or 0.0)  # a cap of 0.0: none
        return out[..., :v.shape[-1]], lse

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float,
        lower: int | None = None, softcap: float | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        check_shapes(q, k, v, causal)
        d, width = q.shape[-1], common_head_dim(q, v)
        left, right = flash_window(q.shape[1], k.shape[1], causal, lower)
        do8, q8, k8, v8, o8 = (dense_head_dim(x.to(q.dtype), width) for x in (dout, q, k, v, out))
        lse = lse.to(torch.float32).contiguous()
        dq, dk, dv = self._backward(do8, q8, k8, v8, o8, lse, causal, scale, left, right, softcap or 0.0)
        return dq[..., :d], dk[..., :d], dv[..., :v.shape[-1]]


class FlashAttnKernel(_FlashKernel):
    """The flash-attn package (CUDA, float16/bfloat16, ``FLASH_ATTN_REQUIREMENT``); supports GQA natively.

    Args:
        interface: the ``flash_attn.flash_attn_interface`` module; imported (and its version checked) when omitted.

    Raises:
        ValueError: flash-attn does not import or its version is outside ``FLASH_ATTN_VERSIONS``.
    """

    name = "flash_attn"

    def __init__(self, interface: ModuleType | None = None) -> None:
        if interface is None:
            interface, problem = load_flash_attn()
            if interface is None:
                raise FPDTError(f"attention_backend='flash_attn' but {problem};{FLASH_ATTN_FIX}")
        super().__init__(interface)

    def _forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, left: int, right: int,
                 softcap: float) -> tuple[Tensor, Tensor]:
        # flash-attn 2.7-2.8 -> (out, softmax_lse, S_dmask, rng_state)
        out, lse, _, _ = self._fa._flash_attn_forward(
            q, k, v, 0.0, scale, causal=causal, window_size_left=left, window_size_right=right,
            softcap=softcap, alibi_slopes=None, return_softmax=False,
        )
        return out, lse

    def _backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                  scale: float, left: int, right: int, softcap: float) -> tuple[Tensor, Tensor, Tensor]:
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        # fills dq, dk, dv; rng_state (unread without dropout) left at its default None
        self._fa._flash_attn_backward(
            dout, q, k, v, out, lse, dq, dk, dv, 0.0, scale, causal, left, right, softcap, None, False,
        )
        return dq, dk, dv


def _load(backend: str, interface: ModuleType | None) -> ModuleType:
    if interface is not None:
        return interface
    module, problem = load_flash_package(backend)
    if module is None:
        raise FPDTError(f"attention_backend={backend!r} but {problem}; {FLASH_PACKAGES[backend].install}, or use"
                        " attention_backend='auto' or 'sdpa'.")
    return module


class FlashAttn3Kernel(_FlashKernel):
    """FlashAttention-3 (``flash_attn_interface``, built from flash-attention's ``hopper/``): its
    ``_flash_attn_forward`` returns ``(out, softmax_lse [b, h, s_q] float32, out_accum, softmax_lse_accum)``, its
    ``_flash_attn_backward`` fills ``dq``/``dk``/``dv`` (k/v's own head count) from the row's final out and lse.

    Args:
        interface: the ``flash_attn_interface`` module; imported (and its functions' arguments checked) when omitted.
    """

    name = "flash_attn_3"

    def __init__(self, interface: ModuleType | None = None) -> None:
        super().__init__(_load(self.name, interface))

    def _forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, left: int, right: int,
                 softcap: float) -> tuple[Tensor, Tensor]:
        out, lse, *_ = self._fa._flash_attn_forward(
            q=q, k=k, v=v, softmax_scale=scale, causal=causal, window_size_left=left, window_size_right=right,
            softcap=softcap,
        )
        return out, lse

    def _backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                  scale: float, left: int, right: int, softcap: float) -> tuple[Tensor, Tensor, Tensor]:
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        self._fa._flash_attn_backward(
            dout=dout, q=q, k=k, v=v, out=out, softmax_lse=lse, dq=dq, dk=dk, dv=dv, softmax_scale=scale,
            is_causal=causal, window_size_left=left, window_size_right=right, softcap=softcap,
        )
        return dq, dk, dv


class Fallback(Protocol):
    """The kernel of the blocks a route declines: ``kernels.SdpaKernel`` (which imports this module)."""

    def forward_declined(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, lower: int | None, softcap: float | None,
        declined: str = "",
    ) -> tuple[Tensor, Tensor]: ...

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float,
        lower: int | None = None, softcap: float | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]: ...


def flash_attn_4_declines(width: int, softcap: float | None, major: int) -> str:
    """Why FlashAttention-4 has no kernel for a block of padded head width ``width`` (and ``softcap``) on a GPU of
    compute-capability ``major`` (``""``: it has one): on sm100 and newer it takes widths up to 128, or 256 uncapped."""
    if major >= 10 and 128 < width != 256:
        return f"head width {width}: FlashAttention-4 on sm{major}x takes up to 128, or 256"
    if major >= 10 and width == 256 and softcap:
        return f"FlashAttention-4 on sm{major}x caps no scores at head width 256"
    return ""


class FlashAttn4Kernel(_FlashKernel):
    """FlashAttention-4 (``flash_attn.cute.interface``, the flash-attn-4 package): ``_flash_attn_fwd`` with
    ``return_lse=True`` gives ``out`` and the natural-log ``lse [b, h, s_q]`` float32 first (later releases return
    two more values), ``_flash_attn_bwd`` returns ``(dq, dk, dv)``. Its window bounds are ``None`` where flash-attn's
    are ``-1``; a cap of ``0.0`` is none. On sm100 and newer its kernels take head widths up to 128 or of 256 (no
    cap at 256); a block outside that (multi-head latent attention's 192, padded) runs on ``fallback``.

    Args:
        interface: the ``flash_attn.cute.interface`` module; imported (and its functions' arguments checked) when
            omitted.
        fallback: the kernel of the blocks it does not take (``get_kernel`` gives ``sdpa``'s); ``None``: refused.
        major: the GPU's compute-capability major (default: the tensors' device's; 9 off CUDA, as for the tests'
            fakes).
    """

    name = "flash_attn_4"

    def __init__(self, interface: ModuleType | None = None, fallback: Fallback | None = None,
                 major: int | None = None) -> None:
        super().__init__(_load(self.name, interface))
        self._fallback, self._major = fallback, major

    def _declines(self, q: Tensor, v: Tensor, softcap: float | None) -> str:
        if self._major is None and q.device.type == "cuda":  # a kernel serves one attention call: asked once there
            self._major = torch.cuda.get_device_capability(q.device)[0]
        return flash_attn_4_declines(common_head_dim(q, v), softcap, 9 if self._major is None else self._major)

    def _refused(self, declined: str) -> FPDTError:
        return FPDTError(f"attention_backend='flash_attn_4': {declined}; use attention_backend='auto' or 'sdpa'.")

    def forward_declined(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, lower: int | None, softcap: float | None,
        declined: str = "",
    ) -> tuple[Tensor, Tensor]:
        own = self._declines(q, v, softcap)
        if not own:
            return super().forward_declined(q, k, v, causal, scale, lower, softcap, declined)
        if self._fallback is None:
            raise self._refused(own)
        check_shapes(q, k, v, causal)
        both = "; ".join(reason for reason in (declined, own) if reason)
        return self._fallback.forward_declined(q, k, v, causal, scale, lower, softcap, both)

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float,
        lower: int | None = None, softcap: float | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        declined = self._declines(q, v, softcap)
        if not declined:
            return super().backward(dout, q, k, v, out, lse, causal, scale, lower, softcap)
        if self._fallback is None:
            raise self._refused(declined)
        return self._fallback.backward(dout, q, k, v, out, lse, causal, scale, lower, softcap)

    def _forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, left: int, right: int,
                 softcap: float) -> tuple[Tensor, Tensor]:
        out, lse, *_ = self._fa._flash_attn_fwd(
            q=q, k=k, v=v, softmax_scale=scale, causal=causal, softcap=softcap, window_size_left=_bound(left),
            window_size_right=_bound(right), return_lse=True,
        )
        return out, lse

    def _backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                  scale: float, left: int, right: int, softcap: float) -> tuple[Tensor, Tensor, Tensor]:
        dq, dk, dv = self._fa._flash_attn_bwd(
            q=q, k=k, v=v, out=out, dout=dout, lse=lse, softmax_scale=scale, causal=causal, softcap=softcap,
            window_size_left=_bound(left), window_size_right=_bound(right),
        )[:3]
        return dq, dk, dv


def _bound(size: int) -> int | None:
    return None if size < 0 else size
