"""Reading a job's log from its end and following it as it grows, on real files."""

from __future__ import annotations

from pathlib import Path

from daemon.joblog import BLOCK, Follower, Tail, tail


def test_tail_gives_the_last_whole_lines_and_a_line_still_being_written(tmp_path: Path) -> None:
    log = tmp_path / "log.txt"
    log.write_bytes(b"one\ntwo\nthree\nfour\nhalf a li")
    last = tail(log, 2)
    assert (last.lines, last.partial, last.end) == (("three", "four"), b"half a li", 28)
    assert tail(log, 10).lines == ("one", "two", "three", "four")
    assert tail(log, 0).lines == ()
    log.write_bytes(b"")
    assert tail(log, 5) == Tail((), b"", 0)


def test_tail_reads_a_large_log_from_its_end_without_cutting_a_line(tmp_path: Path) -> None:
    log = tmp_path / "log.txt"
    lines = [f"epoch {i}: loss {1 / (i + 1):.6f} " + "x" * (i % 97) for i in range(5000)]
    log.write_text("\n".join(lines) + "\n")
    assert log.stat().st_size > 10 * BLOCK
    assert tail(log, 3).lines == tuple(lines[-3:])
    assert tail(log, 400).lines == tuple(lines[-400:])


def test_a_follower_returns_what_the_file_gained_in_whole_lines(tmp_path: Path) -> None:
    log = tmp_path / "log.txt"
    follower = Follower(log)
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
    last = tail(log, 1)
    follower = Follower(log, last.end, last.partial)
    with open(log, "ab") as handle:
        handle.write(b"f\nc\n")
    assert (last.lines, follower.read()) == (("b",), ["half", "c"])
