"""Self-service: the owner of a batch folder cancels its batch without an operator, by making a
file named ``watchd-cancel`` in the folder (``touch watchd-cancel``).

The folder is its owner's, so the file is looked at as anything there is: through the folder
held from its drop root (the one it was taken in from), by ``lstat`` of that one name, never
followed, never opened, never read. It counts only as a regular file made by the folder's owner
(the uid the share reports for the folder at intake): a file someone else could make there
(a group-writable folder) is ignored, with a note in the batch's history. The cancel is recorded
as an intent, as ``watchctl cancel`` records one, and the daemon applies it: the batch's jobs
stop and its status file says that its folder's owner cancelled it. The file stays: a new
revision of the manifest saved while it is there is cancelled too, until the owner removes it.

A folder is looked at when the watcher reports a change in it, and every ``every`` seconds
otherwise (a share without events).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Set

import structlog

from daemon.contract.heldfolder import HeldFolder
from daemon.core.manifest import CANCEL_NAME
from daemon.core.records import Batch, IntentAction
from daemon.store import Store

log = structlog.get_logger("watchd.selfservice")


class SelfService:
    def __init__(self, store: Store, every: float) -> None:
        self.store = store
        self.every = every
        self._due: dict[int, float] = {}  # batch id → when its folder is looked at next
        self._said: dict[int, int] = {}  # batch id → the uid of a stranger's file noted

    def look(self, batches: Iterable[Batch], touched: Set[tuple[str, str]], now: float) -> None:
        """Record a cancel for each batch under way whose folder's owner asked for one."""
        active = {b.id: b for b in batches if not b.state.terminal}
        self._due = {k: v for k, v in self._due.items() if k in active}
        for batch in active.values():
            due = (batch.root, batch.folder) in touched or now >= self._due.get(batch.id, 0.0)
            if due and batch.owner_uid is not None:
                self._due[batch.id] = now + self.every
                self._look(batch, now)

    def _look(self, batch: Batch, now: float) -> None:
        found = cancel_file(batch)
        if found is None:
            return
        if found.st_uid != batch.owner_uid:
            if self._said.get(batch.id) != found.st_uid:
                self._said[batch.id] = found.st_uid
                note = (f"{CANCEL_NAME} ignored: made by uid {found.st_uid}, not by the "
                        f"folder's owner ({batch.owner_user})")  # fmt: skip
                self.store.note(batch.id, note, now)
                log.warning("cancel file not the owner's", batch_id=batch.id,
                            uid=found.st_uid, owner_uid=batch.owner_uid)  # fmt: skip
            return
        asked = any(
            i.action is IntentAction.CANCEL and i.applied_at is None
            for i in self.store.intents_of(batch.id)
        )
        if not asked:
            by = f"its folder's owner {batch.owner_user} ({CANCEL_NAME})"
            self.store.add_intent(IntentAction.CANCEL, batch.id, now, by)
            log.info("cancel asked by the folder's owner", batch_id=batch.id,
                     owner=batch.owner_user)  # fmt: skip


def cancel_file(batch: Batch) -> os.stat_result | None:
    """The stat of the batch folder's ``watchd-cancel`` if it is a regular file there (never
    followed: a link, folder or FIFO of that name is not one), else None; None too when the
    folder cannot be held (gone, replaced, unreadable)."""
    try:
        with HeldFolder.batch(batch.root, batch.folder, batch.identity) as held:
            found = held.lstat(CANCEL_NAME)
    except OSError:
        return None
    return found if stat.S_ISREG(found.st_mode) else None
