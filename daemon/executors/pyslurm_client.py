"""The Slurm client over pyslurm's object API: JobSubmitDescription, Job, Jobs, Partitions.

pyslurm is built against one Slurm release and must match the site's (pyslurm 22.5.x for Slurm
22.05, 25.11.x for 25.11): ``pip install watchd[slurm]`` takes PyPI's newest; see docs/slurm.md.
This is the only module that imports pyslurm, and only through :func:`load`, which guards the
import: with libslurm present but no slurm.conf, ``import pyslurm`` blocks for about a minute
and then ends the whole process. So :func:`load` first checks that the configuration file
exists, then imports pyslurm in a child process (with a timeout), and imports it here only
when the child succeeded. Whatever fails becomes one ``ExecutorUnavailable`` line.

The translation between watchd's requests and records and pyslurm's objects is pure
(:func:`submit_fields`, :func:`records_of`, :func:`transient`) and tested without pyslurm.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from daemon.contract.errors import CommandFailed, ExecutorUnavailable, SubmissionError
from daemon.executors.slurm_api import JobRecord, JobRequest, Versions
from daemon.executors.slurm_cli import TRANSIENT
from daemon.site.subprocesses import run

DEFAULT_CONF = Path("/etc/slurm/slurm.conf")
PROBE = "import pyslurm; print(pyslurm.__version__)"
PROBE_TIMEOUT = 30.0

# Slurm error numbers that mean "the controller is away or busy, try again later".
TRANSIENT_ERRNOS = frozenset(
    {11, 1800, 1801, 1802, 1803, 5004, 5005}  # EAGAIN, socket/connection, timeouts, zero bytes
)
# A cancel answered with these found nothing to stop: the job is unknown (purged after
# MinJobAge) or already done. Not an error: a kept cancel is delivered once it gets this far.
GONE_ERRNOS = frozenset({2017, 2021})  # ESLURM_INVALID_JOB_ID, ESLURM_ALREADY_DONE


def config_path(slurm_conf: Path | None, environment: Mapping[str, str]) -> Path:
    """The slurm.conf libslurm will read: the configured one, else SLURM_CONF, else Slurm's."""
    if slurm_conf is not None:
        return slurm_conf
    return Path(environment["SLURM_CONF"]) if environment.get("SLURM_CONF") else DEFAULT_CONF


def load(slurm_conf: Path | None, environment: Mapping[str, str]) -> PyslurmClient:
    """Import pyslurm safely; raise ExecutorUnavailable with one line saying why not."""
    conf = config_path(slurm_conf, environment)
    if not conf.is_file():
        raise ExecutorUnavailable(
            f"pyslurm: no Slurm configuration at {conf} (set executor.slurm.slurm_conf or "
            "SLURM_CONF); not importing pyslurm, which would hang without one"
        )
    env = {**environment, "SLURM_CONF": str(conf)}
    try:
        version = run([sys.executable, "-c", PROBE], timeout=PROBE_TIMEOUT, env=env).strip()
    except CommandFailed as exc:
        lines = (exc.stderr or exc.stdout).strip().splitlines()
        why = lines[-1] if lines else f"exit code {exc.returncode}"
        raise ExecutorUnavailable(f"pyslurm cannot be imported here: {why}") from None
    # libslurm reads SLURM_CONF from this process's environment when pyslurm is imported.
    os.environ["SLURM_CONF"] = str(conf)
    import pyslurm

    return PyslurmClient(pyslurm, version, os.getuid())


def submit_fields(request: JobRequest) -> dict[str, Any]:
    """JobSubmitDescription's keyword arguments for a request (sbatch's options, as fields)."""
    fields: dict[str, Any] = {
        "name": request.name,
        "comment": request.comment,
        "script": str(request.script),  # a path: pyslurm reads the file
        "working_directory": str(request.work_dir),
        "standard_output": request.output,  # relative to the working directory
        "time_limit": int(request.time_minutes),  # an int: a string of digits is refused
        "memory_per_node": int(request.memory_mb),
        "cpus_per_task": request.cpus_per_task,
        "ntasks": request.ntasks,
        "is_requeueable": False,
        "environment": dict(request.environment),
    }
    optional = {
        "gres_per_node": f"gpu:{request.gpus}" if request.gpus else None,
        "array": request.array,
        "partitions": request.partition or None,
        "account": request.account or None,
        "qos": request.qos or None,
        "constraints": request.constraint or None,
    }
    return fields | {k: v for k, v in optional.items() if v is not None}


def _get(job: Any, name: str) -> Any:
    return job.get(name) if isinstance(job, Mapping) else getattr(job, name, None)


def records_of(jobs: Iterable[Any], uid: int | None = None) -> list[JobRecord]:
    """Records from pyslurm Jobs (or dicts with the same keys), one per job or array task.

    The pending tasks of an array share one record whose ``array_tasks_waiting`` lists them
    ("4-9" or "1,3,5-7"); ``array_task_id`` is None for task 0 (pyslurm reads 0 as unset).
    """
    records = []
    for job in jobs:
        if uid is not None and _get(job, "user_id") not in (uid, None):
            continue
        fields = {
            "state": str(_get(job, "state") or ""),
            "reason": str(_get(job, "state_reason") or ""),
            "exit_code": _get(job, "exit_code"),
            "comment": str(_get(job, "comment") or ""),
        }
        array_id = _get(job, "array_id")
        if array_id is None:
            records.append(JobRecord(str(_get(job, "id")), **fields))
            continue
        waiting = _get(job, "array_tasks_waiting")
        tasks = expand(waiting) if waiting else [_get(job, "array_task_id") or 0]
        records += [JobRecord(f"{array_id}_{task}", **fields) for task in tasks]
    return records


def expand(tasks: str) -> list[int]:
    """ "1,3,5-7" (a throttle "%K" or step ":S" allowed) → [1, 3, 5, 6, 7]."""
    found: list[int] = []
    for part in tasks.split("%", 1)[0].split(","):
        span, _, step = part.partition(":")
        first, _, last = span.partition("-")
        if first.strip().isdigit():
            end = int(last) if last.strip().isdigit() else int(first)
            found += range(int(first), end + 1, int(step) if step.isdigit() else 1)
    return found


def transient(errno: int | None, message: str) -> bool:
    """Whether a pyslurm RPCError may pass if tried again later."""
    return errno in TRANSIENT_ERRNOS or bool(TRANSIENT.search(message))


def arrays_to_cancel(job_ids: Sequence[str]) -> list[int]:
    """The job ids to signal for these jobs and array tasks.

    pyslurm's object API signals a job by its own id; a pending array task has none (it shares
    its array's record), so a task is cancelled with its whole array. watchd only cancels
    whole batches, whose live tasks are all its arrays' tasks.
    """
    return sorted({int(job_id.split("_", 1)[0]) for job_id in job_ids})


class PyslurmClient:
    name = "pyslurm"

    def __init__(self, module: ModuleType, version: str, uid: int) -> None:
        self.pyslurm = module
        self.version = version
        self.uid = uid
        self.counts: Counter[str] = Counter()

    def _call(self, kind: str, fn: Any, *args: Any) -> Any:
        """Call pyslurm. Only a refused submission is a SubmissionError; any other failure
        means Slurm cannot tell us now (ExecutorUnavailable)."""
        self.counts[kind] += 1
        try:
            return fn(*args)
        except (self.pyslurm.RPCError, ValueError) as exc:  # the older API raises ValueError
            errno = getattr(exc, "errno", None)
            if errno is None and len(exc.args) > 1 and isinstance(exc.args[1], int):
                errno = exc.args[1]
            text = f"pyslurm: {exc}"
            if kind == "cancel" and errno in GONE_ERRNOS:
                return None
            if kind == "submit" and not transient(errno, str(exc)):
                raise SubmissionError(text) from None
            raise ExecutorUnavailable(text) from None

    def submit(self, request: JobRequest) -> str:
        description = self.pyslurm.JobSubmitDescription(**submit_fields(request))
        return str(self._call("submit", description.submit))

    def jobs(self) -> list[JobRecord]:
        loaded = self._call("jobs", self.pyslurm.Jobs.load)
        return records_of(loaded.values(), self.uid)

    def cancel(self, job_ids: Sequence[str]) -> None:
        for job_id in arrays_to_cancel(job_ids):
            self._call("cancel", self.pyslurm.Job(job_id).cancel)

    def versions(self) -> Versions:
        controller = self._call("versions", self._controller_version)
        return Versions(f"pyslurm {self.version}", controller)

    def _controller_version(self) -> str:
        config = getattr(self.pyslurm, "slurmctld", None)
        loaded = config.Config.load() if config is not None else None
        version = getattr(loaded, "version", None)  # pyslurm 25.x
        if version is None:  # pyslurm 22.5: the older dict API has it
            version = self.pyslurm.config().get().get("version")
        return str(version or "unknown")

    def partitions(self) -> list[str]:
        loaded = self._call("partitions", self.pyslurm.Partitions.load)
        return sorted(str(p.name) for p in loaded.values())
