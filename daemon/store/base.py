"""What every part of the store shares: the connection, the write transaction, the audit
append. :class:`daemon.store.Store` opens the connection and puts the parts together."""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator
from typing import Any

import sqlite_utils

from daemon.core.records import Batch


class StoreBase(abc.ABC):
    """The connection, and the helpers every part of the store writes through."""

    db: sqlite_utils.Database

    def _table(self, name: str) -> sqlite_utils.db.Table:
        return self.db.table(name)

    def _insert(self, name: str, row: dict[str, Any]) -> int:
        """Insert one row; its id."""
        return int(self._table(name).insert(row).last_pk)  # type: ignore[arg-type]

    # -- transactions ------------------------------------------------------------------------

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

    # -- the audit log: every state change appends its event in the same transaction ----------

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

    @abc.abstractmethod
    def batch(self, batch_id: int) -> Batch:
        """One batch (the batches part reads it; intents check with it that theirs exists)."""
