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
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from daemon.contract.jobspec import LOG_FILE, PROGRESS_FILE

TIMED_OUT = 124  # as timeout(1)
STALLED = 125
KILL_GRACE_SECONDS = 10.0
USAGE = "usage: python -m daemon.executors.local_job JOB_DIR TIME_LIMIT_S STALL_S -- COMMAND..."


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


def supervise(job_dir: Path, limit: float, stall: float, command: Sequence[str]) -> int:
    stopping = False

    def stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True  # the group got it too: the job stops by itself; wait for it

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    child = subprocess.Popen(list(command), stdin=subprocess.DEVNULL)
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


def _end(child: subprocess.Popen[bytes]) -> None:
    child.terminate()
    try:
        child.wait(timeout=KILL_GRACE_SECONDS)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def main(argv: Sequence[str]) -> int:
    if len(argv) < 5 or argv[3] != "--":
        print(USAGE, file=sys.stderr)
        return 2
    job_dir, limit, stall, _, *command = argv
    try:
        seconds = float(limit), float(stall)
    except ValueError:
        print(USAGE, file=sys.stderr)
        return 2
    code = supervise(Path(job_dir), *seconds, command)
    if code < 0:  # the job was killed by a signal: so is this process, as a shell would say it
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
