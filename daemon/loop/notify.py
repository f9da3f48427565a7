"""The systemd notify protocol (sd_notify): READY, STATUS, WATCHDOG and STOPPING datagrams.

Without NOTIFY_SOCKET (not started by systemd with Type=notify) every call does nothing.
systemd's variables are read once, at the edge (the CLI), by :meth:`Notifier.from_environment`;
they are not passed on to jobs (see :data:`SYSTEMD_VARIABLES`).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

# What systemd hands to the daemon alone; a job that inherited them could ping or notify for it.
SYSTEMD_VARIABLES = frozenset({"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"})


class Notifier:
    """Sends notifications to systemd; ``watchdog_seconds`` is WatchdogSec= (None: no
    watchdog), and the daemon must ping at least every half of it."""

    def __init__(self, address: str | None, watchdog_seconds: float | None = None) -> None:
        self.address = address
        if address and address.startswith("@"):
            self.address = "\0" + address[1:]  # abstract namespace socket
        self.watchdog_seconds = watchdog_seconds

    @classmethod
    def from_environment(cls, environ: Mapping[str, str], pid: int | None = None) -> Notifier:
        pid = os.getpid() if pid is None else pid
        return cls(environ.get("NOTIFY_SOCKET"), watchdog_seconds(environ, pid))

    @property
    def enabled(self) -> bool:
        return bool(self.address)

    @property
    def ping_seconds(self) -> float | None:
        """How often to send WATCHDOG=1: half the watchdog period, as sd_watchdog_enabled(3)
        advises; None without a watchdog."""
        return None if self.watchdog_seconds is None else self.watchdog_seconds / 2

    def send(self, *fields: str) -> bool:
        """Send ``KEY=VALUE`` lines in one datagram; False if not under systemd or it failed."""
        if not self.address:
            return False
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.connect(self.address)
                sock.sendall("\n".join(fields).encode())
        except OSError:
            return False
        return True

    def ready(self, status: str) -> bool:
        return self.send("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def status(self, status: str) -> bool:
        return self.send(f"STATUS={status}")

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def stopping(self, status: str) -> bool:
        return self.send("STOPPING=1", f"STATUS={status}")


def watchdog_seconds(environ: Mapping[str, str], pid: int) -> float | None:
    """WatchdogSec= from WATCHDOG_USEC, or None when there is none or it is meant for another
    process (WATCHDOG_PID names someone else, as after a fork)."""
    owner = environ.get("WATCHDOG_PID")
    if owner and owner.strip() != str(pid):
        return None
    try:
        usec = int(environ.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    return usec / 1_000_000 if usec > 0 else None
