"""Warm starts for the local executor: launchers started ahead of their jobs, imports done.

Every inference job's process imports torch before its first image reaches the net: 1–2 s of
each job's start, on the job's critical path, paid again by every shard. The local executor
keeps ``executor.local.warm_starts`` *spares* per job module it warms (the inference job's,
and the report's, whose imports take ~0.9 s before the last step of every batch):
``python -m daemon.executors.local_job --spare MODULE`` (see there), started when the planner
expects a job of that module (:class:`daemon.core.planner.Expect`, passed on by
:meth:`daemon.executors.local.LocalExecutor.expect`: a batch's first jobs while its inputs
settle, the next stage's job while the stage before runs) and after a job of that module is
handed over (they import while that job runs). The next job of the module goes to a spare
(:meth:`Spares.take`, then :func:`hand_over`): the spare becomes its launcher, its handle is
the spare's, and the job is forked from it, its imports already done.

A spare serves a job only once it said its imports are done (:data:`READY`: a job handed to
one still importing would wait for it, without its time limit, where a cold start overlaps
its imports with its workers' first reads), and only where the job would have been started
in the very environment the spare was started in (the job's GPUs aside,
``CUDA_VISIBLE_DEVICES``, which CUDA reads only as it starts, after the fork): what a library
read from it as it was imported still holds. A job with no such spare starts cold, as always.
A spare no job came for ends by itself after ``local_job.SPARE_IDLE_SECONDS`` (a job sent to it
then is refused, and starts cold), or when the daemon stops (its socket's end of file,
whether the daemon stopped or was killed); the daemon reaps it at its next look.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from daemon.executors.local_job import READY, SPARE
from daemon.site.subprocesses import exited, process_start_ticks, reap, spawn

LAUNCHER = "daemon.executors.local_job"
END_GRACE_SECONDS = 5.0  # a spare told to end and still there then is killed
PER_JOB_ENV = ("CUDA_VISIBLE_DEVICES",)  # set for each job at its fork, not at the spare's start


@dataclass
class Spare:
    """A launcher started ahead, waiting for its job on ``channel``."""

    pid: int
    ticks: int
    module: str
    env: dict[str, str]
    channel: socket.socket
    ready: bool = False  # its imports are done (it said so)

    @property
    def handle(self) -> str:
        return f"local:{self.pid}:{self.ticks}"

    def alive(self) -> bool:
        """Whether it still runs (reaping it if it ended)."""
        return exited(self.pid) is None and process_start_ticks(self.pid) == self.ticks

    def says_ready(self) -> bool:
        """Whether its imports are done: its word read, without waiting."""
        if not self.ready:
            with contextlib.suppress(OSError):
                self.ready = self.channel.recv(len(READY), socket.MSG_DONTWAIT) == READY
        return self.ready


def spare_env(env: Mapping[str, str]) -> dict[str, str]:
    """The environment a job's spare is started in: the job's, less what is set per job."""
    return {key: value for key, value in env.items() if key not in PER_JOB_ENV}


def spare_argv(python: str, module: str) -> list[str]:
    return [python, "-m", LAUNCHER, SPARE, module]


class Spares:
    """The spares of one executor: at most ``count`` waiting per module and environment."""

    def __init__(self, python: str, count: int, modules: Sequence[str]) -> None:
        self.python, self.count, self.modules = python, count, frozenset(modules)
        self._waiting: list[Spare] = []

    def take(self, module: str, env: Mapping[str, str]) -> Spare | None:
        """The longest-waiting live spare of ``module`` started in the job's ``env`` whose
        imports are done (the caller hands it the job or ends it), or None (always, for a
        module not warmed)."""
        if module not in self.modules:
            return None
        wanted = spare_env(env)
        self.tend()
        for spare in self._waiting:
            if spare.module == module and spare.env == wanted and spare.says_ready():
                self._waiting.remove(spare)
                return spare
        return None

    def top_up(self, module: str, env: Mapping[str, str]) -> None:
        """Start spares of ``module`` in the job's ``env`` until ``count`` wait (none for a
        module not warmed; a spare that cannot be started is left out: the jobs start cold)."""
        if module not in self.modules:
            return
        wanted = spare_env(env)
        waiting = sum(1 for s in self._waiting if s.module == module and s.env == wanted)
        for _ in range(self.count - waiting):
            try:
                self._waiting.append(self._start(module, wanted))
            except OSError:
                return

    def _start(self, module: str, env: dict[str, str]) -> Spare:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            pid = spawn(spare_argv(self.python, module), log_fd=null, env=env,
                        stdin_fd=theirs.fileno())  # fmt: skip
        except OSError:
            ours.close()
            raise
        finally:
            os.close(null)
            theirs.close()
        return Spare(pid, process_start_ticks(pid) or 0, module, env, ours)

    def tend(self) -> None:
        """Forget the spares that ended (waited too long, or failed), reaping them."""
        for spare in list(self._waiting):
            if not spare.alive():
                self._waiting.remove(spare)
                spare.channel.close()

    def waiting(self) -> list[Spare]:
        return list(self._waiting)

    def close(self) -> None:
        """End every spare still waiting (none has a job: ending them loses nothing)."""
        for spare in self._waiting:
            end(spare)
        self._waiting.clear()


def end(spare: Spare) -> None:
    """End a spare with no job (mid-import or waiting) and reap it."""
    spare.channel.close()
    with contextlib.suppress(ProcessLookupError):
        os.kill(spare.pid, signal.SIGTERM)
    reap(spare.pid, END_GRACE_SECONDS)


def hand_over(
    spare: Spare, job_dir: str, limit: float, stall: float, command: Sequence[str],
    env: Mapping[str, str], log_fd: int,
) -> None:  # fmt: skip
    """Give ``spare`` its job: the request and the job's open log. OSError: it is gone (the
    caller reaps it with :func:`end` and starts the job cold)."""
    request = {"job_dir": job_dir, "limit": limit, "stall": stall, "command": list(command),
               "env": dict(env)}  # fmt: skip
    try:
        socket.send_fds(spare.channel, [json.dumps(request).encode()], [log_fd])
    finally:
        spare.channel.close()
