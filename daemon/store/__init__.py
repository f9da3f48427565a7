"""The store: the only code that touches SQLite. Returns frozen dataclasses, never rows.

WAL mode, so ``watchctl`` reads while the daemon writes; writes take ``BEGIN IMMEDIATE`` so two
writers queue instead of deadlocking. Every state change is checked against the transition
table in :mod:`daemon.core.states` and written in one transaction with its audit event.
Migrations are versioned and recorded in the same transaction that applies them.

:class:`Store` is one handle put together from one part per thing stored: batches
(:mod:`.batches`), jobs (:mod:`.jobs`), the audit log and operators' intents (:mod:`.events`),
what the daemon keeps about its own running: drop roots, undelivered cancels, the heartbeat
(:mod:`.operations`), and accounting: usage per ended attempt, operators' quotas, holds
(:mod:`.usage`). They share the connection, the write transaction and the audit append
(:mod:`.base`) and the row decoders (:mod:`.rows`); the schema is :mod:`daemon.store.migrations`.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import sqlite_utils

from daemon.contract.errors import NotFound
from daemon.store.batches import BatchStore
from daemon.store.events import EventStore
from daemon.store.jobs import JobStore
from daemon.store.migrations import MIGRATIONS
from daemon.store.operations import OperationStore
from daemon.store.rows import _casefold
from daemon.store.usage import UsageStore

__all__ = ["Store"]


class Store(BatchStore, JobStore, EventStore, OperationStore, UsageStore):
    """A handle on the watchd database; one per thread."""

    def __init__(self, path: Path) -> None:
        """A handle on the database at ``path``, in the journal mode its file says (WAL, once
        :meth:`open` made it): a reader's handle never switches it (:meth:`open`)."""
        self.path = Path(path)
        conn = sqlite3.connect(str(self.path), isolation_level=None, timeout=30.0)
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
        # Only the daemon's open sets WAL (kept in the file). A reader that set it too, on the
        # file the daemon's first start had just made, could take the lock the daemon's first
        # write needed: SQLite then refused the daemon at once ("database is locked", no wait:
        # each waiting on the other), and the daemon ended before its first tick.
        store.db.execute("PRAGMA journal_mode=WAL")
        store.migrate()
        return store

    @classmethod
    def open_existing(cls, path: Path) -> Store:
        """Open a database that must already exist (for watchctl: never create one by accident)."""
        if not Path(path).is_file():
            raise NotFound(f"no database at {path}: has the daemon ever run with this config?")
        store = cls(path)
        try:
            made = store.db.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'migrations'"
            ).fetchone()
        except BaseException:
            store.close()
            raise
        if made is None:  # the daemon's first start is making it, or ended before it could
            store.close()
            raise NotFound(f"the database at {path} has no tables yet: the daemon is making "
                           "them, or its first start failed (its log says why)")  # fmt: skip
        return store

    def close(self) -> None:
        self.db.close()

    # -- schema ------------------------------------------------------------------------------

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
                for statement in statements(script):
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


def statements(script: str) -> Iterator[str]:
    """The SQL statements of a migration script, each whole: a ';' inside a string literal or
    a trigger's body does not end one (SQLite itself says when a statement is complete)."""
    pending = ""
    for piece in script.split(";"):
        pending += piece + ";"
        if sqlite3.complete_statement(pending):
            if pending.strip(" \n\t;"):
                yield pending
            pending = ""
    if pending.strip(" \n\t;"):
        raise ValueError(f"an incomplete SQL statement ends the script: {pending.strip()!r}")
