"""The state machine: the store allows exactly the transitions in the table, each with its
audit event, whatever sequence is attempted."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from daemon.contract.errors import IllegalTransition
from daemon.contract.jobspec import Pipeline
from daemon.core.manifest_schema import Kind
from daemon.core.records import NewBatch, NewJob
from daemon.core.states import (
    BATCH_TRANSITIONS,
    JOB_TRANSITIONS,
    BatchState,
    JobState,
    batch_can_move,
    job_can_move,
)
from daemon.store import Store


def new_batch(folder: str = "b") -> NewBatch:
    return NewBatch(
        "/root", folder, "sha-" + folder, "text", "1:2:3", Kind.INFERENCE, "", "o", None, "/run"
    )


def test_every_state_has_a_row_in_its_table() -> None:
    assert set(BATCH_TRANSITIONS) == set(BatchState)
    assert set(JOB_TRANSITIONS) == set(JobState)


def test_terminal_states_only_leave_by_retry_or_requeue() -> None:
    for state in BatchState:
        if state.terminal:
            assert BATCH_TRANSITIONS[state] == {BatchState.WAITING}
    for state in JobState:
        if state.terminal:
            assert JOB_TRANSITIONS[state] == {JobState.PENDING}


def test_a_batch_is_born_waiting_or_failed() -> None:
    assert {s for s in BatchState if batch_can_move(None, s)} == {
        BatchState.WAITING,
        BatchState.FAILED,
    }
    assert {s for s in JobState if job_can_move(None, s)} == {JobState.PENDING}


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(st.sampled_from(list(BatchState)), max_size=12))
def test_the_store_follows_the_batch_table_and_logs_every_move(
    tmp_path: Path, moves: list[BatchState]
) -> None:
    store = Store.open(tmp_path / f"s{abs(hash(tuple(moves)))}.sqlite")
    try:
        batch = store.create_batch(new_batch(), BatchState.WAITING, "accepted", 0.0)
        state, expected_events = BatchState.WAITING, 1
        for i, target in enumerate(moves, start=1):
            if target in BATCH_TRANSITIONS[state]:
                assert store.transition_batch(batch.id, target, "x", float(i)).state is target
                state, expected_events = target, expected_events + 1
            else:
                with pytest.raises(IllegalTransition):
                    store.transition_batch(batch.id, target, "x", float(i))
            assert store.batch(batch.id).state is state
        events = store.events(batch.id)
        assert len(events) == expected_events
        assert all(
            e.from_state is None or e.to_state in BATCH_TRANSITIONS[e.from_state] for e in events
        )
    finally:
        store.close()


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(st.sampled_from(list(JobState)), max_size=12))
def test_the_store_follows_the_job_table(tmp_path: Path, moves: list[JobState]) -> None:
    store = Store.open(tmp_path / f"j{abs(hash(tuple(moves)))}.sqlite")
    try:
        batch = store.create_batch(new_batch(), BatchState.WAITING, "accepted", 0.0)
        (job,) = store.create_jobs(
            batch.id, [NewJob("j", Pipeline.INFER, 0, 0, 1, (), "local")], 0.0
        )
        state = JobState.PENDING
        for target in moves:
            if target in JOB_TRANSITIONS[state]:
                store.transition_job(job.id, target, "x", 1.0)
                state = target
            else:
                with pytest.raises(IllegalTransition):
                    store.transition_job(job.id, target, "x", 1.0)
        assert store.job(job.id).state is state
    finally:
        store.close()


def test_a_refused_transition_changes_nothing(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "s.sqlite")
    batch = store.create_batch(new_batch(), BatchState.WAITING, "accepted", 0.0)
    with pytest.raises(IllegalTransition, match="waiting → done is not allowed"):
        store.transition_batch(batch.id, BatchState.DONE, "x", 1.0)
    assert store.batch(batch.id).state is BatchState.WAITING
    assert len(store.events(batch.id)) == 1
    store.close()
