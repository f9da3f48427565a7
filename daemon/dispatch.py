"""Dispatch: hand jobs to the executor and read back what became of them.

Submitting writes the attempt's spec into the job directory first, then asks the executor, then
records SUBMITTED with the handle. A daemon that dies between a job's end and the recording of
it finds the result at the next submission of that attempt and records it instead of running
the job again. Polling asks the executor about every live job in one call and reads the result
file of each job the executor says has ended (or has forgotten).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog

from daemon import atomicfile, resources
from daemon.errors import ExecutorUnavailable, SubmissionError
from daemon.executors import Executor, Phase, Submission
from daemon.jobspec import (
    LOG_FILE,
    RESULT_FILE,
    SPEC_FILE,
    JobResult,
    JobSpec,
    Resources,
    job_dir_of,
)
from daemon.manifest import Manifest
from daemon.planner import JobSeen, job_spec
from daemon.records import Batch, Job, JobChange
from daemon.states import JobState
from daemon.store import Store

log = structlog.get_logger("watchd.dispatch")

FINISHED_HANDLE = "finished"  # an attempt found finished before it was recorded as submitted


@dataclass(frozen=True)
class Outcome:
    """What a submission round did: jobs now submitted, batches whose folder refused a write."""

    submitted: tuple[Job, ...] = ()
    unwritable: tuple[tuple[Batch, OSError], ...] = ()


class Dispatcher:
    def __init__(
        self,
        store: Store,
        executor: Executor,
        registry_dir: str,
        cpus: int,
        result_grace: float = 0.0,
        training_shape: tuple[int, int] = (0, 1),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``result_grace``: how long a job that ended without a result is given for its result
        to show (on a network share, a file written on a compute node may take a while to be
        seen from here) before it counts as lost."""
        self.store = store
        self.executor = executor
        self.registry_dir = registry_dir
        self.cpus = cpus
        self.training_shape = training_shape
        self.result_grace = result_grace
        self.clock = clock
        self._no_result_since: dict[int, float] = {}
        self._said: dict[str, str] = {}  # the last warning of each kind, not to repeat it

    def _warn(self, event: str, exc: Exception, **fields: object) -> None:
        """Log a warning once while it says the same thing (an outage lasts many ticks)."""
        if self._said.get(event) != str(exc):
            self._said[event] = str(exc)
            log.warning(event, error=str(exc), **fields)

    def observe(self, live: Sequence[Job]) -> dict[int, JobSeen]:
        """One status query for every live job; the result file of each one that ended."""
        handles = {j.handle: j for j in live if j.handle}
        if not handles:
            return {}
        try:
            statuses = self.executor.poll(list(handles))
        except ExecutorUnavailable as exc:
            self._warn("executor unavailable", exc)
            return {}
        self._said.pop("executor unavailable", None)
        seen = {}
        for handle, status in statuses.items():
            job = handles[handle]
            result, note = None, ""
            if status.phase in (Phase.ENDED, Phase.UNKNOWN):
                result = read_result(self.job_dir(job))
                if result is None and self._result_may_come(job.id):
                    seen[job.id] = JobSeen(job.id, Phase.QUEUED)  # no news yet
                    continue
                self._no_result_since.pop(job.id, None)
                if result is None:
                    note = end_note(status.reason, self.job_dir(job) / LOG_FILE)
            seen[job.id] = JobSeen(job.id, status.phase, status.exit_code, result, note)
        return seen

    def _result_may_come(self, job_id: int) -> bool:
        since = self._no_result_since.setdefault(job_id, self.clock())
        return self.clock() - since < self.result_grace

    def job_dir(self, job: Job) -> Path:
        return job_dir_of(self.store.batch(job.batch_id).run_dir, job.name)

    def submit(self, work: Sequence[tuple[Job, Batch, Manifest]], now: float) -> Outcome:
        """Write each job's spec and hand the jobs to the executor in one call."""
        ready: list[tuple[Job, Submission]] = []
        done: list[Job] = []
        unwritable: list[tuple[Batch, OSError]] = []
        for job, batch, manifest in work:
            gpus, tasks = resources.shape(manifest.resources, job.pipeline, *self.training_shape)
            given = Resources(cpus=self.cpus, gpus=gpus, tasks=tasks)
            inputs = self.store.job_inputs(job.id)
            spec = job_spec(job, batch, manifest, inputs, self.registry_dir, given)
            try:
                finished = prepare_job_dir(spec)
            except OSError as exc:
                unwritable.append((batch, exc))
                continue
            if finished:
                change = JobChange(handle=FINISHED_HANDLE, new_attempt=True)
                done.append(
                    self.store.transition_job(
                        job.id, JobState.SUBMITTED, "found finished", now, change
                    )
                )
                continue
            ready.append((job, _submission(spec, manifest)))
        if ready:
            done += self._hand_over(ready, now)
        return Outcome(tuple(done), tuple(unwritable))

    def _hand_over(self, ready: Sequence[tuple[Job, Submission]], now: float) -> list[Job]:
        try:
            handles = self.executor.submit([s for _, s in ready])
        except (SubmissionError, ExecutorUnavailable) as exc:
            self._warn("submission failed; retried next tick", exc, jobs=len(ready))
            return []
        self._said.pop("submission failed; retried next tick", None)
        submitted = []
        for (job, sub), handle in zip(ready, handles, strict=True):
            change = JobChange(handle=handle, new_attempt=True)
            moved = self.store.transition_job(job.id, JobState.SUBMITTED, "submitted", now, change)
            log.info("job submitted", batch_id=job.batch_id, job_id=job.id, job=sub.name,
                     handle=handle, attempt=moved.attempts)  # fmt: skip
            submitted.append(moved)
        return submitted

    def cancel(self, job_ids: Sequence[int], reason: str, now: float) -> list[Job]:
        """Stop the live ones at the executor; mark every one not yet ended as cancelled."""
        jobs = [self.store.job(i) for i in job_ids]
        handles = [j.handle for j in jobs if j.state.live and j.handle]
        if handles:
            try:
                self.executor.cancel(handles)
            except ExecutorUnavailable as exc:
                log.warning("cancel not delivered", error=str(exc), handles=handles)
        return [
            self.store.transition_job(j.id, JobState.CANCELLED, reason, now)
            for j in jobs
            if not j.state.terminal
        ]


def _submission(spec: JobSpec, manifest: Manifest) -> Submission:
    group = f"b{spec.batch_id:06d}-{spec.pipeline.value}"
    return Submission(
        spec.job_id, spec.job_name, spec.pipeline.module, spec.job_dir,
        spec.resources.cpus, spec.resources.gpus, group=group,
        attempt=spec.attempt, resources=manifest.resources,
    )  # fmt: skip


def end_note(reason: str, log_path: Path, lines: int = 3) -> str:
    """What to say of a job that ended without a result: the executor's word (e.g. Slurm's
    state and reason) and the last lines of the job's log, on one line."""
    parts = [reason] if reason else []
    try:
        with open(log_path, "rb") as log_file:
            log_file.seek(max(0, log_file.seek(0, 2) - 4096))
            tail = log_file.read().decode("utf-8", "replace").splitlines()
    except OSError:
        tail = []
    last = [line.strip() for line in tail if line.strip()][-lines:]
    if last:
        parts.append("log ends: " + " | ".join(last))
    return "; ".join(parts)


def read_result(job_dir: Path) -> JobResult | None:
    try:
        return JobResult.from_json((job_dir / RESULT_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def prepare_job_dir(spec: JobSpec) -> bool:
    """Write the spec for this attempt; True if this very attempt already finished.

    A result newer than a spec of the same attempt means the job ran to its end and the daemon
    died before recording it. Otherwise a stale result of an earlier attempt is removed first,
    so a result found later always belongs to the attempt that was submitted.
    """
    job_dir = spec.job_dir
    job_dir.mkdir(parents=True, exist_ok=True)
    spec_path, result_path = job_dir / SPEC_FILE, job_dir / RESULT_FILE
    try:
        old = JobSpec.from_json(spec_path.read_text(encoding="utf-8"))
        newer = result_path.stat().st_mtime_ns >= spec_path.stat().st_mtime_ns
        if old.attempt == spec.attempt and newer:
            return True
    except (OSError, ValueError, KeyError, TypeError):
        pass
    result_path.unlink(missing_ok=True)
    atomicfile.write_text(spec_path, spec.to_json())
    return False
