"""Pictures for reports, drawn with Pillow: mask overlays, line charts and histograms.

Everything returns a ``PIL.Image``; :func:`data_uri` turns one into an inline PNG so the HTML
report needs no other file and no network.
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Mapping, Sequence

import numpy as np
from PIL import Image, ImageDraw, ImageFont
from scipy import ndimage

PREDICTION = (255, 140, 0)  # orange fill and outline
TRUTH = (0, 200, 255)  # cyan outline
PALETTE = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189)]
_INK = (40, 40, 40)
_GRID = (225, 225, 225)


def _font(size: int = 12) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    return ImageFont.load_default(size)


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", optimize=True)
    return buffer.getvalue()


def png_uri(png: bytes) -> str:
    """PNG bytes as a ``data:`` URI for an ``<img src>``."""
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def data_uri(image: Image.Image) -> str:
    return png_uri(png_bytes(image))


def _outline(mask: np.ndarray) -> np.ndarray:
    return mask & ~ndimage.binary_erosion(mask)


def _stretch(image: np.ndarray) -> np.ndarray:
    """Contrast-stretch a [0, 1] image to uint8 for display (0.5–99.5 percentiles)."""
    low, high = np.percentile(image, (0.5, 99.5))
    scaled = (image - low) / max(float(high - low), 1e-6)
    return (np.clip(scaled, 0, 1) * 255).astype(np.uint8)


def _rescale(image: Image.Image, max_side: int, nearest: bool) -> Image.Image:
    scale = max_side / max(image.size)
    if scale >= 2:  # enlarge small images by a whole factor so outlines stay crisp
        factor = min(int(scale), 4)
        return image.resize((image.width * factor, image.height * factor), Image.Resampling.NEAREST)
    if scale < 1:
        size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
        method = Image.Resampling.NEAREST if nearest else Image.Resampling.BOX
        return image.resize(size, method)
    return image


def overlay(
    image: np.ndarray, mask: np.ndarray, truth: np.ndarray | None = None, max_side: int = 256
) -> Image.Image:
    """The image in grey, the mask filled and outlined in orange, ground truth outlined cyan."""
    rgb = np.repeat(_stretch(image)[..., None], 3, axis=2).astype(np.float32)
    fill = np.array(PREDICTION, dtype=np.float32)
    rgb[mask] = 0.65 * rgb[mask] + 0.35 * fill
    rgb[_outline(mask)] = fill
    if truth is not None:
        rgb[_outline(truth)] = TRUTH
    return _rescale(Image.fromarray(rgb.astype(np.uint8)), max_side, nearest=False)


def _ticks(low: float, high: float, count: int = 5, integer: bool = False) -> list[float]:
    """Round tick values covering [low, high] (whole numbers only if ``integer``)."""
    if high <= low:
        high = low + 1.0
    raw = (high - low) / count
    step = 10 ** math.floor(math.log10(raw))
    step *= next(m for m in (1, 2, 2.5, 5, 10) if m * step >= raw)
    step = max(step, 1.0) if integer else step
    ticks = [math.floor(low / step) * step]
    while ticks[-1] < high - 1e-9 * step:
        ticks.append(round(ticks[-1] + step, 10))
    return ticks


def _label(value: float) -> str:
    return f"{value:g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.1e}"


class _Axes:
    """Maps data coordinates to pixels inside a framed plot area."""

    def __init__(self, draw: ImageDraw.ImageDraw, box: tuple[int, int, int, int]) -> None:
        self.draw, self.box = draw, box
        self.x_range = self.y_range = (0.0, 1.0)

    def point(self, x: float, y: float) -> tuple[float, float]:
        left, top, right, bottom = self.box
        (x0, x1), (y0, y1) = self.x_range, self.y_range
        return (
            left + (x - x0) / (x1 - x0 or 1) * (right - left),
            bottom - (y - y0) / (y1 - y0 or 1) * (bottom - top),
        )

    def frame(self, x_ticks: list[float], y_ticks: list[float]) -> None:
        font = _font(11)
        self.x_range = (x_ticks[0], x_ticks[-1])
        self.y_range = (y_ticks[0], y_ticks[-1])
        left, _, right, bottom = self.box
        for y in y_ticks:
            _, py = self.point(x_ticks[0], y)
            self.draw.line([(left, py), (right, py)], fill=_GRID)
            self.draw.text((left - 4, py), _label(y), fill=_INK, font=font, anchor="rm")
        for x in x_ticks:
            px, _ = self.point(x, y_ticks[0])
            self.draw.text((px, bottom + 4), _label(x), fill=_INK, font=font, anchor="mt")
        self.draw.rectangle(self.box, outline=_INK)


def _canvas(title: str, size: tuple[int, int]) -> tuple[Image.Image, _Axes]:
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    draw.text((size[0] // 2, 6), title, fill=_INK, font=_font(14), anchor="mt")
    return image, _Axes(draw, (56, 30, size[0] - 16, size[1] - 40))


def line_chart(
    title: str,
    series: Mapping[str, Sequence[tuple[float, float]]],
    x_label: str = "epoch",
    size: tuple[int, int] = (480, 300),
) -> Image.Image:
    """Lines through (x, y) points, one per named series, with a legend; NaNs are skipped."""
    points = {k: [(x, y) for x, y in v if math.isfinite(y)] for k, v in series.items()}
    xs = [x for line in points.values() for x, _ in line] or [0.0, 1.0]
    ys = [y for line in points.values() for _, y in line] or [0.0, 1.0]
    image, axes = _canvas(title, size)
    whole = all(float(x).is_integer() for x in xs)
    axes.frame(_ticks(min(xs), max(xs), integer=whole), _ticks(min(ys), max(ys)))
    draw, font = axes.draw, _font(11)
    for index, (name, line) in enumerate(points.items()):
        colour = PALETTE[index % len(PALETTE)]
        pixels = [axes.point(x, y) for x, y in line]
        if len(pixels) > 1:
            draw.line(pixels, fill=colour, width=2)
        for px, py in pixels:
            draw.ellipse([px - 2, py - 2, px + 2, py + 2], fill=colour)
        legend_y = axes.box[1] + 6 + 14 * index
        draw.line(
            [(axes.box[2] - 110, legend_y), (axes.box[2] - 92, legend_y)], fill=colour, width=2
        )
        draw.text((axes.box[2] - 88, legend_y), name, fill=_INK, font=font, anchor="lm")
    draw.text((size[0] // 2, size[1] - 6), x_label, fill=_INK, font=font, anchor="mb")
    return image


def histogram(
    title: str,
    values: Sequence[float],
    x_label: str,
    bins: int = 20,
    size: tuple[int, int] = (480, 300),
) -> Image.Image:
    """Bar histogram of ``values`` (empty input draws empty axes)."""
    counts, edges = np.histogram(np.asarray(values, dtype=float) if len(values) else [0.0], bins)
    if not len(values):
        counts[:] = 0
    image, axes = _canvas(title, size)
    axes.frame(_ticks(float(edges[0]), float(edges[-1])), _ticks(0, max(int(counts.max()), 1)))
    for count, start, end in zip(counts, edges[:-1], edges[1:], strict=True):
        if count:
            (x0, y0), (x1, y1) = axes.point(start, count), axes.point(end, 0)
            axes.draw.rectangle([x0 + 1, y0, x1 - 1, y1], fill=PALETTE[0])
    axes.draw.text((size[0] // 2, size[1] - 6), x_label, fill=_INK, font=_font(11), anchor="mb")
    return image
