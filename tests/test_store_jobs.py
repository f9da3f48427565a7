"""The store's jobs: their own parameters (migration 2) and the inputs a later stage inherits."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from daemon.jobspec import InputFile, Pipeline
from daemon.migrations import MIGRATIONS
from daemon.records import NewBatch, NewJob
from daemon.states import BatchState
from daemon.store import Store

INPUTS = (InputFile("images/a.png", 1), InputFile("masks/a.png", 1, role="mask"),
          InputFile("images/b.png", 2))  # fmt: skip


def test_trial_params_round_trip_and_a_later_stage_inherits_each_input_once(
    tmp_path: Path,
) -> None:
    store = Store.open(tmp_path / "watchd.sqlite")
    try:
        batch = store.create_batch(
            NewBatch("/r", "f", "sha", "", "", "sweep", "", "o", None, "/run"),
            BatchState.WAITING, "accepted", 0.0,
        )  # fmt: skip
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
    finally:
        store.close()
