"""The test share of scripts/netshare, as the share tests drive it."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
NETSHARE = REPO / "scripts" / "netshare"
SHARE_DIR = Path(os.environ.get("WATCHD_SHARE_DIR", "/var/lib/watchd-netshare"))


def netshare(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(NETSHARE), *args], capture_output=True, text=True, timeout=300)


@dataclass(frozen=True)
class Share:
    server: Path  # the server's folder: what an instrument PC writes to
    mount: Path  # the same folder through the network filesystem: what the daemon watches

    def outage(self) -> None:
        done = netshare("outage")
        assert done.returncode == 0, done.stderr

    def back(self) -> None:
        done = netshare("back")
        assert done.returncode == 0, done.stderr
