"""Replay scenarios on a real network mount (sshfs, scripts/netshare: an sshd of the project's
own on 127.0.0.1 serves a folder, mounted with NFS-like caching): the batch is written on the
server side, as an instrument PC writes to the share, so no inotify event reaches the daemon,
which watches the mount with ``observer = "auto"`` (it polls there) and writes its results
through it. ``scripts/test`` starts the share before pytest; run on their own, these tests
start it (and stop it at the end). They skip only where it cannot run: not root, or no apt-get.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

# At import, while "conftest" is this folder's (see test_badinput.py).
from conftest import write_config
from replay import Replay, at, copy_slowly, write_atomically
from test_cli import cli
from test_crash import wait_for
from test_permissions import as_unprivileged_service, owned_by_expert, states_of

from daemon.contract.heldfolder import HeldFolder
from daemon.core.manifest import MANIFEST_NAME, STATUS_NAME
from daemon.core.records import Batch
from daemon.core.states import BatchState, JobState
from daemon.site.config import Config
from daemon.site.mounts import filesystem_type

SHARE_TIMING = {"settle_seconds": 0.5, "timeout_seconds": 60, "check_seconds": 0.2}
# Quiet for longer than the mount caches a listing (scripts/netshare: 3 s) before a scenario
# counts as over: a folder written on the server side shows through the mount only then.
QUIET = 7.0


REPO = Path(__file__).resolve().parents[2]
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
def share_config(
    tmp_path: Path, share_root: tuple[Path, Path], registry: Path
) -> Callable[..., Config]:
    """The daemon's configuration: its drop root on the mount, ``observer = "auto"``."""
    return lambda **intake: write_config(
        tmp_path, share_root[1], registry,
        roots={"observer": "auto", "poll_seconds": 0.5}, intake={**SHARE_TIMING, **intake},
    )  # fmt: skip


def only_batch(replay: Replay) -> Batch:
    (batch,) = replay.service.store.batches()
    return batch


def without_manifest(source: Path, where: Path) -> tuple[Path, bytes]:
    shutil.copytree(source, where)
    manifest = (where / MANIFEST_NAME).read_bytes()
    (where / MANIFEST_NAME).unlink()
    return where, manifest


def test_a_clean_drop_on_the_share_is_found_by_polling_and_done(
    share_config: Callable[..., Config],
    share_root: tuple[Path, Path],
    staged: Callable[..., Path],
) -> None:
    server, mount = share_root
    assert filesystem_type(mount) == "fuse.sshfs"
    config = share_config()
    with Replay(config) as replay:
        assert replay.service.watcher.modes[mount].value == "polling"
        replay.run(copy_slowly(staged(count=4), server / "plate 1", 0.0, 0.01), timeout=180,
                   quiet_seconds=QUIET)  # fmt: skip
        batch = only_batch(replay)
    assert batch.state is BatchState.DONE
    assert len(list((Path(batch.run_dir) / "masks").rglob("*.png"))) == 4


def test_a_slow_copy_with_the_manifest_first_waits_then_is_done(
    share_config: Callable[..., Config],
    share_root: tuple[Path, Path],
    staged: Callable[..., Path],
    tmp_path: Path,
) -> None:
    server, _ = share_root
    source, manifest = without_manifest(staged(count=6), tmp_path / "images only")
    steps = [at(0.0, "mkdir", lambda: (server / "plate 2").mkdir())]
    steps += [write_atomically(server / "plate 2" / MANIFEST_NAME, manifest, 0.1)]
    steps += copy_slowly(source, server / "plate 2", 1.0, 0.4)[1:]
    with Replay(share_config()) as replay:
        replay.run(steps, timeout=180, quiet_seconds=QUIET)
        batch = only_batch(replay)
    assert batch.state is BatchState.DONE, batch.problems
    last_image = max(p.stat().st_mtime for p in (server / "plate 2").rglob("*.png"))
    assert batch.created_at < last_image, "taken in while its images were still arriving"


def test_a_file_short_past_the_timeout_fails_naming_it(
    share_config: Callable[..., Config],
    share_root: tuple[Path, Path],
    staged: Callable[..., Path],
) -> None:
    server, mount = share_root
    source = staged(count=2)
    folder = server / "plate 3"
    shutil.copytree(source, folder)
    short = sorted((folder / "images").glob("*.png"))[0]
    short.write_bytes(short.read_bytes()[:10])
    with Replay(share_config(timeout_seconds=3)) as replay:
        replay.run(timeout=120, quiet_seconds=QUIET)
        batch = only_batch(replay)
    assert batch.state is BatchState.FAILED
    assert batch.reason.startswith("inputs incomplete after 3 s")
    assert any(short.name in p.message and "expected" in p.message for p in batch.problems)
    status = (mount / "plate 3" / STATUS_NAME).read_text()
    assert "failed" in status and short.name in status


def test_the_share_lost_mid_run_and_back_loses_nothing_and_does_nothing_twice(
    share: Share,
    share_config: Callable[..., Config],
    share_root: tuple[Path, Path],
    staged: Callable[..., Path],
) -> None:
    server, _ = share_root
    steps = copy_slowly(staged(count=8), server / "plate 4", 0.0, 0.01)
    steps += [at(1.5, "share lost", share.outage), at(5.0, "share back", share.back)]
    with Replay(share_config()) as replay:
        replay.run(steps, timeout=240, quiet_seconds=QUIET)
        batch = only_batch(replay)
        jobs = replay.service.store.jobs([batch.id])
    assert batch.state is BatchState.DONE, (batch.reason, batch.problems)
    assert all(j.state is JobState.SUCCEEDED for j in jobs)
    masks = sorted(p.name for p in (Path(batch.run_dir) / "masks").rglob("*.png"))
    assert len(masks) == 8 == len(set(masks))


def test_a_folder_the_service_cannot_read_on_the_share_is_reported_then_taken_in(
    share_config: Callable[..., Config],
    share_root: tuple[Path, Path],
    staged: Callable[..., Path],
    tmp_path: Path,
) -> None:
    """As tests/replay/test_permissions.py, on the mount: the server's mode bits hold for the
    service (the mount has default_permissions), and no event reaches it when they change."""
    server, _ = share_root
    config = share_config(retry_unreadable_seconds=1.0)
    staging = server / ".staging"
    shutil.copytree(staged(count=2), staging)
    owned_by_expert(staging)
    daemon = as_unprivileged_service(config, tmp_path / "daemon.log")
    try:
        wait_for(lambda store: store.heartbeat() is not None, config, 60)
        staging.rename(server / "plate 5")
        wait_for(lambda store: states_of("plate 5")(store) == [BatchState.FAILED], config, 60)
        status = cli("watchctl", "status", "--config", str(config.source)).stdout
        assert "unreadable by watchd" in status and "plate 5" in status
        subprocess.run(["chmod", "-R", "o+rwX", str(server / "plate 5")], check=True)
        done = [BatchState.FAILED, BatchState.DONE]
        wait_for(lambda store: states_of("plate 5")(store) == done, config, 120)
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=60)


def test_a_held_folders_entries_on_the_share_say_what_they_are_once_it_is_closed(
    share: Share,
) -> None:
    """sshfs lists no entry types when it answers from its cache (as some NFS servers do
    not at all): an entry learns what it is by an lstat through the folder's descriptor. The report listed its shard tables, closed the
    folder, then asked each entry whether it was a file, and failed with EBADF on every
    batch whose spool lay on the share (found by the fuzz campaign, run there)."""
    folder = share.mount / f"entries-{uuid.uuid4().hex}"
    try:
        (folder / "parts").mkdir(parents=True)
        (folder / "table-0000.csv").write_text("path\n")
        (folder / "dangling").symlink_to("nowhere")
        with HeldFolder.open(folder) as held:
            held.entries()  # the next listing, within the mount's cache time, has no types
            entries = held.entries()
        kinds = {
            e.name: (e.is_file(follow_symlinks=False), e.is_dir(follow_symlinks=False),
                     e.is_symlink())
            for e in entries
        }  # fmt: skip
        assert kinds == {"parts": (False, True, False), "table-0000.csv": (True, False, False),
                         "dangling": (False, False, True)}  # fmt: skip
    finally:
        shutil.rmtree(folder, ignore_errors=True)
