"""Migration scripts are cut into statements by SQLite's own rule, not at every ';'; the
daemon's first open makes the schema beside readers of the file it just made."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest

from daemon.store import Store, statements
from daemon.store.migrations import MIGRATIONS

SCRIPT = """
CREATE TABLE notes (id INTEGER PRIMARY KEY, text TEXT NOT NULL DEFAULT 'a; b');
CREATE TABLE counts (n INTEGER);
INSERT INTO counts VALUES (0);
CREATE TRIGGER counted AFTER INSERT ON notes BEGIN
    UPDATE counts SET n = n + 1;
    INSERT INTO notes (text) SELECT 'never; reached' WHERE 0;
END;
"""


def test_a_literal_or_a_trigger_with_semicolons_is_one_statement() -> None:
    found = list(statements(SCRIPT))
    assert len(found) == 4
    db = sqlite3.connect(":memory:")
    for statement in found:
        db.execute(statement)
    db.execute("INSERT INTO notes DEFAULT VALUES")
    assert db.execute("SELECT text FROM notes").fetchone() == ("a; b",)
    assert db.execute("SELECT n FROM counts").fetchone() == (1,)


def test_an_unfinished_statement_is_refused_not_run() -> None:
    with pytest.raises(ValueError, match="incomplete SQL statement"):
        list(statements("CREATE TABLE t (x TEXT DEFAULT 'open;"))


def test_every_migration_cuts_into_complete_statements() -> None:
    for _, script in MIGRATIONS:
        assert all(sqlite3.complete_statement(s) for s in statements(script))


def test_the_daemons_first_open_is_not_refused_by_readers_of_the_file_it_just_made(
    tmp_path: Path,
) -> None:
    """watchctl (and the test harnesses) open the database as soon as its file is there, which
    on the daemon's first start is a moment before its schema is. A reader that switched the
    journal mode then could take the lock the daemon's first write needed, and SQLite refused
    the daemon at once ("database is locked", each waiting on the other): the daemon ended before
    its first tick (seen in CI once). Readers that only read leave it to wait its turn."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def read(where: Path) -> None:
        while not stop.is_set():
            paths = sorted(where.glob("*.sqlite"))
            if not paths:
                continue
            try:
                store = Store(paths[-1])
                try:
                    store.heartbeat()
                finally:
                    store.close()
            except sqlite3.OperationalError as exc:  # no schema yet: as watchctl says
                if "no such table" not in str(exc):
                    errors.append(exc)

    readers = [threading.Thread(target=read, args=(tmp_path,)) for _ in range(2)]
    for reader in readers:
        reader.start()
    try:
        for n in range(300):
            Store.open(tmp_path / f"{n:03}.sqlite").close()
    finally:
        stop.set()
        for reader in readers:
            reader.join()
    assert errors == []
