"""The store: the only module that touches SQLite. Returns frozen dataclasses, never rows.

WAL mode, so ``watchctl`` reads while the daemon writes; writes take ``BEGIN IMMEDIATE`` so two
writers queue instead of deadlocking. Every state change is checked against the transition
table in :mod:`daemon.states` and written in one transaction with its audit event.
Migrations are versioned and recorded in the same transaction that applies them.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import sqlite_utils

from daemon.errors import IllegalTransition, NotFound
from daemon.jobspec import InputFile, Pipeline, Problem
from daemon.migrations import MIGRATIONS
from daemon.records import (
    Batch,
    Event,
    Heartbeat,
    Intent,
    Job,
    JobChange,
    NewBatch,
    NewJob,
    RootRecord,
)
from daemon.states import BatchState, JobState, batch_can_move, job_can_move


class Store:
    """A handle on the watchd database; one per thread."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        conn = sqlite3.connect(str(self.path), isolation_level=None, timeout=30.0)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA foreign_keys=ON")
        # Case-insensitive matching beyond ASCII (SQLite's lower() and LIKE know only ASCII).
        conn.create_function("casefold", 1, _casefold, deterministic=True)
        self.db = sqlite_utils.Database(conn, execute_plugins=False)

    @classmethod
    def open(cls, path: Path) -> Store:
        """Open (creating folders and the file as needed) and bring the schema up to date."""
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        store = cls(path)
        store.migrate()
        return store

    @classmethod
    def open_existing(cls, path: Path) -> Store:
        """Open a database that must already exist (for watchctl: never create one by accident)."""
        if not Path(path).is_file():
            raise NotFound(f"no database at {path}: has the daemon ever run with this config?")
        return cls(path)

    def close(self) -> None:
        self.db.close()

    def _table(self, name: str) -> sqlite_utils.db.Table:
        return self.db.table(name)

    def _insert(self, name: str, row: dict[str, Any]) -> int:
        """Insert one row; its id."""
        return int(self._table(name).insert(row).last_pk)  # type: ignore[arg-type]

    # -- transactions and schema -------------------------------------------------------------

    @contextlib.contextmanager
    def atomic(self) -> Iterator[None]:
        """One write transaction (BEGIN IMMEDIATE); nested blocks become savepoints."""
        if self.db.conn.in_transaction:
            with self.db.atomic():
                yield
            return
        self.db.conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self.db.conn.execute("ROLLBACK")
            raise
        self.db.conn.execute("COMMIT")

    def migrate(self) -> list[int]:
        """Apply the migrations not yet recorded; return the versions applied."""
        applied = []
        with self.atomic():
            self.db.execute(
                "CREATE TABLE IF NOT EXISTS migrations"
                " (version INTEGER PRIMARY KEY, applied_at TEXT)"
            )
            done = {row[0] for row in self.db.execute("SELECT version FROM migrations")}
            for version, script in MIGRATIONS:
                if version in done:
                    continue
                for statement in filter(str.strip, script.split(";")):
                    self.db.execute(statement)
                self.db.execute("INSERT INTO migrations VALUES (?, datetime('now'))", [version])
                applied.append(version)
        return applied

    def schema_version(self) -> int:
        row = self.db.execute("SELECT max(version) FROM migrations").fetchone()
        return int(row[0] or 0)

    def integrity(self) -> str:
        return str(self.db.execute("PRAGMA integrity_check").fetchone()[0])

    def journal_mode(self) -> str:
        return str(self.db.execute("PRAGMA journal_mode").fetchone()[0])

    # -- batches -----------------------------------------------------------------------------

    def create_batch(
        self,
        new: NewBatch,
        state: BatchState,
        reason: str,
        now: float,
        problems: Sequence[Problem] = (),
    ) -> Batch:
        """Record a new revision of a folder's batch, with its creation event."""
        if not batch_can_move(None, state):
            raise IllegalTransition(f"a batch cannot start as {state.value}")
        with self.atomic():
            revision = self._next_revision(new.root, new.folder)
            row = {
                **asdict(new),
                "revision": revision,
                "state": state.value,
                "reason": reason,
                "problems": _dump_problems(problems),
                "created_at": now,
                "updated_at": now,
                "finished_at": now if state.terminal else None,
            }
            batch_id = self._insert("batches", row)
            self._event(now, batch_id, None, None, state.value, reason)
        return self.batch(batch_id)

    def _next_revision(self, root: str, folder: str) -> int:
        row = self.db.execute(
            "SELECT max(revision) FROM batches WHERE root = ? AND folder = ?", [root, folder]
        ).fetchone()
        return int(row[0] or 0) + 1

    def batch(self, batch_id: int) -> Batch:
        rows = list(self.db.query(f"SELECT {_BATCH_COLUMNS} FROM batches WHERE id = ?", [batch_id]))
        if not rows:
            raise NotFound(f"no batch {batch_id}")
        return _batch(rows[0])

    def manifest_text(self, batch_id: int) -> str:
        """The manifest as the batch was accepted (kept out of Batch: it may be megabytes)."""
        row = self.db.execute(
            "SELECT manifest_text FROM batches WHERE id = ?", [batch_id]
        ).fetchone()
        if row is None:
            raise NotFound(f"no batch {batch_id}")
        return str(row[0])

    def latest_revision(self, root: str, folder: str) -> Batch | None:
        rows = self.db.query(
            f"SELECT {_BATCH_COLUMNS} FROM batches WHERE root = ? AND folder = ?"
            " ORDER BY revision DESC LIMIT 1",
            [root, folder],
        )
        return next((_batch(r) for r in rows), None)

    def manifest_stats(self, root: str) -> dict[str, str]:
        """folder → the stat signature of its newest revision's manifest, for one root."""
        rows = self.db.execute(
            "SELECT folder, manifest_stat FROM batches b WHERE root = ? AND revision ="
            " (SELECT max(revision) FROM batches WHERE root = b.root AND folder = b.folder)",
            [root],
        )
        return {folder: stat for folder, stat in rows}

    def batches(
        self,
        states: Iterable[BatchState] | None = None,
        *,
        limit: int | None = None,
        newest_first: bool = False,
        owner: str | None = None,
        root: str | None = None,
        since: float | None = None,
    ) -> list[Batch]:
        """Batches in ``states``, whose owner contains ``owner`` (any case), in ``root``,
        created at or after ``since``."""
        clauses: list[str] = []
        params: list[object] = []
        if states is not None:
            wanted = [s.value for s in states]
            clauses.append(f"state IN ({','.join('?' * len(wanted))})")
            params += wanted
        if owner:
            clauses.append("instr(casefold(owner), ?) > 0")
            params.append(_casefold(owner))
        if root is not None:
            clauses.append("root = ?")
            params.append(root)
        if since is not None:
            clauses.append("created_at >= ?")
            params.append(since)
        sql = f"SELECT {_BATCH_COLUMNS} FROM batches" + (
            f" WHERE {' AND '.join(clauses)}" if clauses else ""
        )
        sql += " ORDER BY id DESC" if newest_first else " ORDER BY id"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        return [_batch(r) for r in self.db.query(sql, params)]

    def active_batches(self) -> list[Batch]:
        return self.batches([s for s in BatchState if not s.terminal])

    def batches_watching_inputs(self, since: float) -> list[Batch]:
        """Failed batches that go back to waiting when their inputs change: the newest revision
        of their folder only, failed after ``since``."""
        rows = self.db.query(
            f"SELECT {_BATCH_COLUMNS} FROM batches b"
            " WHERE state = ? AND watch_inputs != '' AND updated_at > ?"
            " AND revision = (SELECT max(revision) FROM batches"
            " WHERE root = b.root AND folder = b.folder)",
            [BatchState.FAILED.value, since],
        )
        return [_batch(r) for r in rows]

    def stop_watching_inputs(self, root: str, folder: str) -> None:
        """A newer revision of the folder was recorded: no older one may come back."""
        with self.atomic():
            self.db.execute(
                "UPDATE batches SET watch_inputs = '' WHERE root = ? AND folder = ?", [root, folder]
            )

    def set_manifest_stat(self, batch_id: int, stat: str) -> None:
        with self.atomic():
            self.db.execute("UPDATE batches SET manifest_stat = ? WHERE id = ?", [stat, batch_id])

    def transition_batch(
        self,
        batch_id: int,
        target: BatchState,
        reason: str,
        now: float,
        *,
        problems: Sequence[Problem] = (),
        detail: str = "",
        watch_inputs: str = "",
    ) -> Batch:
        """Move a batch to ``target`` and append the event, in one transaction."""
        with self.atomic():
            current = self.batch(batch_id)
            if not batch_can_move(current.state, target):
                raise IllegalTransition(
                    f"batch {batch_id}: {current.state.value} → {target.value} is not allowed"
                )
            self._table("batches").update(
                batch_id,
                {
                    "state": target.value,
                    "reason": reason,
                    "problems": _dump_problems(problems),
                    "detail": detail,
                    "watch_inputs": watch_inputs,
                    "updated_at": now,
                    "finished_at": now if target.terminal else None,
                },
            )
            self._event(now, batch_id, None, current.state.value, target.value, reason, detail)
        return self.batch(batch_id)

    def counts(self) -> dict[BatchState, int]:
        rows = self.db.execute("SELECT state, count(*) FROM batches GROUP BY state")
        found = {BatchState(state): n for state, n in rows}
        return {state: found.get(state, 0) for state in BatchState}

    def entered_at(self, states: Iterable[BatchState]) -> dict[BatchState, float]:
        """For each of ``states`` that has batches: when its longest-standing one entered it."""
        wanted = [s.value for s in states]
        marks = ",".join("?" * len(wanted))
        rows = self.db.execute(
            f"SELECT state, min(updated_at) FROM batches WHERE state IN ({marks}) GROUP BY state",
            wanted,
        )
        return {BatchState(state): at for state, at in rows}

    # -- jobs --------------------------------------------------------------------------------

    def create_jobs(self, batch_id: int, jobs: Sequence[NewJob], now: float) -> list[Job]:
        with self.atomic():
            ids = []
            for new in jobs:
                row = {
                    **asdict(new),
                    "pipeline": new.pipeline.value,
                    "inputs": self._inherited_inputs(batch_id)
                    if new.inherit_inputs
                    else json.dumps([asdict(f) for f in new.inputs]),
                    "params": json.dumps(dict(new.params), sort_keys=True),
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

    def job_inputs(self, job_id: int) -> tuple[InputFile, ...]:
        row = self.db.execute("SELECT inputs FROM jobs WHERE id = ?", [job_id]).fetchone()
        if row is None:
            raise NotFound(f"no job {job_id}")
        return tuple(InputFile(**item) for item in json.loads(row[0]))

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
            if change.new_attempt:
                update["attempts"] = current.attempts + 1
                update["submitted_at"] = now
            if target is JobState.PENDING:
                update.update(exit_code=None, error_kind=None, finished_at=None)
            if target.terminal:
                update.update(
                    finished_at=now, exit_code=change.exit_code, error_kind=change.error_kind
                )
            self._table("jobs").update(job_id, update)
            self._event(
                now, current.batch_id, job_id, current.state.value, target.value, reason, detail
            )
        return self.job(job_id)

    # -- events and intents ------------------------------------------------------------------

    def _event(
        self,
        now: float,
        batch_id: int | None,
        job_id: int | None,
        from_state: str | None,
        to_state: str | None,
        reason: str,
        detail: str = "",
    ) -> None:
        self._table("events").insert(
            {
                "at": now,
                "batch_id": batch_id,
                "job_id": job_id,
                "from_state": from_state,
                "to_state": to_state,
                "reason": reason,
                "detail": detail,
            }
        )

    def note(self, batch_id: int, reason: str, now: float, detail: str = "") -> None:
        """Append an event that changes no state (a remark the operator should see)."""
        with self.atomic():
            self._event(now, batch_id, None, None, None, reason, detail)

    def events(
        self, batch_id: int | None = None, *, limit: int = 1000, jobs: bool = True
    ) -> list[Event]:
        """The newest ``limit`` events, oldest first; of one batch, and without job events."""
        clauses, params = [], []
        if batch_id is not None:
            clauses.append("batch_id = ?")
            params.append(batch_id)
        if not jobs:
            clauses.append("job_id IS NULL")
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        sql = f"SELECT * FROM events {where} ORDER BY id DESC LIMIT {int(limit)}"
        return [_event(r) for r in reversed(list(self.db.query(sql, params)))]

    def events_after(self, event_id: int, *, limit: int = 1000) -> list[Event]:
        """Events appended after ``event_id``, oldest first (to follow the log)."""
        rows = self.db.query(
            "SELECT * FROM events WHERE id > ? ORDER BY id LIMIT ?", [event_id, int(limit)]
        )
        return [_event(r) for r in rows]

    def last_event_id(self, at_or_before: float | None = None) -> int:
        """The newest event's id (0 if none), or the newest one recorded at or before a time;
        read from the end, so it is quick when that time is recent."""
        limit = float("inf") if at_or_before is None else at_or_before
        row = self.db.execute(
            "SELECT id FROM events WHERE at <= ? ORDER BY id DESC LIMIT 1", [limit]
        ).fetchone()
        return int(row[0]) if row else 0

    def noted_after(self, batch_id: int, event_id: int, prefix: str) -> bool:
        """Whether a note starting with ``prefix`` was made on the batch after ``event_id``."""
        row = self.db.execute(
            "SELECT 1 FROM events WHERE batch_id = ? AND id > ? AND to_state IS NULL"
            " AND substr(reason, 1, ?) = ? LIMIT 1",
            [batch_id, event_id, len(prefix), prefix],
        ).fetchone()
        return row is not None

    def add_intent(self, action: str, batch_id: int, now: float, requested_by: str) -> Intent:
        with self.atomic():
            self.batch(batch_id)  # NotFound for an unknown batch
            row = {"at": now, "action": action, "batch_id": batch_id, "requested_by": requested_by}
            intent_id = self._insert("intents", row)
        return self.intent(intent_id)

    def add_root_intent(self, action: str, root: str, now: float, requested_by: str) -> Intent:
        """An intent on a drop root (pause, resume); the caller knows it is a configured one."""
        row = {"at": now, "action": action, "root": root, "requested_by": requested_by}
        with self.atomic():
            intent_id = self._insert("intents", row)
        return self.intent(intent_id)

    def intent(self, intent_id: int) -> Intent:
        rows = list(self.db.query("SELECT * FROM intents WHERE id = ?", [intent_id]))
        if not rows:
            raise NotFound(f"no intent {intent_id}")
        return Intent(**rows[0])

    def intents_of(self, batch_id: int) -> list[Intent]:
        rows = self.db.query("SELECT * FROM intents WHERE batch_id = ? ORDER BY id", [batch_id])
        return [Intent(**r) for r in rows]

    def pending_intents(self) -> list[Intent]:
        rows = self.db.query("SELECT * FROM intents WHERE applied_at IS NULL ORDER BY id")
        return [Intent(**r) for r in rows]

    def resolve_intent(self, intent_id: int, outcome: str, now: float) -> None:
        with self.atomic():
            self._table("intents").update(intent_id, {"applied_at": now, "outcome": outcome})

    # -- drop roots (written by the daemon alone, as it applies pause and resume intents) -------

    def roots(self) -> list[RootRecord]:
        rows = self.db.query("SELECT * FROM roots ORDER BY path")
        return [RootRecord(**{**r, "paused": bool(r["paused"])}) for r in rows]

    def paused_roots(self) -> frozenset[str]:
        return frozenset(r.path for r in self.roots() if r.paused)

    def set_root_paused(self, root: str, paused: bool, by: str, now: float) -> None:
        row = {"path": root, "paused": int(paused), "paused_by": by if paused else "",
               "paused_at": now if paused else None}  # fmt: skip
        with self.atomic():
            self._table("roots").upsert(row, pk="path")

    # -- cancels not delivered yet ------------------------------------------------------------

    def keep_cancel(self, handle: str, job_id: int, now: float) -> None:
        """Remember a cancel to deliver; in the transaction that marks the job cancelled, so a
        crash cannot lose it."""
        with self.atomic():
            row = {"handle": handle, "job_id": job_id, "at": now}
            self._table("cancels").upsert(row, pk="handle")

    def kept_cancels(self) -> dict[str, int]:
        """Cancels not delivered yet: handle → job id, oldest first."""
        rows = self.db.execute("SELECT handle, job_id FROM cancels ORDER BY at, handle")
        return {str(handle): int(job_id) for handle, job_id in rows.fetchall()}

    def drop_cancels(self, handles: Iterable[str]) -> None:
        """These cancels were delivered."""
        with self.atomic():
            self.db.conn.executemany(
                "DELETE FROM cancels WHERE handle = ?", [(h,) for h in handles]
            )

    # -- heartbeat ---------------------------------------------------------------------------

    def beat(self, beat: Heartbeat) -> None:
        with self.atomic():
            row = asdict(beat)
            row["info"] = json.dumps(beat.info, sort_keys=True)
            self._table("heartbeat").upsert({"id": 1, **row}, pk="id")

    def heartbeat(self) -> Heartbeat | None:
        rows = list(self.db.query("SELECT * FROM heartbeat WHERE id = 1"))
        if not rows:
            return None
        row = rows[0]
        row.pop("id")
        row["info"] = json.loads(row["info"])
        return Heartbeat(**row)


_BATCH_COLUMNS = ", ".join(Batch.__dataclass_fields__)  # all but the manifest's text
_JOB_COLUMNS = ", ".join(
    f.name
    for f in Job.__dataclass_fields__.values()  # every column but the inputs
)


def _casefold(text: str | None) -> str:
    return (text or "").casefold()


def _dump_problems(problems: Sequence[Problem]) -> str:
    return json.dumps([asdict(p) for p in problems], ensure_ascii=False)


def _event(row: dict[str, Any]) -> Event:
    state = BatchState if row["job_id"] is None else JobState
    row = dict(row)
    for key in ("from_state", "to_state"):
        row[key] = state(row[key]) if row[key] is not None else None
    return Event(**row)


def _batch(row: dict[str, Any]) -> Batch:
    row = dict(row)
    row["state"] = BatchState(row["state"])
    row["problems"] = tuple(Problem(**p) for p in json.loads(row["problems"]))
    return Batch(**row)


def _job(row: dict[str, Any]) -> Job:
    row = dict(row)
    row["params"] = json.loads(row["params"])
    row["state"] = JobState(row["state"])
    row["pipeline"] = Pipeline(row["pipeline"])
    return Job(**row)
