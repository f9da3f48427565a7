"""A batch's jobs: what runs for it, stage by stage, and the spec of a job's next attempt. Pure;
the planner decides when.

Stage 0 is one training job, a sweep's trials or inference shards; a sweep's trials are followed
by the sweep job, and every batch ends with a report job. Jobs are named after their batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from daemon.contract.jobspec import InputFile, JobSpec, Pipeline, Resources, Role, Shard
from daemon.contract.names import truths_of
from daemon.contract.spool import work_dir
from daemon.core.manifest import Manifest
from daemon.core.manifest_schema import Kind
from daemon.core.records import Batch, Job, NewJob
from daemon.core.sweep import trial_params

# Images a sized job gets at least (a smaller batch gets fewer jobs than the executor's width):
# the fixed size of before, so sizing only ever makes jobs larger. A job on a cluster pays
# 10-30 s to start (Python and torch from a cold shared filesystem); 64 images take ~20 s.
MIN_SIZED_SHARD = 64
MAX_REGIONS = 256  # jobs one slide is split across, at most


@dataclass(frozen=True)
class Sharding:
    """How an inference batch is split into jobs (``[planner]``). ``size`` 0: into ``width``
    jobs (those that run side by side), or a multiple of it (whole waves: no slot idles at
    the end) where jobs would be larger than ``max_size`` images; so each job pays its start
    (interpreter, torch, the model: seconds, tens on a cold cluster share) once for as many
    images as it can, and a retry or resume redoes at most ``max_size``. No job gets fewer
    than MIN_SIZED_SHARD images unless the batch has fewer. ``size`` N: jobs of N images."""

    size: int = 0
    max_size: int = 2000
    width: int | None = None  # None: no limit (then jobs of max_size)
    # An image file larger than this (a whole-slide image) is segmented by several jobs, one
    # region of it each (one per this many bytes, at most MAX_REGIONS); 0: never.
    region_bytes: int = 0

    def regions(self, image: InputFile) -> int:
        """How many jobs segment ``image``: 1, or its regions' count."""
        size = image.size or 0  # (not known: one job)
        if not self.region_bytes or size <= self.region_bytes:
            return 1
        return min(-(-size // self.region_bytes), MAX_REGIONS)

    def slices(self, count: int) -> list[slice]:
        """The images of each job, in order: ``count`` images in parts that differ by one at
        most; at least one (empty) part."""
        if self.size:
            fixed = range(max(1, -(-count // self.size)))
            return [slice(i * self.size, (i + 1) * self.size) for i in fixed]
        jobs = -(-count // self.max_size)
        if self.width:
            waves = -(-jobs // self.width)
            jobs = max(jobs, min(self.width * waves, count // MIN_SIZED_SHARD))
        jobs = max(1, jobs)
        bounds = [i * count // jobs for i in range(jobs + 1)]
        return [slice(a, b) for a, b in pairwise(bounds)]


def first_pipeline(manifest: Manifest) -> Pipeline:
    """The pipeline of a batch's first jobs (those :func:`compute_jobs` plans)."""
    return Pipeline.TRAIN if manifest.kind.trains else Pipeline.INFER


def compute_jobs(
    batch: Batch, manifest: Manifest, inputs: Sequence[InputFile], shards: Sharding, executor: str
) -> tuple[NewJob, ...]:
    """A training batch is one job; an inference batch is shards (see :class:`Sharding`); a
    sweep batch is one training job per trial (one group: one job array under Slurm)."""
    prefix = f"b{batch.id:06d}"
    if manifest.kind is Kind.TRAINING:
        return (NewJob(f"{prefix}-train", Pipeline.TRAIN, 0, 0, 1, tuple(inputs), executor),)
    if manifest.kind is Kind.SWEEP and manifest.sweep is not None:
        trials = trial_params(manifest.sweep)
        return tuple(
            NewJob(
                f"{prefix}-trial-{i:04d}",
                Pipeline.TRAIN,
                0,
                i,
                len(trials),
                tuple(inputs),
                executor,
                params=params,
            )
            for i, params in enumerate(trials)
        )
    images = [f for f in inputs if f.role is Role.IMAGE]
    slides = [(f, shards.regions(f)) for f in images if shards.regions(f) > 1]
    whole = [f for f in images if shards.regions(f) == 1]
    truths = truths_of(inputs)
    # the shards of whole images (with their true masks), then each slide's regions: one
    # stage, one array
    work: list[tuple[tuple[InputFile, ...], dict[str, Any]]] = [
        (_with_truths(whole[part], truths), {})
        for part in (shards.slices(len(whole)) if whole or not slides else [])
    ]
    for slide, count in slides:
        region = {"count": count, "image": slide.path}
        work += [((slide,), {"region": {**region, "index": k}}) for k in range(count)]
    return tuple(
        NewJob(f"{prefix}-infer-{i:04d}", Pipeline.INFER, 0, i, len(work), part, executor,
               params=params)
        for i, (part, params) in enumerate(work)
    )  # fmt: skip


def _with_truths(
    images: Sequence[InputFile], truths: dict[str, InputFile]
) -> tuple[InputFile, ...]:
    """A shard's images, then their masks: the job segments the images; the report, which
    inherits every shard's inputs, scores what it found against the masks."""
    return (*images, *(truths[f.path] for f in images if f.path in truths))


def next_stage_job(
    batch: Batch, manifest: Manifest | None, jobs: Sequence[Job], executor: str
) -> NewJob:
    """The job after ``jobs``, all succeeded: a sweep's trials are followed by the sweep job
    (compare, register the best), a slide's regions by their assembly, compute jobs by the
    report."""
    stage = max(j.stage for j in jobs) + 1
    pipelines = {j.pipeline for j in jobs}
    regional = sorted({_region_image(j) for j in jobs if "region" in j.params})
    if regional and Pipeline.ASSEMBLE not in pipelines:
        return NewJob(f"b{batch.id:06d}-assemble", Pipeline.ASSEMBLE, stage, 0, 1, (), executor,
                      inherit_inputs=True, params={"regional": regional})  # fmt: skip
    if batch.kind is Kind.SWEEP and Pipeline.SWEEP not in {j.pipeline for j in jobs}:
        plan = manifest.sweep if manifest else None
        # the trials the sweep job may read: those recorded here as succeeded, by name
        trials = sorted(j.name for j in jobs if j.pipeline is Pipeline.TRAIN)
        params = {"sweep": plan.describe() if plan else {}, "trial_jobs": trials}
        return NewJob(f"b{batch.id:06d}-sweep", Pipeline.SWEEP, stage, 0, 1, (),
                      executor, inherit_inputs=True, params=params)  # fmt: skip
    return NewJob(f"b{batch.id:06d}-report", Pipeline.REPORT, stage, 0, 1, (),
                  executor, inherit_inputs=True)  # fmt: skip


def _region_image(job: Job) -> str:
    """The image a region job segments (its params say which, beside its region)."""
    return str(job.params["region"]["image"])


def job_spec(
    job: Job,
    batch: Batch,
    manifest: Manifest,
    inputs: Sequence[InputFile],
    registry_dir: str,
    resources: Resources,
    spool: str,
) -> JobSpec:
    """The spec of the job's next attempt; the job's own params override the manifest's;
    ``resources``: what the executor gives this job; ``spool``: the service's spool, where the
    run's work folder is."""
    params = {**manifest.params, **job.params}
    return JobSpec(
        job_id=job.id,
        job_name=job.name,
        pipeline=job.pipeline,
        attempt=job.attempts + 1,
        batch_id=batch.id,
        batch_revision=batch.revision,
        batch_kind=manifest.kind.value,
        batch_dir=str(batch.path),
        run_dir=batch.run_dir,
        work_dir=str(work_dir(spool, batch.id, batch.run_dir)),
        manifest_sha256=batch.manifest_sha256,
        inputs=tuple(inputs),
        model=manifest.model,
        registry_dir=registry_dir,
        params=params,
        shard=Shard(job.shard_index, job.shard_count),
        resources=resources,
        title=manifest.title,
        batch_identity=batch.identity,
    )
