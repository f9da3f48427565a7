"""Fixtures for the share tests: the real network filesystem of scripts/netshare (an sshfs
mount of a folder served by an sshd of the project's own), a drop root on it, and a way to
write on the server side, as an instrument PC writes to the share (no inotify event reaches
the mount, as with NFS).

``scripts/test`` starts the share before pytest; run on their own, these fixtures start it
(and stop it at the end). They skip only where it cannot run: not root, or no apt-get.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sharing import SHARE_DIR, Share, netshare


@pytest.fixture(scope="session")
def share() -> Iterator[Share]:
    if os.geteuid() != 0:
        pytest.skip("the test share needs root (scripts/netshare installs sshfs and mounts)")
    if shutil.which("apt-get") is None and shutil.which("sshfs") is None:
        pytest.skip("no apt-get to install sshfs, and sshfs is not installed")
    was_up = netshare("status").returncode == 0
    started = netshare("start")
    assert started.returncode == 0, started.stderr
    yield Share(SHARE_DIR / "server", SHARE_DIR / "mount")
    if not was_up:
        netshare("stop")


@pytest.fixture
def share_root(share: Share) -> Iterator[tuple[Path, Path]]:
    """A drop root of this test's own on the share: (server side, through the mount)."""
    name = f"drop {uuid.uuid4().hex[:8]} 'q'"
    server = share.server / name
    server.mkdir()
    yield server, share.mount / name
    if netshare("status").returncode != 0:
        share.back()
    shutil.rmtree(server, ignore_errors=True)


@pytest.fixture
def drop_root(share_root: tuple[Path, Path]) -> Path:
    """The daemon's drop root, in these tests: the one on the share, through the mount."""
    return share_root[1]
