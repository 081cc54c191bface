"""Rotary position embedding (RoPE) from global position ids, and its adjoint for the chunked backward; the
scaled frequency schedules for context extension (linear, Llama 3, YaRN) as transformers computes them."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

import torch
from torch import Tensor, nn

from lightning_fpdt.errors import FPDTError, Unsupported

RopeType = Literal["linear", "llama3", "yarn"]
# the fields each type reads (besides rope_type); the first ones listed are required
_REQUIRED: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
    "yarn": ("factor", "original_max_position_embeddings"),
}
_OPTIONAL: dict[str, tuple[str, ...]] = {
    "linear": (),
    "llama3": (),
    "yarn": ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate"),
}


@dataclass
class RopeScaling:
    """A scaled RoPE frequency schedule for context extension, with transformers' ``rope_parameters`` names.

    Attributes:
        rope_type: ``"linear"`` (every frequency divided by ``factor``), ``"llama3"`` (low frequencies divided by
            ``factor``, high ones kept, a smooth ramp between) or ``"yarn"`` (YaRN: per-frequency ramp between
            interpolation and extrapolation, and an attention scaling on cos and sin).
        factor: how many times the original context the model is extended to (>= 1).
        original_max_position_embeddings: the pre-training context (``llama3`` and ``yarn``).
        low_freq_factor: ``llama3``: wavelengths above ``original / low_freq_factor`` are divided by ``factor``.
        high_freq_factor: ``llama3``: wavelengths below ``original / high_freq_factor`` are kept.
        beta_fast: ``yarn``: the rotation count bounding extrapolation (``None``: 32).
        beta_slow: ``yarn``: the rotation count bounding interpolation (``None``: 1).
        attention_factor: ``yarn``: the factor on cos and sin (``None``: ``0.1 ln(factor) + 1``, or the
            ``mscale`` / ``mscale_all_dim`` ratio when both are set).
        mscale: ``yarn``: DeepSeek's numerator of the attention factor.
        mscale_all_dim: ``yarn``: DeepSeek's denominator of the attention factor.
        truncate: ``yarn``: round the correction range outward to whole dimensions (``None``: true).

    Raises:
        ValueError: an unknown ``rope_type``, a ``factor`` below 1, a field the type needs missing, or a field
            the type does not read set.
    """

    rope_type: RopeType
    factor: float
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in _REQUIRED:
            raise FPDTError(f"RopeScaling: rope_type {self.rope_type!r} is not one of {sorted(_REQUIRED)}.")
        required, optional = _REQUIRED[self.rope_type], _OPTIONAL[self.rope_type]
        missing = [name for name in required if getattr(self, name) is None]
        if missing:
            raise FPDTError(f"RopeScaling: rope_type {self.rope_type!r} needs {missing}.")
        unused = [f.name for f in fields(self)
                  if f.name not in ("rope_type", *required, *optional) and getattr(self, f.name) is not None]
        if unused:
            raise FPDTError(
                f"RopeScaling: rope_type {self.rope_type!r} does not read {unused}; it reads {[*required, *optional]}."
            )
        if self.factor < 1:
            raise FPDTError(f"RopeScaling: factor must be >= 1 (an extension), got {self.factor}.")
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise FPDTError(
                f"RopeScaling: llama3 needs high_freq_factor > low_freq_factor, got {self.high_freq_factor}"
                f" and {self.low_freq_factor}."
            )

    def to_hf(self) -> dict[str, Any]:
        """The set fields as transformers' ``rope_parameters`` entries (without ``rope_theta``)."""
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_hf(cls, parameters: dict[str, Any]) -> RopeScaling | None:
        """From transformers' ``rope_parameters`` (or ``rope_scaling``); ``None`` for the unscaled schedule.

        Raises:
            NotImplementedError: a type other than ``default``, ``linear``, ``llama3`` and ``yarn`` (``dynamic``
                and ``longrope`` change the frequencies with the sequence length).
        """
        rope_type = parameters.get("rope_type", parameters.get("type", "default"))
        if rope_type == "default":
            return None
        if rope_type not in _REQUIRED:
            raise Unsupported(
                f"RoPE type {rope_type!r} is not supported by the own models; use linear, llama3 or yarn."
            )
        keys = set(_REQUIRED[rope_type]) | set(_OPTIONAL[rope_type])
        return cls(rope_type=rope_type, **{k: v for k, v in parameters.items() if k in keys and v is not None})

    @classmethod
    def of_hf(cls, config: Any) -> RopeScaling | None:
        """The schedule of a ``transformers`` config's ``rope_parameters`` (YaRN without a ``factor`` takes
        transformers' fallback, ``max_position_embeddings / original_max_position_embeddings``).

        Raises:
            NotImplementedError: as :meth:`from_hf`.
        """
        parameters = dict(getattr(config, "rope_parameters", None) or {})
        if parameters.get("rope_type") == "yarn" and parameters.get("factor") is None:
            parameters["factor"] = config.max_position_embeddings / parameters["original_max_position_embeddings"]
        return cls.from_hf(parameters)


def rope_theta_of(config: Any) -> float:
    """The RoPE base of a ``transformers`` config (transformers >= 5 keeps it in ``rope_parameters``)."""
    theta = getattr(config, "rope_theta", None)
    if theta is None:
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return float(theta)


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> tuple[Tensor, float]:
    """RoPE's inverse frequencies ``[head_dim // 2]`` (float32) and the factor on cos and sin, computed with
    the same float32 operations as transformers' ``ROPE_INIT_FUNCTIONS`` (so the two agree bit for bit).

    Args:
        head_dim: the rotated size (even).
        theta: the base of the schedule.
        scaling: a scaled schedule; ``None``: the default one (factor 1).
    """
    # the exponents in float32, as transformers forms them (the float64 schedule differs by ~1e-7)
    base_powers = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)  # [head_dim // 2]
    inv_freq = 1.0 / base_powers
    if scaling is None:
        return inv_freq, 1.0
    factor = scaling.factor
    if scaling.rope_type == "linear":
        return inv_freq / factor, 1.0
    original = scaling.original_max_position_embeddings
    if scaling.rope_type == "llama3":
        low_wavelen, high_wavelen = original / scaling.low_freq_factor, original / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)  # long wavelengths: interpolated
        ramp = (original / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        blended = (1 - ramp) * scaled / factor + ramp * scaled
        between = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(between, blended, scaled), 1.0
    # yarn: frequencies that rotate fewer than beta_slow times over the original context are interpolated, more
    # than beta_fast times kept, a linear ramp over the dimensions between (arXiv:2309.00071, eq. 23)
    def dimension_of(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension_of(scaling.beta_fast or 32), dimension_of(scaling.beta_slow or 1)
    if scaling.truncate is None or scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (the original frequency), 0: interpolate (divided by factor)
    inv_freq = (1.0 / (factor * base_powers)) * (1 - keep) + inv_freq * keep
    return inv_freq, _yarn_attention_factor(scaling)


def _yarn_attention_factor(scaling: RopeScaling) -> float:
    if scaling.attention_factor is not None:
        return float(scaling.attention_factor)

    def mscale(scale: float, weight: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * weight * math.log(scale) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return float(mscale(scaling.factor, scaling.mscale) / mscale(scaling.factor, scaling.mscale_all_dim))
    return mscale(scaling.factor)


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
            raise FPDTError(
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
