"""What a job may ask of the cluster: a manifest's ``[resources]`` within the site's bounds.

Pure. The bounds are checked when a batch is taken in, so the data owner reads a refusal in the
status file; the executor applies the same rules again when it submits.
"""

from __future__ import annotations

from dataclasses import dataclass

from daemon.config import SlurmExecutorSection
from daemon.jobspec import Pipeline, Problem
from daemon.manifest import MANIFEST_NAME, ResourceRequest


@dataclass(frozen=True)
class Allocation:
    """What one Slurm job gets."""

    time_minutes: int
    memory_mb: int
    gpus: int
    tasks: int


def problems(request: ResourceRequest, site: SlurmExecutorSection) -> list[Problem]:
    """Each value of ``request`` above the site's bound, said so that the owner can act."""
    found = []
    for name, value, bound in _pairs(request, site):
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

    A training job gets the site's GPUs and tasks unless the manifest asks otherwise; each
    inference shard gets the GPUs the manifest asks for (none by default) and one task; the
    report job gets one task and no GPU.
    """
    time_minutes = min(request.time_minutes or site.time_minutes, site.max_time_minutes)
    memory_mb = min(request.memory_mb or site.memory_mb, site.max_memory_mb)
    if pipeline is Pipeline.TRAIN:
        gpus = site.gpus if request.gpus is None else request.gpus
        tasks = request.tasks or site.tasks
    elif pipeline is Pipeline.INFER:
        gpus, tasks = request.gpus or 0, 1
    else:
        gpus, tasks = 0, 1
    return Allocation(time_minutes, memory_mb, min(gpus, site.max_gpus), min(tasks, site.max_tasks))


def _pairs(
    request: ResourceRequest, site: SlurmExecutorSection
) -> list[tuple[str, int | None, int]]:
    return [
        ("time_minutes", request.time_minutes, site.max_time_minutes),
        ("memory_mb", request.memory_mb, site.max_memory_mb),
        ("gpus", request.gpus, site.max_gpus),
        ("tasks", request.tasks, site.max_tasks),
    ]
