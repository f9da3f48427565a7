"""OME-Zarr images as inputs: a store (NGFF 0.4 on Zarr v2, 0.5 on Zarr v3) read region by
region, as a large TIFF is (:class:`pipelines.tiles.Regions`), into an OME-Zarr label image.

A store is a folder of the batch folder, opened by its rule: held, every folder below it
entered and every chunk opened without following a link (:class:`pipelines.omezarr.FolderStore`,
read-only), so a link planted in it is refused, never followed. The image is the first
multiscale's first dataset (full resolution); its axes are any of t, c, z before y, x; a stack
of more than one time point or Z slice is refused; a channel is picked by ``channel``, named
from ``omero.channels`` (:class:`pipelines.channels.Planes`, as for a multi-channel TIFF); the
smallest dataset is the level the tissue mask comes from. Samples are 8- or 16-bit unsigned.

Every read of the store is bounded by what it declares (:mod:`pipelines.storebounds`): its
metadata by size and nesting before zarr parses it; every level's shape, chunks and codecs
before any chunk of it is read (a chunk no larger than ``max_whole_pixels`` pixels, as a
TIFF's tile); every chunk file by what its chunk can need encoded, and its decoded size before
the decoder runs. A chunk the store does not hold is Zarr's fill value, left out by its writer
as empty: a store holding none of its image's chunks is refused, and windows over none of the
chunks it holds are not run, as windows over glass are not (counted with them).

A store has no one file to checksum: what the ledger and the regions' assembly compare is its
state (:func:`daemon.contract.stores.walk_store`: every file's name, size and time), walked
before the image is read and again after; a store that changed in between is a problem of the
input, not a mask.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import zarr

from daemon.contract.heldfolder import HeldFolder
from daemon.contract.jobspec import InputFile, Problem
from daemon.contract.names import INFERENCE
from daemon.contract.stores import MAX_STORE_ENTRIES, walk_store
from pipelines.bounds import spaced, where
from pipelines.channels import Planes
from pipelines.job import InputError
from pipelines.omezarr import FolderStore, walk_keys
from pipelines.storebounds import Guard, Refused, check_declared, chunks_of
from pipelines.tiles import Regions
from pipelines.tissue import MAX_LEVEL_PIXELS, summed

_EXPORT = "write the image as an OME-Zarr image (NGFF 0.4 or 0.5, e.g. bioformats2raw) or a TIFF"
_PLANE = {"t": "time points", "z": "Z slices"}

log = logging.getLogger("pipelines")


class StoreReader(Regions):
    """Rectangular regions of an OME-Zarr image's plane, decoded a chunk at a time."""

    def __init__(
        self, folder: HeldFolder, item: InputFile, cache_pixel_rows: int, channel: Any = None,
        glass_tolerance: float = 0.0, max_pixels: int = INFERENCE.max_whole_pixels,
    ) -> None:  # fmt: skip
        """``folder``: the store, held (the caller closes it). Raises InputError where it is
        not an image this reads or is larger than it may be (``max_pixels``: a chunk's, as
        for a TIFF's tile), ChannelProblem where ``channel`` does not fit it."""
        self.item = item
        self.guard = Guard()
        self.store = FolderStore(folder, read_only=True, guard=self.guard)
        try:
            self._open(channel, max_pixels)
            level = self.levels[0]
            height, width = level.shape[-2:]
            self._layout(height, width, *level.chunks[-2:], level.dtype, cache_pixel_rows)
            self.stored = summed(self._stored_chunks(folder))
            self.tolerance = glass_tolerance
            self.tissue = self._tissue() if glass_tolerance > 0 else None
        except Refused as exc:
            self.store.close()
            raise self._refused(exc.message, exc.hint) from None
        except BaseException:
            self.store.close()
            raise

    def _open(self, channel: Any, max_pixels: int) -> None:
        """Its multiscales, its levels checked and admitted by the guard, its plane."""
        try:
            # its format said, zarr reads no consolidated metadata (.zmetadata), only each node's
            root = zarr.open_group(self.store, mode="r", zarr_format=self._format(),
                                   use_consolidated=False)  # fmt: skip
            attrs = dict(root.attrs)
        except Refused:
            raise
        except Exception as exc:  # zarr raises what its parsers do on a damaged store
            raise self._refused(f"cannot be opened as a Zarr group ({type(exc).__name__}: "
                                f"{exc})") from exc  # fmt: skip
        ome: Any = attrs.get("ome", attrs)  # 0.5 keeps its metadata under "ome"
        ome = ome if isinstance(ome, dict) else {}
        found = ome.get("multiscales")
        if not isinstance(found, list) or not found or not isinstance(found[0], dict):
            raise self._refused("has no multiscales metadata: it is not an OME-Zarr image")
        try:
            paths = [str(d["path"]) for d in found[0]["datasets"]]
            arrays = [root[p] for p in paths]
        except Refused:
            raise
        except Exception as exc:
            raise self._refused(f"has a multiscales entry whose datasets cannot be read "
                                f"({type(exc).__name__}: {exc})") from exc  # fmt: skip
        self.levels = [a for a in arrays if isinstance(a, zarr.Array)]
        if not paths or len(self.levels) != len(arrays):
            raise self._refused("has no image arrays in its multiscales datasets")
        level = self.levels[0]
        axes = _axes(found[0].get("axes"), level.ndim)
        if axes[-2:] != ["y", "x"] or len(set(axes)) != len(axes) or set(axes) - set("tczyx"):
            raise self._refused(f"has the axes {','.join(axes)}; the image's last two must be "
                                "y and x, the others any of t, c, z")  # fmt: skip
        self._admit(axes, max_pixels)
        sizes = dict(zip(axes, level.shape, strict=True))
        stacked = next((f"{sizes[a]} {_PLANE[a]}" for a in "tz" if sizes.get(a, 1) > 1), "")
        channels = sizes.get("c", 1)
        planes = Planes(channels * sizes.get("t", 1) * sizes.get("z", 1), channels,
                        _names(ome, channels), stacked)  # fmt: skip
        plane = planes.page(channel)  # (ChannelProblem: the job says which channels there are)
        self.fixed = {"t": 0, "z": 0, "c": plane}
        self.axes = axes

    def _format(self) -> int:
        """The store's Zarr format: 3 where its top holds a zarr.json, else 2."""
        try:
            self.store.root.lstat("zarr.json")
        except FileNotFoundError:
            return 2
        return 3

    def _admit(self, axes: list[str], max_pixels: int) -> None:
        """Every level checked (:func:`check_declared`: samples, shape, chunks; codecs) before
        any chunk of it is read, and admitted by the guard (its chunks may then be read)."""
        for array in self.levels:
            if array.ndim != len(axes):
                raise self._refused(f"has array '{array.path}' of {array.ndim} dimensions, "
                                    f"where its first has {len(axes)}")  # fmt: skip
            if array.dtype not in (np.uint8, np.uint16):
                raise self._refused(f"has {array.dtype} samples; watchd reads 8- and 16-bit "
                                    "unsigned images")  # fmt: skip
            check_declared(array, axes, max_pixels)
            self.guard.admit(chunks_of(array))

    def _stored_chunks(self, folder: HeldFolder) -> np.ndarray:
        """Which chunks of the plane read are stored (chunk rows × chunk columns), from one
        walk of the first level's folder; Refused where none is."""
        level = self.levels[0]
        meta = level.metadata
        encoding = meta.chunk_key_encoding if meta.zarr_format == 3 else None
        separator = meta.dimension_separator if encoding is None else encoding.separator
        first = "c" if encoding is not None and encoding.name == "default" else None
        above = zip(self.axes[:-2], level.chunks[:-2], strict=True)
        plane = tuple(self.fixed[axis] // size for axis, size in above)
        grid = np.zeros((math.ceil(self.height / self.seg_h), self.across), dtype=bool)
        with folder.folder(level.path) as inside:
            for key in walk_keys(inside, level.ndim + 1):
                parts = key.split(separator)
                if first is not None and parts[:1] == [first]:
                    parts = parts[1:]
                if len(parts) == level.ndim and all(p.isascii() and p.isdigit() for p in parts):
                    *others, row, column = map(int, parts)
                    if tuple(others) == plane and row < grid.shape[0] and column < grid.shape[1]:
                        grid[row, column] = True
        if not grid.any():
            raise Refused(
                f"has none of the {spaced(grid.size)} chunks of array '{level.path}' stored"
                f"{' for the plane read' if level.ndim > 2 else ''}: all of it would be the "
                f"fill value {level.fill_value}, which is not an image",
                "its chunk files are missing: copy the store again, whole",
            )
        if not grid.all():
            log.info("%d of the %d chunks stored: windows over none of them are skipped, as "
                     "over glass", grid.sum(), grid.size)  # fmt: skip
        return grid

    def _refused(self, what: str, hint: str = _EXPORT) -> InputError:
        return InputError("unreadable image", [Problem(where(self.item), what, hint)])

    def _index(self, rows: slice, columns: slice) -> tuple[Any, ...]:
        return tuple(rows if a == "y" else columns if a == "x" else self.fixed[a]
                     for a in self.axes)  # fmt: skip

    def _tissue(self) -> Any:
        """The tissue mask of the store's smallest level, if it has a small enough one."""
        level = self.levels[-1]
        height, width = level.shape[-2:]
        if height == self.height:
            log.info("no reduced level to find the tissue in: every window runs")
            return None
        if height * width > MAX_LEVEL_PIXELS:
            log.info("smallest level %dx%d too large to read whole: every window runs",
                     width, height)  # fmt: skip
            return None
        pixels = self._read(level, slice(None), slice(None))
        return self._tissue_of(pixels[..., None])

    def _decode(self, index: int) -> np.ndarray:
        row, col = divmod(index, self.across)
        y0, x0 = row * self.seg_h, col * self.seg_w
        rows = slice(y0, min(y0 + self.seg_h, self.height))
        columns = slice(x0, min(x0 + self.seg_w, self.width))
        return self._read(self.levels[0], rows, columns)[..., None]

    def _read(self, array: Any, rows: slice, columns: slice) -> np.ndarray:
        """Rows and columns of the plane read of the level ``array``; a chunk the guard
        refuses, or that its codec cannot decode, is a problem of the input."""
        try:
            return np.asarray(array[self._index(rows, columns)])
        except Refused as exc:
            raise self._refused(exc.message, exc.hint) from None
        except Exception as exc:  # zarr and its codecs raise what they do on a damaged chunk
            raise self._refused(f"has a chunk of array '{array.path}' that cannot be decoded "
                                f"({type(exc).__name__}: {exc})") from exc  # fmt: skip

    def close(self) -> None:
        super().close()
        self.store.close()


def _axes(found: Any, ndim: int) -> list[str]:
    """The axes' names (0.4: a list of dicts; 0.3: of names; before: none, then t, c, z, y, x)."""
    if not isinstance(found, list):
        return list("tczyx"[-ndim:]) if ndim <= 5 else ["?"] * ndim
    return [str(a.get("name", "?") if isinstance(a, dict) else a).lower() for a in found]


def _names(ome: dict[str, Any], channels: int) -> tuple[str, ...]:
    """The channels' names (``omero.channels[].label``), when every channel has one."""
    try:
        names = tuple(str(c["label"]) for c in ome["omero"]["channels"])
    except (KeyError, TypeError):
        return ()
    return names if len(names) == channels and all(names) else ()


@contextlib.contextmanager
def open_store(
    batch: HeldFolder, item: InputFile, cache_pixel_rows: int, channel: Any, tolerance: float,
    max_pixels: int = INFERENCE.max_whole_pixels,
) -> Iterator[tuple[StoreReader, dict[str, Any]]]:  # fmt: skip
    """The store ``item`` of the batch folder, held, and what its walk found (size, time,
    state: what the regions of one image must agree on); InputError where it is gone, is not a
    store, holds what no store may or more than it may (:class:`StoreReader`), or changed
    while the block ran."""
    try:
        folder = batch.folder(item.path)
    except FileNotFoundError:
        hint = "it was moved or deleted after the batch was accepted; put it back"
        raise InputError(
            "input missing", [Problem(where(item), "the store is gone", hint)]
        ) from None
    except (OSError, ValueError) as exc:  # a link or a file put in its place
        raise InputError("input refused", [Problem(
            where(item), f"is not a folder of the batch folder any more ({exc})",
            "copy the OME-Zarr store itself into the batch folder, without links",
        )]) from None  # fmt: skip
    with folder:
        before = _walked(folder, item)
        reader = StoreReader(folder, item, cache_pixel_rows, channel, tolerance, max_pixels)
        try:
            yield reader, before
        finally:
            reader.close()
        if _walked(folder, item) != before:
            hint = "it was written to while being read; let the copy finish, then retry the batch"
            raise InputError("input changed", [
                Problem(where(item), "changed while it was being segmented", hint)
            ])  # fmt: skip


def _walked(folder: HeldFolder, item: InputFile) -> dict[str, Any]:
    walked = walk_store(folder.fd, MAX_STORE_ENTRIES)
    if walked.problem:
        raise InputError("input refused", [Problem(where(item), f"now {walked.problem}", "")])
    return {"size": walked.size, "mtime_ns": walked.latest, "state": walked.state}
