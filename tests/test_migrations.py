"""Migration scripts are cut into statements by SQLite's own rule, not at every ';'."""

from __future__ import annotations

import sqlite3

import pytest

from daemon.store import statements
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
