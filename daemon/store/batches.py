"""The store's batches: one row per revision of a drop folder's batch, with its state."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict

from daemon.contract.errors import IllegalTransition, NotFound
from daemon.contract.jobspec import Identity, Problem
from daemon.core.records import Batch, NewBatch
from daemon.core.states import TERMINAL_BATCH_STATES, BatchState, batch_can_move
from daemon.store.base import StoreBase
from daemon.store.rows import (
    _BATCH_COLUMNS,
    _batch,
    _casefold,
    _dump_problems,
    _storable,
    _value,
)

# A row of ``batches b`` that is its folder's newest revision.
_NEWEST_REVISION = (
    "b.revision = (SELECT max(revision) FROM batches WHERE root = b.root AND folder = b.folder)"
)


class BatchStore(StoreBase):
    """Batches: recorded, looked up, listed, counted and moved through their states."""

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
                "kind": _value(new.kind),
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
        if not _storable(batch_id):
            raise NotFound(f"no batch {batch_id}")
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

    def manifest_stats(self, root: str, folders: Sequence[str]) -> dict[str, str]:
        """folder → the stat signature of its newest revision's manifest, for some folders of
        one root (those without a batch are left out)."""
        marks = ", ".join("?" * len(folders))
        rows = self.db.execute(
            f"SELECT folder, manifest_stat FROM batches b WHERE root = ? AND folder IN ({marks})"
            f" AND {_NEWEST_REVISION}",
            [root, *folders],
        )
        return {folder: stat for folder, stat in rows}

    def ended_folders(self, root: str) -> set[str]:
        """The folders of one root whose newest revision has ended (done, failed, cancelled)."""
        ended = [s.value for s in TERMINAL_BATCH_STATES]
        marks = ", ".join("?" * len(ended))
        rows = self.db.execute(
            f"SELECT folder FROM batches b WHERE root = ? AND state IN ({marks})"
            f" AND {_NEWEST_REVISION}",
            [root, *ended],
        )
        return {folder for (folder,) in rows}

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
            f" AND {_NEWEST_REVISION}",
            [BatchState.FAILED.value, since],
        )
        return [_batch(r) for r in rows]

    def stop_watching_inputs(self, root: str, folder: str) -> None:
        """A newer revision of the folder was recorded: no older one may come back."""
        with self.atomic():
            self.db.execute(
                "UPDATE batches SET watch_inputs = '' WHERE root = ? AND folder = ?", [root, folder]
            )

    def set_manifest_stat(self, batch_id: int, stat: str, identity: Identity | None = None) -> None:
        """The manifest's stat signature; with ``identity``, the folder it is in (a folder
        dropped again with the same manifest, or seen again after its share was mounted
        again) and the drop root's inode then."""
        with self.atomic():
            self.db.execute("UPDATE batches SET manifest_stat = ? WHERE id = ?", [stat, batch_id])
            if identity is not None:
                self.db.execute(
                    "UPDATE batches SET folder_device = ?, folder_inode = ?, root_inode = ? "
                    "WHERE id = ?",
                    [identity.device, identity.inode, identity.root, batch_id],
                )

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
