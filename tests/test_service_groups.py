"""The service commits a batch's store-only actions together: a crash between two steps of
one decision (queue the batch, plan its jobs) cannot leave half of it."""

from __future__ import annotations

from pathlib import Path

from daemon.contract.jobspec import Pipeline
from daemon.core.manifest_schema import Kind
from daemon.core.planner import Cancel, MoveBatch, MoveJob, PlanJobs, ResolveIntent, Submit
from daemon.core.records import IntentAction, NewBatch, NewJob
from daemon.core.states import BatchState, JobState
from daemon.loop.acting import _transactions
from daemon.store import Store


def test_store_only_actions_of_one_batch_are_grouped_and_executor_actions_stand_alone(
    tmp_path: Path,
) -> None:
    store = Store.open(tmp_path / "s.sqlite")
    a = store.create_batch(
        NewBatch("/r", "a", "1", "", "", Kind.INFERENCE, "", "", None, "/x"),
        BatchState.WAITING,
        "",
        0.0,
    )
    b = store.create_batch(
        NewBatch("/r", "b", "2", "", "", Kind.INFERENCE, "", "", None, "/y"),
        BatchState.WAITING,
        "",
        0.0,
    )
    (job,) = store.create_jobs(a.id, [NewJob("j", Pipeline.INFER, 0, 0, 1, (), "local")], 0.0)
    intent = store.add_intent(IntentAction.CANCEL, b.id, 0.0, "ops")
    actions = [
        MoveBatch(a.id, BatchState.QUEUED, "inputs complete"),
        PlanJobs(a.id, ()),
        MoveJob(job.id, JobState.CANCELLED, "x", batch_id=a.id),
        Cancel((job.id,), "x"),
        MoveBatch(b.id, BatchState.CANCELLED, "x"),
        ResolveIntent(intent.id, "cancelled", batch_id=intent.batch_id),
        Submit((job.id,)),
    ]
    groups = _transactions(actions)
    store.close()
    assert [[type(x).__name__ for x in g] for g in groups] == [
        ["MoveBatch", "PlanJobs", "MoveJob"],
        ["Cancel"],
        ["MoveBatch", "ResolveIntent"],
        ["Submit"],
    ]
