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
from pathlib import Path

import numpy as np
from PIL import Image
from scipy import ndimage

# matplotlib keeps a font cache in its configuration folder (~/.config/matplotlib); a job of
# the service user may have no writable home (systemd's ProtectHome=): a folder of its own in
# the temporary directory then, instead of matplotlib's warning and a cache built per job.
if "MPLCONFIGDIR" not in os.environ and not os.access(Path.home(), os.W_OK):
    os.environ["MPLCONFIGDIR"] = str(Path(tempfile.gettempdir()) / f"matplotlib-{os.getuid()}")

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

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
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    if axes.get_legend_handles_labels()[0]:
        axes.legend(fontsize=8)
    return _png(figure)


def histogram(title: str, values: Sequence[float], x_label: str, bins: int = 20) -> bytes:
    """A histogram of ``values`` (PNG; no values: empty axes)."""
    figure, axes = _figure(title, x_label)
    if len(values):
        axes.hist(np.asarray(values, dtype=float), bins=bins, color="#1f77b4", edgecolor="white")
    axes.set_ylabel("images")
    axes.yaxis.set_major_locator(MaxNLocator(integer=True))
    return _png(figure)
