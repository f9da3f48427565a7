"""The systemd notify protocol, spoken by a real ``watchd run`` to a real AF_UNIX datagram
socket given as NOTIFY_SOCKET, as systemd would: READY=1 once start-up is done, STATUS= lines
with the queue, WATCHDOG=1 at the pace WATCHDOG_USEC asks for and only while the main loop
turns, STOPPING=1 on SIGTERM."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomli_w

from daemon.loop.notify import Notifier, watchdog_seconds

WATCHD = Path(sys.executable).with_name("watchd")


@dataclass(frozen=True)
class Datagram:
    at: float  # time.monotonic() when it arrived
    fields: dict[str, str]


class NotifySocket:
    """The listening end of NOTIFY_SOCKET, as systemd holds it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.received: list[Datagram] = []

    def close(self) -> None:
        self.sock.close()

    def wait_for(self, predicate: Callable[[Datagram], bool], timeout: float) -> Datagram:
        """Receive until a datagram matches; every datagram is kept in ``received``."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                break
            lines = data.decode().splitlines()
            got = Datagram(time.monotonic(), dict(line.split("=", 1) for line in lines))
            self.received.append(got)
            if predicate(got):
                return got
        raise AssertionError(f"nothing matched in {timeout} s; got {self.received[-5:]}")

    def collect(self, seconds: float) -> list[Datagram]:
        """Every datagram that arrives in the next ``seconds``."""
        start = len(self.received)
        with contextlib.suppress(AssertionError):  # nothing matches: wait the whole time
            self.wait_for(lambda _: False, seconds)
        return self.received[start:]


def pings(datagrams: list[Datagram]) -> list[float]:
    return [d.at for d in datagrams if d.fields.get("WATCHDOG") == "1"]


@pytest.fixture
def notify_socket() -> Iterator[NotifySocket]:
    with tempfile.TemporaryDirectory(prefix="wn") as short:  # socket paths: at most 107 bytes
        listener = NotifySocket(Path(short) / "notify")
        try:
            yield listener
        finally:
            listener.close()


@pytest.fixture
def daemon_config(tmp_path: Path, drop_root: Path) -> Path:
    """A config for a real daemon: a one-second tick (slower than the watchdog asks for), a
    fast heartbeat, and one batch folder whose manifest is refused at the start-up scan."""
    bad = drop_root / "bad batch"
    bad.mkdir()
    (bad / "manifest.toml").write_text("watchd = 1\nkind = [")
    os.utime(bad / "manifest.toml", (time.time() - 60, time.time() - 60))  # settled long ago
    document = {
        "daemon": {"state_dir": str(tmp_path / "state"), "tick_seconds": 1.0,
                   "heartbeat_seconds": 0.2, "shutdown_grace_seconds": 5, "log_format": "json"},
        "roots": [{"path": str(drop_root), "observer": "polling", "poll_seconds": 0.5}],
        "registry": {"path": str(tmp_path / "registry")},
    }  # fmt: skip
    path = tmp_path / "config.toml"
    path.write_text(tomli_w.dumps(document))
    return path


@pytest.fixture
def start_daemon(tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []

    def start(config: Path, notify: NotifySocket, watchdog_usec: int) -> subprocess.Popen[bytes]:
        env = {**os.environ, "NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": str(watchdog_usec)}
        with open(tmp_path / "daemon.log", "ab") as log:
            proc = subprocess.Popen(
                [str(WATCHD), "run", "--config", str(config)], env=env, stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )  # fmt: skip
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_ready_status_watchdog_at_the_asked_pace_and_stopping_on_sigterm(
    daemon_config: Path,
    notify_socket: NotifySocket,
    start_daemon: Callable[..., subprocess.Popen[bytes]],
) -> None:
    proc = start_daemon(daemon_config, notify_socket, watchdog_usec=1_000_000)
    ready = notify_socket.wait_for(lambda d: d.fields.get("READY") == "1", timeout=60)
    assert ready.fields["MAINPID"] == str(proc.pid)
    # start-up is done before READY: the start-up scan has already refused the bad manifest
    assert ready.fields["STATUS"] == "0 waiting, 0 queued, 0 running, 1 failed, 0 done"

    window = notify_socket.collect(4.0)
    times = pings(window)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    print(f"{len(times)} pings in 4 s, gaps {[round(g, 2) for g in gaps]}")
    # WatchdogSec=1 s: systemd needs a ping within every second; the daemon aims at every 0.5 s
    # although its tick is 1 s, and does not ping at every wake-up either.
    assert 5 <= len(times) <= 12
    assert max(gaps) < 1.0
    statuses = [d.fields["STATUS"] for d in window if "STATUS" in d.fields]
    assert statuses and all(s.endswith("1 failed, 0 done") for s in statuses)

    proc.send_signal(signal.SIGTERM)
    stopping = notify_socket.wait_for(lambda d: d.fields.get("STOPPING") == "1", timeout=30)
    assert "stopping" in stopping.fields["STATUS"]
    assert proc.wait(timeout=30) == 0


def test_a_loop_held_up_stops_pinging_and_pings_again_when_it_moves_on(
    daemon_config: Path,
    notify_socket: NotifySocket,
    start_daemon: Callable[..., subprocess.Popen[bytes]],
) -> None:
    """Another process holds the database's write lock: the loop waits at its next heartbeat,
    so no WATCHDOG=1 goes out (systemd would restart a loop stuck for good); once the lock is
    released the pings resume. The pings come from the loop, not from a thread of their own."""
    proc = start_daemon(daemon_config, notify_socket, watchdog_usec=1_000_000)
    notify_socket.wait_for(lambda d: d.fields.get("READY") == "1", timeout=60)
    notify_socket.wait_for(lambda d: d.fields.get("WATCHDOG") == "1", timeout=5)

    holder = sqlite3.connect(
        daemon_config.parent / "state" / "watchd.sqlite", timeout=30, isolation_level=None
    )
    try:
        holder.execute("BEGIN EXCLUSIVE")
        locked_at = time.monotonic()
        held = notify_socket.collect(4.0)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    late = [t - locked_at for t in pings(held) if t - locked_at > 1.5]
    assert late == []  # at most one ping in flight as the lock was taken, none after
    assert proc.poll() is None

    notify_socket.wait_for(lambda d: d.fields.get("WATCHDOG") == "1", timeout=5)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0


def test_the_watchdog_period_comes_from_watchdog_usec_for_this_process_only() -> None:
    assert watchdog_seconds({"WATCHDOG_USEC": "60000000"}, pid=42) == 60.0
    assert watchdog_seconds({"WATCHDOG_USEC": "60000000", "WATCHDOG_PID": "42"}, pid=42) == 60.0
    assert watchdog_seconds({"WATCHDOG_USEC": "60000000", "WATCHDOG_PID": "7"}, pid=42) is None
    assert watchdog_seconds({"WATCHDOG_USEC": "0"}, pid=42) is None
    assert watchdog_seconds({"WATCHDOG_USEC": "soon"}, pid=42) is None
    assert watchdog_seconds({}, pid=42) is None
    notifier = Notifier.from_environment({"NOTIFY_SOCKET": "@x", "WATCHDOG_USEC": "2000000"}, 1)
    assert notifier.ping_seconds == 1.0
    assert Notifier.from_environment({}, 1).ping_seconds is None
