"""The bytes of attention scores where a route materializes them: ``math`` on every block, whole, and a route whose
kernels cannot cap the logits on a softcapped block, which runs on ``math`` in bands of query rows
(:class:`~lightning_fpdt.attention.math_kernel.MathKernel`'s ``forward_in_bands``/``backward_in_bands``, at most
``MATH_BAND_SCORES`` scores a band).

Counted as measured (``tests/test_memory_scores.py``: a block's forward and backward under a tensor tracker, and a
Gemma-2 training step): at its peak a capped block's (or band's) forward holds about four tensors of its scores
(scores, the cap's tanh, the softmax's argument and probabilities, the products' temporaries), its backward seven
(those, dP and dS's factors); with more than one band, the block's k and v at q's head count in the accumulation
dtype, their gradients, and the bands' dq with their concatenation besides.

The estimate asks neither the GPU nor the installed packages: ``fpdt-train`` prints it in the process that starts the
ranks, where loading a FlashAttention package or initialising CUDA would break ranks it forks, and the table and the
ranks' chunk planner must agree. So ``auto`` and ``cudnn``, which hand a capped block to a FlashAttention package
only where one is installed and usable, count the banded scores (at most ``MATH_BAND_SCORES`` of them a band, and one
block's k and v: a bounded count on the safe side), and FlashAttention-4 is held to its sm100 rule.
"""

from __future__ import annotations

from lightning_fpdt.attention.flash_kernels import flash_attn_4_declines
from lightning_fpdt.attention.math_kernel import band_rows

BAND_FORWARD = 4  # score-sized tensors live at once in a capped block's (or band's) forward
BAND_BACKWARD = 7  # and in its backward
UNCAPPED_MATH = 4  # an uncapped block on math: S, P, dP and dS


def caps_in_kernel(backend: str, head_width: int) -> bool:
    """Whether the route ``backend`` surely computes a softcapped block of (padded) ``head_width`` in a fused kernel
    rather than on ``math``: flash-attn 2 and FlashAttention-3 do; FlashAttention-4 does except where sm100 and newer
    have no capped kernel (width 256, or 129-255: the GPU generation is not asked); ``sdpa`` and ``math`` never do,
    and ``auto`` and ``cudnn`` do only where a package is installed and usable, which the estimate does not ask."""
    if backend == "flash_attn_4":
        return not flash_attn_4_declines(head_width, 1.0, major=10)
    return backend in ("flash_attn", "flash_attn_3")


def capped_block_bytes(batch: int, heads: int, rows: int, keys: int, head_dim: int, v_head_dim: int,
                       acc_bytes: int, banded: bool = True) -> tuple[int, int]:
    """``(forward, backward)`` bytes a softcapped block of ``rows`` queries and ``keys`` keys at ``heads`` heads
    (``batch`` samples) holds on ``math`` beyond its inputs and outputs: in bands (``sdpa``'s way), or whole
    (``banded=False``: the ``math`` backend's). ``acc_bytes``: the accumulation dtype's size (4, or 8 for float64)."""
    rows_per_band = band_rows(batch, heads, keys) if banded else rows
    band = batch * heads * min(rows_per_band, rows) * keys * acc_bytes
    forward, backward = BAND_FORWARD * band, BAND_BACKWARD * band
    if rows_per_band < rows:  # banded: k and v expanded once for every band, their gradients, the bands' dq and its cat
        expanded = batch * keys * heads * (head_dim + v_head_dim) * acc_bytes
        forward += expanded
        backward += 2 * expanded + 2 * batch * rows * heads * head_dim * acc_bytes
    return forward, backward
