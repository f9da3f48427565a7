"""What the store keeps about the daemon's own running: paused drop roots, cancels not
delivered yet, the heartbeat."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict

from daemon.core.records import Heartbeat, RootRecord
from daemon.store.base import StoreBase


class OperationStore(StoreBase):
    """Drop roots, kept cancels and the heartbeat: rows the daemon alone writes."""

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
