"""Reading a job's log from its end and following it as it grows, on real files; a link or
FIFO as the log (the spool is the service's, but all the same) is refused, never followed or
waited on."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from daemon.cli.joblog import BLOCK, Follower, LogFile, Tail, tail
from daemon.contract.heldfolder import UnsafeEntry


def at(folder: Path) -> LogFile:
    return LogFile(folder / "log.txt")


def test_tail_gives_the_last_whole_lines_and_a_line_still_being_written(tmp_path: Path) -> None:
    log = tmp_path / "log.txt"
    log.write_bytes(b"one\ntwo\nthree\nfour\nhalf a li")
    last = tail(at(tmp_path), 2)
    assert (last.lines, last.partial, last.end) == (("three", "four"), b"half a li", 28)
    assert tail(at(tmp_path), 10).lines == ("one", "two", "three", "four")
    assert tail(at(tmp_path), 0).lines == ()
    log.write_bytes(b"")
    assert tail(at(tmp_path), 5) == Tail((), b"", 0)


def test_tail_reads_a_large_log_from_its_end_without_cutting_a_line(tmp_path: Path) -> None:
    log = tmp_path / "log.txt"
    lines = [f"epoch {i}: loss {1 / (i + 1):.6f} " + "x" * (i % 97) for i in range(5000)]
    log.write_text("\n".join(lines) + "\n")
    assert log.stat().st_size > 10 * BLOCK
    assert tail(at(tmp_path), 3).lines == tuple(lines[-3:])
    assert tail(at(tmp_path), 400).lines == tuple(lines[-400:])


def test_a_follower_returns_what_the_file_gained_in_whole_lines(tmp_path: Path) -> None:
    log = tmp_path / "log.txt"
    follower = Follower(at(tmp_path))
    assert follower.read() == []  # not there yet
    log.write_bytes(b"started\nloading mo")
    assert follower.read() == ["started"]
    with open(log, "ab") as handle:
        handle.write("del ✓\nimage 1\nimage".encode())
    assert follower.read() == ["loading model ✓", "image 1"]
    assert follower.rest() == ["image"]  # the job ended: its last line without a newline
    log.write_bytes(b"attempt 2\n")  # shorter than what was read: read from the beginning
    assert follower.read() == ["attempt 2"]


def test_a_follower_goes_on_where_the_tail_stopped(tmp_path: Path) -> None:
    log = tmp_path / "log.txt"
    log.write_bytes(b"a\nb\nhal")
    last = tail(at(tmp_path), 1)
    follower = Follower(at(tmp_path), last.end, last.partial)
    with open(log, "ab") as handle:
        handle.write(b"f\nc\n")
    assert (last.lines, follower.read()) == (("b",), ["half", "c"])


def test_a_log_planted_as_a_link_is_refused_not_followed(tmp_path: Path) -> None:
    """As root, following it would print any file of the machine (/etc/shadow)."""
    secret = tmp_path / "secret"
    secret.write_text("root:$6$hash\n")
    batch = tmp_path / "batch"
    (batch / "jobs" / "j").mkdir(parents=True)
    (batch / "jobs" / "j" / "log.txt").symlink_to(secret)
    log = LogFile(batch / "jobs" / "j" / "log.txt")
    with pytest.raises(UnsafeEntry, match=r"'log\.txt' is a symbolic link, not a regular file"):
        tail(log, 5)
    with pytest.raises(UnsafeEntry, match="symbolic link"):
        Follower(log).read()


def test_a_link_on_the_way_to_the_log_is_refused_too(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "log.txt").write_text("not the job's\n")
    batch = tmp_path / "batch"
    (batch / "jobs").mkdir(parents=True)
    (batch / "jobs" / "j").symlink_to(elsewhere)
    with pytest.raises(NotADirectoryError):  # O_DIRECTORY | O_NOFOLLOW on a link
        tail(LogFile(batch / "jobs" / "j" / "log.txt"), 5)


def test_a_log_planted_as_a_fifo_is_refused_at_once_instead_of_hanging(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "log.txt")  # nobody writes to it: an open for reading would wait
    with pytest.raises(UnsafeEntry, match=r"'log\.txt' is a FIFO, not a regular file"):
        tail(at(tmp_path), 5)
    with pytest.raises(UnsafeEntry, match="FIFO"):
        Follower(at(tmp_path)).read()
