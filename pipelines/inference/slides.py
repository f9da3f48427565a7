"""Images too large to decode whole (whole-slide TIFFs, OME-Zarr stores), in the inference job:
window by window in one task, or one region of several (:mod:`pipelines.tiles`), through the
same device stage as whole images (its windows in batches sized like theirs).

An image of more than ``max_whole_pixels`` pixels must be a TIFF or a store: its mask is written
as an OME-Zarr label image ``masks/<input path>.ome.zarr`` with its object table
``objects/<input path>.csv``, in memory bounded by the window size and the image's width
(:mod:`pipelines.tiles`, :mod:`pipelines.omezarr`).

With several CPUs, the job's workers segment such an image side by side, each one region of
its rows (:func:`parts`), as the regions' tasks of a slide split across jobs do: each opens the
file itself (it must be the file the job checked), reads and decodes its windows, blends,
thresholds, labels and measures them and writes its rows of provisional ids; their windows go
through the net here, in the batches one process would make of them (:meth:`pipelines.
inference.pool.Workers.parts`); the regions are then joined into the label image
(:func:`pipelines.tiles.assemble`), whose chunks the workers relabel and halve, each its share.
The temporary folders they write in lie in the owner's results folder: a worker opens them
by name, so it checks that they are the very folders the job made.
Alone, on threads as many as the job has CPUs, a TIFF's tiles for the next row of windows are
read and decoded while the net runs on this row's, and each chunk row of provisional ids is
compressed and written while the next bands are labelled. Either way the results are those of
one thread, bit for bit.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from numcodecs import blosc

from daemon.contract.checksums import sha256_of_stream
from daemon.contract.heldfolder import HeldFolder, UnsafeEntry
from daemon.contract.jobspec import Identity, InputFile, Problem
from daemon.contract.names import is_store
from pipelines.bounds import stored, where
from pipelines.channels import ChannelProblem
from pipelines.images import checksum_problem, held_still, open_item, reading
from pipelines.inference.masks import MaskFolders
from pipelines.job import InputError, give_back_freed_memory, log
from pipelines.layout import label_image_name, objects_csv, objects_table_name, work_folder_name
from pipelines.ngff import open_store
from pipelines.omezarr import CHUNK, halve_chunks, label_levels, relabel_chunks, work_array
from pipelines.tiles import (
    Chunks,
    Predict,
    RegionReader,
    RegionRecord,
    Regions,
    TiledResult,
    segment_region,
    segment_tiled,
    starts,
    tiled_row,
    window_cache_rows,
)

if TYPE_CHECKING:  # (torch: the job's main process only; the workers run parts of this)
    from pipelines.inference.device import DeviceStage
    from pipelines.inference.pool import Setup, Workers

_PROGRESS_EVERY_S = 30.0
# a region's worker holds its blend, bands and decoded tiles: about 8.5 kB a column of the image
# for 512² windows (pipelines.tiles); the regions of one image together hold at most this
_REGIONS_BYTES = 4 * 2**30
_COLUMN_BYTES = 9_000
_CPU_WINDOW_ROWS = 4  # on the CPU, rows of windows a region runs at least (see parts)
Done = Callable[[InputFile, str, dict[str, Any]], None]  # (input, its digest, its table row)


class TiledProgress:
    """After each row of windows of one large image: logs "rows of windows done" at most every
    30 s, and at the end; hands the heap's freed memory back (:func:`give_back_freed_memory`)."""

    def __init__(self, path: str) -> None:
        self.path, self.started = path, time.monotonic()
        self.last = self.started

    def __call__(self, done: int, total: int) -> None:
        give_back_freed_memory()
        now = time.monotonic()
        if now - self.last > _PROGRESS_EVERY_S or done == total:
            self.last = now
            log.info("%s: %d/%d rows of windows (%.0f s)", self.path, done, total,
                     now - self.started)  # fmt: skip


class Slides:
    """Segments the large inputs of a shard, in the job's main process."""

    def __init__(
        self, batch: HeldFolder, masks: MaskFolders, work: HeldFolder, device: DeviceStage,
        params: dict[str, Any], provenance: dict[str, Any], done: Done, threads: int = 1,
        workers: Workers | None = None,
    ) -> None:  # fmt: skip
        """``work``: the run's work folder in the spool (a slide's regions go there);
        ``done``: takes an image segmented, its table row made (into the ledger once its label
        image is durable); ``threads``: read ahead and write behind on so many; ``workers``:
        the job's, to segment an image's regions side by side."""
        self.batch, self.masks, self.work, self.device = batch, masks, work, device
        self.threads, self.workers = max(1, threads), workers
        self.pool: ThreadPoolExecutor | None = None  # made for the first large image
        self.params, self.provenance, self.done = params, provenance, done
        self.threshold = float(params["threshold"])
        self.min_area = int(params["min_object_area"])
        self.window = int(params["tile_size"])
        self.overlap = int(params["tile_overlap"])

    def _batch(self) -> int:
        return self.device.batch_size((self.window, self.window))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None

    def _read_ahead(self, reader: Regions) -> Regions:
        if self.pool is None:
            self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="tiles")
        reader.pool = self.pool
        return reader

    def tiled(self, item: InputFile) -> list[Problem]:
        """Segment one large TIFF, or an OME-Zarr store, window by window; its problems
        (checksum, changed) if any. A problem found after the mask was written drops it."""
        folder, name = self.masks.of(item.path)
        target = label_image_name(name)
        log.info("%s: tiled inference", item.path)
        try:
            with self._opened(item, hashed=True) as (reader, meta):
                result: TiledResult = segment_tiled(
                    reader, folder, target, self.device.probabilities, self.threshold,
                    self.min_area, self.window, self.overlap, self._batch(),
                    TiledProgress(item.path), side_by_side=self._side_by_side(item, meta, reader),
                )  # fmt: skip
        except InputError as exc:
            folder.remove_tree(target)
            return list(exc.problems)
        except ChannelProblem as exc:
            return [Problem(where(item), exc.message, exc.hint)]
        self.masks.run.write_text(objects_table_name(item.path), objects_csv(result.table))
        self.done(item, meta["digest"], {**tiled_row(result), "precision": self.device.precision})
        return []

    def _side_by_side(
        self, item: InputFile, meta: dict[str, Any], reader: Regions
    ) -> Beside | None:
        """The workers that segment ``item`` side by side (None: this process, alone)."""
        count = parts(reader, self.window, self.overlap, self.device.where.cuda,
                      0 if self.workers is None else self.workers.count)  # fmt: skip
        if count < 2:
            return None
        assert self.workers is not None
        log.info("%s: %d regions side by side", item.path, count)
        seen = {key: value for key, value in meta.items() if key != "digest"}
        return Beside(self.workers, count, item, seen, self.params, self.device.probabilities,
                      self._batch(), self.masks.of(item.path)[0])  # fmt: skip

    def region(self, item: InputFile, index: int, count: int) -> list[Problem]:
        """Segment region ``index`` of ``count`` of one large TIFF or OME-Zarr store: its
        provisional ids into the image's work folder (shared by its regions' jobs), its record
        beside them; the assembly job makes the label image, the object table and the row."""
        log.info("%s: region %d of %d", item.path, index + 1, count)
        try:
            with (
                self._opened(item, hashed=False) as (reader, meta),
                self.work.folder(work_folder_name(item.path), create=True) as work,
            ):
                store, ids = work_array(work, reader.height, reader.width)
                try:
                    record = segment_region(
                        reader, self.device.probabilities, self.threshold, ids, index, count,
                        self.window, self.overlap, self._batch(), TiledProgress(item.path),
                    )  # fmt: skip
                finally:
                    store.close()
                record.meta = {**meta, "height": reader.height, "width": reader.width,
                               "provenance": self.provenance,
                               "precision": self.device.precision}  # fmt: skip
                del record.meta["digest"]
                work.write_bytes(record.name(), record.to_bytes())
        except InputError as exc:
            return list(exc.problems)
        except ChannelProblem as exc:
            return [Problem(where(item), exc.message, exc.hint)]
        return []

    @contextlib.contextmanager
    def _opened(self, item: InputFile, hashed: bool) -> Iterator[tuple[Regions, dict[str, Any]]]:
        with opened(self.batch, item, self.params, hashed) as (reader, meta):
            yield self._read_ahead(reader), meta


@contextlib.contextmanager
def opened(
    batch: HeldFolder, item: InputFile, params: dict[str, Any], hashed: bool
) -> Iterator[tuple[Regions, dict[str, Any]]]:
    """The reader of a large input and what all reads of it must agree on: a TIFF's size and
    time (``hashed``: and its sha256, checked against the manifest's), an OME-Zarr store's
    state (:mod:`pipelines.ngff`; its digest the ledger's). The TIFF's windows are read where
    they lie in the file, so its sha256 comes from a read of its own before them, through the
    same open file; :func:`held_still` makes sure that the file did not change in between (the
    store is walked again after)."""
    options = (window_cache_rows(params), params["channel"], float(params["glass_tolerance"]))
    if is_store(item.path):
        most = int(params["max_whole_pixels"])  # a chunk's pixels, as a TIFF tile's
        with open_store(batch, item, *options, most) as (store, state):
            yield store, {**state, "digest": state["state"]}
        return
    with open_item(batch, item) as handle, held_still(handle, item):
        with reading(item):
            stored(handle, item)
            digest = sha256_of_stream(handle) if hashed else ""
        problem = checksum_problem(item, digest) if hashed else None
        if problem is not None:
            raise InputError("checksum mismatch", [problem])
        handle.seek(0)
        seen = os.fstat(handle.fileno())
        reader = RegionReader(handle, *options, item.path)
        try:
            yield reader, {"size": seen.st_size, "mtime_ns": seen.st_mtime_ns, "digest": digest}
        finally:
            reader.close()


def parts(reader: Regions, window: int, overlap: int, cuda: bool, workers: int) -> int:
    """Into how many regions the job's ``workers`` split an image to segment it side by side:
    one each, but no more than its rows of label chunks (a region is whole chunk rows), nor
    than :data:`_REGIONS_BYTES` of their memory holds; on the CPU, where the net is most of
    the work, no more than one for every :data:`_CPU_WINDOW_ROWS` rows of windows (a region
    runs again the windows of the row above its first that reach into it). 1: the job
    segments it alone."""
    rows = len(starts(reader.height, window, max(window - overlap, 1)))
    memory = _REGIONS_BYTES // (_COLUMN_BYTES * reader.width)
    most = [workers, math.ceil(reader.height / CHUNK), memory]
    if not cuda:
        most.append(rows // _CPU_WINDOW_ROWS)
    return max(1, min(most))


class Beside:
    """The passes over one large image that the job's workers run side by side
    (:class:`pipelines.tiles.SideBySide`): its regions, ``count`` of them, each worker's
    windows through the net here; then the label image's chunks, shared out the same way."""

    def __init__(
        self, workers: Workers, count: int, item: InputFile, seen: dict[str, Any],
        params: dict[str, Any], predict: Predict, batch: int, masks: HeldFolder,
    ) -> None:  # fmt: skip
        """``masks``: the folder of the image's mask, where the temporary folders are made."""
        self.workers, self.count, self.item, self.seen = workers, count, item, seen
        self.params, self.predict, self.batch, self.masks = params, predict, batch, masks

    def _held(self, name: str) -> Held:
        """The temporary folder ``name`` of the mask's folder, as this process holds it."""
        with self.masks.folder(name) as folder:
            return Held(name, Identity.of(os.fstat(folder.fd)))

    def regions(self, reader: Regions, ids: Any, work: str) -> list[RegionRecord]:
        held = self._held(work)
        found = self.workers.parts(
            [RegionPart(self.item, self.seen, held, index, self.count, self.params, self.batch)
             for index in range(self.count)], self.predict,
        )  # fmt: skip
        records = [record for record in found if isinstance(record, RegionRecord)]
        if len(records) < len(found):  # each region's problems, once
            problems = [
                p for record in found if not isinstance(record, RegionRecord) for p in record
            ]
            raise InputError("problems in regions", list(dict.fromkeys(problems)))
        return records

    def relabel(self, work: str, building: str, parts: list[tuple[Chunks, np.ndarray]]) -> None:
        ids, labels = self._held(work), self._held(building)
        self.workers.parts([RelabelPart(self.item, ids, labels, chunks, lookup)
                            for chunks, lookup in parts])  # fmt: skip

    def halve(self, building: str, level: int, chunks: Chunks) -> None:
        labels, shares = self._held(building), min(self.count, len(chunks))
        self.workers.parts([
            HalvePart(self.item, labels, level, chunks[k * len(chunks) // shares :
                                                       (k + 1) * len(chunks) // shares])
            for k in range(shares)
        ])  # fmt: skip


@dataclass(frozen=True)
class Held:
    """A temporary folder in the mask's folder, named, and which folder it is, as the job's
    main process made it."""

    name: str
    identity: Identity


@dataclass(frozen=True)
class RegionPart:
    """One region of a large image, for a worker: its provisional ids into the level-0 array
    in ``folder`` (a temporary folder in the mask's folder), its record back, or its
    problems. The worker opens the input itself, by the batch folder's rule, and it must be
    the file the job opened (the same size and time, or store state)."""

    item: InputFile
    seen: dict[str, Any]  # what the job's own read of it found
    folder: Held
    index: int
    count: int
    params: dict[str, Any]
    batch: int  # windows through the net at once

    def __call__(self, setup: Setup, predict: Predict) -> RegionRecord | list[Problem]:
        item, params = self.item, self.params
        _one_thread()
        try:
            with (
                opened(setup.batch, item, params, hashed=False) as (reader, meta),
                _mask_folder(setup, item, self.folder) as held,
            ):
                if any(meta.get(key) != value for key, value in self.seen.items()):
                    raise InputError("changed", [Problem(
                        where(item), "changed while it was being segmented (a region's read "
                        "found another size or modification time)",
                        "leave the file as it is, then ask an operator to retry the batch",
                    )])  # fmt: skip
                store, ids = work_array(held, reader.height, reader.width)
                try:
                    return segment_region(
                        reader, predict, float(params["threshold"]), ids, self.index,
                        self.count, int(params["tile_size"]), int(params["tile_overlap"]),
                        self.batch, TiledProgress(f"{item.path}, region {self.index + 1}"),
                        rows_weigh=True,  # the net runs in the main process, for all regions
                    )  # fmt: skip
                finally:
                    store.close()
        except InputError as exc:
            return list(exc.problems)
        except ChannelProblem as exc:
            return [Problem(where(item), exc.message, exc.hint)]


@dataclass(frozen=True)
class RelabelPart:
    """Chunks of a label image's level 0 from the provisional ids, for a worker."""

    item: InputFile
    work: Held  # the ids' temporary folder in the mask's folder
    building: Held  # the label image's
    chunks: Chunks
    lookup: np.ndarray

    def __call__(self, setup: Setup, predict: Predict) -> None:
        _one_thread()
        with (
            _mask_folder(setup, self.item, self.work) as work,
            _mask_folder(setup, self.item, self.building) as building,
            label_levels(building) as levels,
        ):
            store, ids = work_array(work, *levels[0].shape)
            try:
                relabel_chunks(levels[0], ids, self.chunks, self.lookup)
            finally:
                store.close()


@dataclass(frozen=True)
class HalvePart:
    """Chunks of a label image's lower ``level`` from the level above, for a worker."""

    item: InputFile
    building: Held
    level: int
    chunks: Chunks

    def __call__(self, setup: Setup, predict: Predict) -> None:
        _one_thread()
        with (
            _mask_folder(setup, self.item, self.building) as building,
            label_levels(building) as levels,
        ):
            halve_chunks(levels[self.level - 1], levels[self.level], self.chunks)


def _one_thread() -> None:
    """A worker is one of the job's CPUs: its chunks are compressed and decompressed on one
    thread (Blosc takes as many as the machine has cores, in every worker)."""
    blosc.set_nthreads(1)


@contextlib.contextmanager
def _mask_folder(setup: Setup, item: InputFile, made: Held) -> Iterator[HeldFolder]:
    """The temporary folder ``made`` in the folder of ``item``'s mask, held (in a worker): the
    very folder the job made, or :class:`UnsafeEntry` (the owner's folder swapped in)."""
    masks = MaskFolders(setup.run)
    try:
        folder, _ = masks.of(item.path)
        with folder.folder(made.name) as held:
            if not Identity.of(os.fstat(held.fd)).same(made.identity):
                name = str(held.path.relative_to(setup.run.path))
                raise UnsafeEntry(errno.ESTALE, name, "was replaced while the job wrote in it")
            yield held
    finally:
        masks.close()
