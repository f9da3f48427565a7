"""Executors run job specs: locally as subprocesses, or on a cluster. One Protocol, the same
command everywhere: ``python -m pipelines.<name> JOB_DIR``.

Submitting is idempotent by job directory: an executor asked to submit a job it already runs
returns the existing handle instead of starting a second copy. Each submission gets its own
answer (:data:`Handover`): one job the executor refuses never keeps the others back.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from daemon.contract.heldfolder import HeldFolder
from daemon.contract.jobspec import Pipeline, Resources
from daemon.core.manifest import ResourceRequest
from daemon.core.owners import Charge
from daemon.core.states import Phase

if TYPE_CHECKING:
    from daemon.site.config import Config


@dataclass(frozen=True)
class Submission:
    """One job to start. Jobs of one submit call that share a ``group`` (the shards of one
    batch's stage) may go out together, e.g. as one Slurm job array."""

    job_id: int
    name: str
    module: str  # e.g. "pipelines.infer"
    job_dir: Path
    cpus: int = 1
    gpus: int = 0
    tasks: int = 1  # processes (DDP ranks), each with cpus and gpus
    env: Mapping[str, str] = field(default_factory=dict)
    group: str = ""
    attempt: int = 0  # with the job directory, names this submission for good
    resources: ResourceRequest = field(default_factory=ResourceRequest)  # [resources]
    charge: Charge = field(default_factory=Charge)  # the batch owner's account, QOS, partition
    throttle: int = 0  # the owner's share of an array's throttle (0: the site's)

    def held_job_dir(self) -> HeldFolder:
        """The job's folder (in the spool, the service's own), held."""
        return HeldFolder.open(self.job_dir)


@dataclass(frozen=True)
class Status:
    phase: Phase
    exit_code: int | None = None
    reason: str = ""  # what the executor says of an end (e.g. Slurm's state and reason)


@dataclass(frozen=True)
class Accepted:
    """The executor has the job: ``handle`` names it for good."""

    handle: str


@dataclass(frozen=True)
class Refused:
    """The executor will not run this job, for good (e.g. Slurm refused it every time it was
    asked): ``reason`` is its word, for the job's failure and the data owner's status file."""

    reason: str


@dataclass(frozen=True)
class Deferred:
    """Not handed over this time (the executor does not answer, or waits after refusing the
    job): the job stays pending and is offered again later. ``quiet``: a wait that ends by
    itself within seconds (a warm start finishing its imports), not worth a warning."""

    reason: str
    quiet: bool = False


Handover = Accepted | Refused | Deferred


@dataclass(frozen=True)
class Check:
    """One line of a self-test (start-up log, ``watchctl doctor``)."""

    name: str
    ok: bool
    detail: str
    hint: str = ""  # what to do about it, when it failed


class Executor(Protocol):
    name: str

    def slots(self) -> int | None:
        """How many jobs may run at once (None: the executor queues without limit); 0 while it
        takes no submissions at all (its cluster does not answer), so none are prepared."""

    def width(self) -> int | None:
        """How many jobs of one batch run side by side at most (local: ``max_parallel``;
        Slurm: the array throttle, None without one): the planner sizes shards to it."""

    def bounds(self) -> Mapping[str, int]:
        """The most a manifest's ``[resources]`` may ask for, by name (checked at intake)."""

    def allocation(self, pipeline: Pipeline, request: ResourceRequest) -> Resources:
        """What one job of ``pipeline`` gets for a manifest's ``request``: threads, GPUs and
        tasks (the executor's defaults where the manifest does not say, capped at its bounds)."""

    def result_grace(self) -> float:
        """How long a job that ended without a result is given for its result to show (a file
        written on a compute node may take a while to be seen on the share from here)."""

    def wake_on_end(self, wake: Callable[[], None]) -> None:
        """Call ``wake`` (from any thread) when a job may have ended, or a job it deferred may
        go now (the local executor: a warm start said ready), so that the loop polls at once
        instead of at its next tick; an executor that cannot tell does nothing."""

    def expect(self, pipeline: Pipeline, given: Resources) -> None:
        """A job of ``pipeline`` given ``given`` comes soon (a batch's inputs settle, or the
        stage before it runs: :class:`daemon.core.planner.Expect`): start what it will need
        ahead, if the executor can (Slurm: nothing)."""

    def submit(self, submissions: Sequence[Submission]) -> list[Handover]:
        """Start these jobs (or find them already started): what became of each, in order."""

    def poll(self, handles: Sequence[str]) -> dict[str, Status]:
        """The status of many jobs in one go; a handle it does not know is UNKNOWN."""

    def cancel(self, handles: Sequence[str]) -> None:
        """Ask these jobs to stop; they end as seen by a later poll. Jobs already gone are no
        error; raises ExecutorUnavailable when the request could not be delivered (the caller
        keeps it and sends it again)."""

    def close(self) -> None:
        """Release what the executor holds; running jobs keep running."""

    def self_test(self) -> list[Check]:
        """Can jobs be run at all? (Logged at start-up; shown by ``watchctl doctor``.)"""


def make_executor(
    config: Config, environ: Mapping[str, str], stop: threading.Event | None = None
) -> Executor:
    """The executor the configuration names; ``environ`` is passed on to the jobs. Retries
    against an unreachable cluster end when ``stop`` is set (the service's shutdown)."""
    env = {**environ, "WANDB_MODE": config.jobs.wandb_mode, "PYTHONUNBUFFERED": "1"}
    if config.executor.kind == "slurm":
        from daemon.executors.slurm import make_slurm_executor

        return make_slurm_executor(config.executor.slurm, env, stop or threading.Event())
    from daemon.executors.local import LocalExecutor

    local = config.executor.local
    return LocalExecutor(
        max_parallel=local.max_parallel, python=local.python, env=env, limits=local
    )
