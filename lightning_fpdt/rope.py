"""Rotary position embedding (RoPE) from global position ids, and its adjoint for the chunked backward."""

from __future__ import annotations

import torch
from torch import Tensor, nn


def rotate_half(x: Tensor) -> Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dimension (the Hugging Face half-split convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding from *global* position ids (the Hugging Face half-split convention).

    Angles are computed in float32 like ``transformers`` does, then cast to the activations' dtype.

    Args:
        head_dim: the size of the last dimension it rotates (even).
        theta: the base of the default frequency schedule.
        inv_freq: ``[head_dim // 2]`` inverse frequencies, for scaled variants (e.g. Llama 3); overrides ``theta``.
        attention_scaling: a factor on cos and sin (some scaled variants use it).

    Raises:
        ValueError: ``inv_freq`` is not of shape ``[head_dim // 2]``.
    """

    def __init__(
        self, head_dim: int, theta: float = 10000.0, inv_freq: Tensor | None = None, attention_scaling: float = 1.0
    ) -> None:
        super().__init__()
        self.head_dim, self.theta, self.attention_scaling = head_dim, theta, attention_scaling
        if inv_freq is None:  # the default schedule; scaled variants (e.g. Llama 3) come in as inv_freq
            inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        if inv_freq.shape != (head_dim // 2,):
            raise ValueError(
                f"RotaryEmbedding: inv_freq has shape {tuple(inv_freq.shape)}, expected ({head_dim // 2},)."
            )
        self.register_buffer("inv_freq", inv_freq.float().clone(), persistent=False)

    def _cos_sin(self, position_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = position_ids.float().unsqueeze(-1) * self.inv_freq.float()  # [b, s, d/2]
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(2)  # [b, s, 1, d]
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)

    def forward(self, x: Tensor, position_ids: Tensor) -> Tensor:
        """``x`` ``[batch, seq, heads, head_dim]``, ``position_ids`` ``[batch, seq]`` (global positions)."""
        cos, sin = self._cos_sin(position_ids, x.dtype)
        return x * cos + rotate_half(x) * sin

    def transpose(self, dy: Tensor, position_ids: Tensor) -> Tensor:
        """The adjoint of :meth:`forward` (it is linear in ``x``): the gradient with respect to ``x``.

        ``rotate_half`` maps ``[x1, x2]`` to ``[-x2, x1]``; its adjoint maps ``[y1, y2]`` to ``[y2, -y1]``.
        """
        cos, sin = self._cos_sin(position_ids, dy.dtype)
        y1, y2 = (dy * sin).chunk(2, dim=-1)
        return dy * cos + torch.cat((y2, -y1), dim=-1)
