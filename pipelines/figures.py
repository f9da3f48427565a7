"""Pictures for reports: mask overlays (numpy and Pillow: an image operation) and charts
(matplotlib's object API on the Agg canvas, no pyplot state).

Everything returns PNG bytes or a ``PIL.Image``; :func:`png_uri` and :func:`data_uri` inline
them, so the HTML report needs no other file and no network.
"""

from __future__ import annotations

import base64
import io
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from html import escape
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image
from scipy import ndimage

# matplotlib keeps a font cache in its configuration folder (~/.config/matplotlib); a job of
# the service user may have no writable home (systemd's ProtectHome=): a folder of its own in
# the temporary directory then, instead of matplotlib's warning and a cache built per job.
if "MPLCONFIGDIR" not in os.environ and not os.access(Path.home(), os.W_OK):
    os.environ["MPLCONFIGDIR"] = str(Path(tempfile.gettempdir()) / f"matplotlib-{os.getuid()}")

if TYPE_CHECKING:  # matplotlib (~0.2 s of imports) only where a chart is drawn: not the
    from matplotlib.figure import Figure  # inference report's, whose histogram is SVG text

PREDICTION = (255, 140, 0)  # orange fill and outline
TRUTH = (0, 200, 255)  # cyan outline
SIZE_INCHES = (4.8, 3.0)  # at 100 dpi: 480 × 300 pixels, two charts side by side on a page
DPI = 100


# zlib's fastest level: an overlay of a 256² image is encoded in ~5 ms and ~70 KiB, where
# Pillow's ``optimize`` (the smallest file it finds) took ~58 ms for ~62 KiB; a batch's report
# draws up to six (report.OVERLAYS), the last step of every batch (on its queued → done)
PNG_LEVEL = 1


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=PNG_LEVEL)
    return buffer.getvalue()


def png_uri(png: bytes) -> str:
    """PNG bytes as a ``data:`` URI for an ``<img src>``."""
    return _uri("image/png", png)


def _uri(mime: str, data: bytes) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode("ascii")


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


def _edges(ids: np.ndarray) -> np.ndarray:
    """The pixels of objects next to (4-neighbour) a pixel of another id or background."""
    padded = np.pad(ids, 1, mode="edge")
    centre = padded[1:-1, 1:-1]
    around = (padded[:-2, 1:-1], padded[2:, 1:-1], padded[1:-1, :-2], padded[1:-1, 2:])
    return (centre > 0) & np.logical_or.reduce([side != centre for side in around])


def _picks(size: int, count: int) -> np.ndarray:
    """``count`` indices spread evenly over ``size``: the pixel under each one's centre."""
    return (2 * np.arange(count, dtype=np.intp) + 1) * size // (2 * count)


def label_overlay(grey: np.ndarray, ids: np.ndarray, max_side: int = 1024) -> Image.Image:
    """An 8-bit image in grey with its objects (``ids`` > 0, same shape) filled and outlined
    in orange, at most ``max_side`` across. Ids are picked (nearest), never averaged, and
    outlined at the size shown, so an outline stays one pixel wide and objects that touch
    stay apart."""
    scale = min(1.0, max_side / max(grey.shape))
    if scale < 1:
        height, width = (max(1, round(side * scale)) for side in grey.shape)
        grey = np.asarray(Image.fromarray(grey).resize((width, height), Image.Resampling.BOX))
        ids = ids[_picks(ids.shape[0], height)][:, _picks(ids.shape[1], width)]
    rgb = np.repeat(_stretch(grey)[..., None], 3, axis=2).astype(np.float32)
    fill = np.array(PREDICTION, dtype=np.float32)
    inside = ids > 0
    rgb[inside] = 0.65 * rgb[inside] + 0.35 * fill
    rgb[_edges(ids)] = fill
    return Image.fromarray(rgb.astype(np.uint8))


def _figure(title: str, x_label: str) -> tuple[Figure, object]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=SIZE_INCHES, dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    axes.set_title(title, fontsize=11)
    axes.set_xlabel(x_label)
    axes.grid(True, color="#e1e1e1", linewidth=0.8)
    axes.set_axisbelow(True)
    return figure, axes


def _png(figure: Figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=DPI)
    return buffer.getvalue()


def line_chart(
    title: str, series: Mapping[str, Sequence[tuple[float, float]]], x_label: str = "epoch"
) -> bytes:
    """Lines through (x, y) points, one per named series, with a legend (PNG); NaNs are
    left out."""
    figure, axes = _figure(title, x_label)
    for name, line in series.items():
        points = [(x, y) for x, y in line if math.isfinite(y)]
        if points:
            xs, ys = zip(*points, strict=True)
            axes.plot(xs, ys, marker="o", markersize=3, linewidth=1.6, label=name)
    xs_all = [x for line in series.values() for x, _ in line]
    if xs_all and all(float(x).is_integer() for x in xs_all):
        from matplotlib.ticker import MaxNLocator

        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    if axes.get_legend_handles_labels()[0]:
        axes.legend(fontsize=8)
    return _png(figure)


def histogram(title: str, values: Sequence[float], x_label: str, bins: int = 20) -> bytes:
    """A histogram of ``values`` (SVG; no values: empty axes), the size, colours and grid of the
    charts' PNGs but drawn as text: ~1 ms, where matplotlib's PNG took ~70, the largest part of
    an inference report's own time (docs/benchmarks.md)."""
    width, height = SIZE_INCHES[0] * DPI, SIZE_INCHES[1] * DPI
    left, right, top, bottom = 58.0, 12.0, 28.0, 42.0  # the axes' margins
    data = np.asarray(values, dtype=float)
    data = data[np.isfinite(data)]
    counts, edges = np.histogram(data, bins=bins) if len(data) else ([], np.array([0.0, 1.0]))
    span = float(edges[-1] - edges[0]) or 1.0
    x_low, x_high = edges[0] - 0.05 * span, edges[-1] + 0.05 * span  # matplotlib's margins
    y_high = 1.05 * max(max(counts, default=0), 1)
    inner_w, inner_h = width - left - right, height - top - bottom

    def at_x(x: float) -> float:
        return left + (x - x_low) / (x_high - x_low) * inner_w

    def at_y(y: float) -> float:
        return top + inner_h - y / y_high * inner_h

    x_ticks, y_ticks = _ticks(x_low, x_high, 8), _ticks(0.0, y_high, 6, whole=True)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:g}" height="{height:g}" '
        f'viewBox="0 0 {width:g} {height:g}" font-family="DejaVu Sans, Arial, sans-serif" '
        f'font-size="10">',
        f'<rect width="{width:g}" height="{height:g}" fill="white"/>',
        f'<text x="{left + inner_w / 2:.1f}" y="18" text-anchor="middle" font-size="11">'
        f"{escape(title)}</text>",
    ]
    labels = []  # drawn last, the grid first
    for x in x_ticks:
        parts.append(f'<line x1="{at_x(x):.1f}" x2="{at_x(x):.1f}" y1="{top:g}" '
                     f'y2="{top + inner_h:g}" stroke="#e1e1e1" stroke-width="0.8"/>')  # fmt: skip
        labels.append(f'<text x="{at_x(x):.1f}" y="{top + inner_h + 14:g}" '
                      f'text-anchor="middle">{x:g}</text>')  # fmt: skip
    for y in y_ticks:
        parts.append(f'<line x1="{left:g}" x2="{left + inner_w:g}" y1="{at_y(y):.1f}" '
                     f'y2="{at_y(y):.1f}" stroke="#e1e1e1" stroke-width="0.8"/>')  # fmt: skip
        labels.append(f'<text x="{left - 5:g}" y="{at_y(y) + 3.5:.1f}" '
                      f'text-anchor="end">{y:g}</text>')  # fmt: skip
    for count, low, high in zip(counts, edges[:-1], edges[1:], strict=False):
        parts.append(f'<rect x="{at_x(low):.2f}" y="{at_y(count):.2f}" '
                     f'width="{at_x(high) - at_x(low):.2f}" height="{at_y(0) - at_y(count):.2f}" '
                     f'fill="#1f77b4" stroke="white" stroke-width="0.8"/>')  # fmt: skip
    parts.append(f'<rect x="{left:g}" y="{top:g}" width="{inner_w:g}" height="{inner_h:g}" '
                 f'fill="none" stroke="black" stroke-width="0.8"/>')  # fmt: skip
    parts += labels
    parts.append(f'<text x="{left + inner_w / 2:.1f}" y="{height - 8:g}" '
                 f'text-anchor="middle">{escape(x_label)}</text>')  # fmt: skip
    parts.append(f'<text transform="translate(14 {top + inner_h / 2:.1f}) rotate(-90)" '
                 f'text-anchor="middle">images</text></svg>')  # fmt: skip
    return "\n".join(parts).encode("utf-8")


def svg_uri(svg: bytes) -> str:
    """SVG bytes as a ``data:`` URI for an ``<img src>`` (an image so shown runs nothing)."""
    return _uri("image/svg+xml", svg)


def _ticks(low: float, high: float, most: int, whole: bool = False) -> list[float]:
    """Round values in [``low``, ``high``], at most ``most`` steps apart, each step 1, 2, 2.5 or
    5 times a power of ten (``whole``: a whole number), as a chart's axis is marked."""
    wanted = max(high - low, 1e-12) / most
    power = 10.0 ** math.floor(math.log10(wanted))
    steps = [power * factor for factor in (1, 2, 2.5, 5, 10)]
    if whole:
        steps = [step for step in steps if step >= 1 and float(step).is_integer()] or [1.0]
    step = next((step for step in steps if step >= wanted * (1 - 1e-9)), steps[-1])
    first = math.ceil(low / step - 1e-9)
    return [k * step for k in range(first, math.floor(high / step + 1e-9) + 1)]
