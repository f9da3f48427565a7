"""The planner with many owners: jobs go out in turns, an owner over its share yields a slot,
a batch over quota is held queued saying why, an operator's quota is recorded, and an ended
attempt carries what it measured."""

from __future__ import annotations

from dataclasses import replace

from test_planner import POLICY, batch, job, manifest

from daemon.contract.jobspec import JobResult
from daemon.contract.usage import USAGE_KEY, JobUsage
from daemon.core.owners import Accounts, Period, Quota
from daemon.core.planner import (
    BatchView,
    HoldBatch,
    JobSeen,
    MoveJob,
    PlanJobs,
    Preempt,
    ResolveIntent,
    SetQuota,
    Snapshot,
    Submit,
    plan,
)
from daemon.core.quotas import Account, Used, quota_json
from daemon.core.readiness import Ready
from daemon.core.records import Batch, Intent, IntentAction
from daemon.core.states import BatchState, JobState, Phase

NOW = 1_780_000_000.0


def owned(id: int, user: str, state: BatchState = BatchState.RUNNING, **fields: object) -> Batch:
    uid = {"ann": 1001, "bob": 1002}[user]
    return replace(batch(id, state), owner_uid=uid, owner_gid=uid + 1000, owner_user=user,
                   owner_group=f"g{user}", **fields)  # type: ignore[arg-type]  # fmt: skip


def snapshot(*views: BatchView, free: int | None, **fields: object) -> Snapshot:
    return Snapshot(now=NOW, policy=POLICY, batches=views, free_slots=free, **fields)  # type: ignore[arg-type]


def test_a_second_owners_job_goes_out_before_the_first_owners_backlog() -> None:
    ann = BatchView(owned(1, "ann"), manifest(),
                    tuple(job(i, JobState.PENDING, attempts=0) for i in range(1, 6)))  # fmt: skip
    bob = BatchView(owned(2, "bob", BatchState.QUEUED), manifest(),
                    (job(9, JobState.PENDING, batch_id=2, attempts=0),))  # fmt: skip
    assert plan(snapshot(ann, bob, free=2)) == [Submit((1, 9))]


def test_an_owner_holding_every_slot_yields_one_to_an_owner_who_waits() -> None:
    ann = BatchView(
        owned(1, "ann"), manifest(),
        (job(1, JobState.RUNNING), job(2, JobState.RUNNING), job(3, JobState.PENDING)),
    )  # fmt: skip
    bob = BatchView(owned(2, "bob", BatchState.QUEUED), manifest(),
                    (job(9, JobState.PENDING, batch_id=2, attempts=0),))  # fmt: skip
    actions = plan(snapshot(ann, bob, free=0))
    (preempt,) = [a for a in actions if isinstance(a, Preempt)]
    assert len(preempt.job_ids) == 1 and preempt.job_ids[0] in (1, 2)
    assert preempt.reason == (
        "yielded its slot to user:bob (fair share); it resumes where it stopped"
    )
    assert not any(isinstance(a, Submit) for a in actions)  # bob's goes out when it is free
    off = Accounts(preempt=False)
    assert not any(isinstance(a, Preempt) for a in plan(snapshot(ann, bob, free=0, accounts=off)))


def test_a_waiting_owner_takes_the_slot_of_a_job_about_to_end_instead_of_stopping_one() -> None:
    """Ann's first shard expects to end in 2.5 s (its progress file said so), within the 30 s
    grace of Bob's job queued 5 s ago, so nothing is stopped; once Bob's job has waited past
    the grace, or when no shard is near its end, one yields."""

    def ann(*due_in: float | None) -> BatchView:
        shards = tuple(replace(job(i, JobState.RUNNING), images=100, images_done=50,
                               due_at=None if due is None else NOW + due)
                       for i, due in enumerate(due_in, start=1))  # fmt: skip
        return BatchView(owned(1, "ann"), manifest(), shards)

    def bob(queued_ago: float) -> BatchView:
        pending = replace(job(9, JobState.PENDING, batch_id=2, attempts=0),
                          created_at=NOW - queued_ago)  # fmt: skip
        return BatchView(owned(2, "bob", BatchState.QUEUED), manifest(), (pending,))

    def preempts(*views: BatchView) -> bool:
        return any(isinstance(a, Preempt) for a in plan(snapshot(*views, free=0)))

    assert Accounts().preempt_grace == 30.0
    assert not preempts(ann(2.5, 300.0), bob(5))
    assert preempts(ann(2.5, 300.0), bob(31))
    assert preempts(ann(90.0, 300.0), bob(5))  # longer than the grace
    assert preempts(ann(None, None), bob(5))  # no image done yet: when it ends is not known
    assert preempts(ann(-11.0, 300.0), bob(5))  # overdue: not known either
    assert not preempts(ann(-2.0, 300.0), bob(5))  # just due: about to end


def test_a_slot_freed_while_another_owners_batch_is_planned_waits_one_round_for_it() -> None:
    ann = BatchView(owned(1, "ann"), manifest(),
                    (job(1, JobState.RUNNING), job(2, JobState.PENDING)))  # fmt: skip
    m = manifest()
    bob = BatchView(owned(2, "bob", BatchState.WAITING), m, (), Ready(m.files))
    actions = plan(snapshot(ann, bob, free=1))
    assert any(isinstance(a, PlanJobs) for a in actions)
    assert not any(isinstance(a, (Submit, Preempt)) for a in actions)


def quota_of(subject: str, quota: Quota, used: Used) -> Account:
    return Account(subject, quota, used, NOW - 3600, NOW + 3600)


def queued(user: str, images: int = 100, **fields: object) -> BatchView:
    jobs = (replace(job(1, JobState.PENDING, attempts=0), images=images),)
    return BatchView(owned(1, user, BatchState.QUEUED, **fields), manifest(), jobs)


def test_a_batch_over_its_owners_quota_is_held_queued_and_released_when_it_fits() -> None:
    full = {"user:ann": quota_of("user:ann", Quota(Period.MONTH, images=150), Used(images=100))}
    actions = plan(snapshot(queued("ann"), free=2, quotas=full))
    (hold,) = actions
    assert isinstance(hold, HoldBatch) and hold.batch_id == 1
    assert hold.reason.startswith(
        "over the monthly quota of user ann: 100 of 150 images used this month"
    )
    held = queued("ann", hold=hold.reason)
    assert plan(snapshot(held, free=2, quotas=full)) == []  # said once: no action while it holds
    room = {"user:ann": quota_of("user:ann", Quota(Period.MONTH, images=500), Used(images=100))}
    assert plan(snapshot(held, free=2, quotas=room)) == [HoldBatch(1, ""), Submit((1,))]


def test_a_group_quota_holds_the_batches_of_every_member() -> None:
    used_up = {"group:gbob": quota_of("group:gbob", Quota(Period.DAY, gpu_hours=1.0),
                                      Used(gpu_hours=1.2))}  # fmt: skip
    (hold,) = plan(snapshot(queued("bob"), free=2, quotas=used_up))
    assert isinstance(hold, HoldBatch) and "daily quota of group gbob" in hold.reason


def test_a_batch_under_way_is_never_held_by_its_quota() -> None:
    started = BatchView(
        owned(1, "ann", BatchState.QUEUED), manifest(),
        (replace(job(1, JobState.FAILED, attempts=1), images=100),
         replace(job(2, JobState.PENDING, attempts=0), images=100)),
    )  # fmt: skip
    full = {"user:ann": quota_of("user:ann", Quota(Period.MONTH, images=1), Used(images=5))}
    assert not any(isinstance(a, HoldBatch) for a in plan(snapshot(started, free=2, quotas=full)))


def intent(subject: str, value: str) -> Intent:
    return Intent(7, NOW, IntentAction.QUOTA, None, "op", None, "", subject=subject, value=value)


def test_an_operators_quota_intent_is_recorded_or_refused_with_why() -> None:
    quota = Quota(Period.MONTH, images=200_000)
    actions = plan(snapshot(free=2, intents=(intent("user:ann", quota_json(quota)),)))
    assert actions == [
        SetQuota("user:ann", quota, "op"),
        ResolveIntent(7, "quota of user:ann: 200,000 images per month"),
    ]
    lifted = plan(snapshot(free=2, intents=(intent("group:lab", ""),)))
    assert lifted == [
        SetQuota("group:lab", None, "op"),
        ResolveIntent(7, "quota of group:lab lifted"),
    ]
    (refused,) = plan(snapshot(free=2, intents=(intent("host:x", ""),)))
    assert isinstance(refused, ResolveIntent) and refused.outcome.startswith("ignored")


def test_an_ended_attempt_carries_what_the_job_measured() -> None:
    measured = JobUsage(wall_s=12.5, cpu_s=20.0, gpu_s=0.0, bytes_in=4096, bytes_out=1024)
    result = JobResult(True, "infer", "now", {USAGE_KEY: measured.to_dict()})
    view = BatchView(owned(1, "ann"), manifest(), (job(1, JobState.RUNNING),))
    actions = plan(snapshot(view, free=2, seen={1: JobSeen(1, Phase.ENDED, 0, result)}))
    (moved,) = [a for a in actions if isinstance(a, MoveJob)]
    assert moved.target is JobState.SUCCEEDED and moved.usage == measured
    nonsense = JobResult(True, "infer", "now", {USAGE_KEY: {"cpu_s": float("nan")}})
    actions = plan(snapshot(view, free=2, seen={1: JobSeen(1, Phase.ENDED, 0, nonsense)}))
    assert [a.usage for a in actions if isinstance(a, MoveJob)] == [None]
