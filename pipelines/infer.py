"""Inference job: segment one shard's images with a registered model.

``python -m pipelines.infer JOB_DIR``. For every image input of the spec (the daemon gives each
shard only its own), inside ``run_dir`` (the owner's results folder):

- ``masks/<input path>``: the mask, same relative path, name and format as the input;

and inside ``work_dir`` (the run's work folder in the spool, where the owner cannot write):

- ``parts/table-<shard index, 4 digits>.csv``: one row per image (:data:`TABLE_COLUMNS`);
- ``ledger/shard-<shard index>.jsonl``: what is done (:mod:`pipelines.ledger`): a re-run of the
  shard skips images already segmented from the same bytes with the same model and params.

The job runs as stages (:mod:`pipelines.inference`): as many worker processes as the job has
CPUs read and decode the images ahead of the net and finish their masks behind it (label,
measure, encode, write: :mod:`pipelines.inference.finish`); the net runs in this process, on the
CPU or the GPU it was given (:mod:`pipelines.inference.device`), in batches of one size; masks
are made durable together and only then recorded in the ledger. An image segmented whole has
touching objects cut apart where they narrow (``split_neck``, :mod:`pipelines.instances`: one
call, :func:`pipelines.inference.finish.object_ids`), one pixel of background between them in
its mask; one segmented window by window keeps its connected components. An image of more than
``max_whole_pixels`` pixels is segmented window by window (:mod:`pipelines.inference.slides`).

Each process of the job imports only what it needs. This one starts with the steering code alone
(~0.2 s of imports) and forks the process that starts the workers; then, side by side, that one
imports the code of their stages once (Pillow, libpng, scipy, scikit-image: ~0.5 s), forks the
workers, which share it, and ends, and the workers read the images the net needs first
(:meth:`pipelines.inference.stages.Stages.ahead`), while this process imports torch (1–2 s,
:func:`pipelines.job.importing_late`) and loads the model (its sha256 checked), once per shard.
The job's start then costs the time of torch's imports, not of all imports one after the other;
the workers run at a lower priority (:data:`pipelines.inference.pool.WORKER_NICENESS`), so that
torch's imports, then the steering, get a CPU first and the workers the rest (docs/benchmarks.md).

Each table row also says the precision its mask was made in (``fp32``; on a GPU what the first
batch allowed: :mod:`pipelines.inference.placement`), then the provenance: model name, version
and sha256, the manifest's sha256, the code version.

Images with problems (unreadable, checksum mismatch) do not stop the others: every problem is
collected, and the job fails with all of them at the end without writing the shard table.

Every output is written through the held run folder (:func:`pipelines.job.run_folder`) or the
held work folder (:func:`pipelines.job.work_folder`); each folder of masks is held once per
process for the job's life, not reopened per image.
"""

from __future__ import annotations

import json
import os
import resource
import time
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from daemon.contract.heldfolder import HeldFolder
from daemon.contract.jobspec import (
    JOBS_DIR,
    PROGRESS_FILE,
    RESIDENT_DEVICES_ENV,
    InputFile,
    JobSpec,
    Pipeline,
    Problem,
    Role,
)
from daemon.contract.names import inference_params
from daemon.contract.version import code_version
from models import catalog
from pipelines.inference import durable, remote
from pipelines.inference.masks import MaskFolders, Rules
from pipelines.inference.placement import choose_device
from pipelines.inference.pool import Setup, Workers
from pipelines.inference.remote import RemoteDevice
from pipelines.inference.stages import Committer, Stages, chunk_images
from pipelines.job import InputError, importing_late, log, main, run_folder, work_folder
from pipelines.layout import PARTS_DIR, job_region, ledger_name, table_csv, table_name
from pipelines.ledger import Ledger

if TYPE_CHECKING:
    from models.catalog import ModelVersion
    from pipelines.inference.device import DeviceStage
    from pipelines.inference.slides import Slides

# What a launcher started ahead for this job imports (daemon/executors/spares.py): torch and the
# net (not where resident devices run the nets: the executor says so), the workers' stages,
# which a job started cold imports beside torch, and the slide code, which it imports at its
# first slide (~0.2 s, one after the other). None of them may start CUDA, threads or processes
# as it is imported: the job is forked from there.
_NET_HERE = () if os.environ.get(RESIDENT_DEVICES_ENV) else ("torch", "pipelines.inference.device")
WARM_IMPORTS = (*_NET_HERE, "pipelines.inference.finish", "pipelines.inference.source",
                "pipelines.inference.slides")  # fmt: skip
_PROGRESS_EVERY_S = 30.0
_PROGRESS_SAY_S = 5.0
_FIRST_GPU_BATCH = 64  # the batch a GPU's chunks are sized for before the first image is seen


class Progress:
    """Logs "done/total images" at most every 30 s, and at the end; gives the shard's images
    done (those the ledger had included) to ``say`` at most every 5 s, and at the end, with
    when the shard expects to end at its pace so far (wall-clock time; None before its first
    image): the daemon's progress per image, and what its fair order waits for."""

    def __init__(
        self, total: int, say: Callable[[int, float | None], None], done_before: int = 0
    ) -> None:
        self.total, self.started, self.done = total, time.monotonic(), 0
        self.last = self.said = self.started
        self.say, self.before = say, done_before
        say(done_before, None)

    def tick(self, count: int = 1) -> None:
        self.done += count
        now = time.monotonic()
        if now - self.last > _PROGRESS_EVERY_S or self.done == self.total:
            self.last = now
            per_image = (now - self.started) / max(self.done, 1)
            log.info("%d/%d images (%.3f s/image)", self.done, self.total, per_image)
        if now - self.said > _PROGRESS_SAY_S or self.done == self.total:
            self.said = now
            left = (self.total - self.done) * (now - self.started) / self.done
            self.say(self.before + self.done, time.time() + left)


def infer(spec: JobSpec, job_dir: Path, batch: HeldFolder) -> dict[str, Any]:
    """The inference job for one shard."""
    with run_folder(spec, batch) as run, work_folder(spec) as work:
        return _infer(spec, batch, run, work)


def _infer(spec: JobSpec, batch: HeldFolder, run: HeldFolder, work: HeldFolder) -> dict[str, Any]:
    """The inference job for one shard, reading through the held batch folder, writing masks
    under the held run folder ``run`` and what the next jobs read under the work folder."""
    params = inference_params(spec.params)
    items = [item for item in spec.inputs if item.role is Role.IMAGE]
    masks = MaskFolders(run)
    rules = Rules(int(params["min_object_area"]), float(params["split_neck"]),
                  durable.each_file(run.fd))
    cpus = max(1, spec.resources.cpus)
    # started first: before torch is imported (the workers never need it), their code imported
    # and the shard read ahead while this process imports it
    workers = Workers(cpus, Setup(batch, run, int(params["max_whole_pixels"]), params["channel"],
                                  rules))  # fmt: skip
    ledger: Ledger | None = None
    device: DeviceStage | RemoteDevice | None = None
    try:
        version = catalog.resolve(Path(spec.registry_dir), spec.model.name, spec.model.version)
        ledger = Ledger(work, ledger_name(spec.shard.index), version.sha256, spec.params)
        resumed = _resumed(items, ledger, batch, masks)
        todo = [item for item in items if item.path not in resumed]
        region = job_region(spec.params)
        planned = int(params["batch_size"])  # the batch the chunks are sized for
        if spec.resources.gpus:
            planned = int(params["gpu_batch_size"]) or _FIRST_GPU_BATCH
        stages = Stages(todo, workers, region is None or region[0] == 0,
                        chunk_images(planned, cpus))  # fmt: skip
        stages.ahead()
        resident = remote.address(os.environ)
        if resident is None:  # the net runs here: torch is imported (it is not counted below)
            _import_device()
        # the job's time and CPU from here, as before its imports overlapped the workers' start
        # (the workers' CPU counts whole: their imports and first reads)
        started, cpu_started, main_started = time.monotonic(), _cpu_seconds(), _cpu_seconds(False)
        if resident is not None:
            device = remote.connect(resident, spec.job_name, str(spec.registry_dir), version,
                                    params, spec.resources.gpus, rules,
                                    lambda: _own_device(spec, version, params, rules))  # fmt: skip
        if device is None:
            device = _own_device(spec, version, params, rules)
        log.info("model %s version %d (sha256 %s…)", version.name, version.version,
                 version.sha256[:12])  # fmt: skip
        provenance = {"model_name": version.name, "model_version": version.version,
                      "model_sha256": version.sha256, "manifest_sha256": spec.manifest_sha256,
                      "code_version": code_version()}  # fmt: skip
        log.info("inference on %s, %d worker(s): %s", device.where.device, cpus,
                 device.where.reason)  # fmt: skip
        progress = Progress(len(todo), _progress_file(spec, work, len(items)), len(resumed))
        committer = Committer(run, ledger, progress.tick, rules.fsync_each, provenance)
        slides: list[Slides] = []  # made for the first image too large to decode whole

        def tiled(item: InputFile) -> list[Problem]:
            """Segment ``item`` window by window (or this job's region of it): the code for
            large images (zarr, the window readers: 0.2–0.3 s of imports) is imported then,
            unless the job was forked from a launcher that imported it (``WARM_IMPORTS``)."""
            if not slides:
                from pipelines.inference.slides import Slides

                slides.append(Slides(batch, masks, work, device, params, provenance,
                                     committer.add, cpus, workers))  # fmt: skip
            return slides[0].tiled(item) if region is None else slides[0].region(item, *region)

        try:
            problems = stages.run(device, committer, tiled)
        finally:
            workers.close()
            for made in slides:
                made.close()
            committer.close()
        rows = committer.rows
        summary = device.summary()
    finally:
        workers.close()
        if isinstance(device, RemoteDevice):
            device.close()
        if ledger is not None:
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
        "inference": {
            **summary,
            "workers": cpus,
            "masks_durable": "fsync each" if rules.fsync_each else "syncfs",
        },
        # to the microsecond: a 256² image takes ~1.3 ms on 2 CPUs (benchmarks read these)
        "seconds_per_image": round((time.monotonic() - started) / max(len(rows), 1), 6),
        "cpu_seconds_per_image": round((_cpu_seconds() - cpu_started) / max(len(rows), 1), 6),
        # of which this process's (steering, the device stage, the committer): on a GPU, the
        # share no worker can take over
        "main_cpu_seconds_per_image": round(
            (_cpu_seconds(False) - main_started) / max(len(rows), 1), 6
        ),
    }


def _import_device() -> None:
    """Import torch and the device stage (1–2 s unless the job was forked from a launcher that
    did), the workers' start overlapping them."""
    with importing_late():
        import pipelines.inference.device  # noqa: F401


def _own_device(
    spec: JobSpec, version: ModelVersion, params: dict[str, Any], rules: Rules
) -> DeviceStage:
    """The net in this process, on the CPU or the GPU the job was given."""
    _import_device()
    import torch

    from pipelines.inference.device import DeviceStage, load_model

    net = load_model(version)
    where = choose_device(spec.resources.gpus, os.environ,
                          torch.cuda.device_count() if torch.cuda.is_available() else 0,
                          params)  # fmt: skip
    return DeviceStage(net, where, float(params["threshold"]), rules)


def _resumed(
    items: list[Any], ledger: Ledger, batch: HeldFolder, masks: MaskFolders
) -> dict[str, dict[str, Any]]:
    """The rows of the images the ledger has done with these very inputs, model and params."""
    resumed = {}
    for item in items:
        row = ledger.done_row(item, batch, masks.present)
        if row is not None:
            resumed[item.path] = row
    if resumed:
        log.info("%d of %d images already done (ledger): skipped", len(resumed), len(items))
    return resumed


def _progress_file(
    spec: JobSpec, work: HeldFolder, total: int
) -> Callable[[int, float | None], None]:
    """Writes the job's progress file (what the daemon reads for ``watchctl`` and its fair
    order); a write that fails is logged and the work goes on."""
    name = f"{JOBS_DIR}/{spec.job_name}/{PROGRESS_FILE}"

    def say(done: int, due_at: float | None) -> None:
        said = {"done": done, "total": total, "due_at": due_at}
        try:
            work.write_text(name, json.dumps(said), fsync=False)
        except OSError as exc:
            log.warning("progress not written: %s", exc)

    return say


def _cpu_seconds(children: bool = True) -> float:
    """CPU time of this process and (``children``) its ended children (the workers, once
    joined): on a shared machine it shows the work done, whatever else competes for the
    cores."""
    used = [resource.getrusage(resource.RUSAGE_SELF)]
    if children:
        used.append(resource.getrusage(resource.RUSAGE_CHILDREN))
    return sum(usage.ru_utime + usage.ru_stime for usage in used)


if __name__ == "__main__":
    main(Pipeline.INFER, infer)
