"""The evaluation's pictures, drawn with Pillow (a dependency of TensorBoard; no matplotlib): the depth x length
heatmap of a task's exact match and the loss-by-position curve.

Contract: each function returns an RGB image as a ``[height, width, 3]`` uint8 numpy array, the form
TensorBoard's ``add_image(..., dataformats="HWC")`` takes; :func:`save_png` writes one to a file. Colours run
from dark purple (0) through teal to yellow (1), a viridis-like scale that reads in grey too; empty cells are grey.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

# viridis at 0, 0.25, 0.5, 0.75, 1 (matplotlib's table, rounded)
_SCALE = np.array([[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]], dtype=np.float64)
_EMPTY = (200, 200, 200)
_INK = (20, 20, 20)


def colour(value: float) -> tuple[int, int, int]:
    """The scale's colour of ``value`` in [0, 1] (clipped); grey for NaN."""
    if math.isnan(value):
        return _EMPTY
    x = min(max(value, 0.0), 1.0) * (len(_SCALE) - 1)
    i = min(int(x), len(_SCALE) - 2)
    rgb = _SCALE[i] + (x - i) * (_SCALE[i + 1] - _SCALE[i])
    return int(rgb[0]), int(rgb[1]), int(rgb[2])


def _font(size: int) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    try:
        return ImageFont.load_default(size=size)  # Pillow >= 10.1: a scalable font
    except TypeError:  # an older Pillow: its bitmap font
        return ImageFont.load_default()


def _centred(draw: ImageDraw.ImageDraw, xy: tuple[float, float], text: str, font: object,
             fill: tuple[int, int, int] = _INK) -> None:
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    draw.text((xy[0] - (right - left) / 2, xy[1] - (bottom - top) / 2 - top), text, font=font, fill=fill)


def _text_width(text: str, font: object) -> int:
    left, _, right, _ = ImageDraw.Draw(Image.new("RGB", (1, 1))).textbbox((0, 0), text, font=font)
    return int(right - left)


def _length_label(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def heatmap_image(values: Sequence[Sequence[float]], depths: Sequence[float], lengths: Sequence[int],
                  title: str) -> np.ndarray:
    """A heatmap of ``values`` ``[depth][length]`` in [0, 1], each cell with its value written in it.

    Args:
        values: one row per depth (top: the first depth), one column per length.
        depths: the rows' depths (fractions, written as percentages).
        lengths: the columns' lengths in tokens.
        title: written above the map.

    Returns:
        ``[height, width, 3]`` uint8.
    """
    cell_w, cell_h, left, top, bottom, bar = 64, 32, 86, 34, 44, 70
    rows, cols = len(depths), len(lengths)
    width, height = max(left + cols * cell_w + bar, _text_width(title, _font(13)) + 16), top + rows * cell_h + bottom
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    small, label = _font(11), _font(12)
    _centred(draw, (width / 2, 14), title, _font(13))
    for r, depth in enumerate(depths):
        y = top + r * cell_h
        _centred(draw, (left - 24, y + cell_h / 2), f"{100 * depth:.0f}%", label)
        for c in range(cols):
            v = float(values[r][c])
            x = left + c * cell_w
            fill = colour(v)
            draw.rectangle([x, y, x + cell_w - 1, y + cell_h - 1], fill=fill)
            ink = _INK if math.isnan(v) or sum(fill) > 400 else (255, 255, 255)
            _centred(draw, (x + cell_w / 2, y + cell_h / 2), "-" if math.isnan(v) else f"{v:.2f}", small, ink)
    for c, n in enumerate(lengths):
        _centred(draw, (left + c * cell_w + cell_w / 2, top + rows * cell_h + 10), _length_label(n), label)
    _centred(draw, (left + cols * cell_w / 2, height - 12), "context length (tokens)", label)
    draw.text((4, top - 16), "depth", font=label, fill=_INK)
    bar_x, bar_h = left + cols * cell_w + 18, rows * cell_h
    for i in range(bar_h):  # the scale: 1 at the top
        draw.line([bar_x, top + i, bar_x + 12, top + i], fill=colour(1 - i / max(bar_h - 1, 1)))
    draw.text((bar_x + 16, top - 6), "1", font=small, fill=_INK)
    draw.text((bar_x + 16, top + bar_h - 8), "0", font=small, fill=_INK)
    return np.asarray(image)


def curve_image(starts: Sequence[int], ends: Sequence[int], loss: Sequence[float], title: str,
                subtitle: str = "") -> np.ndarray:
    """The mean loss of each position bucket (``[starts[i], ends[i])``) as a line over the bucket's middle, under
    ``title`` and a smaller ``subtitle`` (what the loss scores).

    Returns:
        ``[height, width, 3]`` uint8; a bucket without targets (NaN) breaks the line.
    """
    width, height, left, right, top, bottom = 520, 300, 60, 20, 34 + 14 * bool(subtitle), 46
    width = max(width, _text_width(title, _font(13)) + 16, _text_width(subtitle, _font(11)) + 16)
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    small, label = _font(11), _font(12)
    _centred(draw, (width / 2, 14), title, _font(13))
    if subtitle:
        _centred(draw, (width / 2, 30), subtitle, small)
    finite = [v for v in loss if not math.isnan(v)]
    low, high = (min(finite), max(finite)) if finite else (0.0, 1.0)
    if high - low < 1e-12:
        low, high = low - 0.5, high + 0.5
    span_x = max(ends[-1] if ends else 1, 1)
    plot_w, plot_h = width - left - right, height - top - bottom

    def xy(position: float, value: float) -> tuple[float, float]:
        return left + plot_w * position / span_x, top + plot_h * (1 - (value - low) / (high - low))

    draw.rectangle([left, top, left + plot_w, top + plot_h], outline=_INK)
    for frac in (0.0, 0.5, 1.0):
        value = low + frac * (high - low)
        y = xy(0, value)[1]
        draw.line([left - 4, y, left, y], fill=_INK)
        _centred(draw, (left - 26, y), f"{value:.3g}", small)
    for position in (0, span_x // 2, span_x):
        x = xy(position, low)[0]
        draw.line([x, top + plot_h, x, top + plot_h + 4], fill=_INK)
        _centred(draw, (x, top + plot_h + 12), _length_label(int(position)), small)
    _centred(draw, (left + plot_w / 2, height - 12), "position in the document (tokens)", label)
    draw.text((4, top - 18), "mean loss (nats)", font=small, fill=_INK)
    segment: list[tuple[float, float]] = []
    for s, e, v in zip(starts, ends, loss):
        if math.isnan(v):
            _polyline(draw, segment)
            segment = []
            continue
        segment.append(xy((s + e) / 2, v))
    _polyline(draw, segment)
    return np.asarray(image)


def _polyline(draw: ImageDraw.ImageDraw, points: list[tuple[float, float]]) -> None:
    if len(points) > 1:
        draw.line(points, fill=(33, 145, 140), width=2)
    for x, y in points:
        draw.ellipse([x - 2.5, y - 2.5, x + 2.5, y + 2.5], fill=(59, 82, 139))


def save_png(image: np.ndarray, path: str | Path) -> Path:
    """Write ``image`` (``[height, width, 3]`` uint8) as a PNG file; returns its path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(image).save(path)
    return path
