"""Calls to a controller that may be away: bounded retries, then a pause that grows.

Within one call, tenacity tries again a few times with a short exponential wait, while the
tries fail fast (a busy controller's EAGAIN). When every
try failed, the gate stays shut for a pause that doubles with each failed round, up to a bound;
calls in that time fail at once, so the daemon's loop goes on taking in batches instead of
waiting on a controller that is down (each try of a Slurm tool against a dead controller takes
about 9 s). Both the waits and the retries end as soon as shutdown is requested.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

import structlog
import tenacity

from daemon.contract.errors import ExecutorUnavailable

log = structlog.get_logger("watchd.slurm")

T = TypeVar("T")

# Tries of one call stop after this long: a tool facing a dead controller already spends about
# 9 s on each try, and the loop must get back to taking in batches.
CALL_BUDGET_SECONDS = 5.0


class Gate:
    def __init__(
        self,
        *,
        attempts: int,
        first_wait: float,
        max_wait: float,
        stop: threading.Event,
        clock: Callable[[], float] = time.monotonic,
        budget: float = CALL_BUDGET_SECONDS,
    ) -> None:
        self.attempts = attempts
        self.budget = budget
        self.first_wait = first_wait
        self.max_wait = max_wait
        self.stop = stop
        self.clock = clock
        self.failures = 0  # rounds failed in a row
        self.shut_until = 0.0
        self.last_error = ""

    @property
    def open(self) -> bool:
        return self.clock() >= self.shut_until

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()``, tried again while it raises ExecutorUnavailable; raises it when the gate is
        shut or every try failed."""
        if not self.open:
            raise self._unavailable()
        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(self.attempts)
            | tenacity.stop_after_delay(self.budget)
            | tenacity.stop_when_event_set(self.stop),
            wait=tenacity.wait_exponential(multiplier=self.first_wait, max=self.max_wait),
            retry=tenacity.retry_if_exception_type(ExecutorUnavailable),
            sleep=self._pause,
            reraise=True,
        )
        try:
            result = retrying(fn)
        except ExecutorUnavailable as exc:
            self._shut(what, exc)
            raise self._unavailable() from exc
        if self.failures:
            log.info("slurm reachable again", call=what, after_rounds=self.failures)
        self.failures = 0
        return result

    def _unavailable(self) -> ExecutorUnavailable:
        """The same words while the outage lasts, so callers can say it once."""
        return ExecutorUnavailable(
            f"Slurm unreachable, waiting before the next try (last error: {self.last_error})"
        )

    def _pause(self, seconds: float) -> None:
        self.stop.wait(seconds)  # a shutdown ends the wait at once

    def _shut(self, what: str, exc: ExecutorUnavailable) -> None:
        self.failures += 1
        pause = min(self.max_wait, self.first_wait * 2**self.failures)
        self.shut_until = self.clock() + pause
        self.last_error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        log.warning(
            "slurm unreachable",
            call=what,
            rounds=self.failures,
            pause_seconds=round(pause, 1),
            error=self.last_error,
        )
