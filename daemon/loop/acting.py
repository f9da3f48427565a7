"""Acting: carrying out the planner's actions, on the store and through the dispatcher.

An action that raises fails its batch (with the traceback stored) and the next group goes on.
The Service owns the Actor and calls it from the loop's thread alone, the one that changes state;
what the loop must know of a round (batches whose status file is due, drop roots paused or
resumed) comes back as :class:`Effects`, a value the service acts on.
"""

from __future__ import annotations

import errno
import traceback
from collections.abc import Iterable
from dataclasses import dataclass, field

import structlog

from daemon.contract.errors import ManifestError
from daemon.contract.heldfolder import unwritable_problem
from daemon.contract.jobspec import ErrorKind
from daemon.core.owners import Accounts
from daemon.core.planner import (
    Action,
    Cancel,
    Expect,
    HoldBatch,
    MoveBatch,
    MoveJob,
    PauseRoot,
    PlanJobs,
    Preempt,
    ResolveIntent,
    SetQuota,
    Submit,
)
from daemon.core.records import Batch, Job, JobChange
from daemon.core.states import BatchState, JobState
from daemon.loop.dispatch import FINISHED_HANDLE, Dispatcher
from daemon.loop.metrics import Metrics
from daemon.loop.waitroom import WaitRoom
from daemon.store import Store
from daemon.store.usage import Charged

log = structlog.get_logger("watchd")


@dataclass
class Effects:
    """What one round of actions did that the loop acts on: the batches whose status file is
    due, and the drop roots paused or resumed (recorded; they change what the loop takes in)."""

    touched: set[int] = field(default_factory=set)
    roots: list[PauseRoot] = field(default_factory=list)


class Actor:
    def __init__(
        self,
        store: Store,
        dispatch: Dispatcher,
        waitroom: WaitRoom,
        metrics: Metrics,
        accounts: Accounts | None = None,
    ) -> None:
        """``accounts``: the site's table of owners (the account an ended job is charged to)."""
        self.store = store
        self.dispatch = dispatch
        self.waitroom = waitroom
        self.metrics = metrics
        self.accounts = accounts or Accounts()
        self._effects = Effects()
        self._unreachable: set[int] = set()  # batches whose folder the share cannot reach now

    def carry_out(self, actions: Iterable[Action], now: float) -> Effects:
        """Carry out ``actions``, group by group; what the loop must know of it."""
        self._effects = Effects()
        for group in _transactions(actions):
            self._act_safely(group, now)
        return self._effects

    def touched(self, batch_id: int) -> None:
        self._effects.touched.add(batch_id)

    def _act_safely(self, group: list[Action], now: float) -> None:
        """Carry out one group of actions: store-only actions of one batch commit together (a
        crash between them must not leave half a decision), an executor action alone."""
        try:
            if len(group) == 1:
                self._act(group[0], now)
            else:
                with self.store.atomic():
                    for action in group:
                        self._act(action, now)
        except Exception as exc:  # a bug must not stop the loop: fail that batch, go on
            batch_id = _failed_batch(group[0], self.store)
            names = [type(a).__name__ for a in group]
            log.exception("action failed", actions=names, batch_id=batch_id)
            if batch_id is not None:
                self._fail_batch(batch_id, f"internal error: {exc}", traceback.format_exc(), now)

    def _act(self, action: Action, now: float) -> None:
        if isinstance(action, MoveBatch):
            self._move_batch(action, now)
        elif isinstance(action, MoveJob):
            change = JobChange(
                exit_code=action.exit_code,
                error_kind=action.error_kind,
                reset_attempts=action.fresh,
            )
            job = self._move_job(
                action.job_id, action.target, action.reason, now, change, action.detail
            )
            if action.target in (JobState.SUCCEEDED, JobState.FAILED):
                self._charge(job, action, now)
        elif isinstance(action, PlanJobs):
            jobs = self.store.create_jobs(action.batch_id, action.jobs, now)
            log.info("jobs planned", batch_id=action.batch_id, jobs=len(jobs))
            self.touched(action.batch_id)
        elif isinstance(action, Submit):
            self._submit(action.job_ids, now)
        elif isinstance(action, Expect):
            self.dispatch.expect(action.pipeline, action.request)
        elif isinstance(action, Cancel):
            self._cancel(action, now)
        elif isinstance(action, Preempt):
            self._preempt(action, now)
        elif isinstance(action, HoldBatch):
            self.store.set_hold(action.batch_id, action.reason, now)
            log.info("batch held" if action.reason else "batch released",
                     batch_id=action.batch_id, reason=action.reason)  # fmt: skip
            self.touched(action.batch_id)
        elif isinstance(action, SetQuota):
            self.store.set_quota(action.subject, action.quota, action.requested_by, now)
            log.info("quota set", subject=action.subject, by=action.requested_by,
                     quota=action.quota.describe() if action.quota else "lifted")  # fmt: skip
        elif isinstance(action, PauseRoot):
            self.store.set_root_paused(action.root, action.paused, action.requested_by, now)
            log.info("drop root " + ("paused" if action.paused else "resumed"), root=action.root,
                     by=action.requested_by)  # fmt: skip
            self._effects.roots.append(action)
        elif isinstance(action, ResolveIntent):
            self.store.resolve_intent(action.intent_id, action.outcome, now)
            log.info("intent applied", intent_id=action.intent_id, outcome=action.outcome)

    def _move_job(
        self,
        job_id: int,
        target: JobState,
        reason: str,
        now: float,
        change: JobChange | None = None,
        detail: str = "",
    ) -> Job:
        """Every job's transition, whoever asked for it (the planner, a submission, a cancel):
        recorded with its event, logged, its batch's status file due, an end counted."""
        job = self.store.transition_job(job_id, target, reason, now, change, detail)
        log.info("job " + target.value, batch_id=job.batch_id, job_id=job.id, job=job.name,
                 reason=reason, **({"handle": job.handle, "attempt": job.attempts}
                                   if target is JobState.SUBMITTED else {}))  # fmt: skip
        self.touched(job.batch_id)
        if job.state.terminal:
            self.metrics.job_ended(job)
        return job

    def _charge(self, job: Job, action: MoveJob, now: float) -> None:
        """Record what an ended attempt used, charged to its batch's owner, group and account
        (as the site's table says now), and count it in the group's metrics."""
        batch = self.store.batch(job.batch_id)
        owner = batch.owned_by
        account = self.accounts.terms(owner).charge.account
        charged = Charged(owner.user if owner else "", owner.group if owner else "", account)
        self.store.record_usage(job, charged, action.usage, now)
        self.metrics.charged(charged.group, job, action.usage)

    def _preempt(self, action: Preempt, now: float) -> None:
        """Stop jobs whose owner is over its share: each is cancelled at the executor (a cancel
        kept in the same transaction) and made pending again, its attempt not counted."""
        for job in (self.store.job(i) for i in action.job_ids):
            if not job.state.live:
                continue
            with self.store.atomic():
                self.dispatch.keep_cancel(job, now)
                self._move_job(job.id, JobState.CANCELLED, action.reason, now)
                change = JobChange(forgive_attempt=True)
                self._move_job(job.id, JobState.PENDING, "waits for its turn again", now, change)
        self.dispatch.deliver_cancels()

    def _move_batch(self, action: MoveBatch, now: float) -> None:
        batch = self.store.transition_batch(
            action.batch_id,
            action.target,
            action.reason,
            now,
            problems=action.problems,
            detail=action.detail,
            watch_inputs=action.watch_inputs,
        )
        log.info(
            "batch " + batch.state.value,
            batch_id=batch.id,
            folder=batch.folder,
            reason=action.reason,
            problems=[p.render() for p in action.problems],
        )
        self.touched(batch.id)
        self.waitroom.moved(batch)

    def _fail_batch(self, batch_id: int, reason: str, detail: str, now: float) -> None:
        try:
            batch = self.store.batch(batch_id)
            if not batch.state.terminal:
                self._move_batch(MoveBatch(batch_id, BatchState.FAILED, reason, detail=detail), now)
        except Exception:
            log.exception("cannot mark batch failed", batch_id=batch_id)

    def _submit(self, job_ids: Iterable[int], now: float) -> None:
        work = []
        batches: dict[int, Batch] = {}
        for job_id in job_ids:
            job = self.store.job(job_id)
            batch = batches.setdefault(job.batch_id, self.store.batch(job.batch_id))
            try:
                manifest = self.waitroom.parsed(batch)
            except ManifestError as refused:
                self._fail_batch(batch.id, f"manifest no longer valid: {refused}", "", now)
                continue
            if manifest is not None and not self.store.batch(batch.id).state.terminal:
                work.append((job, batch, manifest))
        outcome = self.dispatch.submit(work, now)
        for job, handle in outcome.taken:
            found = handle == FINISHED_HANDLE  # ended before a crash let it be recorded
            change = JobChange(handle=handle, new_attempt=True)
            reason = "found finished" if found else "submitted"
            self._move_job(job.id, JobState.SUBMITTED, reason, now, change)
            self._unreachable.discard(job.batch_id)
        for job, why in outcome.refused:  # its batch fails at the next tick's plan
            self._move_job(job.id, JobState.FAILED, why, now, JobChange(error_kind=ErrorKind.INPUT))
        for refused_batch, error in outcome.unwritable:
            self._unwritable(refused_batch, error, now)

    def _unwritable(self, batch: Batch, exc: OSError, now: float) -> None:
        if exc.errno in SHARE_DOWN:  # an outage, not the folder: its jobs wait for the share
            if batch.id not in self._unreachable:
                self._unreachable.add(batch.id)
                log.warning("batch folder unreachable; its jobs wait for the share",
                            batch_id=batch.id, folder=batch.folder, error=str(exc))  # fmt: skip
            return
        problem = unwritable_problem(exc)
        if not self.store.batch(batch.id).state.terminal:
            jobs = [j.id for j in self.store.jobs([batch.id]) if not j.state.terminal]
            self._cancel(Cancel(tuple(jobs), "batch failed"), now)
            failed = MoveBatch(
                batch.id, BatchState.FAILED, "results folder not writable", (problem,)
            )
            self._move_batch(failed, now)

    def _cancel(self, action: Cancel, now: float) -> None:
        """Each job not yet ended is cancelled, a cancel kept for the executor in the same
        transaction; then the cancels go out (or wait for a later tick)."""
        for job in (self.store.job(i) for i in action.job_ids):
            if not job.state.terminal:
                with self.store.atomic():
                    self.dispatch.keep_cancel(job, now)
                    self._move_job(job.id, JobState.CANCELLED, action.reason, now)
        self.dispatch.deliver_cancels()


# What a network share answers while it is away (sshfs, NFS, GPFS): a job waits, queued, and is
# submitted at a later tick once the share answers again; its batch does not fail for it.
SHARE_DOWN = frozenset({
    errno.ENOTCONN, errno.EIO, errno.ETIMEDOUT, errno.EHOSTDOWN, errno.EHOSTUNREACH,
    errno.ENETDOWN, errno.ENETUNREACH, errno.ECONNRESET, errno.ECONNABORTED,
})  # fmt: skip


def _failed_batch(action: Action, store: Store) -> int | None:
    """The batch to fail for an action that raised (a submission's or cancel's: its first
    job's)."""
    if isinstance(action, (Submit, Cancel, Preempt)) and action.job_ids:
        return store.job(action.job_ids[0]).batch_id
    return _batch_of(action)


def _transactions(actions: Iterable[Action]) -> list[list[Action]]:
    """Consecutive store-only actions of the same batch form one group; an action that also
    talks to the executor (submit, cancel, expect) is a group of its own."""
    groups: list[list[Action]] = []
    key: int | None = None
    for action in actions:
        talks = isinstance(action, (Submit, Cancel, Preempt, Expect))
        batch_id = None if talks else _batch_of(action)
        if batch_id is not None and groups and batch_id == key:
            groups[-1].append(action)
        else:
            groups.append([action])
        key = batch_id
    return groups


def _batch_of(action: Action) -> int | None:
    """The batch an action is about, as the planner said (None: a drop root's, or several)."""
    if isinstance(action, (MoveBatch, PlanJobs, MoveJob, ResolveIntent, HoldBatch)):
        return action.batch_id
    return None
