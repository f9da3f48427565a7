"""Dispatch: hand jobs to the executor and read back what became of them.

Submitting writes the attempt's spec into the job's folder in the spool first (unless it is
there already: :mod:`daemon.contract.spool`, the service's own, which no data owner can write),
then asks the executor, then records what became of each job: SUBMITTED with its handle, FAILED
with the executor's word when it refused the job for good (the planner then fails the batch),
or nothing (still pending, offered again next tick). A daemon that dies between a job's end and
the recording of it finds the result at the next submission of that attempt and records it
instead of running the job again. Polling asks the executor about every live job in one call
and reads the result file of each job the executor says has ended (or has forgotten), and copies
that job's log into the owner's results folder (``logs/<job>.log``, its last LOG_COPY_BYTES),
through the held batch folder: the owner reads what the job printed, and nothing the daemon
reads back lies there.

Cancelling marks the jobs cancelled and keeps, in the same transaction, a cancel for each one
the executor has; a cancel is dropped once delivered, and sent again every tick until then
(across restarts). A job with a cancel not delivered yet is not submitted again: its earlier
attempt may still run.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog

from daemon.contract import jobspec, spool
from daemon.contract.errors import ExecutorUnavailable
from daemon.contract.heldfolder import FolderReplaced, HeldFolder, temporary_name
from daemon.contract.jobspec import (
    LOG_FILE,
    PROGRESS_FILE,
    RESULT_FILE,
    SPEC_FILE,
    JobResult,
    JobSpec,
    Pipeline,
)
from daemon.core.jobplan import job_spec
from daemon.core.manifest import Manifest, ResourceRequest
from daemon.core.owners import Accounts, Terms
from daemon.core.planner import JobSeen
from daemon.core.records import Batch, Job
from daemon.core.states import Phase
from daemon.executors import Accepted, Deferred, Executor, Handover, Refused, Submission
from daemon.store import Store

log = structlog.get_logger("watchd.dispatch")

PROGRESS_SECONDS = 10.0  # a running inference job's progress file is read at most this often
LOG_COPY_BYTES = 1 << 20  # the end of a job's log that the owner's copy keeps
MAX_RESULT_BYTES = 16 << 20  # a result.json larger than this is not read (a job's summary is small)
FINISHED_HANDLE = "finished"  # an attempt found finished before it was recorded as submitted


@dataclass(frozen=True)
class Outcome:
    """What a submission round did, for the actor to record: the jobs the executor took (with
    their handles; ``FINISHED_HANDLE`` for an attempt found finished), the jobs it refused for
    good (with its word), and the batches whose folder refused a write."""

    taken: tuple[tuple[Job, str], ...] = ()
    refused: tuple[tuple[Job, str], ...] = ()
    unwritable: tuple[tuple[Batch, OSError], ...] = ()


class Dispatcher:
    def __init__(
        self,
        store: Store,
        executor: Executor,
        registry_dir: str,
        spool: str,
        clock: Callable[[], float] = time.monotonic,
        accounts: Accounts | None = None,
    ) -> None:
        """A job that ended without a result is given the executor's ``result_grace`` for its
        result to show before it counts as lost. ``spool``: the service's spool, where the job
        folders are. ``accounts``: the site's table of owners (what each job is charged to)."""
        self.accounts = accounts or Accounts()
        self.store = store
        self.executor = executor
        self.registry_dir = registry_dir
        self.spool = spool
        self.result_grace = executor.result_grace()
        self.clock = clock
        self._no_result_since: dict[int, float] = {}
        self._progress_due: dict[int, float] = {}  # job id → when its progress is read next
        self._progressed: set[int] = set()  # batches whose images done changed since asked
        self._said: dict[str, str] = {}  # the last warning of each kind, not to repeat it

    def _warn(self, event: str, error: str, **fields: object) -> None:
        """Log a warning once while it says the same thing (an outage lasts many ticks)."""
        if self._said.get(event) != error:
            self._said[event] = error
            log.warning(event, error=error, **fields)

    def observe(self, live: Sequence[Job]) -> dict[int, JobSeen]:
        """One status query for every live job; the result file of each one that ended."""
        handles = {j.handle: j for j in live if j.handle}
        if not handles:
            return {}
        try:
            statuses = self.executor.poll(list(handles))
        except ExecutorUnavailable as exc:
            self._warn("executor unavailable", str(exc))
            return {}
        self._said.pop("executor unavailable", None)
        seen = {}
        for handle, status in statuses.items():
            job = handles[handle]
            result, note = None, ""
            if status.phase in (Phase.ENDED, Phase.UNKNOWN):
                batch, job_dir = self._folders(job)
                result = read_result(job_dir)
                if result is None and self._result_may_come(job.id):
                    seen[job.id] = JobSeen(job.id, Phase.QUEUED)  # no news yet
                    continue
                self._no_result_since.pop(job.id, None)
                if result is None:
                    note = end_note(status.reason, job_dir)
                copy_log(batch, job_dir)
            seen[job.id] = JobSeen(job.id, status.phase, status.exit_code, result, note)
            if status.phase is Phase.RUNNING:
                self._progress(job)
            else:
                self._progress_due.pop(job.id, None)
        return seen

    def take_progressed(self) -> set[int]:
        """The batches whose images done changed since the last call (their status files say
        it), forgotten here."""
        taken, self._progressed = self._progressed, set()
        return taken

    def _progress(self, job: Job) -> None:
        """Record a running inference job's images done, read from its progress file at most
        every PROGRESS_SECONDS (a read on the share per running job, not per image)."""
        now = self.clock()
        if job.pipeline is not Pipeline.INFER or now < self._progress_due.get(job.id, 0.0):
            return
        self._progress_due[job.id] = now + PROGRESS_SECONDS
        said = read_progress(self._folders(job)[1])
        if said is None:
            return
        done = max(0, min(said.done, job.images))
        if (done, said.due_at) != (job.images_done, job.due_at):
            self.store.job_progress(job.id, done, said.due_at)
        if done != job.images_done:
            self._progressed.add(job.batch_id)

    def _result_may_come(self, job_id: int) -> bool:
        since = self._no_result_since.setdefault(job_id, self.clock())
        return self.clock() - since < self.result_grace

    def _folders(self, job: Job) -> tuple[Batch, Path]:
        """The job's batch and its job folder in the spool."""
        batch = self.store.batch(job.batch_id)
        work = spool.work_dir(self.spool, batch.id, batch.run_dir)
        return batch, jobspec.job_dir(work, job.name)

    def expect(self, pipeline: Pipeline, request: ResourceRequest) -> None:
        """Tell the executor that jobs of ``pipeline`` come soon, given what they will get for
        ``request`` (:class:`daemon.core.planner.Expect`). A hint: what goes wrong is said
        once, and the jobs start cold; nothing fails."""
        event = "jobs cannot be started ahead; they start cold"
        try:
            self.executor.expect(pipeline, self.executor.allocation(pipeline, request))
        except Exception as exc:  # a bug here must cost a warm start, not a tick of the loop
            self._warn(event, str(exc), pipeline=pipeline.value)
            return
        self._said.pop(event, None)

    def submit(self, work: Sequence[tuple[Job, Batch, Manifest]], now: float) -> Outcome:
        """Write each job's spec and hand the jobs to the executor in one call."""
        ready: list[tuple[Job, Submission]] = []
        done: list[tuple[Job, str]] = []
        unwritable: list[tuple[Batch, OSError]] = []
        cancelling = set(self.store.kept_cancels().values())
        probed: dict[int, OSError | None] = {}  # batch id → why its results folder refused
        for job, batch, manifest in work:
            if job.id in cancelling:
                continue  # its earlier attempt may still run until the cancel is delivered
            if batch.id not in probed:
                probed[batch.id] = probe_run_folder(batch)
            refusal = probed[batch.id]
            if refusal is not None:
                unwritable.append((batch, refusal))
                continue
            given = self.executor.allocation(job.pipeline, manifest.resources)
            inputs = self.store.job_inputs(job.id)
            spec = job_spec(job, batch, manifest, inputs, self.registry_dir, given, self.spool)
            try:
                finished = prepare_job_dir(spec)
            except OSError as exc:  # the spool is the operator's to mend: the jobs wait for it
                self._warn("the spool cannot be written; jobs wait", str(exc), spool=self.spool)
                continue
            if finished:
                done.append((job, FINISHED_HANDLE))
                continue
            terms = self.accounts.terms(batch.owned_by)
            ready.append((job, _submission(spec, manifest, terms)))
        taken, refused = self._hand_over(ready) if ready else ([], [])
        return Outcome(tuple(done + taken), tuple(refused), tuple(unwritable))

    def _hand_over(
        self, ready: Sequence[tuple[Job, Submission]]
    ) -> tuple[list[tuple[Job, str]], list[tuple[Job, str]]]:
        """One call to the executor; the jobs it took (with their handles), and those it
        refused for good (with why, also written into the job's log, where the owner is sent)."""
        handed = self.executor.submit([s for _, s in ready])
        taken: list[tuple[Job, str]] = []
        refused: list[tuple[Job, str]] = []
        for (job, sub), answer in zip(ready, handed, strict=True):
            if isinstance(answer, Accepted):
                taken.append((job, answer.handle))
            elif isinstance(answer, Refused):
                reason = f"refused by the {self.executor.name} executor: {answer.reason}"
                log.warning("job refused", batch_id=job.batch_id, job_id=job.id, job=sub.name,
                            reason=answer.reason)  # fmt: skip
                _append_line(sub, f"watchd: {reason}")
                refused.append((job, reason))
        self._say_held(ready, handed)
        return taken, refused

    def _say_held(
        self, ready: Sequence[tuple[Job, Submission]], handed: Sequence[Handover]
    ) -> None:
        """Warn once while jobs are held back for the same reason; say nothing more after."""
        held = [a.reason for a in handed if isinstance(a, Deferred) and not a.quiet]
        if held:
            self._warn("submission deferred; offered again later", held[0],
                       jobs=len(held), of=len(ready))  # fmt: skip
        else:
            self._said.pop("submission deferred; offered again later", None)

    def keep_cancel(self, job: Job, now: float) -> None:
        """Keep a cancel for ``job`` if the executor has it (the caller marks the job cancelled
        in the same transaction); :meth:`deliver_cancels` sends it."""
        if job.state.live and job.handle and job.handle != FINISHED_HANDLE:
            self.store.keep_cancel(job.handle, job.id, now)

    def deliver_cancels(self) -> None:
        """Send the cancels not delivered yet (the service calls this every tick)."""
        kept = self.store.kept_cancels()
        if not kept:
            return
        try:
            self.executor.cancel(list(kept))
        except ExecutorUnavailable as exc:
            self._warn("cancel not delivered; sent again later", str(exc), jobs=len(kept))
            return
        self._said.pop("cancel not delivered; sent again later", None)
        self.store.drop_cancels(kept)
        log.info("cancels delivered", jobs=len(kept))


def _submission(spec: JobSpec, manifest: Manifest, terms: Terms) -> Submission:
    group = f"b{spec.batch_id:06d}-{spec.pipeline.value}"
    return Submission(
        spec.job_id, spec.job_name, spec.pipeline.module, spec.job_dir,
        spec.resources.cpus, spec.resources.gpus, spec.resources.tasks, group=group,
        attempt=spec.attempt, resources=manifest.resources, charge=terms.charge,
        throttle=terms.array_throttle,
    )  # fmt: skip


def _log_end(job_dir: Path, size: int) -> bytes:
    """The last ``size`` bytes of a job's log (b'' where there is none)."""
    try:
        with HeldFolder.open(job_dir) as held, held.open_read(LOG_FILE) as log_file:
            log_file.seek(max(0, log_file.seek(0, 2) - size))
            return log_file.read(size)
    except OSError:
        return b""


def end_note(reason: str, job_dir: Path, lines: int = 3) -> str:
    """What to say of a job that ended without a result: the executor's word (e.g. Slurm's
    state and reason) and the last lines of the job's log, on one line."""
    parts = [reason] if reason else []
    tail = _log_end(job_dir, 4096).decode("utf-8", "replace").splitlines()
    last = [line.strip() for line in tail if line.strip()][-lines:]
    if last:
        parts.append("log ends: " + " | ".join(last))
    return "; ".join(parts)


def _append_line(sub: Submission, line: str) -> None:
    try:
        with sub.held_job_dir() as held:
            fd = held.open_append(LOG_FILE)
        with open(fd, "a", encoding="utf-8") as file:
            file.write(line + "\n")
    except OSError as exc:  # the store and the status file still say it
        log.warning("cannot write to the job's log", path=str(sub.job_dir / LOG_FILE),
                    error=str(exc))  # fmt: skip


def probe_run_folder(batch: Batch) -> OSError | None:
    """Why the batch's results folder cannot be written (None when it can): it is made if
    missing and a file made and removed in it, through the held batch folder, once per batch
    per submission round. A link planted on the way, a folder that is not writable or a full
    share is found here, where the batch fails saying so, not in its jobs."""
    relative = Path(batch.run_dir).relative_to(batch.path).as_posix()
    try:
        with (
            HeldFolder.batch(batch.root, batch.folder, batch.identity) as held,
            held.folder(relative, create=True) as run,
        ):
            probe = temporary_name()
            run.write_bytes(probe, b"", fsync=False)
            run.unlink(probe)
    except FolderReplaced:
        return None  # a new revision supersedes this batch; its jobs refuse the new folder
    except OSError as exc:
        return exc
    return None


def copy_log(batch: Batch, job_dir: Path) -> None:
    """Copy the end of an ended job's log into the owner's results folder, ``logs/<job>.log``,
    through the held batch folder (written whole, under a fresh name, renamed into place: a link
    or FIFO planted there is replaced, never written through). A folder that refuses it is
    logged; the status file and the store still say what became of the job."""
    text = _log_end(job_dir, LOG_COPY_BYTES)
    if not text:
        return
    relative = Path(batch.run_dir).relative_to(batch.path).as_posix()
    try:
        with HeldFolder.batch(batch.root, batch.folder, batch.identity) as held:
            held.write_bytes(f"{relative}/{jobspec.owner_log(job_dir.name)}", text, fsync=False)
    except (OSError, ValueError) as exc:
        log.warning("job log not copied into the batch folder", batch_id=batch.id,
                    job=job_dir.name, error=str(exc))  # fmt: skip


def read_result(job_dir: Path) -> JobResult | None:
    try:
        with HeldFolder.open(job_dir) as held, held.open_read(RESULT_FILE) as file:
            return JobResult.from_json(file.read(MAX_RESULT_BYTES).decode("utf-8"))
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclass(frozen=True)
class Progress:
    """What a job's progress file says: images done, and when the job expects to end (None:
    not said)."""

    done: int
    due_at: float | None = None


def read_progress(job_dir: Path) -> Progress | None:
    """What a job's progress file says, or None where it says nothing readable."""
    try:
        with HeldFolder.open(job_dir) as held, held.open_read(PROGRESS_FILE) as file:
            data = json.loads(file.read(4096))
        due_at = data.get("due_at")
        known = isinstance(due_at, (int, float)) and not isinstance(due_at, bool)
        due = float(due_at) if known and math.isfinite(due_at) else None
        return Progress(int(data["done"]), due)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def prepare_job_dir(spec: JobSpec) -> bool:
    """Write the spec for this attempt; True if this very attempt already finished.

    A result newer than a spec of the same attempt means the job ran to its end and the daemon
    died before recording it. Otherwise a stale result of an earlier attempt is removed first,
    so a result found later always belongs to the attempt that was submitted. The job folder
    is in the spool, made as the spool's folders are (:func:`daemon.contract.spool.make_private`).
    """
    spool.make_private(spec.job_dir)
    with HeldFolder.open(spec.job_dir) as held:
        text, old_text = spec.to_json(), None
        try:
            with held.open_read(SPEC_FILE) as file:
                old_text = file.read().decode("utf-8")
            old = JobSpec.from_json(old_text)
            newer = held.lstat(RESULT_FILE).st_mtime_ns >= held.lstat(SPEC_FILE).st_mtime_ns
            if old.attempt == spec.attempt and newer:
                return True
        except (OSError, ValueError, KeyError, TypeError):
            pass
        held.unlink(RESULT_FILE)
        if text != old_text:  # a job offered again and again (held back) is not rewritten
            held.write_text(SPEC_FILE, text)
    return False
