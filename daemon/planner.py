"""The planner: a snapshot of the active batches, their jobs and what was observed in, the
actions that move them on out. Pure; the service carries the actions out.

One tick's plan only reads the snapshot, so a decision that needs another's effect (a report
job after the last shard succeeded) is taken on the next tick.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace

from daemon.executors import Phase
from daemon.jobspec import (
    ErrorKind,
    InputFile,
    JobResult,
    JobSpec,
    Pipeline,
    Problem,
    Resources,
    Shard,
)
from daemon.manifest import Kind, Manifest, Role
from daemon.readiness import NotReady, Ready, Verdict
from daemon.records import Batch, Intent, Job, NewJob
from daemon.states import BatchState, JobState
from daemon.sweep import trial_params

LOST = "lost"  # error kind of a job that ended without writing its result


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
    shard_size: int
    max_attempts: int
    executor: str


@dataclass(frozen=True)
class Snapshot:
    now: float
    batches: tuple[BatchView, ...]
    seen: Mapping[int, JobSeen]
    intents: tuple[Intent, ...]
    free_slots: int | None  # None: the executor queues without limit
    policy: Policy
    submitting: bool = True  # False while shutting down


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
    error_kind: str | None = None
    detail: str = ""
    fresh: bool = False  # an operator's retry: the attempt count starts again


@dataclass(frozen=True)
class PlanJobs:
    batch_id: int
    jobs: tuple[NewJob, ...]


@dataclass(frozen=True)
class Submit:
    job_ids: tuple[int, ...]


@dataclass(frozen=True)
class Cancel:
    """Stop these jobs at the executor (live ones) and mark them cancelled."""

    job_ids: tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class ResolveIntent:
    intent_id: int
    outcome: str


Action = MoveBatch | MoveJob | PlanJobs | Submit | Cancel | ResolveIntent


def plan(snapshot: Snapshot) -> list[Action]:
    """Every action this tick: intents, then each batch in order, then submissions."""
    actions: list[Action] = []
    views = {v.batch.id: v for v in snapshot.batches}
    handled: set[int] = set()
    for intent in snapshot.intents:
        view = views.get(intent.batch_id)
        actions += _apply_intent(intent, view)
        handled.add(intent.batch_id)
    pending: list[Job] = []
    for view in snapshot.batches:
        if view.batch.id in handled:
            continue
        if view.batch.state.terminal:
            actions += _revive(view)
            continue
        batch_actions, ready_to_submit = _plan_batch(view, snapshot)
        actions += batch_actions
        pending += ready_to_submit
    if snapshot.submitting:
        actions += _submissions(pending, snapshot.free_slots)
    return actions


# -- intents ------------------------------------------------------------------------------------


def _apply_intent(intent: Intent, view: BatchView | None) -> list[Action]:
    if view is None:
        return [ResolveIntent(intent.id, "ignored: the batch is not active")]
    state = view.batch.state
    who = intent.requested_by or "an operator"
    if intent.action == "cancel":
        if state.terminal:
            return [ResolveIntent(intent.id, f"nothing to cancel: the batch is {state.value}")]
        return [
            *_cancel_jobs(view.jobs, f"cancelled by {who}"),
            MoveBatch(view.batch.id, BatchState.CANCELLED, f"cancelled by {who}"),
            ResolveIntent(intent.id, "cancelled"),
        ]
    if intent.action in ("retry", "requeue"):
        allowed = (
            {BatchState.FAILED, BatchState.CANCELLED}
            if intent.action == "retry"
            else {BatchState.DONE, BatchState.FAILED, BatchState.CANCELLED}
        )
        if state not in allowed:
            return [ResolveIntent(intent.id, f"not done: the batch is {state.value}")]
        return [
            MoveBatch(view.batch.id, BatchState.WAITING, f"{intent.action} asked by {who}"),
            ResolveIntent(intent.id, f"{intent.action}: waiting for inputs again"),
        ]
    return [ResolveIntent(intent.id, f"ignored: unknown action '{intent.action}'")]


def _cancel_jobs(jobs: Iterable[Job], reason: str) -> list[Action]:
    ids = tuple(j.id for j in jobs if not j.state.terminal)
    return [Cancel(ids, reason)] if ids else []


# -- one batch ----------------------------------------------------------------------------------


def _plan_batch(view: BatchView, snapshot: Snapshot) -> tuple[list[Action], list[Job]]:
    batch = view.batch
    if batch.state is BatchState.WAITING:
        return _plan_waiting(view, snapshot.policy), []
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
            [j for j in jobs if j.state.live or j.state is JobState.PENDING], "batch failed"
        )
        actions.append(failure(batch.id))
        return actions, []
    actions += _next_stage(view, jobs, snapshot.policy)
    pending = [j for j in jobs if j.state is JobState.PENDING]
    return actions, pending


def _revive(view: BatchView) -> list[Action]:
    """Inputs that were incomplete at the timeout changed since: look at them again."""
    if view.batch.state is BatchState.FAILED and view.batch.watch_inputs and view.inputs_changed:
        reason = "inputs changed after the timeout: checking them again"
        return [MoveBatch(view.batch.id, BatchState.WAITING, reason)]
    return []


def _plan_waiting(view: BatchView, policy: Policy) -> list[Action]:
    verdict, batch = view.verdict, view.batch
    if isinstance(verdict, NotReady):
        return [
            MoveBatch(
                batch.id,
                BatchState.FAILED,
                verdict.reason,
                verdict.problems,
                watch_inputs=verdict.watch,
            )
        ]
    if not isinstance(verdict, Ready) or view.manifest is None:
        return []
    actions: list[Action] = [MoveBatch(batch.id, BatchState.QUEUED, "inputs complete")]
    if not view.jobs:
        jobs = compute_jobs(batch, view.manifest, verdict.inputs, policy)
        return [*actions, PlanJobs(batch.id, jobs)]
    return actions + [
        MoveJob(j.id, JobState.PENDING, "retry asked by operator", fresh=True)
        for j in view.jobs
        if j.state in (JobState.FAILED, JobState.CANCELLED)
    ]


def compute_jobs(
    batch: Batch, manifest: Manifest, inputs: Sequence[InputFile], policy: Policy
) -> tuple[NewJob, ...]:
    """A training batch is one job; an inference batch is shards of ``shard_size`` images; a
    sweep batch is one training job per trial (one group: one job array under Slurm)."""
    prefix = f"b{batch.id:06d}"
    if manifest.kind is Kind.TRAINING:
        return (NewJob(f"{prefix}-train", Pipeline.TRAIN, 0, 0, 1, tuple(inputs), policy.executor),)
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
                policy.executor,
                params=params,
            )
            for i, params in enumerate(trials)
        )
    images = [f for f in inputs if f.role == Role.IMAGE.value]
    size = policy.shard_size
    count = max(1, -(-len(images) // size))
    return tuple(
        NewJob(
            f"{prefix}-infer-{i:04d}",
            Pipeline.INFER,
            0,
            i,
            count,
            tuple(images[i * size : (i + 1) * size]),
            policy.executor,
        )
        for i in range(count)
    )


def _next_stage(view: BatchView, jobs: Sequence[Job], policy: Policy) -> list[Action]:
    """Once every job so far succeeded: a sweep's trials are followed by the sweep job (compare,
    register the best), compute jobs by the report; done after the report succeeded."""
    if not jobs or any(j.state is not JobState.SUCCEEDED for j in jobs):
        return []
    batch = view.batch
    pipelines = {j.pipeline for j in jobs}
    if Pipeline.REPORT in pipelines:
        return [MoveBatch(batch.id, BatchState.DONE, "all jobs succeeded")]
    stage = max(j.stage for j in jobs) + 1
    if batch.kind == Kind.SWEEP.value and Pipeline.SWEEP not in pipelines:
        plan = view.manifest.sweep if view.manifest else None
        params = {"sweep": plan.describe() if plan else {}}
        sweep = NewJob(f"b{batch.id:06d}-sweep", Pipeline.SWEEP, stage, 0, 1, (),
                       policy.executor, inherit_inputs=True, params=params)  # fmt: skip
        return [PlanJobs(batch.id, (sweep,))]
    report = NewJob(f"b{batch.id:06d}-report", Pipeline.REPORT, stage, 0, 1, (),
                    policy.executor, inherit_inputs=True)  # fmt: skip
    return [PlanJobs(batch.id, (report,))]


# -- jobs ---------------------------------------------------------------------------------------


def _judge(job: Job, seen: JobSeen | None, policy: Policy) -> list[MoveJob]:
    """The job's next state from what was observed, and a retry where the policy allows one."""
    if seen is None or not job.state.live:
        return []
    if seen.phase is Phase.QUEUED:
        return []
    if seen.phase is Phase.RUNNING:
        return (
            [MoveJob(job.id, JobState.RUNNING, "started")]
            if job.state is JobState.SUBMITTED
            else []
        )
    result = seen.result
    if result is not None and result.ok:
        return [MoveJob(job.id, JobState.SUCCEEDED, "finished", seen.exit_code)]
    kind, reason, detail = _failure_of(seen)
    moves = [MoveJob(job.id, JobState.FAILED, reason, seen.exit_code, kind, detail)]
    if _retryable(kind) and job.attempts < policy.max_attempts:
        moves.append(
            MoveJob(job.id, JobState.PENDING, f"retry {job.attempts + 1} of {policy.max_attempts}")
        )
    return moves


def _failure_of(seen: JobSeen) -> tuple[str, str, str]:
    result = seen.result
    if result is None or result.error is None:
        code = "unknown" if seen.exit_code is None else str(seen.exit_code)
        note = f"; {seen.note}" if seen.note else ""
        return LOST, f"ended without a result (exit code {code}){note}", ""
    error = result.error
    detail = json.dumps(
        {"problems": [asdict(p) for p in error.problems], "traceback": error.traceback},
        ensure_ascii=False,
    )
    return error.kind.value, error.message, detail


def _retryable(kind: str | None) -> bool:
    return kind == LOST or kind == ErrorKind.INTERNAL.value


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
    """A job that failed for good fails its batch, with what the job said."""
    for job in jobs:
        if job.state is not JobState.FAILED:
            continue
        observed = seen.get(job.id)
        result = observed.result if observed else None
        error = result.error if result else None
        attempts = f" after {job.attempts} attempt(s)" if _retryable(job.error_kind) else ""
        problems: tuple[Problem, ...] = error.problems if error else ()
        message = error.message if error else (job.reason or "it ended without a result")
        if not problems:
            problems = (
                Problem(f"job {job.name}", message, f"see its log: jobs/{job.name}/log.txt"),
            )
        return _Failure(
            f"job {job.name} failed{attempts}: {message}",
            problems,
            error.traceback if error else "",
        )
    return None


@dataclass(frozen=True)
class _Failure:
    reason: str
    problems: tuple[Problem, ...] = field(default=())
    detail: str = ""

    def __call__(self, batch_id: int) -> MoveBatch:
        return MoveBatch(batch_id, BatchState.FAILED, self.reason, self.problems, self.detail)


def _submissions(pending: Sequence[Job], free_slots: int | None) -> list[Action]:
    """Hand pending jobs to the executor, oldest batch first, within the free slots. The
    batch moves to RUNNING on a later tick, once the executor took one of its jobs."""
    chosen = list(pending) if free_slots is None else list(pending)[: max(0, free_slots)]
    return [Submit(tuple(j.id for j in chosen))] if chosen else []


def job_spec(
    job: Job,
    batch: Batch,
    manifest: Manifest,
    inputs: Sequence[InputFile],
    registry_dir: str,
    resources: Resources,
) -> JobSpec:
    """The spec of the job's next attempt; the job's own params override the manifest's;
    ``resources``: what the executor gives this job."""
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
        manifest_sha256=batch.manifest_sha256,
        inputs=tuple(inputs),
        model=manifest.model,
        registry_dir=registry_dir,
        params=params,
        shard=Shard(job.shard_index, job.shard_count),
        resources=resources,
        title=manifest.title,
    )
