"""Images too large to decode whole (whole-slide TIFFs, OME-Zarr stores), in the inference job:
window by window in one task, or one region of several (:mod:`pipelines.tiles`), through the
same device stage as whole images (its windows in batches sized like theirs).

An image of more than ``max_whole_pixels`` pixels must be a TIFF or a store: its mask is written
as an OME-Zarr label image ``masks/<input path>.ome.zarr`` with its object table
``objects/<input path>.csv``, in memory bounded by the window size and the image's width
(:mod:`pipelines.tiles`, :mod:`pipelines.omezarr`). On threads as many as the job has CPUs, a
TIFF's tiles for the next row of windows are read and decoded while the net runs on this
row's, and each chunk row of provisional ids is compressed and written while the next bands
are labelled: the results are those of one thread, bit for bit.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from daemon.contract.checksums import sha256_of_stream
from daemon.contract.heldfolder import HeldFolder
from daemon.contract.jobspec import InputFile, Problem
from daemon.contract.names import is_store
from pipelines.bounds import stored, where
from pipelines.channels import ChannelProblem
from pipelines.images import checksum_problem, held_still, open_item, reading
from pipelines.inference.device import DeviceStage
from pipelines.inference.finish import MaskFolders
from pipelines.job import InputError, give_back_freed_memory, log
from pipelines.layout import label_image_name, objects_csv, objects_table_name, work_folder_name
from pipelines.ngff import open_store
from pipelines.omezarr import work_array
from pipelines.tiles import (
    RegionReader,
    Regions,
    TiledResult,
    segment_region,
    segment_tiled,
    tiled_row,
    window_cache_rows,
)

_PROGRESS_EVERY_S = 30.0
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
    ) -> None:  # fmt: skip
        """``work``: the run's work folder in the spool (a slide's regions go there);
        ``done``: takes an image segmented, its table row made (into the ledger once its label
        image is durable); ``threads``: read ahead and write behind on so many."""
        self.batch, self.masks, self.work, self.device = batch, masks, work, device
        self.threads = max(1, threads)
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
                    TiledProgress(item.path),
                )  # fmt: skip
        except InputError as exc:
            folder.remove_tree(target)
            return list(exc.problems)
        except ChannelProblem as exc:
            return [Problem(where(item), exc.message, exc.hint)]
        self.masks.run.write_text(objects_table_name(item.path), objects_csv(result.table))
        self.done(item, meta["digest"], {**tiled_row(result), "precision": self.device.precision})
        return []

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
        """The reader of a large input and what all reads of it must agree on: a TIFF's size
        and time (``hashed``: and its sha256, checked against the manifest's), an OME-Zarr
        store's state (:mod:`pipelines.ngff`; its digest the ledger's). The TIFF's windows are
        read where they lie in the file, so its sha256 comes from a read of its own before them,
        through the same open file; :func:`held_still` makes sure that the file did not change
        in between (the store is walked again after)."""
        params = self.params
        options = (window_cache_rows(params), params["channel"], float(params["glass_tolerance"]))
        if is_store(item.path):
            most = int(params["max_whole_pixels"])  # a chunk's pixels, as a TIFF tile's
            with open_store(self.batch, item, *options, most) as (store, state):
                yield self._read_ahead(store), {**state, "digest": state["state"]}
            return
        with open_item(self.batch, item) as handle, held_still(handle, item):
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
                yield self._read_ahead(reader), {"size": seen.st_size, "mtime_ns": seen.st_mtime_ns,
                               "digest": digest}  # fmt: skip
            finally:
                reader.close()
