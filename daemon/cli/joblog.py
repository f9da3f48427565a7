"""A job's log, ``<work folder>/jobs/<job name>/log.txt`` in the spool (what the job printed,
appended to by each attempt): its last lines, and the lines it gains until the job ends
(``watchctl logs``). The spool is the service's; operators read it as members of its group.
The log is opened without following a link or waiting on a FIFO all the same."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from daemon.contract.heldfolder import HeldFolder
from daemon.contract.jobspec import LOG_FILE, job_dir
from daemon.contract.spool import work_dir
from daemon.core.records import Batch, Job
from daemon.store import Store

BLOCK = 8192


@dataclass(frozen=True)
class LogFile:
    """A job's log in the spool."""

    path: Path

    def open(self) -> BinaryIO:
        """Open it for reading (FileNotFoundError if missing, UnsafeEntry if not a file)."""
        with HeldFolder.open(self.path.parent) as held:
            return held.open_read(self.path.name)


def log_file(spool: Path, batch: Batch, job: Job) -> LogFile:
    return LogFile(job_dir(work_dir(spool, batch.id, batch.run_dir), job.name) / LOG_FILE)


def _decode(line: bytes) -> str:
    return line.decode("utf-8", "replace")


@dataclass(frozen=True)
class Tail:
    lines: tuple[str, ...]  # the last whole lines
    partial: bytes  # a last line still being written (no newline yet)
    end: int  # the file's size when read


def tail(log: LogFile, count: int) -> Tail:
    """The last ``count`` lines of a file, read from its end (a training log may be large)."""
    with log.open() as handle:
        end = position = handle.seek(0, 2)
        data = b""
        while position > 0 and data.count(b"\n") <= count:
            step = min(BLOCK, position)
            position -= step
            handle.seek(position)
            data = handle.read(step) + data
    *whole, partial = data.split(b"\n")
    if position > 0 and whole:
        whole = whole[1:]  # the first line read may have begun before the block
    kept = whole[-count:] if count > 0 else []
    return Tail(tuple(_decode(line) for line in kept), partial, end)


class Follower:
    """What a growing file gained since the last read, in whole lines."""

    def __init__(self, log: LogFile, offset: int = 0, partial: bytes = b"") -> None:
        self.log, self.offset, self.partial = log, offset, partial

    def read(self) -> list[str]:
        try:
            handle = self.log.open()
        except FileNotFoundError:
            return []  # not written yet (the job has not started)
        with handle:
            size = os.fstat(handle.fileno()).st_size
            if size < self.offset:  # truncated or replaced: start from its beginning
                self.offset, self.partial = 0, b""
            handle.seek(self.offset)
            data = handle.read(size - self.offset)
        self.offset += len(data)
        *whole, self.partial = (self.partial + data).split(b"\n")
        return [_decode(line) for line in whole]

    def rest(self) -> list[str]:
        """Whatever is left once the job ended: its last line even without a newline."""
        lines = self.read()
        if self.partial:
            lines.append(_decode(self.partial))
            self.partial = b""
        return lines


class Interrupt:
    """Ctrl-C's word to :func:`follow`: a plain flag that a signal handler sets. A
    ``threading.Event`` there could hang the process: its ``set()`` waits for the Event's lock,
    which the very ``wait()`` the signal interrupted may hold (a handler runs in that thread,
    between two of its steps); so a follow stopped by Ctrl-C once went on for ever."""

    def __init__(self) -> None:
        self.given = False

    def set(self) -> None:
        self.given = True

    def is_set(self) -> bool:
        return self.given

    def wait(self, seconds: float) -> None:
        """Sleep ``seconds`` (a signal's handler runs meanwhile, and the sleep goes on)."""
        if not self.given:
            time.sleep(seconds)


def follow(
    store: Store,
    job_id: int,
    follower: Follower,
    emit: Callable[[str], None],
    *,
    poll_seconds: float = 0.5,
    stop: Interrupt | None = None,
) -> None:
    """Emit the lines the log gains until the job has ended, or until ``stop`` is set.

    A job counts as ended when two polls in a row find it so: a failed job the daemon retries
    goes back to pending in the same tick, and following should go on through the retry.
    """
    stop = stop or Interrupt()
    ended_before = False
    while not stop.is_set():
        for line in follower.read():
            emit(line)
        ended = store.job(job_id).state.terminal
        if ended and ended_before:
            break
        ended_before = ended
        stop.wait(poll_seconds)
    else:
        return  # stopped: what the log holds now was printed
    for line in follower.rest():
        emit(line)
