"""Tiled sliding-window inference for images too large for memory (whole-slide images).

The input TIFF (tiled or stripped, any compression tifffile decodes, 8/16-bit, grey or RGB) is
read lazily: a window decodes only the tiles it overlaps, kept in a small cache. Windows of
``window``² pixels overlap by ``overlap``; their probabilities are blended with a linear ramp
(weights fall towards a window's edges, so a seam gets the average of both neighbours, mostly
from the one that saw it in the middle). Rows of the result are final as soon as the last
window over them ran, so the image streams through in bands.

Each band is thresholded and labelled (8-connected); components crossing a band border are
joined with a union-find whose roots carry their area, intensity, centroid sums and bounding
box. The bands' provisional ids go to an OME-Zarr label image as they come
(:mod:`pipelines.omezarr`); once the last band is labelled, the stored chunks are mapped to the
final object ids (components smaller than ``min_area`` become background), the pyramid is
built, and the per-object table comes from the roots. The label image is built in a temporary
folder of the held masks folder and renamed into place.

Memory grows with the image's width, never its height: per column, the blend's ``window``
rows of float32, a TILE-row band of probabilities, grey and labels (float32, int32), a chunk
row of ids (uint32) and the decoded tiles of about ``window`` + 3 tiles' rows, kept as
decoded (one byte a pixel for 8-bit grey): about 8.5 kB a column for 512² windows, so 0.85 GB
at 100,000 wide besides the interpreter, torch and the net. No step makes a band-sized
temporary, and the heap's freed memory is handed back after each row of windows (the infer
job's progress calls :func:`pipelines.job.give_back_freed_memory`).
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent import futures
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import numpy as np
import tifffile
from scipy import ndimage

from daemon.contract.heldfolder import HeldFolder, temporary_name
from pipelines.channels import ChannelProblem, plane_page
from pipelines.layout import LABEL_IMAGE_SUFFIX, OBJECT_COLUMNS, image_stats
from pipelines.omezarr import CHUNK, LabelImage, RowWriter, overview_step, work_array
from pipelines.tissue import MAX_LEVEL_PIXELS, TissueMask, Windows, any_within

TILE = 256  # the mask's TIFF tiles (and the band height of the statistics)
_EIGHT = np.ones((3, 3), dtype=bool)
_LUMA = np.array([0.299, 0.587, 0.114], dtype=np.float32)
_NORM_ROWS = 32  # rows of a band normalised at once (the temporary is this many rows wide)
_MEASURE_ROWS = 32  # rows of a band whose pixels are measured at once

log = logging.getLogger("pipelines")

Predict = Callable[[np.ndarray], np.ndarray]  # (N, h, w) grey → (N, h, w) probabilities
Progress = Callable[[int, int], None]  # (window rows done, window rows in all)


class Regions:
    """Rectangular regions of an image's plane as float32 grey in [0, 1], read lazily: a
    segment (a TIFF's tile or strip, a Zarr chunk) is decoded when a region first needs it and
    kept, as decoded, among the last few rows of segments. A reader of a format gives its
    segments (:meth:`_decode`), the tissue mask where it has a reduced level, and which
    segments are stored where one may be absent (a Zarr store leaves out a chunk of its fill
    value only).

    Given a ``pool`` of threads, and where its format's segments may be decoded in several
    threads at once (``parallel``), the segments of regions asked for ahead
    (:meth:`prefetch`) are decoded there while the caller works on others."""

    height: int
    width: int
    tissue: TissueMask | None = None
    stored: np.ndarray | None = None  # the segments stored, as a summed-area table
    pool: Executor | None = None
    parallel = False

    def _layout(
        self, height: int, width: int, seg_h: int, seg_w: int, dtype: Any, cache_pixel_rows: int
    ) -> None:
        """The image's size, its segments' (row-major, ``across`` in a row), its samples'
        type, and a cache of enough whole rows of segments for ``cache_pixel_rows`` rows."""
        self.height, self.width, self.seg_h, self.seg_w = height, width, seg_h, seg_w
        self.across = math.ceil(width / seg_w)
        self.scale = np.float32(np.iinfo(dtype).max) if np.dtype(dtype).kind == "u" else None
        self.cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self.cache_size = (math.ceil(cache_pixel_rows / seg_h) + 1) * self.across
        self.ahead: dict[int, Future[np.ndarray]] = {}  # segments decoding on the pool

    def _decode(self, index: int) -> np.ndarray:
        """Segment ``index`` (row-major) as decoded: (rows, columns, samples)."""
        raise NotImplementedError

    def _tissue_of(self, level: np.ndarray) -> TissueMask | None:
        """The tissue mask from a reduced level's decoded samples (rows, columns, samples)."""
        mask = TissueMask.of_level(self.grey(level), self.height, self.width, self.tolerance)
        log.info("tissue mask from the %dx%d level: glass grey %.3f, tissue %.1f %% of the slide",
                 level.shape[1], level.shape[0], mask.glass, 100 * mask.fraction)  # fmt: skip
        return mask

    tolerance = 0.0  # the glass's grey within this is glass (pipelines.tissue)

    def has_tissue(self, top: int, bottom: int, left: int, right: int) -> bool:
        """Whether the rows ``top:bottom``, columns ``left:right`` are worth running the net
        on: they touch a stored segment (where a reader tells), and tissue (where there is a
        tissue mask). A segment that is not stored holds its fill value only: not an image."""
        if self.stored is not None:
            rows = (top // self.seg_h, -(-min(bottom, self.height) // self.seg_h))
            columns = (left // self.seg_w, -(-min(right, self.width) // self.seg_w))
            if not any_within(self.stored, rows, columns):
                return False
        return self.tissue is None or self.tissue.any(top, bottom, left, right)

    def close(self) -> None:
        for ahead in self.ahead.values():  # (they read the file: done before it closes)
            ahead.cancel()
        futures.wait(self.ahead.values())
        self.ahead.clear()
        self.cache.clear()

    def prefetch(self, boxes: Iterable[tuple[int, int, int, int]]) -> None:
        """Start decoding on the pool the segments that regions (top, bottom, left, right)
        will need and that are neither decoded nor under way (nothing without a pool)."""
        if self.pool is None or not self.parallel:
            return
        for top, bottom, left, right in boxes:
            for row in range(top // self.seg_h, (bottom - 1) // self.seg_h + 1):
                for col in range(left // self.seg_w, (right - 1) // self.seg_w + 1):
                    index = row * self.across + col
                    if index not in self.cache and index not in self.ahead:
                        self.ahead[index] = self.pool.submit(self._decode, index)

    def _segment(self, index: int) -> np.ndarray:
        if index in self.cache:
            self.cache.move_to_end(index)
            return self.cache[index]
        # kept as decoded (a quarter of its float32 grey for 8-bit grey), made grey per read
        ahead = self.ahead.pop(index, None)
        segment = ahead.result() if ahead is not None else self._decode(index)
        self.cache[index] = segment
        if len(self.cache) > self.cache_size:
            self.cache.popitem(last=False)
        return segment

    def grey(self, pixels: np.ndarray) -> np.ndarray:
        """Decoded samples (rows, columns, samples) of the plane as float32 grey in [0, 1]."""
        if self.scale is None:
            raise ValueError(f"{pixels.dtype} samples; only 8- and 16-bit unsigned are supported")
        if pixels.shape[-1] >= 3:
            return (pixels[..., :3].astype(np.float32) @ _LUMA) / self.scale
        return pixels[..., 0].astype(np.float32) / self.scale

    def region(
        self, top: int, bottom: int, left: int, right: int, glass_unread: bool = False
    ) -> np.ndarray:
        """Rows ``top:bottom``, columns ``left:right``. ``glass_unread``: a segment that
        touches no tissue is not decoded but given as the glass's grey: for the overview and
        the objects' measures, never for the net (an object the net found on such a segment,
        from a window that touched tissue elsewhere, is measured against that grey)."""
        out = np.empty((bottom - top, right - left), dtype=np.float32)
        for row in range(top // self.seg_h, (bottom - 1) // self.seg_h + 1):
            for col in range(left // self.seg_w, (right - 1) // self.seg_w + 1):
                y0, x0 = row * self.seg_h, col * self.seg_w
                tissue = self.tissue if glass_unread else None
                if tissue is not None and not tissue.any(y0, y0 + self.seg_h, x0, x0 + self.seg_w):
                    ys = slice(max(top, y0) - top, min(bottom, y0 + self.seg_h) - top)
                    xs = slice(max(left, x0) - left, min(right, x0 + self.seg_w) - left)
                    out[ys, xs] = tissue.glass
                    continue
                seg = self.grey(self._segment(row * self.across + col))
                ys = slice(max(top, y0), min(bottom, y0 + seg.shape[0], self.height))
                xs = slice(max(left, x0), min(right, x0 + seg.shape[1], self.width))
                out[ys.start - top : ys.stop - top, xs.start - left : xs.stop - left] = seg[
                    ys.start - y0 : ys.stop - y0, xs.start - x0 : xs.stop - x0
                ]
        return out


class RegionReader(Regions):
    """Rectangular regions of a TIFF's plane, decoded a tile or strip at a time (each read with
    ``pread``, so several threads may decode at once)."""

    parallel = True

    def __init__(
        self, source: Path | BinaryIO, cache_pixel_rows: int = 4 * TILE, channel: Any = None,
        glass_tolerance: float = 0.0, name: str = "",
    ) -> None:  # fmt: skip
        """``source``: a path, or a file open for reading at the TIFF's start (the caller
        opened it by the batch folder's rule and closes it; ``name``, its file's name, tells an
        NDPI from a TIFF, as tifffile knows one by its suffix). ``channel``: the plane of a
        multi-channel TIFF (:mod:`pipelines.channels`; raises ChannelProblem).
        ``glass_tolerance``: above 0, windows over glass only are skipped
        (:mod:`pipelines.tissue`), where the TIFF has a reduced level to tell."""
        # A file opened by descriptor is named by its number, which tifffile cannot split.
        name = source.name if isinstance(source, Path) else Path(name or "input.tif").name
        self.at = 0 if isinstance(source, Path) else source.tell()  # where the TIFF starts
        self.tif = tifffile.TiffFile(source, name=name)
        try:
            page = plane_page(self.tif, channel)
        except ChannelProblem:
            self.tif.close()
            raise
        assert isinstance(page, tifffile.TiffPage)
        if page.planarconfig == tifffile.PLANARCONFIG.SEPARATE and page.samplesperpixel > 1:
            self.tif.close()
            raise ValueError("planar (separate) RGB TIFFs cannot be read by tiles")
        self.page = page
        try:
            self.fd: int | None = self.tif.filehandle.fileno()
        except OSError:  # a file in memory: read from one thread
            self.fd, self.parallel = None, False
        height = page.imagelength
        seg_h = page.tilelength if page.is_tiled else min(page.rowsperstrip, height)
        # Uncompressed strips (a single one, as ImageJ writes them) are read a band of rows
        # at a time from where they lie: never a whole strip of a huge image in memory.
        self.by_rows = not page.is_tiled and page.compression == 1 and page.predictor == 1
        if self.by_rows:
            seg_h = min(seg_h, TILE)
        seg_w = page.tilewidth if page.is_tiled else page.imagewidth
        self._layout(height, page.imagewidth, seg_h, seg_w, page.dtype, cache_pixel_rows)
        self.tolerance = glass_tolerance
        self.tissue = self._tissue(channel) if glass_tolerance > 0 else None

    def _tissue(self, channel: Any) -> TissueMask | None:
        """The tissue mask of the pyramid's smallest level, if it has a small enough one."""
        level = plane_page(self.tif, channel, -1)
        if not isinstance(level, tifffile.TiffPage) or level.imagelength == self.height:
            log.info("no reduced level to find the tissue in: every window runs")
            return None
        if level.imagelength * level.imagewidth > MAX_LEVEL_PIXELS:
            log.info("smallest level %dx%d too large to read whole: every window runs",
                     level.imagewidth, level.imagelength)  # fmt: skip
            return None
        pixels = np.asarray(level.asarray())
        return self._tissue_of(pixels.reshape(*pixels.shape[:2], -1))

    def close(self) -> None:
        super().close()
        self.tif.close()

    def _decode(self, index: int) -> np.ndarray:
        if self.by_rows:
            top = index * self.seg_h
            return self._rows(top, min(top + self.seg_h, self.height))
        data = self._read(self.page.dataoffsets[index], self.page.databytecounts[index])
        # an NDPI's tile is a restart interval of its level's one JPEG, under that header
        decoded, _, _ = self.page.decode(data, index, jpegtables=self.page.jpegtables,
                                         jpegheader=self.page.jpegheader)  # fmt: skip
        return np.asarray(decoded)[0]

    def _read(self, offset: int, count: int) -> bytes:
        """``count`` bytes at ``offset`` of the TIFF (short at its end), from any thread where
        it lies in a file."""
        if self.fd is None:
            self.tif.filehandle.seek(offset)
            return bytes(self.tif.filehandle.read(count))
        parts, at = [], self.at + offset
        while count > 0:
            data = os.pread(self.fd, count, at)
            if not data:
                break
            parts.append(data)
            at, count = at + len(data), count - len(data)
        return b"".join(parts)

    def _rows(self, top: int, bottom: int) -> np.ndarray:
        """Rows ``top:bottom`` of an uncompressed stripped page, (rows, width, samples)."""
        page = self.page
        dtype = np.dtype(page.dtype).newbyteorder(self.tif.byteorder)
        row_bytes = self.width * page.samplesperpixel * dtype.itemsize
        rows_per_strip = min(page.rowsperstrip, self.height)
        parts, row = [], top
        while row < bottom:
            strip, first = divmod(row, rows_per_strip)
            count = min(bottom - row, rows_per_strip - first)
            parts.append(self._read(page.dataoffsets[strip] + first * row_bytes, count * row_bytes))
            row += count
        data = b"".join(parts)
        if len(data) != (bottom - top) * row_bytes:
            raise ValueError(f"the strips end before row {bottom} (the file is cut short)")
        return np.frombuffer(data, dtype).reshape(bottom - top, self.width, -1)


def starts(length: int, window: int, stride: int) -> list[int]:
    """Window start positions covering ``length`` (the last one flush with the end)."""
    if length <= window:
        return [0]
    found = list(range(0, length - window + 1, stride))
    return found if found[-1] == length - window else [*found, length - window]


def ramp(size: int, overlap: int) -> np.ndarray:
    """Blend weights along one side of a window: a linear ramp over ``overlap`` at each end."""
    position = np.minimum(np.arange(size) + 0.5, size - np.arange(size) - 0.5)
    return np.clip(position / max(overlap, 1), 1e-3, 1.0).astype(np.float32)


def coverage(length: int, window: int, positions: list[int], overlap: int) -> np.ndarray:
    total = np.zeros(length, dtype=np.float32)
    weights = ramp(min(window, length), overlap)
    for start in positions:
        total[start : start + len(weights)] += weights
    return total


def probability_bands(
    reader: Regions,
    predict: Predict,
    window: int,
    overlap: int,
    batch: int,
    progress: Progress | None = None,
    rows_wanted: tuple[int, int] | None = None,
    windows: Windows | None = None,
) -> Iterator[tuple[int, np.ndarray]]:
    """(first row, blended probabilities) for consecutive bands of rows, top to bottom: of
    the whole image, or of its rows ``rows_wanted`` (first, end). Windows lie on the whole
    image's grid and only those over the rows wanted run, so those rows come out exactly as
    in the whole image's run (a region's halo is the windows that reach into it). Windows
    over glass only (:meth:`Regions.has_tissue`) are not run: they add nothing. The
    windows whose top lies in the rows wanted are counted in ``windows`` (a halo's windows run
    again in the region above, but count there only)."""
    height, width = reader.height, reader.width
    first, end = rows_wanted or (0, height)
    win_h, win_w = min(window, height), min(window, width)
    stride = max(window - overlap, 1)
    rows, cols = starts(height, window, stride), starts(width, window, stride)
    weight = ramp(win_h, overlap)[:, None] * ramp(win_w, overlap)[None, :]
    norm_x = coverage(width, window, cols, overlap)
    norm_y = coverage(height, window, rows, overlap)
    acc = np.zeros((win_h, width), dtype=np.float32)
    over = [r for r, top in enumerate(rows) if top < end and top + win_h > first]
    windows = windows if windows is not None else Windows()

    def tissue(top: int) -> list[int]:
        return [x for x in cols if reader.has_tissue(top, top + win_h, x, x + win_w)]

    ahead = [] if not over else tissue(rows[over[0]])
    for done_windows, r in enumerate(over, start=1):
        top = rows[r]
        run = ahead
        reader.prefetch((top, top + win_h, x, x + win_w) for x in run)
        if done_windows < len(over):  # the next row's tiles decode while this row runs
            following = rows[over[done_windows]]
            ahead = tissue(following)
            reader.prefetch((following, following + win_h, x, x + win_w) for x in ahead)
        if first <= top < end:  # counted by the region its top lies in: once per image
            windows.run += len(run)
            windows.glass += len(cols) - len(run)
        for start in range(0, len(run), batch):
            chunk = run[start : start + batch]
            tiles = np.stack([reader.region(top, top + win_h, x, x + win_w) for x in chunk])
            for x, prob in zip(chunk, predict(tiles), strict=True):
                acc[:, x : x + win_w] += prob * weight
        if progress is not None:
            progress(done_windows, len(over))
        done = rows[r + 1] - top if r + 1 < len(rows) else win_h
        low, high = max(top, first), min(top + done, end)
        if low < high:  # rows above the region (its halo) and below it are not given
            band = acc[low - top : high - top]
            for row in range(0, len(band), _NORM_ROWS):  # in place: no band-sized temporary
                stop = min(row + _NORM_ROWS, len(band))
                band[row:stop] /= norm_y[low + row : low + stop, None] * norm_x[None, :]
            yield low, band
        acc[: win_h - done] = acc[done:]
        acc[win_h - done :] = 0


def rebanded(bands: Iterator[tuple[int, np.ndarray]]) -> Iterator[np.ndarray]:
    """The same rows regrouped into bands of exactly TILE rows (the last one shorter), copied
    into one buffer: a band given is valid until the next is asked for, and a band it is
    given may be overwritten once it asks for the next (as :func:`probability_bands` does)."""
    buffer: np.ndarray | None = None
    held = 0
    for _, band in bands:
        if buffer is None:
            buffer = np.empty((TILE, band.shape[1]), dtype=band.dtype)
        used = 0
        while used < len(band):
            count = min(TILE - held, len(band) - used)
            buffer[held : held + count] = band[used : used + count]
            held, used = held + count, used + count
            if held == TILE:
                yield buffer
                held = 0
    if held:
        assert buffer is not None
        yield buffer[:held]


# a node's measures: area, intensity sum, row sum, column sum, top, left, bottom, right (ends
# exclusive); a union adds the first four and takes the outer box
_AREA, _INTENSITY, _ROWS, _COLS, _TOP, _LEFT, _BOTTOM, _RIGHT = range(8)


@dataclass
class Components:
    """Connected components over bands: a union-find whose roots carry their measures."""

    parent: list[int] = field(default_factory=lambda: [0])
    measures: list[list[float]] = field(default_factory=lambda: [[0.0] * 8])
    offsets: list[int] = field(default_factory=list)  # first global id of each band, minus 1
    rows: int = 0  # rows seen so far: the next band's first row
    previous_row: np.ndarray | None = None

    def find(self, node: int) -> int:
        while self.parent[node] != node:
            self.parent[node] = self.parent[self.parent[node]]
            node = self.parent[node]
        return node

    def union(self, a: int, b: int) -> None:
        # the smaller id stays the root: a component's root is then its first node, and
        # roots in id order are the objects in the order of their first pixel (raster order)
        a, b = sorted((self.find(a), self.find(b)))
        if a != b:
            self.parent[b] = a
            kept, joined = self.measures[a], self.measures[b]
            for sum_ in (_AREA, _INTENSITY, _ROWS, _COLS):
                kept[sum_] += joined[sum_]
            kept[_TOP], kept[_LEFT] = min(kept[_TOP], joined[_TOP]), min(kept[_LEFT], joined[_LEFT])
            kept[_BOTTOM] = max(kept[_BOTTOM], joined[_BOTTOM])
            kept[_RIGHT] = max(kept[_RIGHT], joined[_RIGHT])

    def add_band(self, mask: np.ndarray, image: np.ndarray) -> np.ndarray:
        """Label ``mask`` (the next band) and join it to the band above; its global ids."""
        labels, count = ndimage.label(mask, structure=_EIGHT)
        offset = len(self.parent) - 1
        self.offsets.append(offset)
        self.parent += list(range(offset + 1, offset + count + 1))
        self.measures += self._measured(labels, count, image)
        self.rows += len(mask)
        # in place: the band's labels become its global ids (int32 while they fit)
        ids = labels.astype(np.int32 if offset + count < 2**31 else np.int64, copy=False)
        np.add(ids, offset, out=ids, where=mask)
        if self.previous_row is not None:
            self.join_rows(self.previous_row, ids[0])
        self.previous_row = ids[-1].copy()
        return ids

    def join_rows(self, upper: np.ndarray, lower: np.ndarray) -> None:
        """Join the components of two adjacent rows of ids that touch (8-connected)."""
        for shift in (-1, 0, 1):
            above = np.roll(upper, shift)
            if shift:  # np.roll wraps around: the wrapped pixel is not a neighbour
                above[0 if shift > 0 else -1] = 0
            touching = (lower > 0) & (above > 0)
            pairs = zip(lower[touching].tolist(), above[touching].tolist(), strict=True)
            for a, b in set(pairs):
                self.union(a, b)

    def _measured(self, labels: np.ndarray, count: int, image: np.ndarray) -> list[list[float]]:
        """Each new component's measures, from its pixels alone (not a grid of the band),
        a few rows at a time (a pixel's index arrays are 8 bytes each per foreground pixel)."""
        if not count:
            return []
        columns = [np.zeros(count, dtype=np.float64) for _ in range(4)]
        for first in range(0, len(labels), _MEASURE_ROWS):
            part = labels[first : first + _MEASURE_ROWS]
            flat = np.flatnonzero(part)
            which = part.ravel()[flat]
            rows, cols = np.divmod(flat, part.shape[1])
            weights = (None, image[first : first + _MEASURE_ROWS].ravel()[flat],
                       rows + (self.rows + first), cols)  # fmt: skip
            for column, weight in zip(columns, weights, strict=True):
                column += np.bincount(which, weight, minlength=count + 1)[1:]
        top = self.rows
        boxes = ndimage.find_objects(labels)
        return [
            [*(float(c[n]) for c in columns), box[0].start + top, box[1].start,
             box[0].stop + top, box[1].stop]
            for n, box in enumerate(boxes)
        ]  # fmt: skip

    def roots(self, min_area: int) -> list[int]:
        """The components of at least ``min_area`` pixels, in the raster order of their first
        pixel (as ``ndimage.label`` numbers a whole image's)."""
        parent = np.asarray(self.parent, dtype=np.int64)
        found = np.flatnonzero(parent == np.arange(len(parent)))[1:]  # node 0: the background
        area = np.fromiter((self.measures[n][_AREA] for n in found), np.float64, len(found))
        return [int(node) for node in found[area >= max(min_area, 1)]]

    def all_roots(self) -> np.ndarray:
        """Each node's root (what :meth:`find` gives it), for all nodes at once: every node
        steps to its parent's parent until none moves (as many passes as the log of the
        deepest chain), where finding them one by one is a Python loop over every node."""
        nodes = np.asarray(self.parent, dtype=np.int64)
        while True:
            above: np.ndarray = nodes[nodes]
            if np.array_equal(above, nodes):
                return nodes
            nodes = above

    def kept(self, min_area: int) -> tuple[int, int, float]:
        """(objects, total area, total intensity) of the components of at least ``min_area``."""
        big = [self.measures[n] for n in self.roots(min_area)]
        return len(big), int(sum(m[_AREA] for m in big)), sum(m[_INTENSITY] for m in big)

    def lookup(self, min_area: int) -> np.ndarray:
        """Each global id's final object id (1, 2, … in :meth:`roots` order; 0: removed)."""
        final, kept = np.zeros(len(self.parent), dtype=np.uint32), self.roots(min_area)
        final[kept] = np.arange(1, len(kept) + 1)
        nodes = self.all_roots()
        return final[nodes]

    def table(self, min_area: int) -> list[dict[str, Any]]:
        """One row per object kept (:data:`OBJECT_COLUMNS`), its id as in :meth:`lookup`."""
        rows = []
        for number, root in enumerate(self.roots(min_area), start=1):
            m = self.measures[root]
            rows.append(dict(zip(OBJECT_COLUMNS, (
                number, int(m[_AREA]), round(m[_ROWS] / m[_AREA], 2),
                round(m[_COLS] / m[_AREA], 2), int(m[_TOP]), int(m[_LEFT]), int(m[_BOTTOM]),
                int(m[_RIGHT]), round(m[_INTENSITY] / m[_AREA], 6)), strict=True)))  # fmt: skip
        return rows


@dataclass(frozen=True)
class TiledResult:
    width: int
    height: int
    area: int
    objects: int
    intensity: float
    confidence: float
    table: list[dict[str, Any]]  # one row per object (OBJECT_COLUMNS)
    windows_run: int = 0
    windows_glass: int = 0


def tiled_row(result: TiledResult) -> dict[str, Any]:
    """The table row's measures of an image segmented window by window."""
    stats = image_stats(result.width, result.height, result.area, result.objects,
                        result.intensity)  # fmt: skip
    return {**stats, "confidence": round(result.confidence, 4), "tiled": 1,
            "windows_run": result.windows_run, "windows_glass": result.windows_glass}  # fmt: skip


def window_cache_rows(params: Mapping[str, Any]) -> int:
    """Rows of the input the window-by-window reader keeps decoded: a window's and two tiles."""
    return int(params["tile_size"]) + 2 * TILE


def region_rows(
    height: int, index: int, count: int, work: np.ndarray | None = None
) -> tuple[int, int]:
    """Rows (first, end) of region ``index`` of ``count``: whole chunk rows (so no two regions
    write one chunk), split so that each region has an even share of ``work`` (per chunk row;
    without it, or with none, of the rows); empty when there are more regions than chunk rows."""
    chunk_rows = math.ceil(height / CHUNK)
    if work is None or not work.sum():
        first, end = index * chunk_rows // count, (index + 1) * chunk_rows // count
    else:
        done = np.concatenate([[0], np.cumsum(work)])
        shares = [done[-1] * k / count for k in (index, index + 1)]
        first, end = (int(np.searchsorted(done, share)) for share in shares)
        end = chunk_rows if index == count - 1 else end
        first = 0 if index == 0 else first
    return first * CHUNK, min(end * CHUNK, height)


def tissue_work(reader: Regions, window: int, overlap: int) -> np.ndarray | None:
    """The windows the net will run, per chunk row of their top (what a region's time goes
    to); None without a tissue mask (every window runs: the rows are the work)."""
    if reader.tissue is None:
        return None
    height, width = reader.height, reader.width
    win_h, win_w = min(window, height), min(window, width)
    stride = max(window - overlap, 1)
    work = np.zeros(math.ceil(height / CHUNK), dtype=np.int64)
    for top in starts(height, window, stride):
        work[top // CHUNK] += sum(reader.has_tissue(top, top + win_h, x, x + win_w)
                                  for x in starts(width, window, stride))  # fmt: skip
    return work


@dataclass
class RegionRecord:
    """What a region's task leaves for the assembly (``region-<index>.npz`` beside the ids):
    its components, the ids of its first and last rows (to join them to its neighbours'),
    the chunks it stored, its share of the certainty sum and of the overview, and what it
    knew of the input (all regions must have read the same file)."""

    index: int
    count: int
    first: int
    end: int
    parents: np.ndarray  # local node → its local root (node 0: background)
    measures: np.ndarray  # (nodes + 1, 8): a root's measures (see Components)
    top_ids: np.ndarray
    bottom_ids: np.ndarray
    chunks: np.ndarray  # (stored chunks, 2): row, column
    certainty: float
    overview: np.ndarray  # the overview's rows that fall in this region
    meta: dict[str, Any]  # the input's size and mtime, the model's provenance
    windows_run: int = 0  # windows the net ran on
    windows_glass: int = 0  # windows skipped as glass (pipelines.tissue)

    def name(self) -> str:
        return region_record_name(self.index)

    def to_bytes(self) -> bytes:
        buffer = io.BytesIO()
        fields = {k: v for k, v in vars(self).items() if k != "meta"}
        np.savez(buffer, meta=np.array(json.dumps(self.meta)), **fields)
        return buffer.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> RegionRecord:
        with np.load(io.BytesIO(data), allow_pickle=False) as found:
            fields = {k: found[k] for k in found.files}
        scalars = {k: int(fields.pop(k)) for k in _RECORD_INTS}
        meta = json.loads(str(fields.pop("meta")))
        return cls(**scalars, certainty=float(fields.pop("certainty")), meta=meta, **fields)


_RECORD_INTS = ("index", "count", "first", "end", "windows_run", "windows_glass")


def region_record_name(index: int) -> str:
    return f"region-{index:04d}.npz"


def segment_region(
    reader: Regions, predict: Predict, threshold: float, ids: Any, index: int, count: int,
    window: int = 512, overlap: int = 64, batch: int = 1, progress: Progress | None = None,
    rows_weigh: bool = False,
) -> RegionRecord:  # fmt: skip
    """Segment region ``index`` of ``count`` of the image: its provisional ids (its own
    numbering) go to the level-0 array ``ids``, the rest to the record it returns. The
    regions share the windows the net runs; ``rows_weigh``: the rows as much (regions whose
    net runs elsewhere, for all of them: what is theirs is the rows' labelling, measuring
    and writing as much as the windows' reading)."""
    # every region's task finds the same split: the same file, the same tissue mask
    work = tissue_work(reader, window, overlap)
    if rows_weigh and work is not None and work.sum():
        rows = np.minimum(CHUNK, reader.height - CHUNK * np.arange(len(work)))
        work = work / work.sum() + rows / reader.height
    first, end = region_rows(reader.height, index, count, work)
    components = Components(rows=first)
    writer = RowWriter(ids, first, reader.pool)
    step = overview_step(reader.height, reader.width)
    overview: list[np.ndarray] = []
    certainty, top_ids = 0.0, np.zeros(reader.width, dtype=np.int64)
    windows = Windows()
    bands = probability_bands(reader, predict, window, overlap, batch, progress, (first, end),
                              windows)  # fmt: skip
    for band in rebanded(bands):
        top = components.rows
        sure = np.multiply(band, 2)  # |2p - 1| in one temporary, summed as one array
        sure -= 1
        certainty += float(np.abs(sure, out=sure).sum())
        del sure
        image = reader.region(top, top + len(band), 0, reader.width, glass_unread=True)
        found = components.add_band(band > threshold, image)
        top_ids = found[0].copy() if top == first else top_ids
        writer.add(found)
        sampled = np.arange(top, top + len(band)) % step == 0
        overview.append(np.round(image[sampled][:, ::step] * 255).astype(np.uint8))
    writer.close()
    parents = components.all_roots()
    bottom = components.previous_row
    return RegionRecord(
        index, count, first, end, parents, np.array(components.measures), top_ids,
        bottom if bottom is not None else np.zeros(reader.width, dtype=np.int64),
        np.array(sorted(writer.stored), dtype=np.int64).reshape(-1, 2), certainty,
        np.concatenate(overview) if overview else np.zeros((0, -(-reader.width // step)), np.uint8),
        {}, windows.run, windows.glass,
    )  # fmt: skip


def joined(records: list[RegionRecord]) -> tuple[Components, list[int]]:
    """The whole image's components from its regions' (ids offset by each region's base, so
    they are the ids one task would have given), joined across region borders."""
    total, bases = Components(), []
    above: tuple[RegionRecord, int] | None = None
    for record in records:
        base = len(total.parent) - 1
        bases.append(base)
        total.parent += (record.parents[1:] + base).tolist()
        total.measures += record.measures[1:].tolist()
        if record.first == record.end:
            continue
        if above is not None:
            upper, upper_base = above
            total.join_rows(np.where(upper.bottom_ids > 0, upper.bottom_ids + upper_base, 0),
                            np.where(record.top_ids > 0, record.top_ids + base, 0))  # fmt: skip
        above = (record, base)
    return total, bases


def assemble(
    records: list[RegionRecord], ids: Any, folder: HeldFolder, target: str, min_area: int,
    height: int, width: int, side_by_side: SideBySide | None = None, work: str = "",
) -> TiledResult:  # fmt: skip
    """The label image ``target`` (a folder name in ``folder``, replaced whole) and the
    statistics and object table of an image from all its regions' records and ids (in the
    temporary folder ``work`` of ``folder`` where its passes run ``side_by_side``)."""
    if [r.index for r in records] != list(range(len(records))) or any(
        r.count != len(records) for r in records
    ):
        raise ValueError(f"regions {[r.index for r in records]} of {records[0].count}")
    total, bases = joined(records)
    final = total.lookup(min_area)
    building = temporary_name()
    folder.mkdir(building)
    try:
        with folder.folder(building) as inside:
            labels = LabelImage(inside, height, width, target.removesuffix(LABEL_IMAGE_SUFFIX))
            try:
                parts: list[tuple[Chunks, np.ndarray]] = []
                for record, base in zip(records, bases, strict=True):
                    nodes = len(record.parents) - 1
                    local = np.concatenate([[0], final[base + 1 : base + 1 + nodes]])
                    parts.append(([(r, c) for r, c in record.chunks.tolist()], local))
                if side_by_side is None:
                    for chunks, local in parts:
                        labels.relabelled(ids, chunks, local)
                else:
                    side_by_side.relabel(work, building, parts)
                    labels.made([chunk for chunks, _ in parts for chunk in chunks])
                halve = None if side_by_side is None else partial(side_by_side.halve, building)
                step = overview_step(height, width)
                labels.finish(np.concatenate([r.overview for r in records]), step, halve)
            finally:
                labels.close()
            os.fsync(inside.fd)
        folder.remove_tree(target)
        folder.rename(building, target)
    except BaseException:
        folder.remove_tree(building)
        raise
    objects, area, intensity = total.kept(min_area)
    certainty = sum(r.certainty for r in records) / (height * width)
    run, glass = sum(r.windows_run for r in records), sum(r.windows_glass for r in records)
    return TiledResult(width, height, area, objects, intensity, certainty, total.table(min_area),
                       run, glass)  # fmt: skip


class SideBySide(Protocol):
    """The passes over one image that other processes run side by side, each on a part of
    its own (the inference job's workers: :mod:`pipelines.inference.slides`), on the arrays in
    the temporary folders of the label image's folder: ``work`` (the provisional ids),
    ``building`` (the label image)."""

    def regions(self, reader: Regions, ids: Any, work: str) -> list[RegionRecord]:
        """The image's regions, segmented into ``ids``: their records, in order."""

    def relabel(self, work: str, building: str, parts: list[tuple[Chunks, np.ndarray]]) -> None:
        """The label image's level 0: each part's chunks through its lookup table."""

    def halve(self, building: str, level: int, chunks: Chunks) -> None:
        """``chunks`` of the label image's ``level`` from the level above it."""


Chunks = list[tuple[int, int]]  # (row, column) of label chunks


def segment_tiled(
    source: Path | BinaryIO | Regions, folder: HeldFolder, target: str, predict: Predict,
    threshold: float, min_area: int, window: int = 512, overlap: int = 64, batch: int = 1,
    progress: Progress | None = None, channel: Any = None, glass_tolerance: float = 0.0,
    name: str = "", side_by_side: SideBySide | None = None,
) -> TiledResult:  # fmt: skip
    """Segment ``source`` (a TIFF: its plane ``channel``, ``name`` its file's name; or an
    image's reader, which the caller made and closes) in one task into the OME-Zarr label
    image ``target`` (a folder name in ``folder``, replaced whole): one region, or the
    regions ``side_by_side`` segments (in other processes, into the same array), assembled at
    once; the provisional ids lie in a temporary folder beside it meanwhile."""
    if isinstance(source, Regions):
        reader = source
    else:
        reader = RegionReader(source, window_cache_rows({"tile_size": window}), channel,
                              glass_tolerance, name)  # fmt: skip
    work = temporary_name()
    try:
        folder.mkdir(work)
        with folder.folder(work) as held:
            store, ids = work_array(held, reader.height, reader.width)
            try:
                if side_by_side is None:
                    records = [segment_region(reader, predict, threshold, ids, 0, 1, window,
                                              overlap, batch, progress)]  # fmt: skip
                else:
                    records = side_by_side.regions(reader, ids, work)
                return assemble(records, ids, folder, target, min_area, reader.height,
                                reader.width, side_by_side, work)  # fmt: skip
            finally:
                store.close()
    finally:
        if reader is not source:
            reader.close()
        folder.remove_tree(work)
