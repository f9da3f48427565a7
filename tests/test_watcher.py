"""The watcher sees manifests appear, in both modes, and watches nothing deeper than the batch
folders unless asked: then (inotify) the folders a waiting batch's inputs land in, whose files
mark the batch for the service's next tick without an event on its queue."""

from __future__ import annotations

import contextlib
import os
import queue
import time
from pathlib import Path

import pytest
from watchdog.utils.dirsnapshot import DirectorySnapshot

from daemon.site.config import ObserverMode, RootSection
from daemon.site.mounts import choose_mode, mount_of, parse_mounts
from daemon.watcher import FolderTouched, ManifestListing, RootLost, Watcher, scan_root


def inotify_watches() -> int:
    """How many inotify watches this process holds, from /proc (black-box)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != "anon_inode:inotify":
                continue
            count += Path(f"/proc/self/fdinfo/{fd}").read_text().count("inotify wd:")
        except OSError:
            continue
    return count


def batch_with_images(root: Path, name: str, images: int = 50) -> Path:
    folder = root / name
    (folder / "images" / "deeper").mkdir(parents=True)
    for i in range(images):
        (folder / "images" / f"{i}.png").write_bytes(b"x")
    return folder


def events_within(events: queue.Queue, seconds: float) -> list:
    deadline, found = time.monotonic() + seconds, []
    while time.monotonic() < deadline:
        with contextlib.suppress(queue.Empty):
            found.append(events.get(timeout=0.05))
    return found


def test_inotify_watches_the_root_and_each_batch_folder_only(drop_root: Path) -> None:
    for name in ("a", "b ä", "c 'q'"):
        batch_with_images(drop_root, name)
    before = inotify_watches()
    events: queue.Queue = queue.Queue()
    watcher = Watcher([RootSection(path=drop_root, observer=ObserverMode.INOTIFY)], events)
    watcher.start()
    try:
        assert inotify_watches() - before == 1 + 3
        batch_with_images(drop_root, "new one")
        (drop_root / "new one" / "manifest.toml").write_text("x")
        (drop_root / "a" / "images" / "manifest.toml").write_text("deeper: not a batch")
        seen = {e.folder for e in events_within(events, 0.5) if isinstance(e, FolderTouched)}
        assert seen == {"new one"}
        assert inotify_watches() - before == 1 + 4
    finally:
        watcher.stop()
    assert inotify_watches() == before


def test_the_folders_of_ended_batches_are_not_watched_and_can_be_let_go_and_taken_back(
    drop_root: Path,
) -> None:
    for name in ("ended", "running"):
        batch_with_images(drop_root, name, images=1)
    before = inotify_watches()
    events: queue.Queue = queue.Queue()
    root = RootSection(path=drop_root, observer=ObserverMode.INOTIFY)
    watcher = Watcher([root], events, ended=lambda path: {"ended"})
    watcher.start()
    try:
        assert watcher.watched_folders(drop_root) == {"running"}
        assert inotify_watches() - before == 1 + 1
        (drop_root / "ended" / "manifest.toml").write_text("x")
        assert events_within(events, 0.3) == []  # left to the catch-up scan
        watcher.release(drop_root, "running")
        watcher.follow(drop_root, "ended")
        watcher.follow(drop_root, "ended")  # twice is once
        watcher.follow(drop_root, "never dropped")  # nothing to watch: no error
        assert watcher.watched_folders(drop_root) == {"ended"}
        assert inotify_watches() - before == 1 + 1
        (drop_root / "running" / "manifest.toml").write_text("x")
        (drop_root / "ended" / "manifest.toml").write_text("y")
        seen = [e.folder for e in events_within(events, 0.3) if isinstance(e, FolderTouched)]
        assert seen == ["ended"]
    finally:
        watcher.stop()
    assert inotify_watches() == before


def test_inputs_landing_in_the_watched_folders_of_a_batch_mark_it_without_queueing_events(
    drop_root: Path,
) -> None:
    waiting = batch_with_images(drop_root, "waiting", images=1)
    (waiting / "plate 2").mkdir()
    batch_with_images(drop_root, "other", images=1)
    before = inotify_watches()
    events: queue.Queue = queue.Queue()
    watcher = Watcher([RootSection(path=drop_root, observer=ObserverMode.INOTIFY)], events)
    watcher.start()
    try:
        assert inotify_watches() - before == 1 + 2
        watcher.watch_inputs(drop_root, "waiting", {"images", "plate 2", "not yet"})
        watcher.watch_inputs(drop_root, "waiting", {"images"})  # twice is once
        assert inotify_watches() - before == 1 + 2 + 2
        (waiting / "images" / ".part").write_bytes(b"x")
        os.rename(waiting / "images" / ".part", waiting / "images" / "new.png")
        (waiting / "plate 2" / "b.tif").write_bytes(b"x")
        (drop_root / "other" / "images" / "x.png").write_bytes(b"x")  # not watched: not asked
        (waiting / "images" / "deeper" / "y.png").write_bytes(b"x")  # below: not watched
        time.sleep(0.3)
        assert events_within(events, 0.2) == []  # no event: a mark the service takes
        assert watcher.arrived(drop_root) == {"waiting"}
        assert watcher.arrived(drop_root) == set()  # taken
        (waiting / "watchd-status.txt").write_text("the daemon's own writes")
        (waiting / "results").mkdir()
        time.sleep(0.3)
        assert watcher.arrived(drop_root) == set()
        (waiting / "a.png").write_bytes(b"x")  # listed in the batch folder itself
        time.sleep(0.3)
        assert watcher.arrived(drop_root) == {"waiting"}
        watcher.release(drop_root, "waiting")
        assert inotify_watches() - before == 1 + 1
        (waiting / "images" / "more.png").write_bytes(b"x")
        time.sleep(0.3)
        assert watcher.arrived(drop_root) == set()
    finally:
        watcher.stop()
    assert inotify_watches() == before


def test_a_polled_root_leaves_the_folders_of_ended_batches_to_the_catch_up_scan(
    drop_root: Path,
) -> None:
    """A poll costs stats per folder under way, not per folder ever dropped."""
    for name in ("ended", "running"):
        batch_with_images(drop_root, name, images=1)
    listing = ManifestListing(drop_root, {"ended"})
    snapshot = DirectorySnapshot(str(drop_root), recursive=True, listdir=listing)
    assert sorted(os.path.relpath(p, drop_root) for p in snapshot.paths) == [".", "running"]
    events: queue.Queue = queue.Queue()
    root = RootSection(path=drop_root, observer=ObserverMode.POLLING, poll_seconds=0.05)
    watcher = Watcher([root], events, ended=lambda path: {"ended"})
    watcher.start()
    try:
        events_within(events, 0.3)
        (drop_root / "ended" / "manifest.toml").write_text("x")
        (drop_root / "running" / "manifest.toml").write_text("x")
        seen = {e.folder for e in events_within(events, 0.5) if isinstance(e, FolderTouched)}
        assert seen == {"running"}
        watcher.release(drop_root, "running")
        watcher.follow(drop_root, "ended")
        events_within(events, 0.3)  # the listing changed: the folders come and go once
        (drop_root / "running" / "manifest.toml").write_text("yy")
        (drop_root / "ended" / "manifest.toml").write_text("yy")
        seen = {e.folder for e in events_within(events, 0.5) if isinstance(e, FolderTouched)}
        assert seen == {"ended"}
        assert sorted(f.folder for f in scan_root(drop_root)) == ["ended", "running"]
    finally:
        watcher.stop()


@pytest.mark.parametrize("mode", [ObserverMode.INOTIFY, ObserverMode.POLLING])
def test_a_manifest_renamed_in_or_a_folder_moved_in_whole_is_seen(
    mode: ObserverMode, drop_root: Path, tmp_path: Path
) -> None:
    events: queue.Queue = queue.Queue()
    watcher = Watcher([RootSection(path=drop_root, observer=mode, poll_seconds=0.1)], events)
    watcher.start()
    try:
        folder = batch_with_images(drop_root, "renamed")
        (folder / ".m.partial").write_text("x")
        os.replace(folder / ".m.partial", folder / "manifest.toml")
        outside = batch_with_images(tmp_path, "moved whole")
        (outside / "manifest.toml").write_text("x")
        os.rename(outside, drop_root / "moved whole")
        seen = {e.folder for e in events_within(events, 1.0) if isinstance(e, FolderTouched)}
    finally:
        watcher.stop()
    assert {"renamed", "moved whole"} <= seen


def test_a_folder_moved_away_and_replaced_under_its_name_is_watched_anew(
    drop_root: Path, tmp_path: Path
) -> None:
    """inotify watches an inode: the watch on the old folder is dropped for one on the new
    folder, whose manifest is then seen at once (not at the catch-up scan)."""
    batch_with_images(drop_root, "plate", images=1)
    before = inotify_watches()
    events: queue.Queue = queue.Queue()
    watcher = Watcher([RootSection(path=drop_root, observer=ObserverMode.INOTIFY)], events)
    watcher.start()
    try:
        os.rename(drop_root / "plate", tmp_path / "plate moved away")
        batch_with_images(drop_root, "plate", images=1)
        events_within(events, 0.3)
        (drop_root / "plate" / "manifest.toml").write_text("x")
        seen = [e.folder for e in events_within(events, 0.5) if isinstance(e, FolderTouched)]
        assert seen == ["plate"]
        (tmp_path / "plate moved away" / "manifest.toml").write_text("old")
        assert events_within(events, 0.3) == []  # the old folder is no longer watched
        watcher.follow(drop_root, "plate")  # the same folder again: nothing changes
        assert watcher.watched_folders(drop_root) == {"plate"}
        assert inotify_watches() - before == 1 + 1
    finally:
        watcher.stop()
    assert inotify_watches() == before


@pytest.mark.parametrize("mode", [ObserverMode.INOTIFY, ObserverMode.POLLING])
def test_a_root_that_disappears_is_reported_lost(mode: ObserverMode, tmp_path: Path) -> None:
    root = tmp_path / "share"
    root.mkdir()
    events: queue.Queue = queue.Queue()
    watcher = Watcher([RootSection(path=root, observer=mode, poll_seconds=0.1)], events)
    watcher.start()
    try:
        root.rmdir()
        lost = [e for e in events_within(events, 1.0) if isinstance(e, RootLost)]
        assert lost and not watcher.armed(root)
    finally:
        watcher.stop()


def test_the_polling_listing_stops_at_the_manifest(drop_root: Path) -> None:
    folder = batch_with_images(drop_root, "big", images=500)
    (folder / "manifest.toml").write_text("x")
    batch_with_images(drop_root, "no manifest yet")
    snapshot = DirectorySnapshot(str(drop_root), recursive=True, listdir=ManifestListing(drop_root))
    relative = sorted(os.path.relpath(p, drop_root) for p in snapshot.paths)
    assert relative == [".", "big", "big/manifest.toml", "no manifest yet"]


def test_the_catch_up_scan_finds_manifests_without_entering_folders(drop_root: Path) -> None:
    batch_with_images(drop_root, "waiting for manifest")
    (batch_with_images(drop_root, "ready") / "manifest.toml").write_text("x")
    (drop_root / "stray file.txt").write_text("not a batch")
    found = list(scan_root(drop_root))
    assert [f.folder for f in found] == ["ready"]
    assert found[0].manifest_stat.count(":") == 2


MOUNTS = """\
/dev/vda / ext4 rw,relatime 0 0
gpfs01 /lsdf gpfs rw 0 0
server:/export /mnt/nfs\\040share nfs4 rw 0 0
sshfs#x /mnt/remote fuse.sshfs rw 0 0
lab:/m /lsdf/Müller\\040lab nfs4 rw 0 0
""".encode()


@pytest.mark.parametrize(
    ("path", "fstype", "mode"),
    [
        ("/home/user/drop", "ext4", ObserverMode.INOTIFY),
        ("/lsdf/projects/dma", "gpfs", ObserverMode.POLLING),
        ("/mnt/nfs share/drop", "nfs4", ObserverMode.POLLING),
        ("/mnt/remote/x", "fuse.sshfs", ObserverMode.POLLING),
        ("/lsdfx", "ext4", ObserverMode.INOTIFY),
        ("/lsdf/Müller lab/drop", "nfs4", ObserverMode.POLLING),
    ],
)
def test_auto_polls_on_network_filesystems(path: str, fstype: str, mode: ObserverMode) -> None:
    mount = mount_of(path, parse_mounts(MOUNTS))
    assert mount is not None and mount.fstype == fstype
    assert choose_mode(ObserverMode.AUTO, mount.fstype) is mode


def test_an_explicit_mode_wins_and_unknown_filesystems_are_polled() -> None:
    assert choose_mode(ObserverMode.INOTIFY, "nfs4") is ObserverMode.INOTIFY
    assert choose_mode(ObserverMode.AUTO, None) is ObserverMode.POLLING


LIMIT = Path("/proc/sys/fs/inotify/max_user_watches")


@pytest.mark.skipif(os.geteuid() != 0, reason="lowering the inotify limit needs root")
def test_a_root_beyond_the_inotify_limit_is_polled_instead_and_nothing_is_left_registered(
    drop_root: Path,
) -> None:
    for i in range(30):
        (drop_root / f"batch {i}").mkdir()
    before = inotify_watches()
    saved = LIMIT.read_text()
    events: queue.Queue = queue.Queue()
    watcher = Watcher(
        [RootSection(path=drop_root, observer=ObserverMode.INOTIFY, poll_seconds=0.1)], events
    )
    try:
        LIMIT.write_text(str(before + 10))  # room for the root and a few folders, not 30
        modes = watcher.start()
    finally:
        LIMIT.write_text(saved)
    try:
        assert modes[drop_root] is ObserverMode.POLLING
        assert inotify_watches() == before  # the half-built inotify watch was taken down
        (drop_root / "batch 3" / "manifest.toml").write_text("x")
        seen = {e.folder for e in events_within(events, 1.0) if isinstance(e, FolderTouched)}
        assert "batch 3" in seen
    finally:
        watcher.stop()
