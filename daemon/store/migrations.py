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
    (
        3,
        # Intents may target a drop root (pause, resume) instead of a batch: batch_id becomes
        # nullable beside a new root column, exactly one of them set. SQLite cannot drop NOT NULL
        # with ALTER TABLE, so the table is rebuilt with its rows. The roots table is what the
        # daemon made of those intents (only the daemon writes it). A job's attempts_base is its
        # attempt count when an operator last started it afresh (retry, requeue): attempts keep
        # counting, so each submission has its own number, and the retry budget counts from it.
        """
        CREATE TABLE intents_new (
            id INTEGER PRIMARY KEY,
            at REAL NOT NULL,
            action TEXT NOT NULL,
            batch_id INTEGER,
            root TEXT,
            requested_by TEXT NOT NULL DEFAULT '',
            applied_at REAL,
            outcome TEXT NOT NULL DEFAULT '',
            CHECK ((batch_id IS NULL) <> (root IS NULL))
        );
        INSERT INTO intents_new (id, at, action, batch_id, requested_by, applied_at, outcome)
            SELECT id, at, action, batch_id, requested_by, applied_at, outcome FROM intents;
        DROP TABLE intents;
        ALTER TABLE intents_new RENAME TO intents;
        CREATE INDEX intents_pending ON intents(id) WHERE applied_at IS NULL;
        CREATE TABLE roots (
            path TEXT PRIMARY KEY,
            paused INTEGER NOT NULL DEFAULT 0,
            paused_by TEXT NOT NULL DEFAULT '',
            paused_at REAL
        );
        ALTER TABLE jobs ADD COLUMN attempts_base INTEGER NOT NULL DEFAULT 0
        """,
    ),
    # Cancels the executor could not deliver yet (the controller was away), sent again every
    # tick until delivered, across restarts.
    (
        4,
        """
        CREATE TABLE cancels (
            handle TEXT PRIMARY KEY,
            job_id INTEGER NOT NULL,
            at REAL NOT NULL
        )
        """,
    ),
    # The batch folder's identity (device, inode) when the batch was taken in: a folder
    # replaced under the same name is another folder, and the batch's jobs never read it.
    # NULL for batches taken in before (their jobs hold the folder without checking).
    (
        5,
        """
        ALTER TABLE batches ADD COLUMN folder_device INTEGER;
        ALTER TABLE batches ADD COLUMN folder_inode INTEGER
        """,
    ),
    # The drop root's inode when the folder's identity was taken: a network share mounted
    # again (sshfs numbers inodes afresh at every mount) changes both, a folder replaced under
    # its name only the folder's. NULL for batches taken in before.
    (
        6,
        """
        ALTER TABLE batches ADD COLUMN root_inode INTEGER
        """,
    ),
    # An inference job's images, and those done as its progress file last said: a batch's
    # progress in images (its shards are few and long: jobs done say little).
    (
        7,
        """
        ALTER TABLE jobs ADD COLUMN images INTEGER NOT NULL DEFAULT 0;
        ALTER TABLE jobs ADD COLUMN images_done INTEGER NOT NULL DEFAULT 0
        """,
    ),
    # Many owners, one facility. A batch's owner is its folder's user and group as the share
    # reported them at intake (NULL: taken in before). ``hold`` says why a queued batch does not
    # start (its owner's quota). ``usage`` has one row per ended job attempt: what the job
    # measured, charged to its batch's owner, group and account then. ``quotas`` are what
    # operators set with ``watchctl quota`` (the daemon writes them, applying an intent); an
    # intent may now name a subject (``user:alice``, ``group:lab``) instead of a batch or a root,
    # so the table is rebuilt with exactly one of the three set, its rows kept.
    (
        8,
        """
        ALTER TABLE batches ADD COLUMN owner_uid INTEGER;
        ALTER TABLE batches ADD COLUMN owner_gid INTEGER;
        ALTER TABLE batches ADD COLUMN owner_user TEXT NOT NULL DEFAULT '';
        ALTER TABLE batches ADD COLUMN owner_group TEXT NOT NULL DEFAULT '';
        ALTER TABLE batches ADD COLUMN hold TEXT NOT NULL DEFAULT '';
        CREATE TABLE usage (
            id INTEGER PRIMARY KEY,
            at REAL NOT NULL,
            job_id INTEGER NOT NULL,
            batch_id INTEGER NOT NULL,
            attempt INTEGER NOT NULL,
            pipeline TEXT NOT NULL,
            state TEXT NOT NULL,
            owner_user TEXT NOT NULL,
            owner_group TEXT NOT NULL,
            account TEXT NOT NULL,
            handle TEXT NOT NULL DEFAULT '',
            wall_s REAL NOT NULL DEFAULT 0,
            cpu_s REAL NOT NULL DEFAULT 0,
            gpu_s REAL NOT NULL DEFAULT 0,
            images INTEGER NOT NULL DEFAULT 0,
            bytes_in INTEGER NOT NULL DEFAULT 0,
            bytes_out INTEGER NOT NULL DEFAULT 0,
            UNIQUE (job_id, attempt)
        );
        CREATE INDEX usage_at ON usage(at);
        CREATE TABLE quotas (
            subject TEXT PRIMARY KEY,
            per TEXT NOT NULL,
            images INTEGER,
            cpu_hours REAL,
            gpu_hours REAL,
            set_by TEXT NOT NULL DEFAULT '',
            set_at REAL NOT NULL
        );
        CREATE TABLE intents_new (
            id INTEGER PRIMARY KEY,
            at REAL NOT NULL,
            action TEXT NOT NULL,
            batch_id INTEGER,
            root TEXT,
            subject TEXT,
            value TEXT NOT NULL DEFAULT '',
            requested_by TEXT NOT NULL DEFAULT '',
            applied_at REAL,
            outcome TEXT NOT NULL DEFAULT '',
            CHECK ((batch_id IS NOT NULL) + (root IS NOT NULL) + (subject IS NOT NULL) = 1)
        );
        INSERT INTO intents_new (id, at, action, batch_id, root, requested_by, applied_at, outcome)
            SELECT id, at, action, batch_id, root, requested_by, applied_at, outcome FROM intents;
        DROP TABLE intents;
        ALTER TABLE intents_new RENAME TO intents;
        CREATE INDEX intents_pending ON intents(id) WHERE applied_at IS NULL
        """,
    ),
    # When a running inference job expects to end, at its own pace, as its progress file last
    # said (NULL: not known): the fair order lets a waiting owner take a slot about to free
    # instead of stopping a shard.
    (
        9,
        """
        ALTER TABLE jobs ADD COLUMN due_at REAL
        """,
    ),
)
