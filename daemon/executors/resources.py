"""What a job may ask of the cluster: a manifest's ``[resources]`` within the site's bounds.

Pure. The bounds are checked when a batch is taken in, so the data owner reads a refusal in the
status file; the executor applies the same rules again when it submits.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from daemon.contract.jobspec import Pipeline, Problem
from daemon.core.manifest import MANIFEST_NAME, ResourceRequest
from daemon.site.config import NO_SITE_SHAPES, JobShapes, LocalExecutorSection, SlurmExecutorSection


@dataclass(frozen=True)
class Allocation:
    """What one Slurm job gets."""

    time_minutes: int
    memory_mb: int
    gpus: int
    tasks: int


def problems(request: ResourceRequest, bounds: Mapping[str, int]) -> list[Problem]:
    """Each value of ``request`` above the site's bound, said so that the owner can act."""
    found = []
    for name, bound in bounds.items():
        value = getattr(request, name)
        if value is not None and value > bound:
            found.append(
                Problem(
                    f"{MANIFEST_NAME}, resources.{name}",
                    f"asks for {value}, more than this site allows ({bound})",
                    f"ask for at most {bound}, or ask an operator to raise max_{name}",
                )
            )
    return found


def allocation(
    request: ResourceRequest, site: SlurmExecutorSection, pipeline: Pipeline
) -> Allocation:
    """The site's defaults overridden by ``request``, capped at the bounds.

    The GPUs and tasks are :func:`shape`'s.
    """
    time_minutes = min(request.time_minutes or site.time_minutes, site.max_time_minutes)
    memory_mb = min(request.memory_mb or site.memory_mb, site.max_memory_mb)
    gpus, tasks = shape(request, pipeline, site.shapes)
    return Allocation(time_minutes, memory_mb, min(gpus, site.max_gpus), min(tasks, site.max_tasks))


def shape(
    request: ResourceRequest, pipeline: Pipeline, site: JobShapes = NO_SITE_SHAPES
) -> tuple[int, int]:
    """GPUs and tasks of one job: a training job (a sweep's trials too) gets the site's
    training defaults unless the manifest asks otherwise; each inference shard the GPUs the
    manifest asks for, else the site's ``inference_gpus``, and one task; the other jobs one
    task, no GPU."""
    if pipeline is Pipeline.TRAIN:
        gpus = site.training_gpus if request.gpus is None else request.gpus
        return gpus, request.tasks or site.training_tasks
    if pipeline is Pipeline.INFER:
        return site.inference_gpus if request.gpus is None else request.gpus, 1
    return 0, 1


def slurm_bounds(site: SlurmExecutorSection) -> dict[str, int]:
    return {
        "time_minutes": site.max_time_minutes,
        "memory_mb": site.max_memory_mb,
        "gpus": site.max_gpus,
        "tasks": site.max_tasks,
    }


def local_bounds(local: LocalExecutorSection) -> dict[str, int]:
    """The local executor has no time or memory limits to ask for; GPUs and DDP tasks it has."""
    return {"gpus": local.max_gpus, "tasks": local.max_tasks}
