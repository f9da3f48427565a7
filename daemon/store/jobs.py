"""The store's jobs: the planned work of each batch, with its state and attempts."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, replace
from typing import Any

from daemon.contract.errors import IllegalTransition, NotFound
from daemon.contract.jobspec import InputFile, inputs_json
from daemon.core.records import Job, JobChange, NewJob
from daemon.core.states import JobState, job_can_move
from daemon.store.base import StoreBase
from daemon.store.rows import _JOB_COLUMNS, _job, _storable, _value


class JobStore(StoreBase):
    """Jobs: created with their inputs, looked up, listed, counted and moved through their
    states."""

    def create_jobs(self, batch_id: int, jobs: Sequence[NewJob], now: float) -> list[Job]:
        with self.atomic():
            ids = []
            for new in jobs:
                row = {
                    **asdict(replace(new, inputs=())),
                    "pipeline": new.pipeline.value,
                    "inputs": self._inherited_inputs(batch_id)
                    if new.inherit_inputs
                    else json.dumps(inputs_json(new.inputs)),
                    "params": json.dumps(dict(new.params), sort_keys=True),
                    "images": new.images,
                    "batch_id": batch_id,
                    "state": JobState.PENDING.value,
                    "created_at": now,
                    "updated_at": now,
                }
                del row["inherit_inputs"]
                job_id = self._insert("jobs", row)
                self._event(now, batch_id, job_id, None, JobState.PENDING.value, "planned")
                ids.append(job_id)
        return [self.job(i) for i in ids]

    def _inherited_inputs(self, batch_id: int) -> str:
        """The inputs of all the batch's stage-0 jobs as one JSON list, built inside SQLite.

        An input that several stage-0 jobs share (every trial of a sweep trains on all the
        inputs) is listed once, where it first appears.
        """
        row = self.db.execute(
            "SELECT json_group_array(json(value)) FROM ("
            " SELECT each.value AS value, min(j.id) AS job, min(each.key) AS position"
            " FROM jobs AS j, json_each(j.inputs) AS each"
            " WHERE j.batch_id = ? AND j.stage = 0"
            " GROUP BY each.value ORDER BY job, position)",
            [batch_id],
        ).fetchone()
        return str(row[0])

    def job(self, job_id: int) -> Job:
        if not _storable(job_id):
            raise NotFound(f"no job {job_id}")
        rows = list(self.db.query(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE id = ?", [job_id]))
        if not rows:
            raise NotFound(f"no job {job_id}")
        return _job(rows[0])

    def job_named(self, name: str) -> Job:
        rows = list(self.db.query(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE name = ?", [name]))
        if not rows:
            raise NotFound(f"no job {name!r}")
        return _job(rows[0])

    def job_counts(self, batch_ids: Iterable[int]) -> dict[int, dict[JobState, int]]:
        """batch id → how many of its jobs are in each state (states with none left out)."""
        ids = list(batch_ids)
        rows = self.db.execute(
            f"SELECT batch_id, state, count(*) FROM jobs WHERE batch_id IN"
            f" ({','.join('?' * len(ids))}) GROUP BY batch_id, state",
            ids,
        )
        counts: dict[int, dict[JobState, int]] = {i: {} for i in ids}
        for batch_id, state, n in rows:
            counts[batch_id][JobState(state)] = n
        return counts

    def jobs(
        self,
        batch_ids: Iterable[int] | None = None,
        states: Iterable[JobState] | None = None,
        *,
        limit: int | None = None,
    ) -> list[Job]:
        """Jobs in id order; with ``limit``, the newest ``limit`` of them."""
        clauses: list[str] = []
        params: list[object] = []
        if batch_ids is not None:
            ids = list(batch_ids)
            clauses.append(f"batch_id IN ({','.join('?' * len(ids))})")
            params += ids
        if states is not None:
            wanted = [s.value for s in states]
            clauses.append(f"state IN ({','.join('?' * len(wanted))})")
            params += wanted
        where = f" WHERE {' AND '.join(clauses)}" if clauses else ""
        sql = f"SELECT {_JOB_COLUMNS} FROM jobs{where} ORDER BY id"
        if limit is not None:
            sql = f"SELECT * FROM ({sql} DESC LIMIT {int(limit)}) ORDER BY id"
        return [_job(r) for r in self.db.query(sql, params)]

    def job_progress(self, job_id: int, images_done: int, due_at: float | None = None) -> None:
        """Record how many of its images a running inference job has done and when it expects
        to end (no event: it is not a change of state)."""
        with self.atomic():
            self.db.execute(
                "UPDATE jobs SET images_done = ?, due_at = ? WHERE id = ?",
                [images_done, due_at, job_id],
            )

    def job_inputs(self, job_id: int) -> tuple[InputFile, ...]:
        row = self.db.execute("SELECT inputs FROM jobs WHERE id = ?", [job_id]).fetchone()
        if row is None:
            raise NotFound(f"no job {job_id}")
        return tuple(InputFile.from_dict(item) for item in json.loads(row[0]))

    def transition_job(
        self,
        job_id: int,
        target: JobState,
        reason: str,
        now: float,
        change: JobChange | None = None,
        detail: str = "",
    ) -> Job:
        """Move a job to ``target`` with the fields that go with it, and append the event."""
        change = change or JobChange()
        with self.atomic():
            current = self.job(job_id)
            if not job_can_move(current.state, target):
                raise IllegalTransition(
                    f"job {current.name}: {current.state.value} → {target.value} is not allowed"
                )
            update: dict[str, Any] = {"state": target.value, "reason": reason, "updated_at": now}
            if change.handle is not None:
                update["handle"] = change.handle
            if change.reset_attempts:
                update["attempts_base"] = current.attempts
            elif change.forgive_attempt:
                update["attempts_base"] = min(current.attempts, current.attempts_base + 1)
            if change.new_attempt:
                update["attempts"] = current.attempts + 1
                update["submitted_at"] = now
                update["due_at"] = None  # the new attempt says its own
            if target is JobState.PENDING:
                update.update(exit_code=None, error_kind=None, finished_at=None)
            if target.terminal:
                update.update(
                    finished_at=now,
                    exit_code=change.exit_code,
                    error_kind=_value(change.error_kind),
                )
            self._table("jobs").update(job_id, update)
            self._event(
                now, current.batch_id, job_id, current.state.value, target.value, reason, detail
            )
        return self.job(job_id)
