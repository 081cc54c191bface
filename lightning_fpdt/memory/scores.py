"""The bytes of attention scores where a route materializes them: ``math`` on every block, and a route whose kernels
cannot cap the logits (``sdpa``; ``cudnn`` and ``auto`` without a FlashAttention package) on a softcapped block,
which runs on ``math`` in bands of query rows (:class:`~lightning_fpdt.attention.math_kernel.MathKernel`'s
``forward_in_bands``/``backward_in_bands``, at most ``MATH_BAND_SCORES`` scores a band).

Counted as measured (``tests/test_memory_scores.py``: a block's forward and backward under a tensor tracker, and a
Gemma-2 training step): at its peak a band's forward holds about four tensors of the band's scores (scores, the cap's
tanh, the softmax's argument and probabilities, the products' temporaries), its backward seven (those, dP and dS's
factors); with more than one band, the block's k and v at q's head count in the accumulation dtype, their gradients,
and the bands' dq with their concatenation besides.
"""

from __future__ import annotations

from lightning_fpdt.attention.math_kernel import MATH_BAND_SCORES
from lightning_fpdt.backends import FLASH_PACKAGES, flash_route

BAND_FORWARD = 4  # band-sized tensors live at once in a capped band's forward
BAND_BACKWARD = 7  # and in its backward


def caps_in_kernel(backend: str, half: bool) -> bool:
    """Whether ``backend`` computes a softcapped block in a fused kernel (a FlashAttention package's, which takes the
    cap) rather than on ``math``. ``sdpa`` and ``math`` never do; ``cudnn`` and ``auto`` pass such blocks to the
    FlashAttention package ``auto`` would take (:func:`~lightning_fpdt.backends.flash_route`), in half precision
    (``half``), where one is installed and usable here."""
    if backend in FLASH_PACKAGES or backend == "flash_attn":
        return True
    return backend in ("auto", "cudnn") and half and flash_route("cuda") != "sdpa"


def capped_block_bytes(batch: int, heads: int, rows: int, keys: int, head_dim: int, v_head_dim: int,
                       acc_bytes: int) -> tuple[int, int]:
    """``(forward, backward)`` bytes a softcapped block of ``rows`` queries and ``keys`` keys at ``heads`` heads
    (``batch`` samples) holds on ``math`` in bands, beyond its inputs and outputs; ``acc_bytes``: the accumulation
    dtype's size (4, or 8 for float64)."""
    band_rows = max(1, MATH_BAND_SCORES // max(1, batch * heads * keys))
    band = batch * heads * min(band_rows, rows) * keys * acc_bytes
    forward, backward = BAND_FORWARD * band, BAND_BACKWARD * band
    if band_rows < rows:  # banded: k and v expanded once for every band, their gradients, the bands' dq and its cat
        expanded = batch * keys * heads * (head_dim + v_head_dim) * acc_bytes
        forward += expanded
        backward += 2 * expanded + 2 * batch * rows * heads * head_dim * acc_bytes
    return forward, backward
