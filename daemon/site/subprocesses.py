"""All subprocess I/O of the daemon: run a command to completion, or start a detached job.

Errors carry the exit code, the command, stdout and stderr (:class:`CommandFailed`), so an
operator sees why without re-running anything by hand. Commands are argument lists, never
shell strings.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from daemon.contract.errors import CommandFailed


def run(
    command: Sequence[str],
    *,
    timeout: float = 60.0,
    env: Mapping[str, str] | None = None,
    input_text: str | None = None,
) -> str:
    """Run ``command`` to completion and return its stdout; raise CommandFailed otherwise."""
    try:
        done = subprocess.run(
            list(command),
            capture_output=True,
            text=True,
            timeout=timeout,
            env=dict(env) if env is not None else None,
            input=input_text,
            check=False,
        )
    except FileNotFoundError as exc:
        raise CommandFailed(command, 127, "", str(exc)) from None
    except subprocess.TimeoutExpired as exc:
        raise CommandFailed(
            command, 124, _text(exc.stdout), f"timed out after {timeout} s"
        ) from None
    if done.returncode != 0:
        raise CommandFailed(command, done.returncode, done.stdout, done.stderr)
    return done.stdout


def _text(data: bytes | str | None) -> str:
    if data is None:
        return ""
    return data if isinstance(data, str) else data.decode("utf-8", "replace")


def spawn(
    command: Sequence[str], *, log_fd: int, env: Mapping[str, str], stdin_fd: int | None = None
) -> int:
    """Start ``command`` in a session of its own (it outlives the daemon and gets no signal
    meant for it), stdin from /dev/null (or the open ``stdin_fd``), stdout and stderr to the
    open file ``log_fd`` (the caller opened it, by the rule of :mod:`daemon.contract.heldfolder`,
    and closes it, as ``stdin_fd``): its pid.

    Nothing is opened by path for the child but /dev/null: a link or FIFO planted at a log's
    name can neither redirect its output nor block this call.

    The caller reaps it with ``exited`` while it lives; if the caller dies first, the process
    goes on and init reaps it."""
    stdin: tuple[Any, ...] = (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0)
    if stdin_fd is not None:
        stdin = (os.POSIX_SPAWN_DUP2, stdin_fd, 0)
    actions = [
        stdin,
        (os.POSIX_SPAWN_DUP2, log_fd, 1),
        (os.POSIX_SPAWN_DUP2, log_fd, 2),
    ]
    executable = shutil.which(command[0], path=env.get("PATH")) or command[0]
    return os.posix_spawn(executable, list(command), dict(env), file_actions=actions, setsid=True)


def exited(pid: int) -> int | None:
    """The exit status of our child ``pid`` if it has ended (reaping it), else None.

    A child killed by a signal gives minus the signal's number, as subprocess does."""
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return None
    if done == 0:
        return None
    return os.waitstatus_to_exitcode(status)


def process_start_ticks(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot, or None if it is gone.

    Together with the pid it names one process for good: a pid reused later has another start
    time. A zombie counts as gone.
    """
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    if fields[0] == "Z":
        return None
    return int(fields[19])


def signal_group(pid: int, signum: int) -> bool:
    """Send ``signum`` to the process group led by ``pid``; False if it no longer exists."""
    try:
        os.killpg(pid, signum)
    except ProcessLookupError:
        return False
    return True


def find_process(argv_tail: Sequence[str], *, leader: bool = False) -> tuple[int, int] | None:
    """A live process whose command line ends with ``argv_tail`` (and that leads its process
    group, when ``leader``): its pid and start ticks.

    For a job started just before its starter died, before the starter could write down the
    pid: the job's own command line (module and job folder) names it."""
    for entry in os.listdir("/proc"):
        if entry.isdigit() and runs(int(entry), argv_tail) and (not leader or _leads(int(entry))):
            ticks = process_start_ticks(int(entry))
            if ticks is not None:
                return int(entry), ticks
    return None


def _leads(pid: int) -> bool:
    try:
        return os.getpgid(pid) == pid
    except ProcessLookupError:
        return False


def runs(pid: int, argv_tail: Sequence[str]) -> bool:
    """Whether process ``pid``'s command line ends with ``argv_tail``."""
    wanted = [os.fsencode(a) for a in argv_tail]
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]
    except OSError:
        return False
    return argv[-len(wanted) :] == wanted


def reap(pid: int, grace: float) -> None:
    """Wait for our child ``pid`` (or a process of ours that is no child: until it is gone),
    told to stop; kill its group if it takes over ``grace``."""
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0]:
                return  # our child, reaped
        except ChildProcessError:  # no child of ours: init reaps it
            if process_start_ticks(pid) is None:
                return
        # (a child's /proc entry is no sign: a process of many threads shows its first as a
        # zombie while the others still end, and cannot be waited for until they have; the
        # resident device's test saw its pid alive after close() so)
        time.sleep(0.05)
    signal_group(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


class ExitWatch:
    """Calls ``wake`` as soon as one of the watched processes ends (or a watched descriptor
    becomes readable), from a thread of its own.

    A process is watched through a pidfd (Linux 5.3+), which becomes readable when it exits
    and works for a process started by an earlier daemon as for a child; nothing is reaped
    here (:func:`exited` does that where the status is read). Without pidfds (an old kernel,
    a seccomp filter) ``watch`` does nothing and the caller sees ends at its next poll."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        self._poller = select.poll()
        self._fds: dict[int, int] = {}  # pidfd → pid
        self._lock = threading.Lock()
        self._nudge_read, self._nudge_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._poller.register(self._nudge_read, select.POLLIN)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="job-exits", daemon=True)
        self._thread.start()

    def watch(self, pid: int) -> None:
        try:
            fd = os.pidfd_open(pid)
        except (OSError, AttributeError):
            return  # gone already (the caller's poll sees it), or no pidfds here
        self._add(fd, pid)

    def watch_readable(self, fd: int) -> None:
        """Also wake, once, when ``fd`` has something to read or its other end closed (a copy
        of it is watched: the caller keeps and closes its own)."""
        try:
            copy = os.dup(fd)
        except OSError:
            return
        self._add(copy, -1)

    def _add(self, fd: int, pid: int) -> None:
        with self._lock:
            if self._closed:
                os.close(fd)
                return
            self._fds[fd] = pid
            self._poller.register(fd, select.POLLIN)
        os.write(self._nudge_write, b"x")  # the thread polls the new fd from now on

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        os.write(self._nudge_write, b"x")
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            ready = [fd for fd, _ in self._poller.poll()]
            with self._lock:
                if self._closed:
                    break
                ended = [fd for fd in ready if fd in self._fds]
                for fd in ended:
                    self._poller.unregister(fd)
                    del self._fds[fd]
                    os.close(fd)
            if self._nudge_read in ready:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._nudge_read, 4096)
            if ended:
                self._wake()
        with self._lock:
            for fd in self._fds:
                os.close(fd)
            self._fds.clear()
        os.close(self._nudge_read)
        os.close(self._nudge_write)
