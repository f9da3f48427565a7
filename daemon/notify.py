"""The systemd notify protocol (sd_notify): READY, STATUS, WATCHDOG and STOPPING datagrams.

Without NOTIFY_SOCKET (not started by systemd with Type=notify) every call does nothing.
"""

from __future__ import annotations

import os
import socket


class Notifier:
    def __init__(self, address: str | None) -> None:
        self.address = address
        if address and address.startswith("@"):
            self.address = "\0" + address[1:]  # abstract namespace socket

    @classmethod
    def from_environment(cls, environ: dict[str, str] | None = None) -> Notifier:
        env = os.environ if environ is None else environ
        return cls(env.get("NOTIFY_SOCKET"))

    @property
    def enabled(self) -> bool:
        return bool(self.address)

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
