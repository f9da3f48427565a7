"""The store's audit log and operators' intents: what happened, and what ``watchctl`` asked
the daemon to do (the loop applies intents; nothing else changes state for an operator)."""

from __future__ import annotations

from daemon.contract.errors import NotFound
from daemon.core.records import Event, Intent, IntentAction
from daemon.store.base import StoreBase
from daemon.store.rows import _event, _intent


class EventStore(StoreBase):
    """Events (appended with every state change, or as notes) and intents."""

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

    def add_intent(
        self, action: IntentAction, batch_id: int, now: float, requested_by: str
    ) -> Intent:
        with self.atomic():
            self.batch(batch_id)  # NotFound for an unknown batch
            row = {
                "at": now,
                "action": action.value,
                "batch_id": batch_id,
                "requested_by": requested_by,
            }
            intent_id = self._insert("intents", row)
        return self.intent(intent_id)

    def add_root_intent(
        self, action: IntentAction, root: str, now: float, requested_by: str
    ) -> Intent:
        """An intent on a drop root (pause, resume); the caller knows it is a configured one."""
        row = {"at": now, "action": action.value, "root": root, "requested_by": requested_by}
        with self.atomic():
            intent_id = self._insert("intents", row)
        return self.intent(intent_id)

    def add_subject_intent(
        self, action: IntentAction, subject: str, value: str, now: float, requested_by: str
    ) -> Intent:
        """An intent on a subject (``user:NAME``, ``group:NAME``): a quota, as JSON."""
        row = {"at": now, "action": action.value, "subject": subject, "value": value,
               "requested_by": requested_by}  # fmt: skip
        with self.atomic():
            intent_id = self._insert("intents", row)
        return self.intent(intent_id)

    def intent(self, intent_id: int) -> Intent:
        rows = list(self.db.query("SELECT * FROM intents WHERE id = ?", [intent_id]))
        if not rows:
            raise NotFound(f"no intent {intent_id}")
        return _intent(rows[0])

    def intents_of(self, batch_id: int) -> list[Intent]:
        rows = self.db.query("SELECT * FROM intents WHERE batch_id = ? ORDER BY id", [batch_id])
        return [_intent(r) for r in rows]

    def pending_intents(self) -> list[Intent]:
        rows = self.db.query("SELECT * FROM intents WHERE applied_at IS NULL ORDER BY id")
        return [_intent(r) for r in rows]

    def resolve_intent(self, intent_id: int, outcome: str, now: float) -> None:
        with self.atomic():
            self._table("intents").update(intent_id, {"applied_at": now, "outcome": outcome})
