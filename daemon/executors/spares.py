"""Warm starts for the local executor: launchers started ahead of their jobs, imports done.

Every inference job's process imports torch before its first image reaches the net: 1–2 s of
each job's start, on the job's critical path, paid again by every shard. The local executor
keeps ``executor.local.warm_starts`` *spares* per job module it warms (the inference job's,
and the report's, whose imports take ~0.9 s before the last step of every batch):
``python -m daemon.executors.local_job --spare MODULE`` (see there), started when the planner
expects a job of that module (:class:`daemon.core.planner.Expect`, passed on by
:meth:`daemon.executors.local.LocalExecutor.expect`: a batch's first jobs and its report while
its inputs settle, the next stage's job while the stage before runs) and after a job of that
module is handed over (they import while that job runs). The next job of the module goes to a
spare (:meth:`Spares.take`, then :func:`hand_over`): the spare becomes its launcher, its handle
is the spare's, and the job is forked from it, its imports already done.

A spare's imports are paid once, not once per job: where a ready spare of the kind waits, the
spares that follow it are *copies* of it (:meth:`Spares.take` with ``replace``, and
:meth:`Spares.top_up`), forked from it in milliseconds, their imports done and their memory
shared with it until written (the copies' protocol: :mod:`daemon.executors.local_job`). Every
shard of a wave then starts warm, not only the first, and no shard's cores go to importing torch
again (~1.5 CPU-s each on this project's 2-core machines). A copy is no child of the daemon: it
says its launcher's exit status on its socket (:func:`end_word`), which the executor keeps open
for it.

A spare serves a job only once it said its imports are done (:data:`READY`: a job handed to
one still importing would wait for it without its time limit, and be lost with a spare that
cannot serve), and only where the job would have been started in the very environment the
spare was started in (the job's GPUs aside, ``CUDA_VISIBLE_DEVICES``, which CUDA reads only as
it starts, after the fork): what a library read from it as it was imported still holds. A job
whose spare is still importing waits for it (:meth:`Spares.coming`: the executor defers the
job, and the spare's word wakes the daemon's loop), one job per spare, once the spare is past
half the time the last of its kind took to say ready (any, before one did) and for at most
:data:`READY_WAIT_SECONDS` of its life: such a spare is ahead of a cold start, which would make
the same imports from the beginning (on a GPU node a spare of the inference job took over
4.4 s, and the first jobs of a batch whose inputs settled in 5 s used to start cold beside
it). A job with no such spare starts cold, as always.
A spare no job came for ends by itself after ``local_job.SPARE_IDLE_SECONDS`` (a job sent to it
then is refused, and starts cold), or when the daemon stops (its socket's end of file,
whether the daemon stopped or was killed); the daemon reaps it at its next look.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import time
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass

import structlog

from daemon.contract.jobspec import RESIDENT_DEVICE_ENV
from daemon.executors.local_job import COPIED, COPY, ENDED, READY, SPARE, SPARE_IDLE_SECONDS
from daemon.site.subprocesses import exited, process_start_ticks, reap, spawn

LAUNCHER = "daemon.executors.local_job"
END_GRACE_SECONDS = 5.0  # a spare told to end and still there then is killed
# set for each job at its fork, not at the spare's start: its GPUs, its resident device's socket
PER_JOB_ENV = ("CUDA_VISIBLE_DEVICES", RESIDENT_DEVICE_ENV)
# A spare that ended before it said ready (a wrapper in executor.local.python that cannot
# serve, a broken environment): no other of its kind for this long, doubled at each such end
# up to SPARE_IDLE_SECONDS, rather than one started at every look (the jobs start cold).
FAILED_PAUSE_SECONDS = 60.0
# A job waits for a spare of its kind still importing while the spare is younger than this;
# an older one is taken for stuck (a share that hangs an import), and the job starts cold.
READY_WAIT_SECONDS = 30.0
# A spare asked for a copy answers within this (two forks: milliseconds), or none is made.
COPY_WAIT_SECONDS = 5.0

log = structlog.get_logger("watchd")


@dataclass
class Spare:
    """A launcher started ahead, waiting for its job on ``channel``."""

    pid: int
    ticks: int
    module: str
    env: dict[str, str]
    channel: socket.socket
    ready: bool = False  # its imports are done (it said so)
    started: float = 0.0  # time.monotonic() when it was started
    watched: bool = False  # the executor's loop wakes at its word
    ready_after: float | None = None  # seconds from its start to its word
    copied: bool = False  # forked from another spare, not started by the daemon: no child of it

    @property
    def handle(self) -> str:
        return f"local:{self.pid}:{self.ticks}"

    def alive(self) -> bool:
        """Whether it still runs (reaping it if it ended)."""
        return exited(self.pid) is None and process_start_ticks(self.pid) == self.ticks

    def says_ready(self) -> bool:
        """Whether its imports are done: its word read, without waiting (with the monotonic
        clock when it said so, shared by every process here: how long its imports took)."""
        if not self.ready:
            with contextlib.suppress(OSError):
                word = self.channel.recv(64, socket.MSG_DONTWAIT)
                self.ready = word.startswith(READY)
                with contextlib.suppress(ValueError):
                    if self.ready and self.started:
                        self.ready_after = float(word[len(READY) :]) - self.started
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
        # by module and environment: spares that ended unready in a row, and until when none
        # of the kind is started
        self._failing: dict[tuple[str, frozenset[tuple[str, str]]], tuple[int, float]] = {}
        # by module and environment: the seconds the last spare seen ready took to say so
        self._imports: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}

    def take(
        self, module: str, env: Mapping[str, str], promised: Set[int] = frozenset(),
        replace: bool = False,
    ) -> Spare | None:  # fmt: skip
        """The longest-waiting live spare of ``module`` started in the job's ``env`` whose
        imports are done, not in ``promised`` (spares that other jobs wait for: :meth:`coming`;
        the caller hands it the job or ends it), or None (always, for a module not warmed).
        ``replace``: a copy of it waits in its place (where one can be made, and fewer than
        ``count`` others of its kind wait)."""
        self.tend()
        for spare in self._of_kind(module, env, promised):
            if self._ready(spare):
                self._waiting.remove(spare)
                self._failing.pop(_kind(spare.module, spare.env), None)
                others = len(self._of_kind(module, env, frozenset()))
                if replace and others < self.count and (copy := _copy(spare)) is not None:
                    self._waiting.append(copy)
                return spare
        return None

    def _of_kind(self, module: str, env: Mapping[str, str], promised: Set[int]) -> list[Spare]:
        """The waiting spares of ``module`` started in the job's ``env``, oldest first, less
        those in ``promised`` (none, for a module not warmed)."""
        if module not in self.modules:
            return []
        wanted = spare_env(env)
        return [s for s in self._waiting
                if s.module == module and s.env == wanted and s.pid not in promised]  # fmt: skip

    def _ready(self, spare: Spare) -> bool:
        """Whether ``spare`` said it is ready; the time its imports took (its own clock's
        word, not when this looked) is noted for its kind."""
        if not spare.says_ready():
            return False
        if spare.ready_after is not None:
            self._imports[_kind(spare.module, spare.env)] = spare.ready_after
        return True

    def coming(self, module: str, env: Mapping[str, str], promised: Set[int]) -> Spare | None:
        """The oldest live spare of ``module`` in the job's ``env`` still importing, whose pid
        is not in ``promised`` (spares another job already waits for), or None: what a job
        with no ready spare waits for. Only one past half the time the last spare of its kind
        took to say ready (a cold start overlaps its imports with its workers' first reads: on
        two busy cores, waiting for a spare just started cost a shard a second), and younger
        than :data:`READY_WAIT_SECONDS`; before any of its kind said ready, any younger one."""
        now = time.monotonic()
        half = self._imports.get(_kind(module, spare_env(env)), 0.0) / 2
        for spare in self._of_kind(module, env, promised):
            if (half <= now - spare.started < READY_WAIT_SECONDS and spare.alive()
                    and not self._ready(spare)):  # fmt: skip
                return spare
        return None

    def top_up(self, module: str, env: Mapping[str, str]) -> None:
        """Start spares of ``module`` in the job's ``env`` until ``count`` wait, copies of a
        ready one where one waits (none for a module not warmed; a spare that cannot be started
        is left out: the jobs start cold)."""
        if module not in self.modules:
            return
        wanted = spare_env(env)
        failing = self._failing.get(_kind(module, wanted))
        if failing is not None and time.monotonic() < failing[1]:
            return
        kind = self._of_kind(module, wanted, frozenset())
        template = next((s for s in kind if self._ready(s) and s.alive()), None)
        for _ in range(self.count - len(kind)):
            spare = _copy(template) if template is not None else None
            try:
                self._waiting.append(spare or self._start(module, wanted))
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
        return Spare(pid, process_start_ticks(pid) or 0, module, env, ours,
                     started=time.monotonic())  # fmt: skip

    def tend(self) -> None:
        """Forget the spares that ended (waited too long, or failed), reaping them; one that
        ended before it said ready pauses the start of others of its kind."""
        for spare in list(self._waiting):
            if not spare.alive():
                self._waiting.remove(spare)
                if not spare.says_ready():
                    self._ended_unready(spare)
                spare.channel.close()
            else:
                self._ready(spare)  # the time its imports took, noted as soon as seen

    def _ended_unready(self, spare: Spare) -> None:
        kind = _kind(spare.module, spare.env)
        times = self._failing.get(kind, (0, 0.0))[0] + 1
        pause = min(FAILED_PAUSE_SECONDS * 2 ** (times - 1), SPARE_IDLE_SECONDS)
        self._failing[kind] = (times, time.monotonic() + pause)
        log.warning("warm start ended before its imports were done; its jobs start cold",
                    module=spare.module, pid=spare.pid, times=times, next_in_s=pause)  # fmt: skip

    def waiting(self) -> list[Spare]:
        return list(self._waiting)

    def close(self) -> None:
        """End every spare still waiting (none has a job: ending them loses nothing)."""
        for spare in self._waiting:
            end(spare)
        self._waiting.clear()


def _kind(module: str, env: Mapping[str, str]) -> tuple[str, frozenset[tuple[str, str]]]:
    return module, frozenset(env.items())


def _copy(template: Spare) -> Spare | None:
    """A copy of the ready spare ``template``, forked from it, ready at once; None where it
    cannot make one in :data:`COPY_WAIT_SECONDS` (gone, no processes left: the caller starts
    one, or the job starts cold)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    word = b""
    try:
        socket.send_fds(template.channel, [COPY], [theirs.fileno()])
        if select.select([template.channel], [], [], COPY_WAIT_SECONDS)[0]:
            word = template.channel.recv(64)
    except OSError:
        pass
    finally:
        theirs.close()
    pid = int(word[len(COPIED) :]) if word[len(COPIED) :].isdigit() else 0
    ticks = process_start_ticks(pid) if word.startswith(COPIED) and pid else None
    if ticks is None:
        ours.close()  # a copy made too late reads its end of file, and ends
        return None
    return Spare(pid, ticks, template.module, template.env, ours, ready=True,
                 started=time.monotonic(), copied=True)  # fmt: skip


def end_word(channel: socket.socket) -> int | None:
    """The exit status a launcher said as its last word on ``channel`` (:data:`ENDED`), or
    None: none yet, or none comes (it was killed; its end of file)."""
    while True:
        try:
            word = channel.recv(64, socket.MSG_DONTWAIT)
        except OSError:
            return None
        if not word:
            return None
        with contextlib.suppress(ValueError):
            if word.startswith(ENDED):
                return int(word[len(ENDED) :])
        # else the answer to a copy request that came too late: read past it


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
    caller reaps it with :func:`end` and starts the job cold). The caller keeps the spare's
    socket (its launcher's exit status, :func:`end_word`) or closes it."""
    request = {"job_dir": job_dir, "limit": limit, "stall": stall, "command": list(command),
               "env": dict(env)}  # fmt: skip
    socket.send_fds(spare.channel, [json.dumps(request).encode()], [log_fd])
