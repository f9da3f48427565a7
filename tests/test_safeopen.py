"""Opening a batch's inputs: only regular files inside the batch folder, whatever was swapped in
after readiness looked (a link out of the folder, a folder above swapped for a link, a FIFO);
refused without reading anything and without blocking."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest

from daemon.contract.heldfolder import HeldFolder
from daemon.contract.safeopen import Presence, RefusedInput, _checked, open_input, real_folder
from daemon.loop.inputs import look

DATA = b"\x89PNG pretend image bytes"


@pytest.fixture
def batch(drop_root: Path) -> Path:
    folder = drop_root / "plate ä"
    (folder / "images").mkdir(parents=True)
    (folder / "images" / "a.png").write_bytes(DATA)
    return folder


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A file outside every batch folder, last read long before it was last changed: a read
    of it would move its access time (relatime)."""
    secret = tmp_path / "secret" / "a.png"
    secret.parent.mkdir()
    secret.write_bytes(DATA)
    _make_read_visible(secret)
    return secret


def _make_read_visible(path: Path) -> None:
    mtime = path.stat().st_mtime_ns
    os.utime(path, ns=(mtime - 10**12, mtime))


def _read_is_recorded(tmp_path: Path) -> bool:
    """Whether this filesystem records reads in the access time (not mounted noatime)."""
    probe = tmp_path / "probe"
    probe.write_bytes(b"x")
    _make_read_visible(probe)
    before = probe.stat().st_atime_ns
    probe.read_bytes()
    return probe.stat().st_atime_ns != before


def test_a_regular_file_and_a_link_that_stays_inside_are_opened(batch: Path) -> None:
    os.symlink("a.png", batch / "images" / "alias.png")
    os.symlink("images", batch / "pictures")
    for relative in ("images/a.png", "images/alias.png", "pictures/a.png"):
        with open_input(batch, relative) as handle:
            assert handle.read() == DATA


def test_a_file_swapped_for_a_link_out_of_the_folder_is_refused_unread(
    batch: Path, outside: Path, tmp_path: Path
) -> None:
    (batch / "images" / "a.png").unlink()
    os.symlink(outside, batch / "images" / "a.png")
    atime = outside.stat().st_atime_ns
    with pytest.raises(RefusedInput) as caught:
        open_input(batch, "images/a.png")
    assert caught.value.located.presence is Presence.OUTSIDE
    assert str(caught.value) == f"'images/a.png' leads outside the batch folder (to {outside})"
    if not _read_is_recorded(tmp_path):
        pytest.skip("this filesystem does not record reads (noatime)")
    assert outside.stat().st_atime_ns == atime


def test_a_folder_above_swapped_for_a_link_out_of_the_folder_is_refused(
    batch: Path, outside: Path
) -> None:
    (batch / "images" / "a.png").unlink()
    (batch / "images").rmdir()
    os.symlink(outside.parent, batch / "images")
    with pytest.raises(RefusedInput) as caught:
        open_input(batch, "images/a.png")
    assert caught.value.reason == f"leads outside the batch folder (to {outside})"


@pytest.mark.timeout(20)
def test_a_fifo_swapped_in_is_refused_at_once_without_waiting_for_a_writer(batch: Path) -> None:
    (batch / "images" / "a.png").unlink()
    os.mkfifo(batch / "images" / "a.png")
    started = time.monotonic()
    with pytest.raises(RefusedInput) as caught:
        open_input(batch, "images/a.png")
    assert caught.value.reason == "is a FIFO, not a regular file"
    assert time.monotonic() - started < 10


@pytest.mark.timeout(20)
def test_what_was_opened_is_checked_again_after_opening(batch: Path) -> None:
    """Between the look at the name and the open, the name may change: the opened file itself
    must be a regular file (here a FIFO, opened without waiting), else it is closed unread."""
    os.mkfifo(batch / "pipe.png")
    fd = os.open(batch / "pipe.png", os.O_RDONLY | os.O_NONBLOCK)
    with pytest.raises(RefusedInput) as caught:
        _checked(fd, "pipe.png")
    assert caught.value.reason == "is a FIFO, not a regular file"
    with pytest.raises(OSError):
        os.fstat(fd)  # closed by the refusal


def test_missing_inputs_are_file_not_found(batch: Path) -> None:
    with pytest.raises(FileNotFoundError):
        open_input(batch, "images/gone.png")
    os.symlink("nowhere.png", batch / "images" / "dangling.png")
    with pytest.raises(FileNotFoundError):
        open_input(batch, "images/dangling.png")


def test_readiness_looks_at_inputs_by_the_same_rule(batch: Path, outside: Path) -> None:
    os.symlink(outside, batch / "images" / "out.png")
    os.mkfifo(batch / "images" / "pipe.png")
    folder = real_folder(batch)
    seen = {rel: look(folder, rel) for rel in ("images/a.png", "images/out.png", "images/pipe.png")}
    assert seen["images/a.png"].presence is Presence.FILE
    assert seen["images/a.png"].size == len(DATA)
    assert (seen["images/out.png"].presence, seen["images/out.png"].detail) == (
        Presence.OUTSIDE,
        str(outside),
    )
    assert (seen["images/pipe.png"].presence, seen["images/pipe.png"].detail) == (
        Presence.SPECIAL,
        "a FIFO",
    )


def test_links_that_stay_inside_are_walked_within_the_folder(batch: Path) -> None:
    """A relative link climbing out of its own folder but not the batch's, and an absolute link
    naming a place inside the batch folder, are legal inputs."""
    (batch / "other").mkdir()
    (batch / "other" / "b.png").write_bytes(b"other")
    os.symlink("../other/b.png", batch / "images" / "up.png")
    os.symlink(batch / "images", batch / "absolute")
    os.symlink(real_folder(batch) + "/other/b.png", batch / "images" / "real.png")
    for relative, expected in [
        ("images/up.png", b"other"),
        ("absolute/a.png", DATA),
        ("images/real.png", b"other"),
        ("images/../other/b.png", b"other"),
    ]:
        with open_input(batch, relative) as handle:
            assert handle.read() == expected


def test_a_link_or_a_name_climbing_above_the_folder_is_refused(
    batch: Path, outside: Path, tmp_path: Path
) -> None:
    depth = len(batch.relative_to(tmp_path).parts) + 1  # up to tmp_path from batch/images
    os.symlink("../" * depth + "secret/a.png", batch / "images" / "escape.png")
    atime = outside.stat().st_atime_ns
    for relative in ("images/escape.png", "../secret/a.png"):
        with pytest.raises(RefusedInput) as caught:
            open_input(batch, relative)
        assert caught.value.located.presence is Presence.OUTSIDE
    with pytest.raises(RefusedInput) as caught:
        open_input(batch, "images/escape.png")
    assert caught.value.reason == f"leads outside the batch folder (to {outside})"
    if _read_is_recorded(tmp_path):
        assert outside.stat().st_atime_ns == atime


def test_a_loop_of_links_ends_after_a_bounded_number_of_hops(batch: Path) -> None:
    os.symlink("b.png", batch / "images" / "c.png")
    os.symlink("c.png", batch / "images" / "b.png")
    with pytest.raises(OSError) as caught:
        open_input(batch, "images/b.png")
    assert caught.value.errno == errno.ELOOP


def test_a_held_folder_is_read_even_after_its_name_was_given_to_another(
    batch: Path, tmp_path: Path
) -> None:
    """A job holds its batch folder: once moved away and replaced by another folder of the same
    name, every input still comes from the folder held, never from the new one."""
    with HeldFolder.open(batch) as held:
        os.rename(batch, tmp_path / "moved away")
        (batch / "images").mkdir(parents=True)
        (batch / "images" / "a.png").write_bytes(b"the new folder's image")
        with open_input(held, "images/a.png") as handle:
            assert handle.read() == DATA
