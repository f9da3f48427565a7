"""The status file is written by the rule of daemon.contract.heldfolder: a link or FIFO planted at its
name is replaced, never followed; its clean-up removes only the temporaries it makes itself."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from daemon.contract.heldfolder import UnsafeEntry, temporary_name
from daemon.core.manifest import STATUS_NAME
from daemon.loop.reporter import write


def test_the_clean_up_removes_a_stray_of_its_own_and_never_an_input(tmp_path: Path) -> None:
    folder = tmp_path / "batch"
    folder.mkdir()
    inputs = [".tmp-watchd-status.txt.png", f".tmp-{STATUS_NAME}.abc123", ".tmp-img.png"]
    for name in inputs:
        (folder / name).write_bytes(b"an image")
    stray = temporary_name()  # what a daemon killed mid-write leaves
    (folder / stray).write_text("half a status")
    write(folder, "State:     DONE\n")
    assert (folder / STATUS_NAME).read_text() == "State:     DONE\n"
    assert not (folder / stray).exists()
    assert all((folder / name).read_bytes() == b"an image" for name in inputs)


@pytest.mark.parametrize("planted", ["link", "fifo"])
def test_a_status_file_planted_as_a_link_or_fifo_is_replaced_not_followed(
    tmp_path: Path, planted: str
) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text("someone else's file\n")
    folder = tmp_path / "batch"
    folder.mkdir()
    if planted == "link":
        (folder / STATUS_NAME).symlink_to(outside)
    else:
        os.mkfifo(folder / STATUS_NAME)
    write(folder, "State:     WAITING\n")
    assert (folder / STATUS_NAME).read_text() == "State:     WAITING\n"
    assert not (folder / STATUS_NAME).is_symlink()
    assert outside.read_text() == "someone else's file\n"


def test_a_batch_folder_that_became_a_link_is_not_written_through(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "batch").symlink_to(elsewhere)
    with pytest.raises(UnsafeEntry, match="'batch' is a symbolic link, not a folder"):
        write(tmp_path / "batch", "State:     DONE\n")
    assert list(elsewhere.iterdir()) == []
