"""What follows a batch's end: it is counted in the metrics, and its owner gets an e-mail.

The loop calls :meth:`Endings.follow` once per tick. It reads the events appended since its
last call: the store's audit log records every state change, whichever path made it (intake
refusing a manifest, the planner, an operator's intent, an internal error), so no ending is
missed and none is seen twice. The loop gets the batches that ended back: it stops watching
their folders after a while.

At most one e-mail per batch end: a note ``e-mail to ADDRESS`` is recorded before the letter
goes to the mailer's thread, and an ending already followed by such a note is never mailed
again. After a restart, following resumes at the previous run's last heartbeat: an ending
recorded in the moments before a crash is still mailed if it was not, and no earlier one is.
"""

from __future__ import annotations

import structlog

from daemon.core.manifest_schema import is_one_address
from daemon.core.readiness import Timing
from daemon.core.records import Batch, Event
from daemon.core.states import BatchState
from daemon.loop import reporter
from daemon.loop.mailer import Mailer, compose
from daemon.loop.metrics import Metrics
from daemon.store import Store

log = structlog.get_logger("watchd.endings")

MAILED = frozenset({BatchState.DONE, BatchState.FAILED})
NOTE = "e-mail to "


class Endings:
    def __init__(
        self,
        store: Store,
        metrics: Metrics,
        mailer: Mailer | None,
        timing: Timing,
        sender: str = "",
    ) -> None:
        self.store = store
        self.metrics = metrics
        self.mailer = mailer
        self.timing = timing
        self.sender = sender
        beat = store.heartbeat()
        self.cursor = store.last_event_id(beat.beat_at if beat else None)

    def start(self) -> None:
        if self.mailer is not None:
            self.mailer.start()

    def follow(self, now: float) -> list[Batch]:
        """Act on the batch endings recorded since the last call (metrics, e-mail); record
        finished deliveries. The batches that ended, once each, for the loop."""
        self._record_deliveries(now)
        ended = []
        while events := self.store.events_after(self.cursor):
            for event in events:
                self.cursor = event.id
                if isinstance(event.to_state, BatchState) and event.to_state.terminal:
                    ended.append(self._ended(event, now))
        return ended

    def close(self, now: float, timeout: float) -> None:
        """Give queued e-mails up to ``timeout`` seconds, then record what became of them."""
        if self.mailer is None:
            return
        for letter in self.mailer.close(timeout):
            self._note(letter.batch_id, f"{NOTE}{letter.to} not sent: the daemon stopped", now)
            self.metrics.mails.labels("unsent").inc()
        self._record_deliveries(now)

    def _ended(self, event: Event, now: float) -> Batch:
        batch = self.store.batch(event.batch_id or 0)
        state = event.to_state
        assert isinstance(state, BatchState)
        came_from = event.from_state if isinstance(event.from_state, BatchState) else None
        self.metrics.batch_ended(state, came_from, self.store.jobs([batch.id]))
        self._mail(batch, state, event, now)
        return batch

    def _mail(self, batch: Batch, state: BatchState, event: Event, now: float) -> None:
        if self.mailer is None or state not in MAILED or not batch.contact:
            return
        if self.store.noted_after(batch.id, event.id, NOTE):
            return  # mailed before a restart
        if not is_one_address(batch.contact):  # taken in by a watchd that let lists through
            self._note(batch.id, f"{NOTE}{batch.contact!r} not sent: not one address", now)
            return
        status = reporter.render(reporter.gather(self.store, batch, (), self.timing), now)
        letter = compose(batch, state, status, self.sender, now)
        self.store.note(batch.id, f"{NOTE}{letter.to}", now)
        log.info("e-mail queued", batch_id=batch.id, to=letter.to)
        if not self.mailer.post(letter):
            self._note(batch.id, f"{NOTE}{letter.to} dropped: too many e-mails waiting", now)
            self.metrics.mails.labels("dropped").inc()

    def _record_deliveries(self, now: float) -> None:
        if self.mailer is None:
            return
        for delivery in self.mailer.deliveries():
            letter = delivery.letter
            if delivery.error is None:
                log.info("e-mail sent", batch_id=letter.batch_id, to=letter.to)
                self.metrics.mails.labels("sent").inc()
            else:
                self._note(letter.batch_id, f"{NOTE}{letter.to} failed: {delivery.error}", now)
                self.metrics.mails.labels("failed").inc()

    def _note(self, batch_id: int, reason: str, now: float) -> None:
        log.warning("e-mail not delivered", batch_id=batch_id, note=reason)
        self.store.note(batch_id, reason, now)
