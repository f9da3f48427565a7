"""The daemon's pulse: the heartbeat in the database (what `watchctl status` reads), systemd's
watchdog pings and STATUS line, and the gauges that go with them.

Only the loop calls it: a hung loop stops the pings, and systemd restarts the service.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from daemon.contract.version import code_version
from daemon.core.records import Heartbeat
from daemon.core.states import BatchState, JobState
from daemon.loop.metrics import Metrics
from daemon.loop.notify import Notifier
from daemon.store import Store

ACTIVE = [BatchState.WAITING, BatchState.QUEUED, BatchState.RUNNING]


class Pulse:
    def __init__(
        self,
        store: Store,
        notifier: Notifier,
        metrics: Metrics,
        heartbeat_seconds: float,
        describe: Callable[[], Mapping[str, object]],
    ) -> None:
        """``describe``: what the heartbeat says of the daemon beyond the counts (executor,
        roots and their watch modes, roots lost)."""
        self.store = store
        self.notifier = notifier
        self.metrics = metrics
        self.heartbeat_seconds = heartbeat_seconds
        self.describe = describe
        self.started_at = 0.0
        self._next_beat = 0.0
        self._ping_every = notifier.ping_seconds  # None: no systemd watchdog
        self._next_ping = 0.0

    def until_ping(self, tick_seconds: float) -> float:
        """How long the loop may sleep: a tick, or less when the watchdog's ping is due."""
        if self._ping_every is None:
            return tick_seconds
        return max(0.0, min(tick_seconds, self._next_ping - time.monotonic()))

    def beat(self, now: float, *, force: bool = False, stopped: bool = False) -> None:
        if now < self._next_beat and not force:
            return
        self._next_beat = now + self.heartbeat_seconds
        by_state = self.store.counts()
        counts = {s.value: n for s, n in by_state.items()}
        info = {"counts": counts, **self.describe()}
        self.store.beat(
            Heartbeat(
                pid=os.getpid(), host=socket.gethostname(), version=code_version(),
                started_at=self.started_at, beat_at=now, stopped_at=now if stopped else None,
                info=info,
            )
        )  # fmt: skip
        live = self.store.jobs(states=[JobState.SUBMITTED, JobState.RUNNING])
        lost = info.get("lost_roots", [])
        self.metrics.beat(
            by_state,
            self.store.entered_at(ACTIVE),
            len(live),
            len(lost) if isinstance(lost, list) else 0,
            now,
        )
        self.notifier.status(status_line(counts))

    def ping(self, now: float) -> None:
        """Tell systemd's watchdog that the loop is alive, at its pace (monotonic, so a clock
        step cannot delay it)."""
        self.metrics.ticked(now)
        if self._ping_every is None or time.monotonic() < self._next_ping:
            return
        self._next_ping = time.monotonic() + self._ping_every
        self.notifier.watchdog()

    def ready(self) -> None:
        self.notifier.ready(status_line({s.value: n for s, n in self.store.counts().items()}))


def status_line(counts: Mapping[str, int]) -> str:
    shown = ("waiting", "queued", "running", "failed", "done")
    return ", ".join(f"{counts.get(s, 0)} {s}" for s in shown)


def roots_info(modes: Mapping[Path, object], lost: set[Path]) -> dict[str, object]:
    return {
        "roots": {str(r): getattr(m, "value", str(m)) for r, m in modes.items()},
        "lost_roots": sorted(str(r) for r in lost),
    }
