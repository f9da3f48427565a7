"""The store's jobs: their own parameters (migration 2), the inputs a later stage inherits, and
migration 3 (intents on drop roots, attempts counted on)."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest

from daemon.cli import overview
from daemon.cli import read as cli_read
from daemon.contract.jobspec import PROGRESS_FILE, InputFile, Pipeline, Role
from daemon.core.manifest_schema import Kind
from daemon.core.records import Batch, IntentAction, JobChange, NewBatch, NewJob
from daemon.core.states import BatchState, JobState
from daemon.loop.dispatch import Progress, read_progress
from daemon.store import Store
from daemon.store.migrations import MIGRATIONS

INPUTS = (InputFile("images/a.png", 1), InputFile("masks/a.png", 1, role=Role.MASK),
          InputFile("images/b.png", 2))  # fmt: skip


def a_batch(store: Store, kind: Kind) -> Batch:
    new = NewBatch("/r", "f", "sha", "", "", kind, "", "o", None, "/run")
    return store.create_batch(new, BatchState.WAITING, "accepted", 0.0)


def test_trial_params_round_trip_and_a_later_stage_inherits_each_input_once(
    tmp_path: Path,
) -> None:
    store = Store.open(tmp_path / "watchd.sqlite")
    try:
        batch = a_batch(store, Kind.SWEEP)
        trials = [NewJob(f"b1-trial-{i}", Pipeline.TRAIN, 0, i, 3, INPUTS, "local",
                         params={"learning_rate": rate, "trial": i})
                  for i, rate in enumerate((0.1, 0.01, 0.001))]  # fmt: skip
        created = store.create_jobs(batch.id, trials, 1.0)
        assert [dict(j.params) for j in created] == [
            {"learning_rate": 0.1, "trial": 0},
            {"learning_rate": 0.01, "trial": 1},
            {"learning_rate": 0.001, "trial": 2},
        ]
        (sweep,) = store.create_jobs(
            batch.id, [NewJob("b1-sweep", Pipeline.SWEEP, 1, 0, 1, (), "local",
                              inherit_inputs=True)], 2.0)  # fmt: skip
        assert store.job_inputs(sweep.id) == INPUTS
        assert dict(store.job(sweep.id).params) == {}
    finally:
        store.close()


def test_a_database_of_schema_1_gains_the_params_column_with_empty_params(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    connection = sqlite3.connect(path)
    connection.execute("CREATE TABLE migrations (version INTEGER PRIMARY KEY, applied_at TEXT)")
    connection.executescript(dict(MIGRATIONS)[1])
    connection.execute("INSERT INTO migrations VALUES (1, 'then')")
    connection.execute(
        "INSERT INTO batches (root, folder, revision, manifest_sha256, manifest_text, state,"
        " run_dir, created_at, updated_at) VALUES ('/r', 'f', 1, 's', '', 'running', '/run', 0, 0)"
    )
    connection.execute(
        "INSERT INTO jobs (batch_id, name, pipeline, stage, shard_index, shard_count, inputs,"
        " state, executor, created_at, updated_at)"
        " VALUES (1, 'old', 'infer', 0, 0, 1, '[]', 'running', 'local', 0, 0)"
    )
    connection.commit()
    connection.close()
    store = Store.open(path)
    try:
        assert store.schema_version() == MIGRATIONS[-1][0]
        (job,) = store.jobs()
        assert job.name == "old" and dict(job.params) == {}
        assert (job.attempts, job.attempts_base) == (0, 0)
    finally:
        store.close()


def database_at(path: Path, version: int, *statements: str) -> Path:
    """A database file of schema ``version`` (the migrations up to it), then ``statements``."""
    connection = sqlite3.connect(path)
    connection.execute("CREATE TABLE migrations (version INTEGER PRIMARY KEY, applied_at TEXT)")
    for number, script in MIGRATIONS[:version]:
        connection.executescript(script)
        connection.execute("INSERT INTO migrations VALUES (?, 'then')", [number])
    for statement in statements:
        connection.execute(statement)
    connection.commit()
    connection.close()
    return path


def test_migration_3_keeps_the_intents_and_lets_an_intent_name_a_root_instead_of_a_batch(
    tmp_path: Path,
) -> None:
    path = database_at(
        tmp_path / "v2.sqlite",
        2,
        "INSERT INTO intents (at, action, batch_id, requested_by, applied_at, outcome)"
        " VALUES (5.0, 'retry', 7, 'ops', 6.0, 'retry: waiting for inputs again')",
    )
    store = Store.open(path)
    try:
        old = store.intent(1)
        assert (old.action.value, old.batch_id, old.root, old.outcome) == (
            "retry",
            7,
            None,
            "retry: waiting for inputs again",
        )
        pause = store.add_root_intent(IntentAction.PAUSE, "/drop", 8.0, "ops")
        assert (pause.id, pause.batch_id, pause.root) == (2, None, "/drop")
        assert [i.id for i in store.pending_intents()] == [2]
        with pytest.raises(sqlite3.IntegrityError):  # exactly one of batch and root
            store.db.execute("INSERT INTO intents (at, action) VALUES (1, 'pause')")
        store.set_root_paused("/drop", True, "ops", 9.0)
        assert store.paused_roots() == {"/drop"}
        store.set_root_paused("/drop", False, "ops", 10.0)
        assert store.paused_roots() == frozenset()
        assert [(r.path, r.paused, r.paused_by, r.paused_at) for r in store.roots()] == [
            ("/drop", False, "", None)
        ]
    finally:
        store.close()


def test_a_fresh_start_keeps_counting_attempts_and_restarts_the_retry_budget(
    tmp_path: Path,
) -> None:
    """A retried job's next submission has a number of its own (a result left by an earlier
    attempt is never taken for the new one's), while its retry budget starts again."""
    store = Store.open(tmp_path / "watchd.sqlite")
    try:
        batch = a_batch(store, Kind.INFERENCE)
        (job,) = store.create_jobs(
            batch.id, [NewJob("j", Pipeline.INFER, 0, 0, 1, INPUTS, "local")], 1.0
        )
        store.transition_job(job.id, JobState.SUBMITTED, "submitted", 2.0,
                             JobChange(handle="h", new_attempt=True))  # fmt: skip
        store.transition_job(job.id, JobState.FAILED, "bad input", 3.0)
        again = store.transition_job(job.id, JobState.PENDING, "retry", 4.0,
                                     JobChange(reset_attempts=True))  # fmt: skip
        assert (again.attempts, again.attempts_base, again.tries) == (1, 1, 0)
        second = store.transition_job(job.id, JobState.SUBMITTED, "submitted", 5.0,
                                      JobChange(handle="h2", new_attempt=True))  # fmt: skip
        assert (second.attempts, second.tries) == (2, 1)
    finally:
        store.close()


def test_a_batch_recorded_before_migration_5_has_no_folder_identity(tmp_path: Path) -> None:
    """Its jobs then hold the batch folder without checking it (they did not before either)."""
    path = database_at(
        tmp_path / "v4.sqlite",
        4,
        "INSERT INTO batches (root, folder, revision, manifest_sha256, manifest_text, state,"
        " run_dir, created_at, updated_at) VALUES ('/r', 'f', 1, 's', '', 'running', '/run', 0, 0)",
    )
    store = Store.open(path)
    try:
        (batch,) = store.batches()
        assert (batch.folder_device, batch.folder_inode, batch.identity) == (None, None, None)
    finally:
        store.close()


def test_a_batchs_progress_counts_the_images_of_its_inference_jobs(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "watchd.sqlite")
    try:
        batch = a_batch(store, Kind.INFERENCE)
        images = tuple(InputFile(f"images/{i}.png", i) for i in range(5))
        one, two = store.create_jobs(batch.id, [
            NewJob("b1-infer-0000", Pipeline.INFER, 0, 0, 2, images[:3], "local"),
            NewJob("b1-infer-0001", Pipeline.INFER, 0, 1, 2, images[3:], "local"),
        ], 1.0)  # fmt: skip
        (report,) = store.create_jobs(
            batch.id, [NewJob("b1-report", Pipeline.REPORT, 1, 0, 1, (), "local",
                              inherit_inputs=True)], 2.0)  # fmt: skip
        assert (one.images, two.images, report.images) == (3, 2, 0)
        store.job_progress(one.id, 2)
        for state in (JobState.SUBMITTED, JobState.RUNNING, JobState.SUCCEEDED):
            store.transition_job(two.id, state, "test", 3.0)
        row = overview.batch_summary(store.batch(batch.id), store.jobs([batch.id]))
        assert (row["images_done"], row["images_total"], row["jobs_done"]) == (4, 5, 1)
        assert cli_read.progress(row) == "4/5 images, 1/3 jobs"
    finally:
        store.close()


@pytest.mark.parametrize("planted", ["link", "fifo", "huge", "garbage"])
def test_a_progress_file_that_is_not_a_small_plain_file_is_not_believed(
    tmp_path: Path, planted: str
) -> None:
    """(In the spool, the service's own: no owner can plant one; read by the rule all the
    same.)"""
    job_dir = tmp_path / "spool" / "runs" / "b000001" / "run" / "jobs" / "b1-infer-0000"
    job_dir.mkdir(parents=True)
    target = job_dir / PROGRESS_FILE
    (tmp_path / "elsewhere.json").write_text('{"done": 5}')
    if planted == "link":
        target.symlink_to(tmp_path / "elsewhere.json")
    elif planted == "fifo":
        os.mkfifo(target)
    elif planted == "huge":
        target.write_text('{"done": 5, "x": "' + "x" * 10_000 + '"}')
    else:
        target.write_text("not json")
    assert read_progress(job_dir) is None
    target.unlink()
    target.write_text('{"done": 5, "total": 9}')
    assert read_progress(job_dir) == Progress(5, None)
    target.unlink()
    target.write_text('{"done": 5, "total": 9, "due_at": 1780000012.5}')
    assert read_progress(job_dir) == Progress(5, 1780000012.5)
    target.unlink()
    target.write_text('{"done": 5, "total": 9, "due_at": "soon"}')
    assert read_progress(job_dir) == Progress(5, None)
