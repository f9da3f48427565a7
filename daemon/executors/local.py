"""The local executor: jobs as subprocesses of this machine, at most ``max_parallel`` at once.

Each job runs in its own session, so it outlives a daemon that is stopped or killed; a handle
``local:PID:START`` names the process for good (the start time tells a reused pid apart), and
``launch.json`` in the job directory lets a restarted daemon find a job it started before.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from daemon import atomicfile
from daemon.executors import Accepted, Check, Deferred, Handover, Phase, Refused, Status, Submission
from daemon.jobspec import LOG_FILE
from daemon.subprocesses import process_start_ticks, signal_group, spawn

LAUNCH_FILE = "launch.json"
CANCEL_GRACE_SECONDS = 10.0
# A start that failed for want of processes, memory or file descriptors may work later; any
# other failure (no such interpreter, not executable) will fail every time.
PASSING = frozenset({errno.EAGAIN, errno.ENOMEM, errno.EMFILE, errno.ENFILE})


class LocalExecutor:
    name = "local"

    def __init__(
        self, *, max_parallel: int, python: str = "", env: Mapping[str, str] | None = None
    ) -> None:
        self.max_parallel = max_parallel
        self.python = python or sys.executable
        self.env = dict(env or {})
        self._children: dict[str, subprocess.Popen[bytes]] = {}
        self._ending: list[subprocess.Popen[bytes]] = []  # cancelled, not yet seen to exit

    def slots(self) -> int | None:
        return self.max_parallel

    def submit(self, submissions: Sequence[Submission]) -> list[Handover]:
        return [self._hand_over(s) for s in submissions]

    def _hand_over(self, sub: Submission) -> Handover:
        adopted = self._adopt(sub)
        return Accepted(adopted) if adopted else self._start(sub)

    def _start(self, sub: Submission) -> Handover:
        command = [self.python, "-m", sub.module, str(sub.job_dir)]
        env = {**self.env, **sub.env, "OMP_NUM_THREADS": str(sub.cpus)}
        try:
            proc = spawn(command, cwd=sub.job_dir, log_path=sub.job_dir / LOG_FILE, env=env)
        except OSError as exc:
            reason = f"cannot start {sub.name}: {exc}"
            return Deferred(reason) if exc.errno in PASSING else Refused(reason)
        ticks = process_start_ticks(proc.pid)
        handle = f"local:{proc.pid}:{ticks if ticks is not None else 0}"
        self._children[handle] = proc
        record = {"handle": handle, "pid": proc.pid, "command": command}
        atomicfile.write_text(sub.job_dir / LAUNCH_FILE, json.dumps(record))
        return Accepted(handle)

    def _adopt(self, sub: Submission) -> str | None:
        """The handle of this job's process if an earlier daemon started it and it still runs."""
        try:
            handle = json.loads((sub.job_dir / LAUNCH_FILE).read_text())["handle"]
        except (OSError, ValueError, KeyError):
            return None
        return handle if _alive(handle) else None

    def poll(self, handles: Sequence[str]) -> dict[str, Status]:
        self._ending = [p for p in self._ending if p.poll() is None]  # reap the cancelled
        return {h: self._status(h) for h in handles}

    def _status(self, handle: str) -> Status:
        proc = self._children.get(handle)
        if proc is None:
            return Status(Phase.RUNNING) if _alive(handle) else Status(Phase.UNKNOWN)
        code = proc.poll()
        if code is None:
            return Status(Phase.RUNNING)
        del self._children[handle]
        return Status(Phase.ENDED, code)

    def cancel(self, handles: Sequence[str]) -> None:
        for handle in handles:
            if _alive(handle):
                signal_group(_pid(handle), signal.SIGTERM)
            proc = self._children.pop(handle, None)
            if proc is not None:
                self._ending.append(proc)

    def close(self) -> None:
        """Forget the running children (they keep running; a later daemon re-adopts them) and
        see the cancelled ones end, killing those that ignore SIGTERM for long."""
        for proc in self._ending:
            try:
                proc.wait(timeout=CANCEL_GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
        self._ending.clear()
        self._children.clear()

    def self_test(self) -> list[Check]:
        if not os.access(self.python, os.X_OK):
            return [Check("local executor", False, f"{self.python} is not executable")]
        detail = f"{self.python}, {self.max_parallel} job(s) at once"
        return [Check("local executor", True, detail)]


def _pid(handle: str) -> int:
    return int(handle.split(":")[1])


def _alive(handle: str) -> bool:
    try:
        _, pid, ticks = handle.split(":")
    except ValueError:
        return False
    return process_start_ticks(int(pid)) == int(ticks)


def from_path(path: Path) -> str | None:
    """The handle recorded in a job directory, if any (for watchctl)."""
    try:
        return str(json.loads((path / LAUNCH_FILE).read_text())["handle"])
    except (OSError, ValueError, KeyError):
        return None
