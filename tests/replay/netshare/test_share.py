"""Replay scenarios on a real network mount (sshfs, scripts/netshare): the batch is written on
the server side, so no inotify event reaches the daemon, which watches the mount with
``observer = "auto"`` (it polls there) and writes its results through it."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from replay import Replay, at, copy_slowly, write_atomically
from sharing import Share

from daemon.config import Config
from daemon.manifest import MANIFEST_NAME, STATUS_NAME
from daemon.mounts import filesystem_type
from daemon.records import Batch
from daemon.states import BatchState, JobState

SHARE_TIMING = {"settle_seconds": 0.5, "timeout_seconds": 60, "check_seconds": 0.2}


@pytest.fixture
def share_config(config_for: Callable[..., Config]) -> Callable[..., Config]:
    """The daemon's configuration for the share: ``observer = "auto"``, polled every 0.5 s."""
    return lambda **intake: config_for(
        roots={"observer": "auto", "poll_seconds": 0.5}, intake={**SHARE_TIMING, **intake}
    )


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
        replay.run(copy_slowly(staged(count=4), server / "plate 1", 0.0, 0.01), timeout=180)
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
        replay.run(steps, timeout=180)
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
        replay.run(timeout=120)
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
    server, mount = share_root
    steps = copy_slowly(staged(count=8), server / "plate 4", 0.0, 0.01)
    steps += [at(1.5, "share lost", share.outage), at(5.0, "share back", share.back)]
    with Replay(share_config()) as replay:
        replay.run(steps, timeout=240)
        batch = only_batch(replay)
        jobs = replay.service.store.jobs([batch.id])
    assert batch.state is BatchState.DONE, (batch.reason, batch.problems)
    assert all(j.state is JobState.SUCCEEDED for j in jobs)
    masks = sorted(p.name for p in (Path(batch.run_dir) / "masks").rglob("*.png"))
    assert len(masks) == 8 == len(set(masks))
