"""What a job may ask of its executor: a manifest's ``[resources]`` within the site's bounds,
and the shape of each job (GPUs, tasks).

Pure; the executors apply it (:meth:`daemon.executors.Executor.bounds` and ``allocation``). The
bounds are checked when a batch is taken in, so the data owner reads a refusal in the status
file; each job is shaped once, when it is submitted, and a Slurm launch adds only its time and
memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from daemon.contract.jobspec import Pipeline, Problem, Resources
from daemon.core.manifest import MANIFEST_NAME, ResourceRequest
from daemon.site.config import NO_SITE_SHAPES, JobShapes, LocalExecutorSection, SlurmExecutorSection


@dataclass(frozen=True)
class Allocation:
    """What one Slurm job gets."""

    time_minutes: int
    memory_mb: int
    gpus: int
    tasks: int
    cpus: int = 1  # per task


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


def given(
    request: ResourceRequest,
    pipeline: Pipeline,
    cpus: int,
    site: JobShapes,
    bounds: Mapping[str, int],
) -> Resources:
    """What one job gets: :func:`shape`'s GPUs and tasks, capped at the bounds, and ``cpus``
    threads."""
    gpus, tasks = shape(request, pipeline, site)
    capped_gpus = min(gpus, bounds.get("gpus", gpus))
    return Resources(cpus=cpus, gpus=capped_gpus, tasks=min(tasks, bounds.get("tasks", tasks)))


def allocation(
    request: ResourceRequest, given: Resources, site: SlurmExecutorSection
) -> Allocation:
    """One Slurm job's allocation: the job's shape as given, the site's time and memory
    defaults overridden by ``request``, capped at the bounds."""
    time_minutes = min(request.time_minutes or site.time_minutes, site.max_time_minutes)
    memory_mb = min(request.memory_mb or site.memory_mb, site.max_memory_mb)
    return Allocation(time_minutes, memory_mb, given.gpus, given.tasks, given.cpus)


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
    """The local executor has time limits, GPUs and DDP tasks to ask for; no memory limits."""
    return {"time_minutes": local.max_time_minutes, "gpus": local.max_gpus,
            "tasks": local.max_tasks}  # fmt: skip
