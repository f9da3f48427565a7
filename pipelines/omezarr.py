"""Label images in OME-Zarr (NGFF 0.4), written chunk by chunk through a held folder.

A large image's segmentation is a folder ``<input name>.ome.zarr`` that napari (napari-ome-zarr),
QuPath and OMERO open::

    .zattrs, .zgroup        multiscales: an overview of the input (grey, 8 bit), coarsest
                            level about 2048 pixels across or less, at its scale in pixels
    0, 1, …                 the overview's levels
    labels/.zattrs          {"labels": ["segmentation"]}
    labels/segmentation/    the label image: multiscales + image-label; uint32 object ids
        0, 1, …             (0 background) at full resolution, then halved (nearest) until
                            one chunk holds a level; chunks of 512², Blosc-zstd compressed

Levels are Zarr v2 arrays (what NGFF 0.4 is written in, and what the viewers read today).
Chunks that hold only background are not stored (Zarr's fill value is 0), so the glass of a
slide costs no file. Every key is a file written through :class:`FolderStore`, which opens
nothing by path (:mod:`daemon.contract.heldfolder`); the whole folder is built under a
temporary name and renamed into place, so a reader sees the old output or the new one. The
report reads the overview and the matching label level back the same way
(:func:`overview_and_labels`), checking their shapes before it reads a pixel.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from concurrent.futures import Executor, Future
from typing import Any

import numcodecs
import numpy as np
import zarr
from zarr.abc.store import ByteRequest, OffsetByteRequest, RangeByteRequest, Store
from zarr.core.buffer import Buffer, BufferPrototype

from daemon.contract.heldfolder import HeldFolder, parts_of
from pipelines.storebounds import Guard, chunks_of

CHUNK = 512  # pixels per side of a label chunk
OVERVIEW_SIDE = 2048  # the overview's finest level is at most this many pixels across
LABEL_NAME = "segmentation"
NGFF_VERSION = "0.4"
_AXES = [{"name": "y", "type": "space"}, {"name": "x", "type": "space"}]  # in pixels


class FolderStore(Store):
    """A Zarr store whose keys are files below a :class:`HeldFolder`, each written atomically.

    The folders on a key's way are held once and reused (a chunk write is one open, not one
    per path component). Reading and listing go through the same held folders. A store made
    ``read_only`` refuses writes (what zarr's mode "r" asks for). Given a ``guard`` (a store
    its owner wrote: :class:`pipelines.storebounds.Guard`), a key is read only up to what the
    guard allows it, and the guard checks what was read before zarr parses or decodes it.
    """

    supports_writes = True
    supports_deletes = True
    supports_listing = True
    supports_partial_writes = False

    def __init__(
        self, folder: HeldFolder, *, read_only: bool = False, guard: Guard | None = None
    ) -> None:
        super().__init__(read_only=read_only)
        self.root = folder
        self.held: dict[str, HeldFolder] = {}
        self.guard = guard

    def __eq__(self, other: object) -> bool:
        return other is self

    def __hash__(self) -> int:
        return id(self)

    def close(self) -> None:
        for folder in self.held.values():
            folder.close()
        self.held.clear()
        super().close()

    def _place(self, key: str, *, create: bool = False) -> tuple[HeldFolder, str]:
        *above, name = parts_of(key)
        if not above:
            return self.root, name
        where = "/".join(above)
        if where not in self.held:
            self.held[where] = self.root.folder(where, create=create)
        return self.held[where], name

    async def get(
        self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None
    ) -> Buffer | None:
        limit = None if self.guard is None else self.guard.limit(key)
        try:
            folder, name = self._place(key)
            with folder.open_read(name) as handle:
                data = handle.read() if limit is None else handle.read(limit + 1)
        except (FileNotFoundError, NotADirectoryError):
            return None
        if self.guard is not None:
            self.guard.check(key, data)
        if isinstance(byte_range, RangeByteRequest):
            data = data[byte_range.start : byte_range.end]
        elif isinstance(byte_range, OffsetByteRequest):
            data = data[byte_range.offset :]
        elif byte_range is not None:
            data = data[-byte_range.suffix :] if byte_range.suffix else b""
        return prototype.buffer.from_bytes(data)

    async def get_partial_values(
        self, prototype: BufferPrototype, key_ranges: Iterable[tuple[str, ByteRequest | None]]
    ) -> list[Buffer | None]:
        return [await self.get(key, prototype, byte_range) for key, byte_range in key_ranges]

    async def exists(self, key: str) -> bool:
        try:
            folder, name = self._place(key)
            folder.lstat(name)
        except (FileNotFoundError, NotADirectoryError):
            return False
        return True

    async def set(self, key: str, value: Buffer) -> None:
        self._check_writable()
        folder, name = self._place(key, create=True)
        # one fsync for the whole folder when it is renamed into place is enough: an output
        # cut short by a crash is never renamed, and its run is redone
        folder.write_bytes(name, value.to_bytes(), fsync=False)

    async def delete(self, key: str) -> None:
        self._check_writable()
        try:
            folder, name = self._place(key)
            folder.unlink(name)
        except (FileNotFoundError, NotADirectoryError):
            pass

    async def list(self) -> AsyncIterator[str]:
        for key in walk_keys(self.root):
            yield key

    async def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        for key in walk_keys(self.root):
            if key.startswith(prefix):
                yield key

    async def list_dir(self, prefix: str) -> AsyncIterator[str]:
        prefix = prefix.rstrip("/")
        try:
            folder = self.root if not prefix else self._place(f"{prefix}/.")[0]
        except (FileNotFoundError, NotADirectoryError):
            return
        for entry in folder.entries():
            yield entry.name


def walk_keys(folder: HeldFolder, depth: int | None = None, prefix: str = "") -> Iterator[str]:
    """The keys of the regular files below ``folder`` (``prefix`` before each), in folders
    at most ``depth`` deep (1: its own files only; None: any), entered without following a
    link."""
    for entry in folder.entries():
        if entry.is_dir(follow_symlinks=False) and (depth is None or depth > 1):
            with folder.folder(entry.name) as inner:
                yield from walk_keys(inner, None if depth is None else depth - 1,
                                     f"{prefix}{entry.name}/")  # fmt: skip
        elif entry.is_file(follow_symlinks=False):
            yield f"{prefix}{entry.name}"


def _multiscale(name: str, shapes: list[tuple[int, int]], first_scale: float) -> dict[str, Any]:
    datasets = []
    for level in range(len(shapes)):
        scale = first_scale * 2**level  # level n's pixel i starts at its level 0's 2ⁿ·i
        transforms = [{"type": "scale", "scale": [scale, scale]}]
        datasets.append({"path": str(level), "coordinateTransformations": transforms})
    return {"version": NGFF_VERSION, "name": name, "axes": _AXES, "datasets": datasets}


def _halved(shape: tuple[int, int]) -> tuple[int, int]:
    return math.ceil(shape[0] / 2), math.ceil(shape[1] / 2)


def overview_step(height: int, width: int) -> int:
    """The power of two by which the overview samples the input (1 for a small input)."""
    return 1 << max(0, math.ceil(math.log2(max(height, width) / OVERVIEW_SIDE)))


def _create_array(group: Any, name: str, shape: tuple[int, int], dtype: Any) -> Any:
    compressor = numcodecs.Blosc(cname="zstd", clevel=5, shuffle=numcodecs.Blosc.BITSHUFFLE)
    return group.create_array(
        name, shape=shape, chunks=(CHUNK, CHUNK), dtype=dtype, fill_value=0,
        compressors=compressor, chunk_key_encoding={"name": "v2", "separator": "/"},
    )  # fmt: skip


def work_array(folder: HeldFolder, height: int, width: int) -> tuple[FolderStore, Any]:
    """The provisional ids of an image being segmented (one uint32 array, chunks of CHUNK²)
    in ``folder``: made by the first task to come, opened by the others (each region task
    writes the same metadata, atomically, so two tasks making it at once is no harm)."""
    store = FolderStore(folder)
    root = zarr.open_group(store, mode="a", zarr_format=2)
    try:
        return store, _create_array(root, "ids", (height, width), np.uint32)
    except zarr.errors.ContainsArrayError:
        return store, root["ids"]


class RowWriter:
    """Rows of ids written to a level-0 array from row ``first`` on, a chunk row at a time
    (gathered in one buffer of a chunk row); which chunks hold anything is noted (the others
    are not stored). Given a ``pool``, a chunk row is compressed and written there while the
    next is gathered (one at a time: memory stays one chunk row more); :meth:`close` waits for
    the last, and a write that failed fails the next call."""

    def __init__(self, array: Any, first: int, pool: Executor | None = None) -> None:
        self.array, self.written, self.pool = array, first, pool
        self.buffer = np.zeros((CHUNK, array.shape[1]), dtype=np.uint32)
        self.held = 0
        self.stored: set[tuple[int, int]] = set()
        self.writing: Future[None] | None = None

    def add(self, ids: np.ndarray) -> None:
        if ids.size and ids.max() >= 2**32:
            raise ValueError("more than 2³² provisional objects in one image")
        used = 0
        while used < len(ids):
            count = min(CHUNK - self.held, len(ids) - used)
            self.buffer[self.held : self.held + count] = ids[used : used + count]
            self.held, used = self.held + count, used + count
            if self.held == CHUNK:
                self.flush()

    def flush(self) -> None:
        """Write the rows held (a whole chunk row, or the last rows of the region)."""
        if not self.held:
            return
        band = self.buffer[: self.held]
        for left in range(0, band.shape[1], CHUNK):
            if band[:, left : left + CHUNK].any():
                self.stored.add((self.written // CHUNK, left // CHUNK))
        self._wait()
        if self.pool is None:
            self._write(self.written, band)
        else:
            self.writing = self.pool.submit(self._write, self.written, band.copy())
        self.written += len(band)
        self.held = 0

    def _write(self, first: int, band: np.ndarray) -> None:
        self.array[first : first + len(band)] = band

    def _wait(self) -> None:
        if self.writing is not None:
            writing, self.writing = self.writing, None
            writing.result()

    def close(self) -> None:
        """Write what is held and wait until every row is written."""
        self.flush()
        self._wait()


# a pass over chunks of the label image, done elsewhere (the job's workers, side by side):
# (level made: 0 from the ids, n from level n - 1; its chunks (row, column) to make)
Passes = Callable[[int, list[tuple[int, int]]], None]


class LabelImage:
    """An OME-Zarr label image made from provisional ids: :meth:`relabelled` maps each stored
    chunk through a lookup table to the final object ids; :meth:`finish` builds the lower
    levels from the level above (only where something is stored) and writes the overview and
    the metadata. No pass holds more than a few chunks. The passes over chunks
    (:func:`relabel_chunks`, :func:`halve_chunks`) may run in other processes, each on chunks
    of its own, on the arrays they open (:func:`label_levels`)."""

    def __init__(self, folder: HeldFolder, height: int, width: int, name: str = "") -> None:
        self.store = FolderStore(folder)
        self.root = zarr.open_group(self.store, mode="w", zarr_format=2)
        self.labels = self.root.require_group("labels").require_group(LABEL_NAME)
        self.shapes = [(height, width)]
        while max(self.shapes[-1]) > CHUNK:
            self.shapes.append(_halved(self.shapes[-1]))
        self.levels = [_create_array(self.labels, str(n), shape, np.uint32)
                       for n, shape in enumerate(self.shapes)]  # fmt: skip
        self.name = name
        self.stored: set[tuple[int, int]] = set()

    def relabelled(self, ids: Any, chunks: Iterable[tuple[int, int]], lookup: np.ndarray) -> None:
        """Level 0's ``chunks`` from the provisional ``ids`` through ``lookup`` (0: none)."""
        chunks = sorted(chunks)
        relabel_chunks(self.levels[0], ids, chunks, lookup)
        self.stored.update(chunks)

    def made(self, chunks: Iterable[tuple[int, int]]) -> None:
        """Level 0's ``chunks``, made by :func:`relabel_chunks` in another process."""
        self.stored.update(chunks)

    def finish(self, overview: np.ndarray, step: int, passes: Passes | None = None) -> None:
        """The lower levels (each by ``passes`` where given, else here), the overview image
        (the input sampled every ``step`` pixels) and the NGFF metadata."""
        stored = self.stored
        for number in range(1, len(self.levels)):
            stored = {(row // 2, col // 2) for row, col in stored}
            if passes is None:
                halve_chunks(self.levels[number - 1], self.levels[number], sorted(stored))
            else:
                passes(number, sorted(stored))
        self._write_overview(overview, step)
        self.labels.attrs.update(
            multiscales=[_multiscale(LABEL_NAME, self.shapes, 1.0)],
            **{"image-label": {"version": NGFF_VERSION, "source": {"image": "../../"}}},
        )
        self.root["labels"].attrs.update(labels=[LABEL_NAME])

    def _write_overview(self, image: np.ndarray, step: int) -> None:
        shapes = [image.shape]
        _create_array(self.root, "0", image.shape, np.uint8)[:] = image
        while max(shapes[-1]) > 256:
            image = image[::2, ::2]
            shapes.append(image.shape)
            _create_array(self.root, str(len(shapes) - 1), image.shape, np.uint8)[:] = image
        self.root.attrs.update(
            multiscales=[_multiscale(self.name or "overview", shapes, float(step))],
            omero={"channels": [{"label": "grey", "color": "FFFFFF", "active": True,
                                 "window": {"start": 0, "end": 255, "min": 0, "max": 255}}]},
        )  # fmt: skip

    def close(self) -> None:
        self.store.close()


def relabel_chunks(
    level: Any, ids: Any, chunks: Iterable[tuple[int, int]], lookup: np.ndarray
) -> None:
    """The label image's level-0 ``chunks`` from the provisional ``ids`` through ``lookup``,
    each run of neighbouring chunks of a row read and written at once (a call to Zarr costs
    about a millisecond on top of its chunks)."""
    for row, first, end in _runs(chunks):
        ys = slice(row * CHUNK, (row + 1) * CHUNK)
        xs = slice(first * CHUNK, end * CHUNK)
        level[ys, xs] = lookup[ids[ys, xs]].astype(np.uint32)


_RUN_CHUNKS = 8  # chunks written in one call at most (a chunk of uint32 is 1 MB; halving
# reads four times as many)


def _runs(chunks: Iterable[tuple[int, int]]) -> Iterator[tuple[int, int, int]]:
    """(row, first column, end column) of the runs of neighbouring ``chunks`` in a row."""
    run: list[int] = []
    for row, col in sorted(chunks):
        if run and (row != run[0] or col != run[2] or col - run[1] == _RUN_CHUNKS):
            yield run[0], run[1], run[2]
            run = []
        run = [row, run[1] if run else col, col + 1]
    if run:
        yield run[0], run[1], run[2]


def halve_chunks(above: Any, level: Any, chunks: Iterable[tuple[int, int]]) -> None:
    """``chunks`` of a level from the level above it, every second pixel (nearest), a run of
    neighbouring chunks of a row at once."""
    for row, first, end in _runs(chunks):
        ys = slice(2 * row * CHUNK, 2 * (row + 1) * CHUNK)
        xs = slice(2 * first * CHUNK, 2 * end * CHUNK)
        block = above[ys, xs][::2, ::2]
        level[row * CHUNK : row * CHUNK + len(block),
              first * CHUNK : first * CHUNK + block.shape[1]] = block  # fmt: skip


@contextlib.contextmanager
def label_levels(folder: HeldFolder) -> Iterator[list[Any]]:
    """The levels of the label image :class:`LabelImage` is building in ``folder``, opened
    for writing chunks (by another process than the one that made them)."""
    store = FolderStore(folder)
    try:
        group = zarr.open_group(store, path=f"labels/{LABEL_NAME}", mode="r+", zarr_format=2,
                                use_consolidated=False)  # fmt: skip
        levels, number = [], 0
        while str(number) in group:
            levels.append(group[str(number)])
            number += 1
        yield levels
    finally:
        store.close()


def overview_and_labels(folder: HeldFolder) -> tuple[np.ndarray, np.ndarray]:
    """The overview of the label image held as ``folder`` (uint8) and its object ids on the
    overview's grid: the label level whose pixel is the overview's (log2 of the overview's
    step, both sampled by picking), cropped or padded with background to the overview's shape.

    The folder is the batch owner's to alter: every key is read through it, bounded as an
    input store's are (:class:`pipelines.storebounds.Guard`), and the arrays are checked to be
    what :class:`LabelImage` writes (2-D, of its types, the overview at most OVERVIEW_SIDE
    across, chunks at most CHUNK²) before any pixel is read, so that no array declared huge is
    allocated. One that is not raises (OSError, ValueError, LookupError, …).
    """
    guard = Guard()
    store = FolderStore(folder, read_only=True, guard=guard)
    try:
        root = zarr.open_group(store, mode="r", zarr_format=2, use_consolidated=False)
        step = _overview_step(root.attrs.asdict())
        overview = _checked(root, guard, "0", np.uint8, OVERVIEW_SIDE)[:]
        label_key = f"labels/{LABEL_NAME}/{step.bit_length() - 1}"
        level = _checked(root, guard, label_key, np.uint32)
        labels = np.zeros(overview.shape, np.uint32)
        rows, cols = (min(a, b) for a, b in zip(overview.shape, level.shape, strict=True))
        labels[:rows, :cols] = level[:rows, :cols]
        return overview, labels
    finally:
        store.close()


def _overview_step(attrs: dict[str, Any]) -> int:
    """The overview's step: its finest level's scale in input pixels, a power of two."""
    scale = attrs["multiscales"][0]["datasets"][0]["coordinateTransformations"][0]["scale"]
    step = int(scale[0])
    if step < 1 or step & (step - 1) or list(scale) != [step, step]:
        raise ValueError(f"the overview's scale {scale!r} is not a power of two")
    return step


def _checked(root: Any, guard: Guard, key: str, dtype: Any, side: int | None = None) -> Any:
    """The array ``key`` of ``root`` if it is shaped as :class:`LabelImage` writes it, admitted
    by ``guard`` (its chunks may be read)."""
    try:
        array = root[key]
    except KeyError:
        raise ValueError(f"it has no {key}") from None
    if not isinstance(array, zarr.Array) or array.ndim != 2 or array.dtype != dtype:
        raise ValueError(f"{key} is not a 2-D array of {np.dtype(dtype)}")
    too_large = side is not None and max(array.shape) > side
    if min(array.shape) < 1 or too_large or max(array.chunks) > CHUNK:
        raise ValueError(f"{key} has shape {array.shape} in chunks of {array.chunks}: "
                         "not an array this label image format writes")  # fmt: skip
    guard.admit(chunks_of(array))
    return array
