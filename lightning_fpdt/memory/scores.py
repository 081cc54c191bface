"""The bytes of attention scores where a route materializes them: ``math`` on every block, whole, and a route whose
kernels cannot cap the logits (``sdpa``; ``cudnn`` and ``auto`` without a FlashAttention package that caps at the
model's head width) on a softcapped block, which runs on ``math`` in bands of query rows
(:class:`~lightning_fpdt.attention.math_kernel.MathKernel`'s ``forward_in_bands``/``backward_in_bands``, at most
``MATH_BAND_SCORES`` scores a band).

Counted as measured (``tests/test_memory_scores.py``: a block's forward and backward under a tensor tracker, and a
Gemma-2 training step): at its peak a capped block's (or band's) forward holds about four tensors of its scores
(scores, the cap's tanh, the softmax's argument and probabilities, the products' temporaries), its backward seven
(those, dP and dS's factors); with more than one band, the block's k and v at q's head count in the accumulation
dtype, their gradients, and the bands' dq with their concatenation besides.

Which FlashAttention package ``auto`` and ``cudnn`` would hand a capped block to is read on the machine that runs the
estimate (:func:`~lightning_fpdt.backends.flash_route`): the training machine when the strategy plans its chunks.
"""

from __future__ import annotations

import torch

from lightning_fpdt.attention.flash_kernels import flash_attn_4_declines
from lightning_fpdt.attention.math_kernel import MATH_BAND_SCORES
from lightning_fpdt.backends import flash_route

BAND_FORWARD = 4  # score-sized tensors live at once in a capped block's (or band's) forward
BAND_BACKWARD = 7  # and in its backward
UNCAPPED_MATH = 4  # an uncapped block on math: S, P, dP and dS


def caps_in_kernel(backend: str, half: bool, head_width: int) -> bool:
    """Whether ``backend`` computes a softcapped block of (padded) ``head_width`` in a fused kernel (a FlashAttention
    package's, which takes the cap) rather than on ``math``. ``sdpa`` and ``math`` never do; ``cudnn`` and ``auto``
    pass such blocks, in half precision (``half``), to the package ``auto`` would take where one is installed and
    usable; FlashAttention-4 on sm100 and newer has no capped kernel at width 256 (nor any at 129-255)."""
    package = flash_route("cuda") if backend in ("auto", "cudnn") and half else backend
    if package == "flash_attn_4":
        major = torch.cuda.get_device_capability()[0] if torch.cuda.is_available() else 9
        return not flash_attn_4_declines(head_width, 1.0, major)
    return package in ("flash_attn", "flash_attn_3")


def capped_block_bytes(batch: int, heads: int, rows: int, keys: int, head_dim: int, v_head_dim: int,
                       acc_bytes: int, banded: bool = True) -> tuple[int, int]:
    """``(forward, backward)`` bytes a softcapped block of ``rows`` queries and ``keys`` keys at ``heads`` heads
    (``batch`` samples) holds on ``math`` beyond its inputs and outputs: in bands (``sdpa``'s way), or whole
    (``banded=False``: the ``math`` backend's). ``acc_bytes``: the accumulation dtype's size (4, or 8 for float64)."""
    band_rows = max(1, MATH_BAND_SCORES // max(1, batch * heads * keys)) if banded else rows
    band = batch * heads * min(band_rows, rows) * keys * acc_bytes
    forward, backward = BAND_FORWARD * band, BAND_BACKWARD * band
    if band_rows < rows:  # banded: k and v expanded once for every band, their gradients, the bands' dq and its cat
        expanded = batch * keys * heads * (head_dim + v_head_dim) * acc_bytes
        forward += expanded
        backward += 2 * expanded + 2 * batch * rows * heads * head_dim * acc_bytes
    return forward, backward
