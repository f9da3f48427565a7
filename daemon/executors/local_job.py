"""The job side of a local launch: run the job, and end it when it runs too long or stalls.

``python -m daemon.executors.local_job JOB_DIR TIME_LIMIT_S STALL_S -- COMMAND...``, started by
the local executor in a session of its own with its output in the job's log. It runs COMMAND as
its child (in its process group: a cancel's signal to the group reaches both) and waits for it;
every few seconds it looks at the job's progress: the modification times of the job folder's
``log.txt`` and ``progress.json``. It ends the job (SIGTERM, then SIGKILL after a grace) when

- it has run TIME_LIMIT_S seconds (the manifest's ``[resources] time_minutes``, else the site's
  ``executor.local.time_minutes``): exit status :data:`TIMED_OUT`;
- neither file changed for STALL_S seconds (``executor.local.stall_minutes``; 0: never):
  exit status :data:`STALLED`;

saying so first as the last line of the log, which the daemon shows the owner. Otherwise its
exit status is the job's. Being a process of its own, it keeps the limits while the daemon is
stopped or restarted, as Slurm keeps a job's time limit.

``python -m daemon.executors.local_job --spare MODULE`` is a *warm start*: the local executor
starts it before there is a job for it (``executor.local.warm_starts``), with one end of a
socket as its stdin. It imports MODULE and the modules MODULE names in ``WARM_IMPORTS`` (the
inference job: torch, ~1–2 s of every job's start), with the garbage collector off, then frozen,
as a job started with ``-m`` does (:mod:`pipelines`), says so (one message: :data:`READY` and
the system's monotonic clock then, which the executor reads before it hands a job over, and
from which it learns how long a spare's imports take: a Unix socket closed with data unread
resets its peer), and waits. The executor hands it one job: a JSON request (the job
folder, the limits, the command the job would have been started with, its environment) and the
job's open log. From then on it is that job's launcher, as above, but the job is forked from it
with its imports done, and runs MODULE as ``python -m`` would, in the job's environment. What
the imports printed goes to the head of the job's log. Before its job, a spare may be asked for
a copy of itself (:data:`COPY`, with one end of a new socket): it forks one, its imports done,
in a session of its own and a child of no process of ours (forked twice, as a daemon is: it is
not left a zombie of a launcher that runs a long job), serving on that socket as this one does,
and answers :data:`COPIED` and the copy's pid. The executor thus gets the next job's spare in
milliseconds, without importing again. As a launcher, a spare says the exit status it ends with
(:data:`ENDED` and the status) on its socket: the executor, which is not a copy's parent,
learns it there. An end of file instead of a job (the
daemon stopped, or is gone) ends it; so does waiting :data:`SPARE_IDLE_SECONDS` (it stops
reading first: a job sent after that is refused, one sent before is run). Where the imports
failed, or left CUDA started (a fork cannot use it), the job is started as the command says,
cold, and its log says why. A module warmed so must not start CUDA, threads or processes at
its import, and its job ends the process itself (:func:`pipelines.job.main`): the job forked
runs nothing at the interpreter's exit.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from daemon.contract.jobspec import LOG_FILE, PROGRESS_FILE

TIMED_OUT = 124  # as timeout(1)
STALLED = 125
KILL_GRACE_SECONDS = 10.0
USAGE = ("usage: python -m daemon.executors.local_job JOB_DIR TIME_LIMIT_S STALL_S -- COMMAND...\n"
         "       python -m daemon.executors.local_job --spare MODULE")  # fmt: skip
SPARE = "--spare"
READY = b"R"  # a spare's word that its imports are done: only then is it handed a job
COPY = b"copy"  # a request for a copy of a spare, with one end of the copy's socket
COPIED = b"C"  # a spare's answer to it: C and the copy's pid (C alone: no copy)
ENDED = b"E"  # a launcher's last word on its socket: E and its exit status
SPARE_IDLE_SECONDS = 600.0  # a spare no job came for by then ends
MAX_REQUEST_BYTES = 1 << 20  # a request is a job folder, two numbers, a command, an environment
POLL_SECONDS = 0.05  # how often a forked job's end is looked for, where there are no pidfds
MAX_PRELOAD_OUTPUT = 1 << 20  # of what the imports printed, the head of the job's log gets this


class Child(Protocol):
    """The job a launcher waits for: a subprocess, or a job forked from a spare."""

    def wait(self, timeout: float | None = None) -> int: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


def ended_why(code: int | None) -> str:
    """What an exit status of this launcher says of the job's end ('' when it is the job's)."""
    if code == TIMED_OUT:
        return "ended by watchd: it ran past its time limit ([resources] time_minutes)"
    if code == STALLED:
        return "ended by watchd: it made no progress (executor.local.stall_minutes)"
    return ""


def last_progress(job_dir: Path, since: float) -> float:
    """The latest modification time (wall clock) of the job's log and progress file; ``since``
    when neither is newer (or there)."""
    latest = since
    for name in (LOG_FILE, PROGRESS_FILE):
        try:
            latest = max(latest, os.stat(job_dir / name, follow_symlinks=False).st_mtime)
        except OSError:
            continue
    return latest


def verdict(now: float, started: float, progressed: float, limit: float, stall: float) -> int:
    """0 while the job may go on, else the exit status that says why it is ended. Pure."""
    if limit > 0 and now - started >= limit:
        return TIMED_OUT
    if stall > 0 and now - progressed >= stall:
        return STALLED
    return 0


def supervise(job_dir: Path, limit: float, stall: float, start: Callable[[], Child]) -> int:
    """Start the job (``start``, once this process's signals are its own) and keep its limits:
    the exit status, the job's or :data:`TIMED_OUT` / :data:`STALLED`."""
    stopping = False

    def stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True  # the group got it too: the job stops by itself; wait for it

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    child = start()
    if stopping:  # told before its job was there: the signal to the group missed the job
        child.terminate()
    started = time.time()
    progressed = started
    period = max(0.2, min(5.0, (stall or limit or 5.0) / 10))
    while True:
        try:
            return child.wait(timeout=period)
        except subprocess.TimeoutExpired:
            pass
        if stopping:
            continue
        now = time.time()
        progressed = last_progress(job_dir, progressed)
        why = verdict(now, started, progressed, limit, stall)
        if why:
            print(f"watchd: {_said(why, limit, stall)}", flush=True)
            _end(child)
            return why


def _said(why: int, limit: float, stall: float) -> str:
    if why == TIMED_OUT:
        return f"{ended_why(why)}: {limit / 60:g} minutes"
    return f"{ended_why(why)} for {stall / 60:g} minutes: its log and progress unchanged"


def _end(child: Child) -> None:
    child.terminate()
    try:
        child.wait(timeout=KILL_GRACE_SECONDS)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def _cold(command: Sequence[str]) -> Callable[[], Child]:
    return lambda: subprocess.Popen(list(command), stdin=subprocess.DEVNULL)


class Forked:
    """A job forked from this process, waited for as a subprocess is: through a pidfd, or
    looked at every :data:`POLL_SECONDS` where there are none (an old kernel, a filter)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.pidfd: int | None = None
        with contextlib.suppress(OSError):
            self.pidfd = os.pidfd_open(pid)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            if self.pidfd is not None:
                select.select([self.pidfd], [], [], timeout)
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)
                if self.pidfd is not None:
                    os.close(self.pidfd)
            elif deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"job {self.pid}", timeout or 0.0)
            elif self.pidfd is None:
                time.sleep(POLL_SECONDS)
        return self.returncode

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, signum: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)


def _warm(module: str, job_dir: str, channel: socket.socket) -> Callable[[], Child]:
    def start() -> Child:
        pid = os.fork()
        if pid == 0:
            channel.close()  # the launcher's: its end of file is the launcher's end
            _run_module(module, job_dir)
        return Forked(pid)

    return start


def _run_module(module: str, job_dir: str) -> None:
    """In the forked job: run ``module`` as ``python -m MODULE JOB_DIR`` would; never returns.
    It ends as a warmed module's job does itself (:func:`pipelines.job.main`): at once, with
    nothing run at the interpreter's exit; a KeyboardInterrupt ends it by SIGINT, as Python."""
    code: Any = 1
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.argv = [module, job_dir]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        code = -signal.SIGINT
    except BaseException:
        sys.excepthook(*sys.exc_info())
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        if code == -signal.SIGINT:
            _die_by(signal.SIGINT)
        os._exit(code or 0)


def _die_by(signum: int) -> None:
    """End this process by ``signum``, as the job it ran ended (SIGKILL cannot be set)."""
    if signum not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _preload(module: str) -> str:
    """Import ``module`` and its ``WARM_IMPORTS`` as a job's imports are made: '' when the jobs
    can be forked from here, else why not."""
    gc.disable()
    try:
        loaded = importlib.import_module(module)
        for name in getattr(loaded, "WARM_IMPORTS", ()):
            importlib.import_module(name)
        # its job runs it as __main__, as ``-m`` does: found imported, runpy would warn
        del sys.modules[module]
    except BaseException:
        traceback.print_exc()
        return "its imports failed (above)"
    finally:
        gc.freeze()
        gc.enable()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "its imports started CUDA, which a forked job cannot use"
    return ""


def serve(module: str) -> int:
    """A spare (see the module's docstring): its imports, then copies of itself where asked,
    then one job, or none (0; 2 for a request it could not read)."""
    kept = os.memfd_create("preload-output")  # what the imports say, for the job's log
    os.dup2(kept, 1)
    os.dup2(kept, 2)
    channel = socket.socket(fileno=os.dup(0))
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    why_cold = _preload(module)
    try:
        channel.sendall(READY + f"{time.monotonic():.6f}".encode())  # the executor's clock too
        channel, text, fds = _await_job(channel)
    except OSError:
        return 0  # the daemon is gone
    if not fds:
        return 0  # end of file: the daemon stopped, ended the spare, or it waited too long
    code = _launch(module, why_cold, kept, channel, text, fds[0])
    with contextlib.suppress(OSError):  # the daemon that is not its parent learns it here
        channel.sendall(ENDED + str(code).encode())
    return code


def _await_job(channel: socket.socket) -> tuple[socket.socket, bytes, list[int]]:
    """Serve requests for copies until a job's request comes (or the end of file: no fds):
    the socket it came on (a copy's own, in a copy), the request and its fds."""
    while True:
        if not select.select([channel], [], [], SPARE_IDLE_SECONDS)[0]:
            channel.shutdown(socket.SHUT_RD)  # a job sent from now on is refused (EPIPE) …
        text, fds, _, _ = socket.recv_fds(channel, MAX_REQUEST_BYTES, 1)  # … one sent is run
        if text != COPY or len(fds) != 1:
            return channel, text, fds
        channel = _copy(channel, fds[0]) or channel


def _copy(channel: socket.socket, copy_fd: int) -> socket.socket | None:
    """Fork a copy of this spare that serves on ``copy_fd``, through a process that ends at
    once (the copy is nobody's child here: init reaps it), and answer its pid on ``channel``:
    in the copy, its socket; here, None."""
    read, write = os.pipe()
    middle = os.fork()
    if middle == 0:
        copy = -1
        with contextlib.suppress(OSError):
            copy = os.fork()
        if copy == 0:
            os.close(read)
            os.close(write)
            os.setsid()  # a cancel's signal to a launcher's group reaches its job, not others
            channel.close()
            return socket.socket(fileno=copy_fd)
        try:
            os.write(write, str(max(copy, 0)).encode())
        finally:
            os._exit(0)
    os.close(write)
    os.close(copy_fd)
    pid = os.read(read, 32)
    os.close(read)
    os.waitpid(middle, 0)
    channel.sendall(COPIED + (pid if pid != b"0" else b""))
    return None


def _launch(
    module: str, why_cold: str, kept: int, channel: socket.socket, text: bytes, log_fd: int
) -> int:
    """Run the job of the request ``text`` as its launcher, its output to ``log_fd`` (after
    what the imports printed, in the memfd ``kept``): the exit status."""
    try:
        request = json.loads(text)
        job_dir, command = str(request["job_dir"]), [str(part) for part in request["command"]]
        limit, stall = float(request["limit"]), float(request["stall"])
        env = {str(key): str(value) for key, value in request["env"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        _append_all(log_fd, f"watchd: a spare could not read its job's request: {exc!r}\n"
                    .encode())  # fmt: skip
        return 2
    sys.stdout.flush()
    sys.stderr.flush()
    _append_all(log_fd, os.pread(kept, MAX_PRELOAD_OUTPUT, 0))
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    for fd in (log_fd, kept):
        os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    if not why_cold and command[-3:-1] != ["-m", module]:
        why_cold = f"it was started for {module}, not for {' '.join(command[-3:-1])}"
    if why_cold:
        print(f"watchd: the job starts cold: the process started ahead for it: {why_cold}",
              flush=True)  # fmt: skip
    start = _cold(command) if why_cold else _warm(module, command[-1], channel)
    return supervise(Path(job_dir), limit, stall, start)


def _append_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data) :]


def main(argv: Sequence[str]) -> int:
    if len(argv) == 2 and argv[0] == SPARE:
        code = serve(argv[1])
    elif len(argv) < 5 or argv[3] != "--":
        print(USAGE, file=sys.stderr)
        return 2
    else:
        job_dir, limit, stall, _, *command = argv
        try:
            seconds = float(limit), float(stall)
        except ValueError:
            print(USAGE, file=sys.stderr)
            return 2
        code = supervise(Path(job_dir), *seconds, _cold(command))
    if code < 0:  # the job was killed by a signal: so is this process, as a shell would say it
        _die_by(-code)
        code = 128 - code  # (a signal that did not end it: as a shell says it)
    if argv[0] == SPARE:  # without Python's own ending: what the imports made, torch's, torn
        sys.stdout.flush()  # down object by object, the job's end seen ~0.1 s later
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
