"""Inference job: segment one shard's images with a registered model.

``python -m pipelines.infer JOB_DIR``. For every image input of the spec (the daemon gives each
shard only its own), inside ``run_dir`` (the owner's results folder):

- ``masks/<input path>``: the mask, same relative path, name and format as the input;

and inside ``work_dir`` (the run's work folder in the spool, where the owner cannot write):

- ``parts/table-<shard index, 4 digits>.csv``: one row per image (:data:`TABLE_COLUMNS`);
- ``ledger/shard-<shard index>.jsonl``: what is done (:mod:`pipelines.ledger`): a re-run of the
  shard skips images already segmented from the same bytes with the same model and params.

The model is loaded (and its sha256 checked) once per shard. Images are read and decoded by
DataLoader workers ahead of the net (prefetch) and handed over in shared memory, a chunk at a
time (:mod:`pipelines.reader`); images of one size go through the net in batches of
``batch_size``, under ``inference_mode`` in channels-last layout (what measured fastest on CPU;
see docs/benchmarks.md). Each image's mask is labelled, written, measured and recorded in the
ledger by one finisher thread, in order, while the net runs on the next images. An image of
more than ``max_whole_pixels`` pixels must be a TIFF: it is segmented window by window and its
mask written as an OME-Zarr label image ``masks/<input path>.ome.zarr`` with its object table
``objects/<input path>.csv``, in memory bounded by the window size and the image's width
(:mod:`pipelines.tiles`, :mod:`pipelines.omezarr`).

A pixel is foreground when the sigmoid probability exceeds ``threshold``; connected components
(8-connected) smaller than ``min_object_area`` pixels are removed and not counted. An image
segmented whole then has touching objects cut apart where they narrow (``split_neck``,
:mod:`pipelines.instances`: one call, in :meth:`Segmenter._finish`), one pixel of background
between them in its mask; one segmented window by window keeps its connected components. Per
image:
``area_px`` is the total foreground area, ``equivalent_diameter_px`` the diameter of a circle
of that area, ``objects`` the number of objects kept, ``mean_intensity`` the mean grey value
(0–1) under the mask (empty when there is no object), ``confidence`` the mean of |2p − 1| over
the image (1: every pixel decided with certainty), ``tiled`` whether it went window by window;
then the provenance: model name, version and sha256, the manifest's sha256, the code version.

Images with problems (unreadable, checksum mismatch) do not stop the others: every problem is
collected, and the job fails with all of them at the end without writing the shard table.

Every output is written through the held run folder (:func:`pipelines.job.run_folder`) or the
held work folder (:func:`pipelines.job.work_folder`); each folder of masks is held once for the
job's life (:class:`MaskFolders`), not reopened per image.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import stat
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import torch

from daemon.contract.checksums import sha256_of_stream
from daemon.contract.heldfolder import HeldFolder, parts_of
from daemon.contract.jobspec import (
    JOBS_DIR,
    PROGRESS_FILE,
    InputFile,
    JobSpec,
    Pipeline,
    Problem,
    Role,
)
from daemon.contract.names import inference_params, is_store
from daemon.contract.version import code_version
from models import registry
from models.registry import ModelError, ModelVersion
from models.unet import UNet
from pipelines.bounds import stored, where
from pipelines.channels import ChannelProblem
from pipelines.device import Placement, choose_device
from pipelines.images import checksum_problem, held_still, open_item, reading, write_mask
from pipelines.instances import components, label_objects
from pipelines.job import (
    InputError,
    give_back_freed_memory,
    log,
    run_folder,
    run_job,
    work_folder,
)
from pipelines.layout import (
    MASKS_DIR,
    PARTS_DIR,
    image_stats,
    label_image_name,
    ledger_name,
    mask_name,
    objects_csv,
    objects_table_name,
    table_csv,
    table_name,
    work_folder_name,
)
from pipelines.ledger import Ledger
from pipelines.ngff import open_store
from pipelines.omezarr import work_array
from pipelines.reader import read_ahead
from pipelines.tiles import (
    RegionReader,
    Regions,
    TiledResult,
    job_region,
    segment_region,
    segment_tiled,
    tiled_row,
    window_cache_rows,
)

ON_CPU = Placement("cpu", 1, False, "")
_PROGRESS_EVERY_S = 30.0
_PROGRESS_SAY_S = 5.0
_FINISHING_AHEAD = 4  # images whose masks wait for the finisher, at most …
_FINISHING_PIXELS = 2048 * 2048  # … and pixels: one large image at a time


def clean_mask(
    probabilities: np.ndarray, threshold: float, min_area: int
) -> tuple[np.ndarray, int]:
    """Threshold, then drop components smaller than ``min_area``; return (mask, objects)."""
    labels = components(probabilities > threshold, min_area)
    return labels > 0, int(labels.max())


def measure(image: np.ndarray, mask: np.ndarray, objects: int) -> dict[str, Any]:
    """The per-image statistics of the table (without confidence, path and provenance)."""
    area = int(mask.sum())
    intensity = float(image[mask].sum()) if area else 0.0
    return image_stats(image.shape[1], image.shape[0], area, objects, intensity)


def load_model(spec: JobSpec) -> tuple[UNet, ModelVersion]:
    """Resolve, verify and build the spec's model, ready for inference."""
    version = registry.resolve(Path(spec.registry_dir), spec.model.name, spec.model.version)
    state = registry.load(version)
    try:
        net = UNet(**version.architecture)
        net.load_state_dict(state)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ModelError(
            f"model {version.name!r} version {version.version}: the weights do not fit the "
            f"architecture in its metadata {version.architecture} ({exc})"
        ) from exc
    net.eval()
    return net.to(memory_format=torch.channels_last), version


@torch.inference_mode()
def predict(net: UNet, images: np.ndarray, where: Placement = ON_CPU) -> np.ndarray:
    """Sigmoid probabilities (N, H, W) for a stack of grey images (N, H, W), on the CPU or
    on the GPU ``where`` names (from pinned memory, copied asynchronously; in half precision
    under autocast when ``where.mixed_precision``)."""
    tensor = torch.from_numpy(np.ascontiguousarray(images))[:, None]
    if not where.cuda:
        logits = net(tensor.contiguous(memory_format=torch.channels_last))
        return torch.sigmoid(logits)[:, 0].numpy()
    on_device = tensor.pin_memory().to(where.device, non_blocking=True)
    with torch.autocast("cuda", dtype=torch.float16, enabled=where.mixed_precision):
        logits = net(on_device.contiguous(memory_format=torch.channels_last))
    return torch.sigmoid(logits.float())[:, 0].cpu().numpy()


def placed(net: UNet, spec: JobSpec) -> tuple[UNet, Placement]:
    """The net moved where this job runs it (see :mod:`pipelines.device`)."""
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    where = choose_device(spec.resources.gpus, os.environ, cuda, spec.params)
    log.info("inference on %s, %d image(s) at once: %s", where.device, where.batch_size,
             where.reason)  # fmt: skip
    return net.to(where.device), where


def precision_check(net: UNet, images: np.ndarray, where: Placement, params: Any) -> Placement:
    """Half precision only where it changes no mask: the first batch's masks in half and in
    full precision compared; full precision from then on if one pixel differs."""
    if not (where.cuda and where.mixed_precision):
        return where
    full = replace(where, mixed_precision=False)
    threshold, min_area = float(params["threshold"]), int(params["min_object_area"])
    masks = [
        [clean_mask(p, threshold, min_area)[0] for p in predict(net, images, w)]
        for w in (where, full)
    ]
    if all(np.array_equal(a, b) for a, b in zip(*masks, strict=True)):
        log.info("mixed precision: the first %d masks equal full precision's", len(images))
        return where
    log.info("mixed precision changes masks of the first batch: full precision")
    return full


class Progress:
    """Logs "done/total images" at most every 30 s, and at the end; gives the shard's images
    done (those the ledger had included) to ``say`` at most every 5 s, and at the end: the
    daemon's progress per image."""

    def __init__(self, total: int, say: Callable[[int], None], done_before: int = 0) -> None:
        self.total, self.started, self.done = total, time.monotonic(), 0
        self.last = self.said = self.started
        self.say, self.before = say, done_before
        say(done_before)

    def tick(self, count: int = 1) -> None:
        self.done += count
        now = time.monotonic()
        if now - self.last > _PROGRESS_EVERY_S or self.done == self.total:
            self.last = now
            per_image = (now - self.started) / max(self.done, 1)
            log.info("%d/%d images (%.3f s/image)", self.done, self.total, per_image)
        if now - self.said > _PROGRESS_SAY_S or self.done == self.total:
            self.said = now
            self.say(self.before + self.done)


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


class MaskFolders:
    """The folders of masks under ``masks/`` of the held run folder, each held once (made when
    first needed) and kept for the job's life: a mask write opens only its own file."""

    def __init__(self, run: HeldFolder) -> None:
        self.run = run
        self.held: dict[str, HeldFolder] = {}

    def of(self, input_path: str) -> tuple[HeldFolder, str]:
        """The held folder of the mask of ``input_path``, and the input's name (its mask's
        is :func:`mask_name` of it, its label image's :func:`label_image_name`)."""
        *above, name = parts_of(input_path)
        folder = "/".join((MASKS_DIR, *above))
        if folder not in self.held:
            self.held[folder] = self.run.folder(folder, create=True)
        return self.held[folder], name

    def present(self, input_path: str, tiled: bool) -> bool:
        """Whether the mask of ``input_path`` is there (nothing is made): a plain file, or the
        label image's folder for an image segmented window by window."""
        try:
            if tiled:
                label_image = f"{MASKS_DIR}/{label_image_name(input_path)}"
                return stat.S_ISDIR(self.run.lstat(label_image).st_mode)
            return stat.S_ISREG(self.run.lstat(f"{MASKS_DIR}/{mask_name(input_path)}").st_mode)
        except (OSError, ValueError):  # missing, or a planted entry on the way
            return False

    def close(self) -> None:
        for folder in self.held.values():
            folder.close()
        self.held.clear()


class Segmenter:
    """Segments loaded images (batched by size) and tiled ones; writes masks, ledger rows."""

    def __init__(
        self, spec: JobSpec, batch: HeldFolder, net: UNet, provenance: dict[str, Any],
        ledger: Ledger, masks: MaskFolders, work: HeldFolder,
    ) -> None:  # fmt: skip
        self.spec, self.provenance, self.ledger = spec, provenance, ledger
        self.work = work  # the run's work folder in the spool: a slide's regions go there
        self.batch = batch  # the inputs are read through it
        self.params = params = inference_params(spec.params)
        self.threshold, self.min_area = float(params["threshold"]), int(params["min_object_area"])
        self.split_neck = float(params["split_neck"])
        self.net, self.where = placed(net, spec)
        self.checked = not self.where.cuda  # half precision checked against full, on a GPU
        self.batch_size = self.where.batch_size
        self.masks = masks
        self.rows: dict[str, dict[str, Any]] = {}
        self.pending: list[tuple[InputFile, str, np.ndarray]] = []
        # The masks are labelled, written and recorded by one thread (in order) while the net
        # runs on the next images: the main thread does not wait on the mask's fsync.
        self.finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="finisher")
        self.finishing: deque[tuple[Future[None], int]] = deque()  # and each image's pixels

    def add(self, item: InputFile, digest: str, pixels: np.ndarray) -> None:
        """Queue a decoded image; a full batch, or an image of another size, flushes."""
        if self.pending and self.pending[0][2].shape != pixels.shape:
            self.flush()
        self.pending.append((item, digest, pixels))
        if len(self.pending) >= self.batch_size:
            self.flush()

    def flush(self) -> None:
        """Run the net on the queued images; their masks are finished by the finisher."""
        if not self.pending:
            return
        stack = np.stack([pixels for _, _, pixels in self.pending])
        if not self.checked:
            self.where, self.checked = (
                precision_check(self.net, stack, self.where, self.params),
                True,
            )
        for (item, digest, pixels), probabilities in zip(
            self.pending, predict(self.net, stack, self.where), strict=True
        ):
            while self.finishing and (
                len(self.finishing) >= _FINISHING_AHEAD
                or sum(size for _, size in self.finishing) + pixels.size > _FINISHING_PIXELS
            ):
                self.finishing.popleft()[0].result()
            future = self.finisher.submit(self._finish, item, digest, pixels, probabilities)
            self.finishing.append((future, pixels.size))
        self.pending = []

    def _finish(
        self, item: InputFile, digest: str, pixels: np.ndarray, probabilities: np.ndarray
    ) -> None:
        """In the finisher thread: label, write the mask, measure, record in the ledger."""
        # where the mask becomes objects: touching ones cut apart (pipelines.instances)
        labels = label_objects(probabilities, self.threshold, self.min_area, self.split_neck)
        mask, objects = labels > 0, int(labels.max())
        folder, name = self.masks.of(item.path)
        write_mask(folder, mask_name(name), mask)
        confidence = float(np.abs(2 * probabilities - 1).mean())
        row = {**measure(pixels, mask, objects), "confidence": round(confidence, 4)}
        self._done(item, digest, {**row, "tiled": 0})

    def finish(self) -> None:
        """Run the net on what is queued and wait until every mask is written; the first
        error of the finisher (the share failing under a mask write) is raised here."""
        self.flush()
        while self.finishing:
            self.finishing.popleft()[0].result()

    def close(self) -> None:
        """Stop the finisher, after the masks it has in hand (none is left half written)."""
        self.finisher.shutdown(wait=True, cancel_futures=True)

    def tiled(self, item: InputFile) -> list[Problem]:
        """Segment one large TIFF, or an OME-Zarr store, window by window; its problems
        (checksum, changed) if any. A problem found after the mask was written drops it."""
        folder, name = self.masks.of(item.path)
        target = label_image_name(name)
        try:
            with self._opened(item, hashed=True) as (reader, meta):
                result = self._segment_tiled(item, reader, folder, target)
        except InputError as exc:
            folder.remove_tree(target)
            return list(exc.problems)
        except ChannelProblem as exc:
            return [Problem(where(item), exc.message, exc.hint)]
        self.masks.run.write_text(objects_table_name(item.path), objects_csv(result.table))
        self._done(item, meta["digest"], tiled_row(result))
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
                yield store, {**state, "digest": state["state"]}
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
                yield reader, {"size": seen.st_size, "mtime_ns": seen.st_mtime_ns,
                               "digest": digest}  # fmt: skip
            finally:
                reader.close()

    def region(self, item: InputFile, index: int, count: int) -> list[Problem]:
        """Segment region ``index`` of ``count`` of one large TIFF or OME-Zarr store: its
        provisional ids into the image's work folder (shared by its regions' jobs), its record
        beside them; the assembly job makes the label image, the object table and the row."""
        log.info("%s: region %d of %d", item.path, index + 1, count)
        params = self.params
        try:
            with (
                self._opened(item, hashed=False) as (reader, meta),
                self.work.folder(work_folder_name(item.path), create=True) as work,
            ):
                store, ids = work_array(work, reader.height, reader.width)
                try:
                    record = segment_region(
                        reader, self._predict(), self.threshold, ids, index, count,
                        int(params["tile_size"]), int(params["tile_overlap"]),
                        self.batch_size, TiledProgress(item.path),
                    )  # fmt: skip
                finally:
                    store.close()
                record.meta = {**meta, "height": reader.height, "width": reader.width,
                               "provenance": self.provenance}  # fmt: skip
                del record.meta["digest"]
                work.write_bytes(record.name(), record.to_bytes())
        except InputError as exc:
            return list(exc.problems)
        except ChannelProblem as exc:
            return [Problem(where(item), exc.message, exc.hint)]
        return []

    def _predict(self) -> Callable[[np.ndarray], np.ndarray]:
        # (half precision is used for windows only once whole images showed it changes no mask)
        where = self.where if self.checked else replace(self.where, mixed_precision=False)
        return lambda tiles: predict(self.net, tiles, where)

    def _segment_tiled(
        self, item: InputFile, reader: Regions, folder: HeldFolder, target: str
    ) -> TiledResult:
        params = self.params
        log.info("%s: tiled inference", item.path)
        return segment_tiled(
            reader, folder, target, self._predict(), self.threshold,
            self.min_area, int(params["tile_size"]), int(params["tile_overlap"]),
            self.batch_size, TiledProgress(item.path),
        )  # fmt: skip

    def _done(self, item: InputFile, digest: str, stats: dict[str, Any]) -> None:
        row = {"path": item.path, **stats, **self.provenance}
        self.rows[item.path] = row
        self.ledger.record(item.path, digest, row)


def segment(
    spec: JobSpec, segmenter: Segmenter, items: list[InputFile], progress: Progress
) -> tuple[dict[str, dict[str, Any]], list[Problem]]:
    """Segment every item, writing its mask; return the table rows and the input problems."""
    problems: list[Problem] = []
    max_pixels = int(inference_params(spec.params)["max_whole_pixels"])
    channel = inference_params(spec.params)["channel"]
    region = job_region(spec.params)
    reader = read_ahead(segmenter.batch, items, max_pixels, spec.resources.cpus, channel)
    for loaded in reader:
        problems += loaded.problems
        if loaded.tiled and region is not None:
            problems += segmenter.region(loaded.item, *region)
        elif loaded.tiled:
            segmenter.finish()
            problems += segmenter.tiled(loaded.item)
        elif region is not None and region[0] > 0:
            pass  # small enough to go whole: the first region's job does it
        elif loaded.pixels is not None:
            segmenter.add(loaded.item, loaded.sha256, loaded.pixels)
        progress.tick()
    segmenter.finish()
    return segmenter.rows, problems


def infer(spec: JobSpec, job_dir: Path, batch: HeldFolder) -> dict[str, Any]:
    """The inference job for one shard."""
    net, version = load_model(spec)
    with run_folder(spec, batch) as run, work_folder(spec) as work:
        return _infer(spec, net, version, batch, run, work)


def _infer(
    spec: JobSpec, net: UNet, version: ModelVersion, batch: HeldFolder, run: HeldFolder,
    work: HeldFolder,
) -> dict[str, Any]:  # fmt: skip
    """The inference job for one shard, reading through the held batch folder, writing masks
    under the held run folder ``run`` and what the next jobs read under the work folder."""
    log.info("model %s version %d (sha256 %s…)", version.name, version.version, version.sha256[:12])
    provenance = {
        "model_name": version.name,
        "model_version": version.version,
        "model_sha256": version.sha256,
        "manifest_sha256": spec.manifest_sha256,
        "code_version": code_version(),
    }
    items = [item for item in spec.inputs if item.role is Role.IMAGE]
    ledger = Ledger(work, ledger_name(spec.shard.index), version.sha256, spec.params)
    masks = MaskFolders(run)
    resumed = {}
    for item in items:
        row = ledger.done_row(item, batch, masks.present)
        if row is not None:
            resumed[item.path] = row
    if resumed:
        log.info("%d of %d images already done (ledger): skipped", len(resumed), len(items))
    started, cpu_started = time.monotonic(), _cpu_seconds()
    todo = [item for item in items if item.path not in resumed]
    segmenter = Segmenter(spec, batch, net, provenance, ledger, masks, work)
    progress = Progress(len(todo), _progress_file(spec, work, len(items)), len(resumed))
    try:
        rows, problems = segment(spec, segmenter, todo, progress)
    finally:
        segmenter.close()
        ledger.close()
        masks.close()
    if problems:
        raise InputError(f"{len(problems)} problem(s) with the images of this shard", problems)
    # a region's image has its row from the assembly job
    table_rows = [row for item in items if (row := resumed.get(item.path) or rows.get(item.path))]
    table = PurePosixPath(PARTS_DIR, table_name(spec.shard.index))
    work.write_text(table, table_csv(table_rows))
    return {
        "images": len(table_rows),
        "segmented": len(rows),
        "resumed": len(resumed),
        "images_with_objects": sum(1 for row in table_rows if int(row["objects"])),
        "objects": sum(int(row["objects"]) for row in table_rows),
        "table": str(table),
        "model": {**provenance, "requested_version": spec.model.version},
        "shard": {"index": spec.shard.index, "count": spec.shard.count},
        "seconds_per_image": round((time.monotonic() - started) / max(len(rows), 1), 4),
        "cpu_seconds_per_image": round((_cpu_seconds() - cpu_started) / max(len(rows), 1), 4),
    }


def _progress_file(spec: JobSpec, work: HeldFolder, total: int) -> Callable[[int], None]:
    """Writes the job's progress file (what the daemon reads for ``watchctl``); a write that
    fails is logged and the work goes on."""
    name = f"{JOBS_DIR}/{spec.job_name}/{PROGRESS_FILE}"

    def say(done: int) -> None:
        try:
            work.write_text(name, json.dumps({"done": done, "total": total}))
        except OSError as exc:
            log.warning("progress not written: %s", exc)

    return say


def _cpu_seconds() -> float:
    """CPU time of this process and its ended children (the loader's workers, once joined):
    on a shared machine it shows the work done, whatever else competes for the cores."""
    own, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


if __name__ == "__main__":
    raise SystemExit(run_job(Pipeline.INFER, infer))
