"""The job side of a Slurm launch: open the job's log by the rule, then become the job.

``python -m daemon.executors.slurm_job JOB_DIR -- COMMAND...``, run by the job script on the
compute node as the daemon's user. The job folder is in the spool (the service's own); its
``log.txt`` is opened without following a link or blocking on a FIFO, made the job's stdout and
stderr, and the job's working folder is that folder. A log that may not be opened ends the
task with exit status 3 before the job starts: the daemon sees it end without a result.
"""

from __future__ import annotations

import datetime as dt
import os
import socket
import sys
from collections.abc import Mapping, Sequence

from daemon.contract.heldfolder import HeldFolder
from daemon.contract.jobspec import LOG_FILE

REFUSED = 3


def banner(env: Mapping[str, str], host: str, at: dt.datetime) -> str:
    """The first line an attempt adds to the log: where and when it runs."""
    job, task = env.get("SLURM_JOB_ID", "?"), env.get("SLURM_ARRAY_TASK_ID", "0")
    gpus = env.get("CUDA_VISIBLE_DEVICES") or "none"
    return f"watchd: Slurm job {job} task {task} on {host}, GPUs {gpus}, at {at:%Y-%m-%dT%H:%M:%SZ}"


def main(argv: Sequence[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m daemon.executors.slurm_job JOB_DIR -- COMMAND...",
              file=sys.stderr)  # fmt: skip
        return 2
    job_dir, _, *command = argv
    try:
        with HeldFolder.open(job_dir) as held:
            log_fd = held.open_append(LOG_FILE)
            os.fchdir(held.fd)
    except (OSError, ValueError) as exc:
        print(f"watchd: the job's log cannot be opened: {exc}", file=sys.stderr)
        return REFUSED
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    now = dt.datetime.now(dt.UTC)
    os.write(1, (banner(os.environ, socket.gethostname(), now) + "\n").encode())
    os.execvp(command[0], command)
    return REFUSED  # not reached: execvp replaces this process or raises


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
