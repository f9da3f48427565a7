"""The planner: a snapshot of the active batches, their jobs and what was observed in, the
actions that move them on out. Pure; the service carries the actions out.

One tick's plan only reads the snapshot, so a decision that needs another's effect (a report
job after the last shard succeeded) is taken on the next tick.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace

from daemon.contract.heldfolder import FOLDER_REPLACED
from daemon.contract.jobspec import (
    ErrorKind,
    JobResult,
    Pipeline,
    Problem,
    owner_log,
    summarised,
)
from daemon.contract.usage import JobUsage
from daemon.core import fairshare
from daemon.core.jobplan import Sharding, compute_jobs, first_pipeline, next_stage_job
from daemon.core.manifest import Manifest, ResourceRequest
from daemon.core.owners import Accounts, Quota
from daemon.core.quotas import Account as QuotaAccount
from daemon.core.quotas import parse_quota, refusal
from daemon.core.readiness import NotReady, Ready, Verdict, Waiting
from daemon.core.records import Batch, Intent, IntentAction, Job, NewJob
from daemon.core.states import BatchState, JobState, Phase


@dataclass(frozen=True)
class JobSeen:
    """One observation of a live job: the executor's word and the result file, if any."""

    job_id: int
    phase: Phase
    exit_code: int | None = None
    result: JobResult | None = None
    note: str = ""  # for an end without a result: the executor's word, the log's last lines


@dataclass(frozen=True)
class BatchView:
    batch: Batch
    manifest: Manifest | None
    jobs: tuple[Job, ...] = ()
    verdict: Verdict | None = None  # set for a waiting batch whose inputs were looked at
    inputs_changed: bool = False  # a batch failed for incomplete inputs saw them change


@dataclass(frozen=True)
class Policy:
    shards: Sharding
    max_attempts: int
    executor: str


@dataclass(frozen=True)
class Snapshot:
    """What the planner decides from: fields by name (``Snapshot(now=..., policy=...)``); a
    snapshot of intents alone (at start-up) leaves the rest empty."""

    now: float
    policy: Policy
    batches: tuple[BatchView, ...] = ()
    seen: Mapping[int, JobSeen] = field(default_factory=dict)
    intents: tuple[Intent, ...] = ()
    free_slots: int | None = None  # None: the executor queues without limit
    submitting: bool = True  # False while shutting down
    paused_roots: frozenset[str] = frozenset()  # paused by an operator: no job goes out
    held_elsewhere: frozenset[str] = frozenset()  # roots another daemon holds: nor there
    # the site's table of owners: turns, caps, quotas
    accounts: Accounts = field(default_factory=Accounts)
    quotas: Mapping[str, QuotaAccount] = field(default_factory=dict)  # by subject, this period


@dataclass(frozen=True)
class MoveBatch:
    batch_id: int
    target: BatchState
    reason: str
    problems: tuple[Problem, ...] = ()
    detail: str = ""
    watch_inputs: str = ""  # with FAILED: revive the batch when its inputs change from this


@dataclass(frozen=True)
class MoveJob:
    job_id: int
    target: JobState
    reason: str
    exit_code: int | None = None
    error_kind: ErrorKind | None = None
    detail: str = ""
    fresh: bool = False  # an operator's retry: the attempt count starts again
    batch_id: int | None = None  # the job's batch: the actor commits a batch's moves together
    usage: JobUsage | None = None  # what an ended attempt measured: charged to its owner


@dataclass(frozen=True)
class PlanJobs:
    batch_id: int
    jobs: tuple[NewJob, ...]


@dataclass(frozen=True)
class Submit:
    job_ids: tuple[int, ...]


@dataclass(frozen=True)
class Expect:
    """A job of ``pipeline``, with what the batch's manifest asks for, goes out soon: a
    waiting batch's first jobs once its inputs are all there and settle, the next stage's job
    while the jobs before it run. The executor may start its process ahead (the local one: a
    warm start, :mod:`daemon.executors.spares`)."""

    batch_id: int
    pipeline: Pipeline
    request: ResourceRequest


@dataclass(frozen=True)
class Cancel:
    """Stop these jobs at the executor (live ones) and mark them cancelled."""

    job_ids: tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class ResolveIntent:
    intent_id: int
    outcome: str
    batch_id: int | None = None  # the intent's batch (None: a drop root's)


@dataclass(frozen=True)
class PauseRoot:
    """Record a drop root as paused (no manifest taken in, no job submitted) or resumed."""

    root: str
    paused: bool
    requested_by: str


@dataclass(frozen=True)
class Preempt:
    """Stop these live jobs at the executor and make them pending again (their attempt is not
    counted against the retry budget): their owner is over its share and another waits."""

    job_ids: tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class HoldBatch:
    """Record why a queued batch does not start (its owner's quota); '' releases it."""

    batch_id: int
    reason: str


@dataclass(frozen=True)
class SetQuota:
    """Record an operator's quota of a subject (None: lift it, the config's applies again)."""

    subject: str
    quota: Quota | None
    requested_by: str


Action = (
    MoveBatch | MoveJob | PlanJobs | Submit | Cancel | ResolveIntent | PauseRoot | Preempt
    | HoldBatch | SetQuota | Expect
)  # fmt: skip


def opens_work(actions: Iterable[Action]) -> bool:
    """Whether these actions may let the next plan do more at once: jobs planned (to submit)
    or a job ended or retried (the next stage, a retry, a free slot). The loop then plans
    again without waiting for its tick; a job seen running asks for nothing. (Each of these
    happens once per job or stage, so plans asked for this way end.)"""
    return any(
        isinstance(a, (PlanJobs, Preempt))
        or (isinstance(a, MoveJob) and a.target is not JobState.RUNNING)
        for a in actions
    )


def plan(snapshot: Snapshot) -> list[Action]:
    """Every action this tick: intents, then each batch in order, then submissions (none for
    the batches of a paused drop root, or of one another daemon holds)."""
    actions: list[Action] = []
    views = {v.batch.id: v for v in snapshot.batches}
    handled: set[int] = set()
    paused = snapshot.paused_roots
    for intent in snapshot.intents:
        if intent.subject is not None:  # an operator's quota
            actions += _apply_quota_intent(intent)
            continue
        if intent.batch_id is None:  # an intent on a drop root
            root_actions, paused = _apply_root_intent(intent, paused)
            actions += root_actions
            continue
        view = views.get(intent.batch_id)
        actions += _apply_intent(intent, view)
        handled.add(intent.batch_id)
    pending: list[Job] = []
    stopped = paused | snapshot.held_elsewhere  # as this tick's intents left them
    for view in snapshot.batches:
        if view.batch.id in handled:
            continue
        if view.batch.state.terminal:
            actions += _revive(view)
            continue
        going = snapshot.submitting and view.batch.root not in stopped
        batch_actions, ready_to_submit = _plan_batch(view, snapshot, going)
        actions += batch_actions
        pending += ready_to_submit
    if snapshot.submitting:
        free = [j for j in pending if views[j.batch_id].batch.root not in stopped]
        # a batch or stage planned now has no pending job yet: its slot waits one round for
        # it, so that it takes its turn with the others instead of losing it to them
        planned = sum(isinstance(a, PlanJobs) for a in actions)
        actions += _submissions(free, snapshot, planned)
    return actions


# -- intents ------------------------------------------------------------------------------------


def _resolved(intent: Intent, outcome: str) -> ResolveIntent:
    return ResolveIntent(intent.id, outcome, intent.batch_id)


def _apply_intent(intent: Intent, view: BatchView | None) -> list[Action]:
    if view is None:
        return [_resolved(intent, "ignored: the batch is not active")]
    state = view.batch.state
    who = intent.requested_by or "an operator"
    if intent.action is IntentAction.CANCEL:
        if state.terminal:
            return [_resolved(intent, f"nothing to cancel: the batch is {state.value}")]
        return [
            *_cancel_jobs(view.jobs, f"cancelled by {who}"),
            MoveBatch(view.batch.id, BatchState.CANCELLED, f"cancelled by {who}"),
            _resolved(intent, "cancelled"),
        ]
    if intent.action in (IntentAction.RETRY, IntentAction.REQUEUE):
        allowed = (
            {BatchState.FAILED, BatchState.CANCELLED}
            if intent.action is IntentAction.RETRY
            else {BatchState.DONE, BatchState.FAILED, BatchState.CANCELLED}
        )
        if state not in allowed:
            return [_resolved(intent, f"not done: the batch is {state.value}")]
        if view.manifest is None:
            refused = "not done: its manifest was refused; saving a fixed one starts a new revision"
            return [_resolved(intent, refused)]
        reason = f"{intent.action.value} asked by {who}"
        # A retry re-runs the failed jobs once the inputs are checked; a requeue runs them all.
        again: list[Action] = [
            MoveJob(j.id, JobState.PENDING, reason, fresh=True, batch_id=j.batch_id)
            for j in view.jobs
            if intent.action is IntentAction.REQUEUE and j.state.terminal
        ]
        return [
            MoveBatch(view.batch.id, BatchState.WAITING, reason),
            *again,
            _resolved(intent, f"{intent.action.value}: waiting for inputs again"),
        ]
    return [_resolved(intent, f"ignored: {intent.action.value} is asked of a drop root")]


def _apply_quota_intent(intent: Intent) -> list[Action]:
    """Set or lift an operator's quota of a subject (``user:NAME`` or ``group:NAME``)."""
    subject, who = str(intent.subject), intent.requested_by or "an operator"
    kind = subject.partition(":")[0]
    if intent.action is not IntentAction.QUOTA or kind not in ("user", "group"):
        return [_resolved(intent, f"ignored: {intent.action.value} of {subject}")]
    try:
        quota = parse_quota(intent.value)
    except ValueError as exc:
        return [_resolved(intent, f"ignored: {exc}")]
    outcome = f"quota of {subject}: {quota.describe()}" if quota else f"quota of {subject} lifted"
    return [SetQuota(subject, quota, who), _resolved(intent, outcome)]


def _apply_root_intent(
    intent: Intent, paused: frozenset[str]
) -> tuple[list[Action], frozenset[str]]:
    """Pause or resume a drop root; the paused roots after it."""
    root, who = str(intent.root), intent.requested_by or "an operator"
    if not intent.action.on_root:
        refused = f"ignored: {intent.action.value} is asked of a batch"
        return [_resolved(intent, refused)], paused
    pause = intent.action is IntentAction.PAUSE
    if (root in paused) == pause:
        already = "already paused" if pause else "not paused"
        return [_resolved(intent, f"nothing to do: the root is {already}")], paused
    after = paused | {root} if pause else paused - {root}
    outcome = "paused" if pause else "resumed"
    return [PauseRoot(root, pause, who), _resolved(intent, outcome)], after


def _cancel_jobs(jobs: Iterable[Job], reason: str) -> list[Action]:
    ids = tuple(j.id for j in jobs if not j.state.terminal)
    return [Cancel(ids, reason)] if ids else []


# -- one batch ----------------------------------------------------------------------------------


def _plan_batch(view: BatchView, snapshot: Snapshot, going: bool) -> tuple[list[Action], list[Job]]:
    """One batch's actions and its jobs ready to go out; ``going``: its jobs may go out now
    (its root neither paused nor held elsewhere, the daemon not stopping)."""
    batch = view.batch
    if batch.state is BatchState.WAITING:
        return _plan_waiting(view, snapshot.policy, going), []
    actions: list[Action] = []
    if batch.state is BatchState.QUEUED and any(j.state.live for j in view.jobs):
        # only once the executor took a job: a refused or held-back submission leaves it queued
        actions.append(MoveBatch(batch.id, BatchState.RUNNING, "jobs submitted"))
    jobs = []
    for job in view.jobs:
        moves = _judge(job, snapshot.seen.get(job.id), snapshot.policy)
        actions += moves
        jobs.append(_after(job, moves))
    failure = _failure(jobs, snapshot.seen, snapshot.policy)
    if failure is not None:
        actions += _cancel_jobs(
            [j for j in jobs if j.state.live or j.state is JobState.PENDING],
            f"batch {failure.state.value}",
        )
        actions.append(failure(batch.id))
        return actions, []
    actions += _next_stage(view, jobs, snapshot.policy)
    # A job goes out once every job of the earlier stages succeeded (after a requeue, the
    # report waits for the shards again).
    open_stage = min((j.stage for j in jobs if j.state is not JobState.SUCCEEDED), default=0)
    pending = [j for j in jobs if j.state is JobState.PENDING and j.stage == open_stage]
    held = _quota_hold(view, jobs, snapshot)
    if held != batch.hold:
        actions.append(HoldBatch(batch.id, held))
    if going:  # last: it talks to the executor, after the batch's store-only actions
        actions += _expect_next_stage(view, jobs)
    return actions, [] if held else pending


def _quota_hold(view: BatchView, jobs: Sequence[Job], snapshot: Snapshot) -> str:
    """Why a queued batch may not start under its owner's or its group's quota ('' when it
    may). Only before its first job went out: a batch under way goes on to its end."""
    batch = view.batch
    if batch.state is not BatchState.QUEUED or any(j.attempts for j in jobs):
        return ""
    owner = batch.owned_by
    if owner is None:
        return ""
    images = sum(j.images for j in jobs)
    for subject in (f"user:{owner.user}", f"group:{owner.group}"):
        account = snapshot.quotas.get(subject)  # the quotas in force, as the service found them
        if account is not None and (said := refusal(account, images)):
            return said
    return ""


def _revive(view: BatchView) -> list[Action]:
    """Inputs that were incomplete at the timeout changed since: look at them again."""
    if view.batch.state is BatchState.FAILED and view.batch.watch_inputs and view.inputs_changed:
        reason = "inputs changed after the timeout: checking them again"
        return [MoveBatch(view.batch.id, BatchState.WAITING, reason)]
    return []


def _plan_waiting(view: BatchView, policy: Policy, going: bool) -> list[Action]:
    """A waiting batch: failed, queued with its jobs planned, or left to wait (its first jobs
    and its report expected where its inputs are all there and settle, and jobs of its root
    may go out)."""
    verdict, batch = view.verdict, view.batch
    settling = isinstance(verdict, Waiting) and not verdict.problems
    if settling and going and view.manifest is not None:
        # every batch ends with its report: its warm start imports while the inputs settle, so
        # that it is ready even after shards shorter than its imports (a resident device's)
        first = first_pipeline(view.manifest)
        return [Expect(batch.id, pipeline, view.manifest.resources)
                for pipeline in dict.fromkeys((first, Pipeline.REPORT))]  # fmt: skip
    if isinstance(verdict, NotReady):
        return [
            *_cancel_jobs(view.jobs, "batch failed"),  # a requeued batch's jobs wait pending
            MoveBatch(
                batch.id,
                BatchState.FAILED,
                verdict.reason,
                verdict.problems,
                watch_inputs=verdict.watch,
            ),
        ]
    if not isinstance(verdict, Ready) or view.manifest is None:
        return []
    actions: list[Action] = [MoveBatch(batch.id, BatchState.QUEUED, "inputs complete")]
    if not view.jobs:
        jobs = compute_jobs(batch, view.manifest, verdict.inputs, policy.shards, policy.executor)
        return [*actions, PlanJobs(batch.id, jobs)]
    return actions + [
        MoveJob(j.id, JobState.PENDING, "retry asked by operator", fresh=True, batch_id=j.batch_id)
        for j in view.jobs
        if j.state in (JobState.FAILED, JobState.CANCELLED)
    ]


def _next_stage(view: BatchView, jobs: Sequence[Job], policy: Policy) -> list[Action]:
    """Once every job so far succeeded: the next stage's job (see next_stage_job); done after
    the report succeeded."""
    if not jobs or any(j.state is not JobState.SUCCEEDED for j in jobs):
        return []
    batch = view.batch
    if Pipeline.REPORT in {j.pipeline for j in jobs}:
        return [MoveBatch(batch.id, BatchState.DONE, "all jobs succeeded")]
    return [PlanJobs(batch.id, (next_stage_job(batch, view.manifest, jobs, policy.executor),))]


def _expect_next_stage(view: BatchView, jobs: Sequence[Job]) -> list[Action]:
    """While jobs of a batch run, the job of the stage after them (its report, a slide's
    assembly, a sweep's comparison) is expected: its process may be started ahead and be
    ready when they end. None after the report, the last stage."""
    if view.manifest is None or not any(j.state.live for j in jobs):
        return []
    if any(j.pipeline is Pipeline.REPORT for j in jobs):
        return []
    coming = next_stage_job(view.batch, view.manifest, jobs, "").pipeline
    return [Expect(view.batch.id, coming, view.manifest.resources)]


# -- jobs ---------------------------------------------------------------------------------------


def _judge(job: Job, seen: JobSeen | None, policy: Policy) -> list[MoveJob]:
    """The job's next state from what was observed, and a retry where the policy allows one."""
    if seen is None or not job.state.live:
        return []
    if seen.phase is Phase.QUEUED:
        return []
    if seen.phase is Phase.RUNNING:
        return (
            [MoveJob(job.id, JobState.RUNNING, "started", batch_id=job.batch_id)]
            if job.state is JobState.SUBMITTED
            else []
        )
    result = seen.result
    usage = JobUsage.from_summary(result.summary) if result is not None else None
    if result is not None and result.ok:
        return [
            MoveJob(
                job.id,
                JobState.SUCCEEDED,
                "finished",
                seen.exit_code,
                batch_id=job.batch_id,
                usage=usage,
            )
        ]
    kind, reason, detail = _failure_of(seen)
    moves = [
        MoveJob(
            job.id,
            JobState.FAILED,
            reason,
            seen.exit_code,
            kind,
            detail,
            batch_id=job.batch_id,
            usage=usage,
        )
    ]
    if _retryable(kind) and job.tries < policy.max_attempts:
        moves.append(
            MoveJob(
                job.id,
                JobState.PENDING,
                f"retry {job.tries + 1} of {policy.max_attempts}",
                batch_id=job.batch_id,
            )
        )
    return moves


def _failure_of(seen: JobSeen) -> tuple[ErrorKind, str, str]:
    result = seen.result
    if result is None or result.error is None:
        code = "unknown" if seen.exit_code is None else str(seen.exit_code)
        note = f"; {seen.note}" if seen.note else ""
        return ErrorKind.LOST, f"ended without a result (exit code {code}){note}", ""
    error = result.error
    detail = json.dumps(
        {"problems": [asdict(p) for p in summarised(error.problems)], "traceback": error.traceback},
        ensure_ascii=False,
    )
    return error.kind, error.message, detail


def _retryable(kind: ErrorKind | None) -> bool:
    return kind is not None and kind.retryable


def _after(job: Job, moves: Sequence[MoveJob]) -> Job:
    """The job as it will be once ``moves`` are applied."""
    for move in moves:
        job = replace(
            job,
            state=move.target,
            error_kind=move.error_kind or job.error_kind,
            reason=move.reason,
        )
    return job


def _failure(jobs: Sequence[Job], seen: Mapping[int, JobSeen], policy: Policy) -> _Failure | None:
    """A job that failed for good fails its batch, with what the job said; one that refused a
    batch folder replaced under its name cancels it (nothing in it is wrong: its owner put
    another folder there, taken in as a batch of its own once its manifest is read, which
    also cancels this one, whichever comes first)."""
    for job in jobs:
        if job.state is not JobState.FAILED:
            continue
        observed = seen.get(job.id)
        result = observed.result if observed else None
        error = result.error if result else None
        if error is not None and error.kind is ErrorKind.INPUT and error.message == FOLDER_REPLACED:
            return _Failure(
                f"cancelled by watchd ({FOLDER_REPLACED}: job {job.name} found another folder "
                "under its name)",
                summarised(error.problems),
                state=BatchState.CANCELLED,
            )
        attempts = f" after {job.tries} attempt(s)" if _retryable(job.error_kind) else ""
        problems = summarised(error.problems) if error else ()  # a shard may report thousands
        message = error.message if error else (job.reason or "it ended without a result")
        if not problems:
            problems = (
                Problem(f"job {job.name}", message, f"see its log: {owner_log(job.name)}"),
            )
        return _Failure(
            f"job {job.name} failed{attempts}: {message}",
            problems,
            error.traceback if error else "",
        )
    return _stranded(jobs)


def _stranded(jobs: Sequence[Job]) -> _Failure | None:
    """Jobs cancelled while their batch went on (a daemon stopped between cancelling them and
    ending the batch): nothing is left to run, so the batch fails with what happened."""
    if any(j.state.live or j.state is JobState.PENDING for j in jobs):
        return None
    cancelled = [j for j in jobs if j.state is JobState.CANCELLED]
    if not cancelled:
        return None
    job = cancelled[0]
    message = f"job {job.name} was cancelled ({job.reason or 'no reason recorded'})"
    return _Failure(message, (Problem(f"job {job.name}", "was cancelled", "ask for a retry"),))


@dataclass(frozen=True)
class _Failure:
    reason: str
    problems: tuple[Problem, ...] = field(default=())
    detail: str = ""
    state: BatchState = BatchState.FAILED  # CANCELLED: the batch folder was replaced

    def __call__(self, batch_id: int) -> MoveBatch:
        return MoveBatch(batch_id, self.state, self.reason, self.problems, self.detail)


def fair_turns(snapshot: Snapshot, pending: Sequence[Job], held_back: int = 0) -> fairshare.Turns:
    """The fair order of this snapshot (see :mod:`daemon.core.fairshare`): who goes out, who
    yields, who waits and why; ``held_back`` slots are kept for jobs planned this round."""
    batches = {v.batch.id: v.batch for v in snapshot.batches}
    accounts = snapshot.accounts
    live = [j for v in snapshot.batches for j in v.jobs if j.state.live]

    def subject_of(job: Job) -> str:
        return accounts.subject(batches[job.batch_id].owned_by)

    stakes = {}
    for batch in batches.values():
        terms = accounts.terms(batch.owned_by)
        stakes[accounts.subject(batch.owned_by)] = fairshare.Stake(terms.weight, terms.max_running)
    served: dict[str, float] = {}
    for job in (j for v in snapshot.batches for j in v.jobs if j.submitted_at is not None):
        subject = subject_of(job)
        served[subject] = max(served.get(subject, 0.0), float(job.submitted_at or 0.0))
    free = snapshot.free_slots
    if free is not None:
        free = max(0, free - held_back)
    patience: dict[str, float] = {}
    for job in pending:  # the grace less what the subject's longest-waiting job has waited
        left = accounts.preempt_grace - (snapshot.now - job.created_at)
        patience[subject_of(job)] = min(patience.get(subject_of(job), left), left)
    due = {j.id: eta for j in live if (eta := _due(j, snapshot.now)) is not None}
    return fairshare.share_out(
        pending, live, subject_of, stakes, free,
        preempt=accounts.preempt and not held_back, served=served, patience=patience, due=due,
    )  # fmt: skip


OVERDUE_SECONDS = 10.0  # a job this far past the end it expected: when it ends is not known


def _due(job: Job, now: float) -> float | None:
    """The seconds a job expects to run still, as its progress file last said (the job's own
    pace on this attempt, start-up left out); None when that is not known: no image done yet,
    not inference, or overdue by more than OVERDUE_SECONDS."""
    if job.due_at is None or job.due_at < now - OVERDUE_SECONDS:
        return None
    return max(0.0, job.due_at - now)


def _submissions(pending: Sequence[Job], snapshot: Snapshot, held_back: int) -> list[Action]:
    """Hand pending jobs to the executor in the fair order, within the free slots, and stop
    what must yield. The batch moves to RUNNING on a later tick, once the executor took one of
    its jobs."""
    turns = fair_turns(snapshot, pending, held_back)
    actions: list[Action] = []
    if turns.preempt:
        owed = [s.subject for s in turns.standings
                if s.pending and s.share is not None and s.running < s.share]  # fmt: skip
        to = f" to {', '.join(owed)}" if owed else ""
        reason = f"yielded its slot{to} (fair share); it resumes where it stopped"
        actions.append(Preempt(tuple(j.id for j in turns.preempt), reason))
    if turns.submit:
        actions.append(Submit(tuple(j.id for j in turns.submit)))
    return actions
