"""The gate in front of the Slurm controller: bounded retries, a pause that grows, and both
ending at once on shutdown."""

from __future__ import annotations

import threading
import time

import pytest

from daemon.contract.errors import ExecutorUnavailable
from daemon.executors.gate import Gate


class Controller:
    """Stands in for Slurm's controller: down for the first ``down`` calls, then answers."""

    def __init__(self, down: int) -> None:
        self.down = down
        self.calls = 0

    def ask(self) -> str:
        self.calls += 1
        if self.calls <= self.down:
            raise ExecutorUnavailable("Unable to contact slurm controller (connect failure)")
        return "answer"


class SlowController(Controller):
    """A controller that is gone: each try waits for the connection to fail."""

    def ask(self) -> str:
        time.sleep(0.2)
        return super().ask()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_passing_hiccup_is_retried_within_the_call() -> None:
    controller = Controller(down=1)
    gate = Gate(attempts=3, first_wait=0.01, max_wait=0.05, stop=threading.Event())
    assert gate.call("squeue", controller.ask) == "answer"
    assert controller.calls == 2 and gate.failures == 0


def test_after_every_try_failed_the_gate_stays_shut_and_calls_fail_without_asking() -> None:
    controller, clock = Controller(down=2), Clock()
    gate = Gate(attempts=2, first_wait=0.01, max_wait=0.04, stop=threading.Event(), clock=clock)
    with pytest.raises(ExecutorUnavailable):
        gate.call("sbatch", controller.ask)
    assert controller.calls == 2 and not gate.open
    assert gate.shut_until - clock.now == pytest.approx(0.02)
    with pytest.raises(
        ExecutorUnavailable, match=r"waiting before the next try \(last error: Unable to"
    ):
        gate.call("sbatch", controller.ask)
    assert controller.calls == 2  # shut: the controller is not asked at all
    clock.now = gate.shut_until
    assert gate.call("sbatch", controller.ask) == "answer" and gate.failures == 0


def test_the_pause_grows_between_rounds() -> None:
    controller, clock = Controller(down=100), Clock()
    gate = Gate(attempts=1, first_wait=1.0, max_wait=8.0, stop=threading.Event(), clock=clock)
    pauses = []
    for _ in range(5):
        clock.now = gate.shut_until
        with pytest.raises(ExecutorUnavailable):
            gate.call("squeue", controller.ask)
        pauses.append(gate.shut_until - clock.now)
    assert pauses == [2.0, 4.0, 8.0, 8.0, 8.0]


def test_a_shutdown_ends_the_retries_and_their_waits_at_once() -> None:
    stop = threading.Event()
    controller = Controller(down=100)
    gate = Gate(attempts=10, first_wait=5.0, max_wait=60.0, stop=stop)
    threading.Timer(0.2, stop.set).start()
    started = time.monotonic()
    with pytest.raises(ExecutorUnavailable):
        gate.call("sbatch", controller.ask)
    assert time.monotonic() - started < 2.0
    assert controller.calls <= 2


def test_tries_that_fail_slowly_are_not_repeated_past_the_calls_budget() -> None:
    controller = SlowController(down=100)
    gate = Gate(attempts=10, first_wait=0.01, max_wait=0.05, stop=threading.Event(), budget=0.3)
    with pytest.raises(ExecutorUnavailable):
        gate.call("squeue", controller.ask)
    assert controller.calls == 2
