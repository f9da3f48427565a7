"""The database schema, as numbered migrations. A migration is never edited once released;
a change is a new one. The store applies the missing ones in order, each recorded in the
same transaction that applies it."""

from __future__ import annotations

MIGRATIONS: tuple[tuple[int, str], ...] = (
    (
        1,
        """
        CREATE TABLE batches (
            id INTEGER PRIMARY KEY,
            root TEXT NOT NULL,
            folder TEXT NOT NULL,
            revision INTEGER NOT NULL,
            manifest_sha256 TEXT NOT NULL,
            manifest_text TEXT NOT NULL,
            manifest_stat TEXT NOT NULL DEFAULT '',
            kind TEXT,
            title TEXT NOT NULL DEFAULT '',
            owner TEXT NOT NULL DEFAULT '',
            contact TEXT,
            state TEXT NOT NULL,
            reason TEXT NOT NULL DEFAULT '',
            problems TEXT NOT NULL DEFAULT '[]',
            detail TEXT NOT NULL DEFAULT '',
            run_dir TEXT NOT NULL,
            watch_inputs TEXT NOT NULL DEFAULT '',
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL,
            finished_at REAL,
            UNIQUE (root, folder, revision)
        );
        CREATE INDEX batches_state ON batches(state);
        CREATE TABLE jobs (
            id INTEGER PRIMARY KEY,
            batch_id INTEGER NOT NULL REFERENCES batches(id),
            name TEXT NOT NULL UNIQUE,
            pipeline TEXT NOT NULL,
            stage INTEGER NOT NULL,
            shard_index INTEGER NOT NULL,
            shard_count INTEGER NOT NULL,
            inputs TEXT NOT NULL,
            state TEXT NOT NULL,
            attempts INTEGER NOT NULL DEFAULT 0,
            executor TEXT NOT NULL,
            handle TEXT,
            exit_code INTEGER,
            error_kind TEXT,
            reason TEXT NOT NULL DEFAULT '',
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL,
            submitted_at REAL,
            finished_at REAL
        );
        CREATE INDEX jobs_batch ON jobs(batch_id);
        CREATE INDEX jobs_state ON jobs(state);
        CREATE TABLE events (
            id INTEGER PRIMARY KEY,
            at REAL NOT NULL,
            batch_id INTEGER,
            job_id INTEGER,
            from_state TEXT,
            to_state TEXT,
            reason TEXT NOT NULL DEFAULT '',
            detail TEXT NOT NULL DEFAULT ''
        );
        CREATE INDEX events_batch ON events(batch_id);
        CREATE TABLE intents (
            id INTEGER PRIMARY KEY,
            at REAL NOT NULL,
            action TEXT NOT NULL,
            batch_id INTEGER NOT NULL,
            requested_by TEXT NOT NULL DEFAULT '',
            applied_at REAL,
            outcome TEXT NOT NULL DEFAULT ''
        );
        CREATE TABLE heartbeat (
            id INTEGER PRIMARY KEY CHECK (id = 1),
            pid INTEGER NOT NULL,
            host TEXT NOT NULL,
            version TEXT NOT NULL,
            started_at REAL NOT NULL,
            beat_at REAL NOT NULL,
            stopped_at REAL,
            info TEXT NOT NULL DEFAULT '{}'
        );
        """,
    ),
    (
        2,
        """
        ALTER TABLE jobs ADD COLUMN params TEXT NOT NULL DEFAULT '{}'
        """,
    ),
    # review-slurm: cancels the executor could not deliver yet (the controller was away),
    # sent again every tick until delivered, across restarts (renumber at merge if needed).
    (
        3,
        """
        CREATE TABLE cancels (
            handle TEXT PRIMARY KEY,
            job_id INTEGER NOT NULL,
            at REAL NOT NULL
        )
        """,
    ),
)
