"""The Slurm executor: the same job specs and pipelines as the local one, run by Slurm.

- Submitting: the shards of one batch's stage go out as ONE job array (throttled with ``%K``),
  a training as one job run under srun (see :mod:`daemon.executors.slurm_launch`). Before a
  submission that may repeat an earlier one (the first after a start, any after a failed
  submit) the executor asks Slurm for the jobs it remembers and adopts those whose comment and
  tasks file name the same job and attempt: nothing is submitted twice, not even a submit that
  timed out after the controller accepted it.
- Tracking: one status query for all jobs, at most every ``poll_seconds`` (sooner after a
  submission). Slurm forgets finished jobs after MinJobAge and keeps no accounting here: a job
  it no longer knows is UNKNOWN, and the result file on the share says what became of it.
- Faults: calls go through a :class:`Gate`: bounded retries, then a growing pause during which
  calls fail at once and :meth:`SlurmExecutor.slots` is 0, so the daemon's loop goes on
  (intake, readiness, status files) and submits when the controller is back. A launch Slurm
  refuses (bad partition, a limit) holds back only its own jobs, which are asked again after a
  pause and refused for good after ``max_refusals`` tries. A cancel that could not be delivered
  raises; the dispatcher keeps it (in the store) and sends it again.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import structlog

from daemon.contract.errors import ExecutorUnavailable, SubmissionError, WatchdError
from daemon.contract.heldfolder import HeldFolder
from daemon.contract.jobspec import Pipeline, Resources
from daemon.contract.spool import make_private
from daemon.core.manifest import ResourceRequest
from daemon.core.states import Phase
from daemon.executors import (
    Accepted,
    Check,
    Deferred,
    Handover,
    Refused,
    Status,
    Submission,
    resources,
)
from daemon.executors import slurm_launch as launching
from daemon.executors.gate import Gate
from daemon.executors.slurm_api import JobRecord, SlurmClient, describe, phase_of, release
from daemon.executors.slurm_cli import CliClient
from daemon.executors.slurm_launch import HANDLE_PREFIX, Launch
from daemon.site.config import SlurmExecutorSection

log = structlog.get_logger("watchd.slurm")

Adopted = dict[tuple[Path, str, int], str]  # (jobs folder, job name, attempt) → handle
MAX_TASKS_BYTES = 64 << 20  # a tasks file: a line per task, at most max_array_tasks of them


@dataclass(frozen=True)
class Refusals:
    """Slurm refused a job ``count`` time(s), the last with ``reason``; not asked before
    ``until``."""

    count: int
    until: float
    reason: str


class SlurmExecutor:
    name = "slurm"

    def __init__(
        self,
        client: SlurmClient,
        site: SlurmExecutorSection,
        environment: Mapping[str, str],
        stop: threading.Event,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.site = site
        self.environment = dict(environment)
        self.python = site.python or sys.executable
        self.clock = clock
        self.gate = Gate(
            attempts=site.retry_attempts,
            first_wait=site.retry_wait_seconds,
            max_wait=site.max_backoff_seconds,
            stop=stop,
            clock=clock,
        )
        self._records: dict[str, JobRecord] | None = None  # the last answer to a status query
        self._asked_at = 0.0
        self._must_look = True  # a submission may repeat one Slurm already has
        self._refusals: dict[int, Refusals] = {}  # by job id: Slurm said no, not yet for good

    def slots(self) -> int | None:
        """``max_jobs`` (0: no limit: Slurm queues; arrays are throttled with %K), but none
        while the gate is shut: the daemon then prepares no submissions it could not hand
        over."""
        return (self.site.max_jobs or None) if self.gate.open else 0

    def width(self) -> int | None:
        return self.site.array_throttle or None

    def bounds(self) -> dict[str, int]:
        return resources.slurm_bounds(self.site)

    def allocation(self, pipeline: Pipeline, request: ResourceRequest) -> Resources:
        site = self.site
        cpus = site.cpus(pipeline is Pipeline.INFER)
        return resources.given(request, pipeline, cpus, site.shapes, self.bounds())

    def result_grace(self) -> float:
        return self.site.result_grace_seconds

    def wake_on_end(self, wake: Callable[[], None]) -> None:
        """Nothing: ends are learnt from the status query, at most one per ``poll_seconds``."""

    def expect(self, pipeline: Pipeline, given: Resources) -> None:
        """Nothing: a job's process starts on a node Slurm picks, when it picks it."""

    # -- submitting --------------------------------------------------------------------------

    def submit(self, submissions: Sequence[Submission]) -> list[Handover]:
        """Each launch on its own: one Slurm refuses does not keep the others back. Its jobs
        wait ``max_backoff_seconds`` before they are offered again, and are refused for good
        (their batch fails with Slurm's word) after ``max_refusals`` refusals."""
        now = self.clock()
        self._forget_refusals(now)
        answers: dict[int, Handover] = {}
        ready = []
        for sub in submissions:
            why = launching.unnameable(sub)
            held = self._refusals.get(sub.job_id)
            if why:
                answers[sub.job_id] = Refused(why)
            elif held is not None and now < held.until:
                answers[sub.job_id] = Deferred(f"{held.reason} (asked again later)")
            else:
                ready.append(sub)
        launches = launching.plan(ready, self.site)
        try:
            adopted = self._adoptable(launches) if self._must_look and launches else {}
        except ExecutorUnavailable as exc:
            answers.update((s.job_id, Deferred(str(exc))) for s in ready)
        else:
            self._must_look = False
            for launch in launches:
                answers.update(self._try(launch, adopted))
        return [answers[s.job_id] for s in submissions]

    def _try(self, launch: Launch, adopted: Adopted) -> dict[int, Handover]:
        """Adopt what Slurm already has of a launch; send the rest as one job or array."""
        found = _found(launch, adopted)
        if found:
            log.info("adopted jobs already in Slurm", jobs=len(found), name=launch.name)
        answers: dict[int, Handover] = {job_id: Accepted(h) for job_id, h in found.items()}
        rest = tuple(s for s in launch.submissions if s.job_id not in found)
        if not rest:
            return answers
        if len(rest) < len(launch.submissions):
            launch = replace(launch, submissions=rest)
        try:
            job_id = self._send(launch)
        except ExecutorUnavailable as exc:
            self._must_look = True  # it may have been accepted before the answer was lost
            return answers | {s.job_id: Deferred(str(exc)) for s in rest}
        except (SubmissionError, OSError) as exc:  # OSError: its files could not be written
            self._must_look = True
            return answers | self._refused(launch, str(exc))
        self._records = None  # the next poll asks afresh and sees the new jobs
        for sub in rest:
            self._refusals.pop(sub.job_id, None)
        return answers | {s.job_id: Accepted(launch.handle(job_id, i)) for i, s in enumerate(rest)}

    def _refused(self, launch: Launch, reason: str) -> dict[int, Handover]:
        """Count Slurm's refusal of a launch's jobs: each waits before it is asked again, or is
        given up on after ``max_refusals``."""
        answers: dict[int, Handover] = {}
        until = self.clock() + self.site.max_backoff_seconds
        for sub in launch.submissions:
            known = self._refusals.pop(sub.job_id, None)
            count = known.count + 1 if known else 1
            if count >= self.site.max_refusals:
                answers[sub.job_id] = Refused(f"Slurm refused it {count} time(s): {reason}")
            else:
                self._refusals[sub.job_id] = Refusals(count, until, reason)
                answers[sub.job_id] = Deferred(reason)
        given_up = sum(isinstance(a, Refused) for a in answers.values())
        log.warning("slurm refused a submission", name=launch.name, jobs=len(answers),
                    given_up=given_up, error=reason)  # fmt: skip
        return answers

    def _forget_refusals(self, now: float) -> None:
        """Drop the count of a job not offered since its wait ended (cancelled meanwhile, or
        Slurm was away): a job offered again later starts from nothing."""
        stale = now - 2 * self.site.max_backoff_seconds
        self._refusals = {k: r for k, r in self._refusals.items() if r.until > stale}

    def _send(self, launch: Launch) -> str:
        """Write the launch's files and submit it; Slurm's job id."""
        script = self._write_files(launch)
        request = launching.request(launch, self.site, script, self.environment)
        job_id = self.gate.call("sbatch", lambda: self.client.submit(request))
        log.info("submitted to slurm", slurm_job=job_id, name=launch.name,
                 tasks=len(launch.submissions), array=request.array)  # fmt: skip
        return job_id

    def _write_files(self, launch: Launch) -> Path:
        """Write the tasks file and the script into the spool, beside the job folders."""
        make_private(launch.files)
        with HeldFolder.open(launch.files) as held:
            held.write_text(f"{launch.key}.tasks", launching.tasks_text(launch))
            held.write_text(f"{launch.key}.sh", launching.job_script(launch, self.python))
        return launch.files / f"{launch.key}.sh"

    def _adoptable(self, launches: Sequence[Launch]) -> Adopted:
        """Jobs of these launches' folders that Slurm has and that have not ended, found by
        their comment and tasks file. An ended one is not adopted: it may be an attempt that
        was cancelled and is now asked for again (an operator's retry counts attempts anew)."""
        arrays: dict[str, list[str]] = {}  # launch key → Slurm ids of its jobs or arrays
        live: set[str] = set()
        for record in self._query():
            key = launching.key_of_comment(record.comment)
            if key is not None:
                arrays.setdefault(key, []).append(record.array_id)
                if phase_of(record.state) is not Phase.ENDED:
                    live.add(record.id)
        adopted: Adopted = {}
        for launch in {launch.jobs_dir: launch for launch in launches}.values():
            for key, array_ids in arrays.items():
                tasks = launching.parse_tasks(_tasks_file(launch, key))
                for task, handle in launching.live_tasks(tasks, array_ids, live).items():
                    adopted.setdefault((launch.jobs_dir, *task), handle)
        return adopted

    # -- tracking ----------------------------------------------------------------------------

    def poll(self, handles: Sequence[str]) -> dict[str, Status]:
        if self._records is None or self.clock() - self._asked_at >= self.site.poll_seconds:
            self._query()
        records = self._records or {}
        return {h: _status(records.get(h.removeprefix(HANDLE_PREFIX))) for h in handles}

    def _query(self) -> list[JobRecord]:
        found = self.gate.call("squeue", self.client.jobs)
        self._records = {r.id: r for r in found}
        self._asked_at = self.clock()
        return found

    def cancel(self, handles: Sequence[str]) -> None:
        ids = sorted(h.removeprefix(HANDLE_PREFIX) for h in handles if h.startswith(HANDLE_PREFIX))
        if ids:
            self.gate.call("scancel", lambda: self.client.cancel(ids))
            self._records = None

    def close(self) -> None:
        """Nothing to release: Slurm jobs keep running and a later daemon re-adopts them."""

    # -- self-test ---------------------------------------------------------------------------

    def self_test(self) -> list[Check]:
        checks = [Check("slurm client", True, f"{self.client.name}, python {self.python}")]
        try:
            versions = self.client.versions()
            partitions = self.client.partitions()
        except WatchdError as exc:
            hint = "is slurmctld up, and is slurm_conf the cluster's? the daemon retries meanwhile"
            return [*checks, Check("slurm controller", False, str(exc).splitlines()[0], hint)]
        checks.append(
            Check("slurm controller", True, f"Slurm {versions.controller}, {versions.client}")
        )
        if self.client.name == "pyslurm":
            same = release(versions.client) == release(versions.controller)
            detail = f"{versions.client} for Slurm {versions.controller}"
            hint = 'install the pyslurm of this Slurm release, or set client = "cli"'
            checks.append(Check("pyslurm release", same, detail, "" if same else hint))
        listed = ", ".join(partitions) or "none"
        wanted = self.site.partition
        if wanted:
            there = wanted in partitions
            hint = "" if there else "set executor.slurm.partition to one the cluster has"
            found = Check("slurm partition", there, f"'{wanted}' among {listed}", hint)
        else:
            found = Check("slurm partitions", bool(partitions), f"the default; there are {listed}")
        return [*checks, found]


def _found(launch: Launch, adopted: Adopted) -> dict[int, str]:
    """The handles of the launch's jobs that Slurm already has, by job id."""
    keys = {s.job_id: (launch.jobs_dir, s.job_dir.name, s.attempt) for s in launch.submissions}
    return {job_id: adopted[key] for job_id, key in keys.items() if key in adopted}


def _tasks_file(launch: Launch, key: str) -> str:
    """The text of launch ``key``'s tasks file beside ``launch``'s, or '' if there is none."""
    try:
        with HeldFolder.open(launch.files) as held, held.open_read(f"{key}.tasks") as file:
            return file.read(MAX_TASKS_BYTES).decode("utf-8", "replace")
    except OSError:
        return ""


def _status(record: JobRecord | None) -> Status:
    if record is None:
        return Status(Phase.UNKNOWN, reason="no longer known to Slurm")
    return Status(phase_of(record.state), record.exit_code, f"Slurm: {describe(record)}")


def job_environment(environ: Mapping[str, str], slurm_conf: Path | None) -> dict[str, str]:
    """What jobs get: the daemon's environment without Slurm's own option variables (every
    option is an argument), and SLURM_CONF when the config names the cluster's file."""
    env = {
        k: v
        for k, v in environ.items()
        if not k.startswith(("SBATCH_", "SLURM_", "SALLOC_", "SRUN_")) or k == "SLURM_CONF"
    }
    if slurm_conf is not None:
        env["SLURM_CONF"] = str(slurm_conf)
    return env


def choose_client(site: SlurmExecutorSection, environment: Mapping[str, str]) -> SlurmClient:
    """The client the config asks for; ``auto``: pyslurm when it imports and its release is the
    controller's, else the command-line tools."""
    cli = CliClient(environment=environment, timeout=site.command_timeout_seconds)
    if site.client == "cli":
        return cli
    from daemon.executors import pyslurm_client

    if site.client == "pyslurm":
        return pyslurm_client.load(site.slurm_conf, environment)
    try:
        client = pyslurm_client.load(site.slurm_conf, environment)
    except ExecutorUnavailable as exc:
        log.info("using Slurm's command-line tools", why=str(exc))
        return cli
    try:
        controller = cli.versions().controller
    except WatchdError as exc:
        log.info("using Slurm's command-line tools", why=f"controller version unknown: {exc}")
        return cli
    if release(client.version) != release(controller):
        log.info("using Slurm's command-line tools",
                 why=f"pyslurm {client.version} does not match Slurm {controller}")  # fmt: skip
        return cli
    return client


def make_slurm_executor(
    site: SlurmExecutorSection, environ: Mapping[str, str], stop: threading.Event
) -> SlurmExecutor:
    environment = job_environment(environ, site.slurm_conf)
    return SlurmExecutor(choose_client(site, environment), site, environment, stop)
