"""Resident devices for the local executor: one process per GPU that keeps the inference net on
its GPU across jobs (``executor.local.resident_device``; the process is
:mod:`pipelines.inference.resident`, a job's side :mod:`pipelines.inference.remote`).

Every inference job started on its own imports torch, starts CUDA, loads and checks the model
and decides its precision before its first image: on a GPU node a job forked from a warm start
still took 2.4–3.0 s for 1,024–1,638 images of 256² (docs/benchmarks.md), and a batch is
shards, each a job. A resident device pays that once per model; its jobs hand it their batches.

With ``gpus = N`` a resident device runs per GPU, started in the executor's environment with
that GPU alone visible, and an inference job that holds GPUs is named the socket of its first
(:data:`daemon.contract.jobspec.RESIDENT_DEVICE_ENV`); a job with no GPU runs its own net on
its CPUs. Without ``gpus`` one resident device runs, seeing what the daemon sees, and every
inference job is named it (where it sees no GPU, the nets of all jobs run in its threads, one
batch at a time: a machine without a GPU gains nothing by it).

They are started when the planner expects an inference job (while a batch settles) or at the
first one; the sockets are in a folder only the service can enter (made with ``mkdtemp``: mode
0700), removed at :meth:`Residents.close`. A resident device holds one end of a pipe as its
standard input and ends at its end of file, so it never outlives the daemon, even a killed one;
a job that was using it goes on with a net of its own (:mod:`pipelines.inference.remote`), as
the daemon's next start adopts it. One found ended is
started again at the next job, or after :data:`FAILED_PAUSE_SECONDS` when it ended within
:data:`EARLY_END_SECONDS` of its start (its jobs run their own nets meanwhile, and the log says
so).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import structlog

from daemon.contract.jobspec import RESIDENT_DEVICE_ENV
from daemon.executors.gpus import visible
from daemon.executors.spares import FAILED_PAUSE_SECONDS
from daemon.site.subprocesses import exited, process_start_ticks, reap, spawn

MODULE = "pipelines.inference.resident"
END_GRACE_SECONDS = 10.0
EARLY_END_SECONDS = 30.0
MAX_FOLDER = 64  # characters of TMPDIR, for the socket's path to stay under its limit

log = structlog.get_logger("watchd")


@dataclass
class Resident:
    """A resident device started, and the write end of its standard input."""

    pid: int
    ticks: int
    socket: str
    stdin: int
    started: float

    def alive(self) -> bool:
        return exited(self.pid) is None and process_start_ticks(self.pid) == self.ticks


class Residents:
    """The resident devices of one executor: one per GPU (``gpus`` > 0), else one."""

    def __init__(self, python: str, gpus: int, env: Mapping[str, str]) -> None:
        self.python, self.gpus, self.env = python, gpus, dict(env)
        self.folder = ""  # made at the first start
        self.running: dict[int | None, Resident] = {}  # by GPU (None: the one of every job)
        self.paused: dict[int | None, float] = {}  # no start before then

    def start_all(self) -> None:
        """Every resident device this executor has, started where none runs."""
        for gpu in range(self.gpus) if self.gpus else (None,):
            self._ensure(gpu)

    def env_for(self, gpus: Sequence[int]) -> dict[str, str]:
        """What to add to the environment of an inference job that holds ``gpus`` (where GPUs
        are handed out): the socket of its resident device, started if need be; nothing where
        it has none, or none runs."""
        if self.gpus and not gpus:
            return {}
        found = self._ensure(gpus[0] if self.gpus else None)
        return {RESIDENT_DEVICE_ENV: found.socket} if found is not None else {}

    def _ensure(self, gpu: int | None) -> Resident | None:
        self.tend()
        if gpu in self.running:
            return self.running[gpu]
        if time.monotonic() < self.paused.get(gpu, 0.0):
            return None
        try:
            self.running[gpu] = self._start(gpu)
        except OSError as exc:
            log.warning("resident device not started; jobs run their own nets", gpu=gpu,
                        error=str(exc))  # fmt: skip
            self.paused[gpu] = time.monotonic() + FAILED_PAUSE_SECONDS
            return None
        return self.running[gpu]

    def _start(self, gpu: int | None) -> Resident:
        if not self.folder:  # 0700, the service's; in /tmp where TMPDIR is too long a path
            short = len(tempfile.gettempdir()) <= MAX_FOLDER  # for a socket's (108 bytes)
            self.folder = tempfile.mkdtemp(prefix="watchd-resident-", dir=None if short else "/tmp")
        path = os.path.join(self.folder, "all.sock" if gpu is None else f"gpu{gpu}.sock")
        env = {**self.env, **(visible((gpu,)) if gpu is not None else {})}
        theirs, ours = os.pipe2(os.O_CLOEXEC)
        try:
            pid = spawn([self.python, "-m", MODULE, path], log_fd=2, env=env, stdin_fd=theirs)
        except OSError:
            os.close(ours)
            raise
        finally:
            os.close(theirs)
        log.info("resident device started", gpu=gpu, pid=pid, socket=path)
        return Resident(pid, process_start_ticks(pid) or 0, path, ours, time.monotonic())

    def tend(self) -> None:
        """Forget the resident devices that ended (reaped); one that ended soon after its start
        pauses the next start on its GPU."""
        for gpu, found in list(self.running.items()):
            if found.alive():
                continue
            del self.running[gpu]
            os.close(found.stdin)
            early = time.monotonic() - found.started < EARLY_END_SECONDS
            if early:
                self.paused[gpu] = time.monotonic() + FAILED_PAUSE_SECONDS
            log.warning("resident device ended; its jobs go on with their own nets", gpu=gpu,
                        pid=found.pid,
                        next_in_s=FAILED_PAUSE_SECONDS if early else 0)  # fmt: skip

    def close(self) -> None:
        """End every resident device (a job using one goes on with a net of its own) and
        remove their sockets' folder."""
        for found in self.running.values():
            os.close(found.stdin)
            with contextlib.suppress(ProcessLookupError):
                os.kill(found.pid, signal.SIGTERM)
        for found in self.running.values():
            reap(found.pid, END_GRACE_SECONDS)
        self.running.clear()
        if self.folder:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = ""
