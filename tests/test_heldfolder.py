"""The one rule for opening under a batch folder: no planted link, FIFO, hard link or swapped
folder is ever followed or opened, on real folders."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from daemon.contract.heldfolder import (
    FolderReplaced,
    HeldFolder,
    UnsafeEntry,
    is_temporary,
    parts_of,
    temporary_name,
)


@pytest.fixture()
def batch(tmp_path: Path) -> Path:
    (tmp_path / "root" / "plate 1").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.txt").write_text("keep me")
    return tmp_path / "root" / "plate 1"


def test_a_write_makes_its_folders_and_appears_whole(batch: Path) -> None:
    with HeldFolder.open(batch) as held:
        held.write_text("results/run/jobs/j1/spec.json", "{}")
    assert (batch / "results/run/jobs/j1/spec.json").read_text() == "{}"
    assert [p.name for p in (batch / "results/run/jobs/j1").iterdir()] == ["spec.json"]


def test_a_link_planted_on_the_way_is_refused_and_nothing_is_written_outside(batch: Path) -> None:
    outside = batch.parent.parent / "outside"
    (batch / "results").symlink_to(outside)
    with HeldFolder.open(batch) as held, pytest.raises(UnsafeEntry, match="symbolic link"):
        held.write_text("results/masks/a.png", "x")
    assert sorted(p.name for p in outside.iterdir()) == ["secret.txt"]


def test_a_link_planted_as_the_file_is_replaced_not_followed(batch: Path) -> None:
    secret = batch.parent.parent / "outside" / "secret.txt"
    (batch / "summary.json").symlink_to(secret)
    with HeldFolder.open(batch) as held:
        held.write_text("summary.json", "new")
    assert secret.read_text() == "keep me"
    assert not (batch / "summary.json").is_symlink()


def test_a_folder_planted_as_the_file_is_refused_naming_it_and_left_as_it_was(batch: Path) -> None:
    """Looked for only once the rename onto it failed: the temporary file goes again."""
    (batch / "masks" / "a.png").mkdir(parents=True)
    (batch / "masks" / "a.png" / "inside.txt").write_text("theirs")
    with HeldFolder.open(batch) as held, pytest.raises(UnsafeEntry) as caught:
        held.write_bytes("masks/a.png", b"mask")
    assert "masks/a.png" in str(caught.value) and "is a folder, not a file" in str(caught.value)
    assert caught.value.folder == batch
    assert sorted(p.name for p in (batch / "masks").iterdir()) == ["a.png"]
    assert (batch / "masks" / "a.png" / "inside.txt").read_text() == "theirs"


@pytest.mark.parametrize("planted", ["link", "fifo", "hardlink"])
def test_appending_never_opens_a_planted_link_fifo_or_hard_link(batch: Path, planted: str) -> None:
    secret = batch.parent.parent / "outside" / "secret.txt"
    log = batch / "log.txt"
    {"link": lambda: log.symlink_to(secret), "fifo": lambda: os.mkfifo(log),
     "hardlink": lambda: os.link(secret, log)}[planted]()  # fmt: skip
    with HeldFolder.open(batch) as held, pytest.raises(UnsafeEntry):
        held.open_append("log.txt")  # a FIFO would block here for ever without O_NONBLOCK
    assert secret.read_text() == "keep me"


def test_appending_to_a_regular_log_keeps_what_it_had(batch: Path) -> None:
    with HeldFolder.open(batch) as held:
        for word in (b"one\n", b"two\n"):
            fd = held.open_append("jobs/j/log.txt")
            os.write(fd, word)
            os.close(fd)
    assert (batch / "jobs/j/log.txt").read_bytes() == b"one\ntwo\n"


def test_reading_refuses_a_fifo_without_blocking(batch: Path) -> None:
    os.mkfifo(batch / "log.txt")
    done = threading.Event()

    def read() -> None:
        with HeldFolder.open(batch) as held, pytest.raises(UnsafeEntry, match="FIFO"):
            held.open_read("log.txt")
        done.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(5)
    assert done.is_set()


def test_a_folder_swapped_under_its_name_is_refused(batch: Path) -> None:
    with HeldFolder.batch(batch.parent, batch.name) as held:
        accepted = held.identity()
    batch.rename(batch.parent / "moved away")
    batch.mkdir()
    with pytest.raises(FolderReplaced, match="replaced"):
        HeldFolder.batch(batch.parent, batch.name, accepted)
    with HeldFolder.batch(batch.parent, "moved away", accepted) as held:
        assert held.identity() == accepted


def test_a_batch_folder_that_is_a_link_is_refused(batch: Path) -> None:
    (batch.parent / "alias").symlink_to(batch)
    with pytest.raises(UnsafeEntry, match="symbolic link, not a folder"):
        HeldFolder.batch(batch.parent, "alias")


def test_a_name_of_255_bytes_is_written_through_a_short_temporary(batch: Path) -> None:
    name = "é" * 127 + "x"  # 255 bytes in UTF-8
    with HeldFolder.open(batch) as held:
        held.write_bytes(name, b"mask")
    assert (batch / name).read_bytes() == b"mask"


def test_strays_are_only_the_daemons_own_temporaries(batch: Path) -> None:
    stray = temporary_name()
    inputs = [".tmp-watchd-status.txt.png", ".tmp-input.png", "img.png"]
    for name in [*inputs, f"sub/{stray}"]:
        (batch / name).parent.mkdir(exist_ok=True)
        (batch / name).write_text("data")
    with HeldFolder.open(batch) as held:
        assert held.remove_strays() == [f"sub/{stray}"]
    assert all((batch / name).exists() for name in inputs)
    assert is_temporary(stray) and not is_temporary(".tmp-watchd-status.txt.png")


def test_a_half_built_folder_a_crash_left_is_a_stray_below_not_here(batch: Path) -> None:
    """A label image a crash left under its temporary name goes whole, when the strays below
    are removed (by the report in its run folder, once the jobs are done); a link so named is
    not followed; the status writer's clean-up of the owner's batch folder (here only) never
    takes a folder for a stray."""
    built, planted, top = temporary_name(), temporary_name(), temporary_name()
    (batch / "masks" / built / "labels" / "0").mkdir(parents=True)
    (batch / "masks" / built / "labels" / "0" / "0.0").write_bytes(b"chunk")
    (batch.parent / "elsewhere").mkdir()
    (batch.parent / "elsewhere" / "keep").write_text("theirs")
    (batch / "masks" / planted).symlink_to(batch.parent / "elsewhere")
    (batch / top).mkdir()
    with HeldFolder.open(batch) as held:
        assert held.remove_strays(below=False) == []
        assert (batch / top).is_dir()
        assert sorted(held.remove_strays()) == sorted([f"masks/{built}/", f"{top}/"])
    assert sorted(p.name for p in (batch / "masks").iterdir()) == [planted]
    assert (batch.parent / "elsewhere" / "keep").read_text() == "theirs"


def test_strays_only_here_leave_the_folders_below_alone(batch: Path) -> None:
    """The status writer cleans the batch folder itself while jobs write below it."""
    here, below = temporary_name(), temporary_name()
    (batch / here).write_text("half a status")
    (batch / "results").mkdir()
    (batch / "results" / below).write_text("a job's write in progress")
    with HeldFolder.open(batch) as held:
        assert held.remove_strays(below=False) == [here]
    assert (batch / "results" / below).exists()


def test_a_new_folder_is_never_one_that_exists(batch: Path) -> None:
    (batch / "planted").mkdir()
    with HeldFolder.open(batch) as held:
        held.mkdir("made")
        with pytest.raises(FileExistsError):
            held.mkdir("planted")
        with pytest.raises(ValueError, match="not one name"):
            held.mkdir("a/b")
    assert (batch / "made").is_dir()


@pytest.mark.parametrize("relative", ["../x.png", "/etc/x.png", "a/../../x.png", ""])
def test_a_name_below_a_held_folder_cannot_leave_it(relative: str) -> None:
    with pytest.raises(ValueError, match="not a path inside a folder"):
        parts_of(relative)


def test_a_name_below_a_held_folder_keeps_the_input_layout() -> None:
    assert parts_of("plate 1/ä.tif") == ("plate 1", "ä.tif")
