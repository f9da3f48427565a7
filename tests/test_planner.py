"""The planner, as a pure function: snapshots in, actions out."""

from __future__ import annotations

from dataclasses import replace

import pytest
import tomli_w

from daemon.contract.heldfolder import FOLDER_REPLACED
from daemon.contract.jobspec import (
    ErrorKind,
    InputFile,
    JobError,
    JobResult,
    Pipeline,
    Problem,
    Resources,
    Role,
)
from daemon.core.jobplan import Sharding, compute_jobs, first_pipeline
from daemon.core.manifest import parse_manifest
from daemon.core.manifest_schema import Kind
from daemon.core.planner import (
    BatchView,
    Cancel,
    Expect,
    JobSeen,
    MoveBatch,
    MoveJob,
    PauseRoot,
    PlanJobs,
    Policy,
    ResolveIntent,
    Snapshot,
    Submit,
    opens_work,
    plan,
)  # fmt: skip
from daemon.core.readiness import NotReady, Ready, Settle, Waiting
from daemon.core.records import Batch, Intent, IntentAction, Job
from daemon.core.states import BatchState, JobState, Phase

POLICY = Policy(Sharding(size=2), max_attempts=3, executor="local")


SWEEP = {"method": "grid", "space": {"learning_rate": [0.01, 0.001], "width": [8, 16]}}


def manifest(kind: str = "inference"):
    files = [{"path": f"i/{n}.png", "size": 1} for n in range(5)]
    if kind in ("training", "sweep"):
        files += [{"path": f"m/{n}.png", "size": 1, "role": "mask"} for n in range(5)]
    doc = {
        "watchd": 1,
        "kind": kind,
        "owner": {"name": "A"},
        "model": {"name": "m"},
        "files": files,
        **({"sweep": SWEEP, "params": {"epochs": 3}} if kind == "sweep" else {}),
    }
    return parse_manifest(tomli_w.dumps(doc).encode())


def batch(
    id: int = 1, state: BatchState = BatchState.WAITING, kind: Kind = Kind.INFERENCE
) -> Batch:
    return Batch(
        id=id, root="/r", folder=f"f{id}", revision=1, manifest_sha256="sha",
        manifest_stat="", kind=kind, title="", owner="", contact=None, state=state, reason="",
        problems=(), detail="", run_dir="/run", watch_inputs="", created_at=0.0, updated_at=0.0,
        finished_at=None,
    )  # fmt: skip


def job(
    id: int,
    state: JobState,
    *,
    batch_id: int = 1,
    pipeline: Pipeline = Pipeline.INFER,
    attempts: int = 1,
    handle: str | None = "h",
    error_kind: ErrorKind | None = None,
    stage: int | None = None,
) -> Job:
    return Job(
        id,
        batch_id,
        f"j{id}",
        pipeline,
        (1 if pipeline is Pipeline.REPORT else 0) if stage is None else stage,
        0,
        1,
        state,
        attempts,
        "local",
        handle,
        None,
        error_kind,
        "",
        0.0,
        0.0,
        None,
        None,
    )


def snap(
    *views: BatchView, seen=(), intents=(), free: int | None = 2, submitting: bool = True
) -> Snapshot:
    return Snapshot(
        now=10.0, policy=POLICY, batches=tuple(views), seen={s.job_id: s for s in seen},
        intents=tuple(intents), free_slots=free, submitting=submitting,
    )  # fmt: skip


def ok() -> JobResult:
    return JobResult(True, "infer", "now")


def test_a_ready_inference_batch_is_queued_as_shards() -> None:
    m = manifest()
    actions = plan(snap(BatchView(batch(), m, (), Ready(m.files))))
    assert actions[0] == MoveBatch(1, BatchState.QUEUED, "inputs complete")
    planned = actions[1]
    assert isinstance(planned, PlanJobs)
    assert [j.name for j in planned.jobs] == [
        "b000001-infer-0000",
        "b000001-infer-0001",
        "b000001-infer-0002",
    ]
    assert [len(j.inputs) for j in planned.jobs] == [2, 2, 1]
    assert {j.shard_count for j in planned.jobs} == {3}


@pytest.mark.parametrize(
    ("images", "sharding", "sizes"),
    [
        (1500, Sharding(width=2), [750, 750]),  # one job per slot: each starts once
        (7, Sharding(width=4), [7]),  # too few images to be worth a second start
        (200, Sharding(width=4), [66, 67, 67]),  # at least MIN_SIZED_SHARD (64) images a job
        (1000, Sharding(width=50), [66, 67, 67] * 5),  # fewer jobs than jobs of 64 made
        (127, Sharding(width=2), [127]),
        (5000, Sharding(max_size=2000, width=2), [1250] * 4),  # ≤ 2000 a retry; whole waves
        (55_000, Sharding(width=50), [1100] * 50),  # a Slurm array throttled at %50
        (4500, Sharding(max_size=2000, width=None), [1500, 1500, 1500]),  # no throttle
        (5, Sharding(size=2, width=8), [2, 2, 1]),  # a fixed size wins
        (0, Sharding(width=2), [0]),
    ],
)
def test_shards_are_sized_from_the_work_and_the_jobs_that_run_side_by_side(
    images: int, sharding: Sharding, sizes: list[int]
) -> None:
    parts = sharding.slices(images)
    assert [len(range(images)[part]) for part in parts] == sizes
    assert [i for part in parts for i in range(images)[part]] == list(range(images))


def test_a_finished_job_or_planned_jobs_ask_for_the_next_plan_at_once() -> None:
    assert opens_work([MoveJob(1, JobState.SUCCEEDED, "finished", 0)])
    assert opens_work([PlanJobs(1, ())])
    assert not opens_work([MoveJob(1, JobState.RUNNING, "started")])
    assert not opens_work([MoveBatch(1, BatchState.RUNNING, "job started")])


def test_a_training_batch_is_one_job_with_images_and_masks() -> None:
    m = manifest("training")
    actions = plan(snap(BatchView(batch(kind=Kind.TRAINING), m, (), Ready(m.files))))
    (train,) = actions[1].jobs
    assert train.pipeline is Pipeline.TRAIN and len(train.inputs) == 10


def test_a_batch_whose_inputs_settle_has_its_first_jobs_and_report_expected() -> None:
    """All inputs there, settling: the executor is told what the first jobs will be, and that
    the report follows them, so that it can start both ahead (warm starts); not while inputs
    are missing, nor for a batch whose jobs would not go out (its root paused or held
    elsewhere, the daemon stopping)."""
    settling = Waiting((), Settle("fp", 9.0))
    for kind in ("inference", "training", "sweep"):
        m = manifest(kind)
        view = BatchView(batch(kind=Kind(kind)), m, (), settling)
        first = compute_jobs(batch(kind=Kind(kind)), m, m.files, POLICY.shards, "local")[0]
        assert plan(snap(view)) == [
            Expect(1, first.pipeline, m.resources),
            Expect(1, Pipeline.REPORT, m.resources),
        ]
        assert first_pipeline(m) is first.pipeline
    view = BatchView(batch(), manifest(), (), settling)
    missing = Problem("manifest.toml, files[0]", "'a' is missing", "not copied yet?")
    incomplete = Waiting((missing,), Settle("fp", 9.0))
    assert plan(snap(BatchView(batch(), manifest(), (), incomplete))) == []
    assert plan(snap(BatchView(batch(), manifest(), ()))) == []  # not looked at this tick
    assert plan(snap(view, submitting=False)) == []
    assert plan(replace(snap(view), paused_roots=frozenset({"/r"}))) == []
    assert plan(replace(snap(view), held_elsewhere=frozenset({"/r"}))) == []


def test_while_a_stages_jobs_run_the_job_after_them_is_expected_but_none_after_the_report() -> None:
    """The report is expected while the shards run, a sweep's comparison while its trials
    do; nothing once the report runs, while no job runs, or where jobs would not go out."""
    m, sweep = manifest(), manifest("sweep")
    running = batch(1, BatchState.RUNNING)
    shards = BatchView(running, m, (job(1, JobState.RUNNING),))
    trial = job(2, JobState.RUNNING, batch_id=2, pipeline=Pipeline.TRAIN)
    trials = BatchView(batch(2, BatchState.RUNNING, Kind.SWEEP), sweep, (trial,))
    expected = [a for a in plan(snap(shards, trials)) if isinstance(a, Expect)]
    assert expected == [
        Expect(1, Pipeline.REPORT, m.resources),
        Expect(2, Pipeline.SWEEP, sweep.resources),
    ]
    report = job(2, JobState.RUNNING, pipeline=Pipeline.REPORT)
    views = [
        BatchView(running, m, (job(1, JobState.SUCCEEDED), report)),
        BatchView(running, m, (job(1, JobState.PENDING, attempts=0),)),
    ]
    snaps = [snap(view, free=0) for view in views]
    snaps.append(replace(snap(shards), paused_roots=frozenset({"/r"})))
    snaps.append(snap(shards, intents=[root_intent(5, IntentAction.PAUSE)]))  # paused this tick
    for each in snaps:
        assert not [a for a in plan(each) if isinstance(a, Expect)]


def test_inputs_that_cannot_become_ready_fail_the_batch_with_the_problems() -> None:
    problem = Problem("manifest.toml, files[0]", "'a' is missing", "not copied yet?")
    actions = plan(
        snap(
            BatchView(batch(), manifest(), (), NotReady((problem,), "inputs incomplete after 1 h"))
        )
    )
    assert actions == [MoveBatch(1, BatchState.FAILED, "inputs incomplete after 1 h", (problem,))]


def test_pending_jobs_go_out_within_the_free_slots_oldest_batch_first() -> None:
    first = BatchView(
        batch(1, BatchState.QUEUED),
        manifest(),
        (job(1, JobState.PENDING, attempts=0), job(2, JobState.PENDING, attempts=0)),
    )
    second = BatchView(
        batch(2, BatchState.QUEUED), manifest(), (job(3, JobState.PENDING, batch_id=2, attempts=0),)
    )
    actions = plan(snap(first, second, free=2))
    assert actions == [Submit((1, 2))]  # the batches stay queued until a job is taken
    assert plan(snap(first, second, free=0)) == []
    assert plan(snap(first, second, free=None))[-1] == Submit((1, 2, 3))
    assert plan(snap(first, second, submitting=False)) == []


def test_a_queued_batch_runs_once_the_executor_took_one_of_its_jobs() -> None:
    """Moved on the tick after the submission, from what the store says: a submission the
    executor held back or refused leaves the batch queued."""
    held = BatchView(
        batch(1, BatchState.QUEUED), manifest(), (job(1, JobState.PENDING, attempts=0),)
    )
    taken = BatchView(
        batch(2, BatchState.QUEUED),
        manifest(),
        (job(2, JobState.SUBMITTED, batch_id=2), job(3, JobState.PENDING, batch_id=2, attempts=0)),
    )
    assert plan(snap(held, taken)) == [
        MoveBatch(2, BatchState.RUNNING, "jobs submitted"),
        Expect(2, Pipeline.REPORT, taken.manifest.resources),  # its shards under way
        Submit((1, 3)),
    ]


def test_a_job_the_executor_refused_for_good_fails_its_queued_batch() -> None:
    refused = job(1, JobState.FAILED, attempts=0, handle=None, error_kind=ErrorKind.INPUT)
    refused = replace(refused, reason="refused by the slurm executor: Invalid partition")
    view = BatchView(
        batch(1, BatchState.QUEUED), manifest(), (refused, job(2, JobState.PENDING, attempts=0))
    )
    problem = Problem("job j1", "refused by the slurm executor: Invalid partition",
                      "see its log: logs/j1.log")  # fmt: skip
    assert plan(snap(view)) == [
        Cancel((2,), "batch failed"),
        MoveBatch(
            1, BatchState.FAILED, "job j1 failed: refused by the slurm executor: Invalid partition",
            (problem,),
        ),
    ]  # fmt: skip


def test_a_finished_shard_succeeds_and_the_report_follows_the_last_one() -> None:
    view = BatchView(
        batch(1, BatchState.RUNNING),
        manifest(),
        (job(1, JobState.RUNNING), job(2, JobState.SUCCEEDED)),
    )
    actions = plan(snap(view, seen=[JobSeen(1, Phase.ENDED, 0, ok())]))
    assert actions[0] == MoveJob(1, JobState.SUCCEEDED, "finished", 0, batch_id=1)
    assert isinstance(actions[1], PlanJobs) and actions[1].jobs[0].pipeline is Pipeline.REPORT


def test_the_batch_is_done_when_its_report_succeeded() -> None:
    jobs = (job(1, JobState.SUCCEEDED), job(2, JobState.SUCCEEDED, pipeline=Pipeline.REPORT))
    assert plan(snap(BatchView(batch(1, BatchState.RUNNING), manifest(), jobs))) == [
        MoveBatch(1, BatchState.DONE, "all jobs succeeded")
    ]


def test_a_job_that_ended_without_a_result_is_retried_until_the_attempts_run_out() -> None:
    view = BatchView(
        batch(1, BatchState.RUNNING), manifest(), (job(1, JobState.RUNNING, attempts=1),)
    )
    actions = plan(snap(view, seen=[JobSeen(1, Phase.ENDED, -9)]))
    assert actions[:2] == [
        MoveJob(
            1,
            JobState.FAILED,
            "ended without a result (exit code -9)",
            -9,
            ErrorKind.LOST,
            batch_id=1,
        ),
        MoveJob(1, JobState.PENDING, "retry 2 of 3", batch_id=1),
    ]
    assert isinstance(actions[-1], Submit)
    last = BatchView(
        batch(1, BatchState.RUNNING),
        manifest(),
        (job(1, JobState.RUNNING, attempts=3), job(2, JobState.RUNNING)),
    )
    actions = plan(snap(last, seen=[JobSeen(1, Phase.UNKNOWN)]))
    assert Cancel((2,), "batch failed") in actions
    failure = actions[-1]
    assert failure.target is BatchState.FAILED
    assert failure.reason == (
        "job j1 failed after 3 attempt(s): ended without a result (exit code unknown)"
    )


def test_an_input_error_is_not_retried_and_its_problems_reach_the_batch() -> None:
    problem = Problem(
        "manifest.toml, files[2] 'i/2.png'", "sha256 is 00…, expected 11…", "copy it again"
    )
    bad = JobResult(
        False, "infer", "now", error=JobError(ErrorKind.INPUT, "1 input refused", (problem,))
    )
    view = BatchView(batch(1, BatchState.RUNNING), manifest(), (job(1, JobState.RUNNING),))
    actions = plan(snap(view, seen=[JobSeen(1, Phase.ENDED, 2, bad)]))
    assert actions[0].target is JobState.FAILED and actions[0].error_kind is ErrorKind.INPUT
    assert actions[-1] == MoveBatch(
        1, BatchState.FAILED, "job j1 failed: 1 input refused", (problem,), ""
    )


def test_a_job_that_found_its_batch_folder_replaced_cancels_its_batch_rather_than_fail_it() -> None:
    """The owner put another folder under the batch's name: a job that starts then refuses it
    (pipelines.job.hold_batch); nothing in the batch is wrong, the new folder is a batch of its
    own, so the batch is cancelled (as the new folder's manifest cancels it when it comes
    first), its other jobs with it."""
    problem = Problem("batch folder", "was replaced by another folder of the same name", "…")
    refused = JobResult(
        False, "infer", "now", error=JobError(ErrorKind.INPUT, FOLDER_REPLACED, (problem,))
    )
    view = BatchView(
        batch(1, BatchState.RUNNING),
        manifest(),
        (job(1, JobState.RUNNING), job(2, JobState.PENDING), job(3, JobState.SUCCEEDED)),
    )
    actions = plan(snap(view, seen=[JobSeen(1, Phase.ENDED, 2, refused)]))
    assert actions[0].target is JobState.FAILED and actions[0].error_kind is ErrorKind.INPUT
    assert Cancel((2,), "batch cancelled") in actions
    assert actions[-1] == MoveBatch(
        1,
        BatchState.CANCELLED,
        "cancelled by watchd (the batch folder was replaced: job j1 found another folder under "
        "its name)",
        (problem,),
        "",
    )


def test_a_job_reporting_thousands_of_problems_fails_its_batch_with_twenty_and_a_count() -> None:
    problems = tuple(Problem(f"input 'i/{n}.png'", "is not an image") for n in range(5000))
    bad = JobResult(False, "infer", "now", error=JobError(ErrorKind.INPUT, "refused", problems))
    view = BatchView(batch(1, BatchState.RUNNING), manifest(), (job(1, JobState.RUNNING),))
    actions = plan(snap(view, seen=[JobSeen(1, Phase.ENDED, 2, bad)]))
    assert actions[-1].problems == (*problems[:20], Problem("", "… and 4 980 more like these"))
    assert len(actions[0].detail) < 5000  # the job's record keeps the same few


def test_a_cancel_intent_stops_live_and_pending_jobs() -> None:
    view = BatchView(
        batch(1, BatchState.RUNNING),
        manifest(),
        (job(1, JobState.RUNNING), job(2, JobState.PENDING), job(3, JobState.SUCCEEDED)),
    )
    intent = Intent(7, 0.0, IntentAction.CANCEL, 1, "ops", None, "")
    assert plan(snap(view, intents=[intent])) == [
        Cancel((1, 2), "cancelled by ops"),
        MoveBatch(1, BatchState.CANCELLED, "cancelled by ops"),
        ResolveIntent(7, "cancelled", batch_id=1),
    ]
    done = BatchView(batch(1, BatchState.DONE), manifest(), ())
    assert plan(snap(done, intents=[intent])) == [
        ResolveIntent(7, "nothing to cancel: the batch is done", batch_id=1)
    ]


def test_a_retried_batch_waits_again_then_reruns_only_failed_jobs_with_fresh_attempts() -> None:
    failed = BatchView(
        batch(1, BatchState.FAILED),
        manifest(),
        (job(1, JobState.SUCCEEDED), job(2, JobState.FAILED, attempts=3)),
    )
    intent = Intent(1, 0.0, IntentAction.RETRY, 1, "ops", None, "")
    assert plan(snap(failed, intents=[intent]))[0] == MoveBatch(
        1, BatchState.WAITING, "retry asked by ops"
    )
    m = manifest()
    again = BatchView(batch(1, BatchState.WAITING), m, failed.jobs, Ready(m.files))
    assert plan(snap(again)) == [
        MoveBatch(1, BatchState.QUEUED, "inputs complete"),
        MoveJob(2, JobState.PENDING, "retry asked by operator", fresh=True, batch_id=1),
    ]


def test_a_running_job_is_marked_started_once() -> None:
    view = BatchView(
        batch(1, BatchState.RUNNING),
        manifest(),
        (job(1, JobState.SUBMITTED), job(2, JobState.RUNNING)),
    )
    seen = [JobSeen(1, Phase.RUNNING), JobSeen(2, Phase.RUNNING)]
    assert plan(snap(view, seen=seen)) == [
        MoveJob(1, JobState.RUNNING, "started", batch_id=1),
        Expect(1, Pipeline.REPORT, view.manifest.resources),
    ]


def test_a_shard_carries_its_images_and_their_true_masks_and_counts_the_images() -> None:
    """Ground truth beside an inference batch's images goes with each image's shard (the
    report, inheriting every shard's inputs, scores against it); an unpaired mask goes nowhere,
    and masks do not count as images to segment."""
    m = manifest()
    truths = (InputFile("m/1.png", 1, role=Role.MASK), InputFile("m/4.png", 1, role=Role.MASK),
              InputFile("x/mask.png", 1, role=Role.MASK))  # fmt: skip
    actions = plan(snap(BatchView(batch(), m, (), Ready((*m.files, *truths)))))
    shards = [[f.path for f in j.inputs] for j in actions[1].jobs]
    assert shards == [["i/0.png", "i/1.png", "m/1.png"], ["i/2.png", "i/3.png"],
                      ["i/4.png", "m/4.png"]]  # fmt: skip
    assert [j.images for j in actions[1].jobs] == [2, 2, 1]


def test_an_end_without_a_result_carries_the_executors_word_and_the_log_tail() -> None:
    view = BatchView(
        batch(1, BatchState.RUNNING), manifest(), (job(1, JobState.RUNNING, attempts=3),)
    )
    note = "Slurm: OUT_OF_MEMORY (None); log ends: loading model | Killed"
    actions = plan(snap(view, seen=[JobSeen(1, Phase.ENDED, 137, note=note)]))
    reason = f"ended without a result (exit code 137); {note}"
    assert actions[0] == MoveJob(1, JobState.FAILED, reason, 137, ErrorKind.LOST, batch_id=1)
    failure = actions[-1]
    assert failure.reason == f"job j1 failed after 3 attempt(s): {reason}"
    assert failure.problems[0].message == reason


def test_a_sweep_batch_becomes_one_training_job_per_trial_with_its_own_params() -> None:
    m = manifest("sweep")
    actions = plan(snap(BatchView(batch(kind=Kind.SWEEP), m, (), Ready(m.files))))
    planned = actions[1]
    assert isinstance(planned, PlanJobs)
    assert [j.name for j in planned.jobs] == [f"b000001-trial-{i:04d}" for i in range(4)]
    assert {j.pipeline for j in planned.jobs} == {Pipeline.TRAIN}
    assert {j.stage for j in planned.jobs} == {0}
    assert [dict(j.params) for j in planned.jobs] == [
        {"learning_rate": lr, "width": w, "trial": i}
        for i, (lr, w) in enumerate((lr, w) for lr in (0.01, 0.001) for w in (8, 16))
    ]
    assert all(len(j.inputs) == 10 for j in planned.jobs)


def test_a_trial_spec_merges_its_params_over_the_manifest_and_carries_its_resources() -> None:
    from dataclasses import replace

    from daemon.core.jobplan import job_spec

    m = manifest("sweep")
    trial = replace(job(7, JobState.PENDING, pipeline=Pipeline.TRAIN),
                    params={"learning_rate": 0.01, "trial": 3})  # fmt: skip
    given = Resources(cpus=1, gpus=0, tasks=2)
    spec = job_spec(trial, batch(kind=Kind.SWEEP), m, m.files, "/registry", given, "/spool")
    assert spec.params["epochs"] == 3 and spec.params["learning_rate"] == 0.01
    assert spec.params["trial"] == 3 and spec.resources == given
    assert spec.batch_kind == "sweep"


def test_after_all_trials_the_sweep_job_runs_then_the_report_then_done() -> None:
    m = manifest("sweep")
    running = batch(state=BatchState.RUNNING, kind=Kind.SWEEP)
    trials = tuple(job(i, JobState.SUCCEEDED, pipeline=Pipeline.TRAIN) for i in range(1, 4))
    actions = plan(snap(BatchView(running, m, trials)))
    (planned,) = actions
    assert isinstance(planned, PlanJobs)
    (sweep,) = planned.jobs
    assert (sweep.name, sweep.pipeline, sweep.stage) == ("b000001-sweep", Pipeline.SWEEP, 1)
    assert sweep.inherit_inputs and sweep.params["sweep"]["method"] == "grid"
    with_sweep = (*trials, job(4, JobState.SUCCEEDED, pipeline=Pipeline.SWEEP, stage=1))
    (planned,) = plan(snap(BatchView(running, m, with_sweep)))
    assert isinstance(planned, PlanJobs)
    (report,) = planned.jobs
    assert (report.pipeline, report.stage, report.inherit_inputs) == (Pipeline.REPORT, 2, True)
    done = (*with_sweep, job(5, JobState.SUCCEEDED, pipeline=Pipeline.REPORT, stage=2))
    assert plan(snap(BatchView(running, m, done))) == [
        MoveBatch(1, BatchState.DONE, "all jobs succeeded")
    ]


def test_a_batch_left_with_only_cancelled_jobs_fails_instead_of_waiting_forever() -> None:
    jobs = (job(1, JobState.SUCCEEDED), job(2, JobState.CANCELLED))
    actions = plan(snap(BatchView(batch(1, BatchState.RUNNING), manifest(), jobs)))
    assert actions[-1].target is BatchState.FAILED
    assert actions[-1].reason == "job j2 was cancelled (no reason recorded)"


# -- pause and resume of a drop root; requeue -------------------------------------------------


def root_intent(id: int, action: IntentAction, root: str = "/r") -> Intent:
    return Intent(id, 0.0, action, None, "ops", None, "", root=root)


def queued(id: int, root: str = "/r") -> BatchView:
    view = BatchView(
        replace(batch(id, BatchState.QUEUED), root=root),
        manifest(),
        (job(id * 10, JobState.PENDING, batch_id=id, attempts=0),),
    )
    return view


def test_a_paused_root_holds_its_queued_batches_while_other_roots_submit() -> None:
    held, other = queued(1, "/r"), queued(2, "/elsewhere")
    actions = plan(replace(snap(held, other), paused_roots=frozenset({"/r"})))
    assert actions == [Submit((20,))]
    assert plan(snap(held, other))[-1] == Submit((10, 20))


def test_a_held_job_takes_no_slot_from_another_roots_jobs() -> None:
    held, other = queued(1, "/r"), queued(2, "/elsewhere")
    actions = plan(replace(snap(held, other, free=1), paused_roots=frozenset({"/r"})))
    assert actions[-1] == Submit((20,))


def test_a_pause_intent_holds_submissions_in_the_same_tick_and_a_resume_releases_them() -> None:
    actions = plan(snap(queued(1), intents=[root_intent(5, IntentAction.PAUSE)]))
    assert actions == [PauseRoot("/r", True, "ops"), ResolveIntent(5, "paused")]
    paused = frozenset({"/r"})
    actions = plan(
        replace(snap(queued(1), intents=[root_intent(6, IntentAction.RESUME)]), paused_roots=paused)
    )
    assert actions == [
        PauseRoot("/r", False, "ops"),
        ResolveIntent(6, "resumed"),
        Submit((10,)),
    ]


def test_pausing_a_paused_root_or_resuming_a_running_one_changes_nothing() -> None:
    paused = replace(
        snap(intents=[root_intent(1, IntentAction.PAUSE)]), paused_roots=frozenset({"/r"})
    )
    assert plan(paused) == [ResolveIntent(1, "nothing to do: the root is already paused")]
    assert plan(snap(intents=[root_intent(2, IntentAction.RESUME)])) == [
        ResolveIntent(2, "nothing to do: the root is not paused")
    ]
    assert plan(snap(intents=[root_intent(3, IntentAction.RETRY)])) == [
        ResolveIntent(3, "ignored: retry is asked of a batch")
    ]


def test_a_requeued_done_batch_waits_again_with_every_job_pending_afresh() -> None:
    jobs = (job(1, JobState.SUCCEEDED), job(2, JobState.SUCCEEDED, pipeline=Pipeline.REPORT))
    done = BatchView(batch(1, BatchState.DONE), manifest(), jobs)
    intent = Intent(3, 0.0, IntentAction.REQUEUE, 1, "ops", None, "")
    assert plan(snap(done, intents=[intent])) == [
        MoveBatch(1, BatchState.WAITING, "requeue asked by ops"),
        MoveJob(1, JobState.PENDING, "requeue asked by ops", fresh=True, batch_id=1),
        MoveJob(2, JobState.PENDING, "requeue asked by ops", fresh=True, batch_id=1),
        ResolveIntent(3, "requeue: waiting for inputs again", batch_id=1),
    ]
    running = BatchView(batch(1, BatchState.RUNNING), manifest(), ())
    assert plan(snap(running, intents=[intent])) == [
        ResolveIntent(3, "not done: the batch is running", batch_id=1)
    ]
    refused = BatchView(batch(1, BatchState.FAILED), None, ())
    assert plan(snap(refused, intents=[intent])) == [
        ResolveIntent(
            3,
            "not done: its manifest was refused; saving a fixed one starts a new revision",
            batch_id=1,
        )
    ]


def test_a_later_stage_goes_out_only_after_every_earlier_job_succeeded() -> None:
    """After a requeue the shards and the report are all pending: the report waits."""
    jobs = (
        job(1, JobState.PENDING, attempts=1),
        job(2, JobState.SUCCEEDED),
        job(3, JobState.PENDING, pipeline=Pipeline.REPORT, attempts=1),
    )
    actions = plan(snap(BatchView(batch(1, BatchState.QUEUED), manifest(), jobs), free=None))
    assert actions[-1] == Submit((1,))
    shards_done = (job(1, JobState.SUCCEEDED), jobs[1], jobs[2])
    actions = plan(snap(BatchView(batch(1, BatchState.RUNNING), manifest(), shards_done)))
    assert actions == [Submit((3,))]


def test_a_requeued_batch_whose_inputs_are_gone_fails_and_its_pending_jobs_are_cancelled() -> None:
    problem = Problem("manifest.toml, files[0]", "'a' is missing")
    view = BatchView(
        batch(), manifest(), (job(1, JobState.PENDING),), NotReady((problem,), "inputs gone")
    )
    assert plan(snap(view)) == [
        Cancel((1,), "batch failed"),
        MoveBatch(1, BatchState.FAILED, "inputs gone", (problem,)),
    ]


def test_the_retry_budget_counts_from_the_operators_last_fresh_start() -> None:
    """Attempts keep counting across a retry (each submission has its own number); the
    automatic retries after a lost job count from the fresh start."""
    fresh = replace(job(1, JobState.RUNNING, attempts=4), attempts_base=3)
    view = BatchView(batch(1, BatchState.RUNNING), manifest(), (fresh,))
    actions = plan(snap(view, seen=[JobSeen(1, Phase.ENDED, -9)]))
    assert actions[1] == MoveJob(1, JobState.PENDING, "retry 2 of 3", batch_id=1)


def test_a_slide_larger_than_region_bytes_is_split_into_region_jobs_then_assembled() -> None:
    """The small images are sharded as ever; each large file becomes jobs of one region each
    in the same stage (one array), counted once in the batch's images; once they all
    succeeded the assembly job follows, then the report, then done."""
    doc = {"watchd": 1, "kind": "inference", "owner": {"name": "A"}, "model": {"name": "m"},
           "files": [{"path": "small.png", "size": 10}, {"path": "slide.tif", "size": 2500},
                     {"path": "other.tif", "size": 1001}]}  # fmt: skip
    m = parse_manifest(tomli_w.dumps(doc).encode())
    policy = replace(POLICY, shards=Sharding(size=2, region_bytes=1000))
    view = BatchView(batch(), m, (), Ready(m.files))
    planned = plan(replace(snap(view), policy=policy))[1]
    assert isinstance(planned, PlanJobs)
    described = [
        (j.name, [f.path for f in j.inputs], dict(j.params), j.images) for j in planned.jobs
    ]
    slide, other = {"count": 3, "image": "slide.tif"}, {"count": 2, "image": "other.tif"}
    assert described == [
        ("b000001-infer-0000", ["small.png"], {}, 1),
        ("b000001-infer-0001", ["slide.tif"], {"region": {**slide, "index": 0}}, 1),
        ("b000001-infer-0002", ["slide.tif"], {"region": {**slide, "index": 1}}, 0),
        ("b000001-infer-0003", ["slide.tif"], {"region": {**slide, "index": 2}}, 0),
        ("b000001-infer-0004", ["other.tif"], {"region": {**other, "index": 0}}, 1),
        ("b000001-infer-0005", ["other.tif"], {"region": {**other, "index": 1}}, 0),
    ]
    assert {(j.stage, j.shard_count) for j in planned.jobs} == {(0, 6)}
    running = batch(state=BatchState.RUNNING)
    done = tuple(
        replace(job(i + 1, JobState.SUCCEEDED), params=dict(j.params))
        for i, j in enumerate(planned.jobs)
    )
    (assembly,) = plan(snap(BatchView(running, m, done)))
    assert isinstance(assembly, PlanJobs)
    (assemble,) = assembly.jobs
    assert (assemble.name, assemble.pipeline, assemble.stage) == (
        "b000001-assemble", Pipeline.ASSEMBLE, 1)  # fmt: skip
    assert assemble.inherit_inputs and assemble.params == {"regional": ["other.tif", "slide.tif"]}
    assembled = (*done, job(7, JobState.SUCCEEDED, pipeline=Pipeline.ASSEMBLE, stage=1))
    (report,) = plan(snap(BatchView(running, m, assembled)))
    assert isinstance(report, PlanJobs) and report.jobs[0].pipeline is Pipeline.REPORT
    assert report.jobs[0].stage == 2
