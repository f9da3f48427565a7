"""The local executor: jobs as subprocesses of this machine, at most ``max_parallel`` at once.

Each job runs in its own session, so it outlives a daemon that is stopped or killed; a handle
``local:PID:START`` names the process for good (the start time tells a reused pid apart), and
``launch.json`` in the job directory lets a restarted daemon find a job it started before. The
process started is :mod:`daemon.executors.local_job`, which runs the job as its child and ends
it when it runs past its time limit or makes no progress for ``stall_minutes`` (limits it keeps
while the daemon is away); the job's exit status is its own. An inference or report job is
handed to such a launcher started ahead, its imports done, where one waits (``warm_starts``,
:mod:`daemon.executors.spares`: started behind an inference job, and where the planner expects
a job, :meth:`LocalExecutor.expect`); ``launch.json`` says so (``"warm": true``), and names it
before the job is handed over. Such a launcher may be a copy forked from another (no child of
this process): its exit status comes as its last word on its socket, kept open for it.

The job's folder is in the spool (:mod:`daemon.contract.spool`, the service's own): its log is
opened there by the daemon and handed to the child.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence

from daemon.contract.heldfolder import HeldFolder, UnsafeEntry
from daemon.contract.jobspec import LOG_FILE, RESIDENT_DEVICES_ENV, Pipeline, Resources
from daemon.core.manifest import ResourceRequest
from daemon.core.states import Phase
from daemon.executors import (
    Accepted,
    Check,
    Deferred,
    Handover,
    Refused,
    Status,
    Submission,
    resources,
    spares,
)
from daemon.executors.gpus import GpuSeats, visible
from daemon.executors.local_job import ended_why
from daemon.executors.resident import Residents
from daemon.executors.spares import LAUNCHER, Spare, Spares
from daemon.site.config import JobShapes, LocalExecutorSection
from daemon.site.subprocesses import (
    ExitWatch,
    exited,
    find_process,
    process_start_ticks,
    reap,
    runs,
    signal_group,
    spawn,
)

LAUNCH_FILE = "launch.json"
CANCEL_GRACE_SECONDS = 10.0
# A start that failed for want of processes, memory or file descriptors may work later; any
# other failure (no such interpreter, not executable) will fail every time.
PASSING = frozenset({errno.EAGAIN, errno.ENOMEM, errno.EMFILE, errno.ENFILE})


class LocalExecutor:
    name = "local"

    def __init__(
        self,
        *,
        max_parallel: int,
        python: str = "",
        env: Mapping[str, str] | None = None,
        limits: LocalExecutorSection | None = None,
        warm: Sequence[str] = (Pipeline.INFER.module, Pipeline.REPORT.module),
    ) -> None:
        """``limits``: the site's [executor.local] (threads, GPUs and tasks jobs get and may ask
        for); its defaults where not given. ``warm``: the job modules whose jobs start from
        spares (``limits.warm_starts`` of them)."""
        self.max_parallel = max_parallel
        self.limits = limits or LocalExecutorSection()
        self.python = python or sys.executable
        self.env = dict(env or {})
        self._children: dict[str, int] = {}  # handle → pid of the jobs this executor started
        # handle → socket of the jobs handed to copies of spares (no children: their launchers'
        # exit statuses come on these, spares.end_word)
        self._reports: dict[str, socket.socket] = {}
        self._ending: list[int] = []  # children cancelled, not yet seen to exit
        self._exits: ExitWatch | None = None
        gpus = self.limits.gpus
        self.seats = GpuSeats(gpus, self.limits.jobs_per_gpu) if gpus else None
        self.spares = Spares(self.python, self.limits.warm_starts, warm)
        self.residents: Residents | None = None  # the inference jobs' nets (resident_device)
        if self.limits.resident_device:
            threads = {"OMP_NUM_THREADS": str(self.limits.cpus_per_job)}
            self.residents = Residents(self.python, gpus, {**self.env, **threads})

    def slots(self) -> int | None:
        return self.max_parallel

    def width(self) -> int | None:
        """Inference jobs side by side: ``max_parallel``, and where GPUs are handed out, no
        more than their seats hold (each job ``inference_gpus`` of them)."""
        per_job = self.limits.inference_gpus
        if self.seats is None or not per_job:
            return self.max_parallel
        return max(1, min(self.max_parallel, self.seats.seats // per_job))

    def bounds(self) -> dict[str, int]:
        return resources.local_bounds(self.limits)

    def allocation(self, pipeline: Pipeline, request: ResourceRequest) -> Resources:
        shapes = JobShapes(inference_gpus=self.limits.inference_gpus)
        return resources.given(request, pipeline, self.limits.cpus_per_job, shapes, self.bounds())

    def result_grace(self) -> float:
        return 0.0  # a local job writes its result on this host: it is there when the job ends

    def wake_on_end(self, wake: Callable[[], None]) -> None:
        """A job's end wakes the loop at once: the next job starts without waiting a tick."""
        self._exits = ExitWatch(wake)

    def expect(self, pipeline: Pipeline, given: Resources) -> None:
        """Start the warm starts of ``pipeline``'s coming jobs now, so that even the first job
        of a burst finds one ready (none for a pipeline not warmed)."""
        resident = self._resident(pipeline.module, given.gpus)
        if resident and self.residents is not None:
            self.residents.start_all()  # torch imported, CUDA started, while the batch settles
        self.spares.top_up(pipeline.module, self._job_env({}, given.cpus, resident))

    def _resident(self, module: str, gpus: int) -> bool:
        """Whether a job of ``module`` given ``gpus`` GPUs hands its batches to a resident
        device: an inference job, where there are resident devices, given a GPU where they are
        handed out."""
        if self.residents is None or module != Pipeline.INFER.module:
            return False
        return gpus > 0 or self.seats is None

    def _job_env(self, extra: Mapping[str, str], cpus: int, resident: bool = False
                 ) -> dict[str, str]:  # fmt: skip
        """A job's environment (its GPUs aside): the executor's, the submission's, its CPUs,
        and whether resident devices run the nets (its warm start then imports no torch)."""
        env = {**self.env, **extra, "OMP_NUM_THREADS": str(cpus)}
        if resident:
            env[RESIDENT_DEVICES_ENV] = "1"
        return env

    def _watch(self, handle: str) -> str:
        if self._exits is not None:
            self._exits.watch(_pid(handle))
        return handle

    def submit(self, submissions: Sequence[Submission]) -> list[Handover]:
        promised: set[int] = set()  # spares still importing that a job of these waits for
        return [self._hand_over(s, promised) for s in submissions]

    def _hand_over(self, sub: Submission, promised: set[int]) -> Handover:
        adopted = self._adopt(sub)
        return Accepted(self._watch(adopted)) if adopted else self._start(sub, promised)

    def _start(self, sub: Submission, promised: set[int]) -> Handover:
        limit = 60 * min(sub.resources.time_minutes or self.limits.time_minutes,
                         self.limits.max_time_minutes)  # fmt: skip
        stall = 60 * self.limits.stall_minutes
        supervisor = [self.python, "-m", LAUNCHER, str(sub.job_dir), str(limit), str(stall), "--"]
        job = [self.python, "-m", sub.module, str(sub.job_dir)]
        command = [*supervisor, *job]
        resident = self._resident(sub.module, sub.gpus)
        env = self._job_env(sub.env, sub.cpus, resident)
        gpus: tuple[int, ...] = ()
        if self.seats is not None:  # each job its own GPUs
            found = self.seats.free(sub.gpus * sub.tasks)
            if found is None:
                return Deferred(f"{sub.name} waits for {sub.gpus * sub.tasks} GPU(s) of "
                                f"{len(self.seats.jobs)}: every one has its jobs")  # fmt: skip
            gpus = found
            env.update(visible(gpus))
        if resident and self.residents is not None:
            env.update(self.residents.env_for(gpus))
        try:
            with sub.held_job_dir() as held:
                # a batch's report is its last job: no spare of its kind is kept behind it
                replace = sub.module != Pipeline.REPORT.module
                spare = self.spares.take(sub.module, env, promised, replace)
                if spare is None:
                    if coming := self._coming(sub, env, promised):
                        return coming
                    spare = self.spares.take(sub.module, env, promised, replace)  # ready now
                handle = None
                if spare is not None:
                    handle = self._warm_start(held, spare, job, limit, stall, env, gpus)
                if handle is None:
                    pid = _spawn_logged(held, command, env)
                    handle = self._started(held, pid, command, gpus)
        except UnsafeEntry as exc:
            return Refused(f"cannot start {sub.name}: {exc}: remove it, watchd makes it itself")
        except OSError as exc:
            reason = f"cannot start {sub.name}: {exc}"
            return Deferred(reason) if exc.errno in PASSING else Refused(reason)
        if sub.module != Pipeline.REPORT.module:  # a batch's last: the planner expects the next
            self.spares.top_up(sub.module, env)  # where none was copied: imports while this runs
        return Accepted(self._watch(handle))

    def _coming(self, sub: Submission, env: dict[str, str], promised: set[int]) -> Deferred | None:
        """Defer ``sub`` for a spare of its kind still importing (none promised to another job
        of this submission), and wake the loop at the spare's word; None: none comes."""
        spare = self.spares.coming(sub.module, env, promised)
        if spare is None:
            return None
        promised.add(spare.pid)
        if self._exits is not None and not spare.watched:
            self._exits.watch_readable(spare.channel.fileno())
            spare.watched = True
        return Deferred(f"{sub.name} waits for its warm start, importing for "
                        f"{time.monotonic() - spare.started:.1f} s", quiet=True)  # fmt: skip

    def _warm_start(
        self, held: HeldFolder, spare: Spare, job: list[str], limit: int, stall: float,
        env: Mapping[str, str], gpus: tuple[int, ...],
    ) -> str | None:  # fmt: skip
        """Hand the job to ``spare``, its ``launch.json`` written first (a daemon that dies
        before the spare has it leaves a spare that ends at once, and a record of a process
        that runs no job): its handle, or None (the job starts cold)."""
        try:
            log_fd = held.open_append(LOG_FILE)
        except OSError:
            spares.end(spare)
            raise
        try:
            self._record(held, spare.handle, spare.pid, job, gpus, warm=True)
            spares.hand_over(spare, job[-1], limit, stall, job, env, log_fd)
        except OSError:
            spares.end(spare)
            return None
        finally:
            os.close(log_fd)
        if not spare.copied:
            spare.channel.close()  # our child: its exit status is waited for
            return self._keep(spare.handle, spare.pid, gpus)
        self._reports[spare.handle] = spare.channel
        return self._keep(spare.handle, 0, gpus)

    def _started(
        self, held: HeldFolder, pid: int, command: list[str], gpus: tuple[int, ...]
    ) -> str:
        """Keep the started child and write its ``launch.json`` (if that cannot be written,
        a restarted daemon finds the job by its command line instead): its handle."""
        ticks = process_start_ticks(pid)
        handle = self._keep(f"local:{pid}:{ticks if ticks is not None else 0}", pid, gpus)
        with contextlib.suppress(OSError):
            self._record(held, handle, pid, command, gpus)
        return handle

    def _keep(self, handle: str, pid: int, gpus: tuple[int, ...]) -> str:
        """Keep a job started here (``pid``: our child; 0: a copy's, :attr:`_reports`)."""
        if pid:
            self._children[handle] = pid
        if self.seats is not None:
            self.seats.hold(handle, gpus)
        return handle

    @staticmethod
    def _record(
        held: HeldFolder, handle: str, pid: int, command: list[str], gpus: tuple[int, ...],
        warm: bool = False,
    ) -> None:  # fmt: skip
        record = {"handle": handle, "pid": pid, "command": command, "gpus": list(gpus),
                  "warm": warm}  # fmt: skip
        held.write_text(LAUNCH_FILE, json.dumps(record))

    def _adopt(self, sub: Submission) -> str | None:
        """The handle of this job's process if an earlier daemon started it and it still runs.

        ``launch.json`` names it; if the earlier daemon died between starting the job and
        writing that down (the log file, opened first, is there), the job's own command line
        finds it."""
        try:
            with sub.held_job_dir() as held:
                handle, gpus, warm = _recorded(held)
                started = held.exists(LOG_FILE)
        except OSError:
            return None  # no job folder to read (or a planted one): nothing started from it
        argv_tail = ["-m", sub.module, str(sub.job_dir)]
        launched = spares.spare_argv(self.python, sub.module)[1:] if warm else argv_tail
        if handle and _alive(handle) and runs(_pid(handle), launched):
            if self.seats is not None:
                self.seats.hold(handle, gpus)  # its GPUs stay its own
            return handle
        if not started:
            return None
        found = find_process(argv_tail, leader=True)  # the launcher, not the job it runs
        return f"local:{found[0]}:{found[1]}" if found else None

    def poll(self, handles: Sequence[str]) -> dict[str, Status]:
        self._ending = [pid for pid in self._ending if exited(pid) is None]  # reap the cancelled
        self.spares.tend()
        if self.residents is not None:
            self.residents.tend()
        return {h: self._status(h) for h in handles}

    def _status(self, handle: str) -> Status:
        if handle in self._reports:
            return self._reported(handle)
        pid = self._children.get(handle)
        if pid is None:
            if _alive(handle):
                return Status(Phase.RUNNING)
            self._free(handle)
            return Status(Phase.UNKNOWN)
        code = exited(pid)
        if code is None:
            return Status(Phase.RUNNING)
        del self._children[handle]
        self._free(handle)
        return Status(Phase.ENDED, code, ended_why(code))

    def _reported(self, handle: str) -> Status:
        """The status of a job handed to a copy of a spare: its launcher's last word, read
        after it was seen alive or gone (a word said just before it ended is not missed)."""
        alive = _alive(handle)
        code = spares.end_word(self._reports[handle])
        if code is None and alive:
            return Status(Phase.RUNNING)
        self._reports.pop(handle).close()
        self._free(handle)
        if code is None:  # killed with no word (SIGKILL): its result says, as for an adopted job
            return Status(Phase.UNKNOWN)
        return Status(Phase.ENDED, code, ended_why(code))

    def _free(self, handle: str) -> None:
        if self.seats is not None:
            self.seats.release(handle)

    def cancel(self, handles: Sequence[str]) -> None:
        for handle in handles:
            if _alive(handle):
                signal_group(_pid(handle), signal.SIGTERM)
            pid = self._children.pop(handle, None)
            if pid is not None:
                self._ending.append(pid)
            if (channel := self._reports.pop(handle, None)) is not None:
                channel.close()
            self._free(handle)

    def close(self) -> None:
        """Forget the running children (they keep running; a later daemon re-adopts them) and
        see the cancelled ones end, killing those that ignore SIGTERM for long."""
        for pid in self._ending:
            reap(pid, CANCEL_GRACE_SECONDS)
        self._ending.clear()
        self._children.clear()
        for channel in self._reports.values():
            channel.close()  # their launchers' last words go unsaid: a later daemon adopts them
        self._reports.clear()
        self.spares.close()
        if self.residents is not None:
            self.residents.close()
        if self._exits is not None:
            self._exits.close()

    def self_test(self) -> list[Check]:
        if not os.access(self.python, os.X_OK):
            hint = "set executor.local.python to a Python with watchd[train] installed"
            return [Check("local executor", False, f"{self.python} is not executable", hint)]
        detail = f"{self.python}, {self.max_parallel} job(s) at once"
        return [Check("local executor", True, detail)]


def _spawn_logged(held: HeldFolder, command: list[str], env: Mapping[str, str]) -> int:
    """Start the job with its output appended to ``log.txt``, opened here by the rule."""
    log_fd = held.open_append(LOG_FILE)
    try:
        return spawn(command, log_fd=log_fd, env=env)
    finally:
        os.close(log_fd)


def _recorded(held: HeldFolder) -> tuple[str, list[int], bool]:
    """The handle ``launch.json`` records in a held job folder (or ''), its GPUs, and whether
    the job went to a spare."""
    try:
        with held.open_read(LAUNCH_FILE) as file:
            record = json.loads(file.read())
        gpus = record.get("gpus", [])
        warm = record.get("warm", False) is True
        return str(record["handle"]), [g for g in gpus if isinstance(g, int)], warm
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return "", [], False


def _pid(handle: str) -> int:
    return int(handle.split(":")[1])


def _alive(handle: str) -> bool:
    try:
        _, pid, ticks = handle.split(":")
    except ValueError:
        return False
    return process_start_ticks(int(pid)) == int(ticks)
