"""The Slurm client over Slurm's command-line tools: sbatch, squeue, scancel, scontrol, sinfo.

Works with any Slurm release. The text in and out of the tools is made and read by pure
functions (tested with strings); commands run through :mod:`daemon.site.subprocesses`, as argument
lists, never through a shell.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from daemon.contract.errors import CommandFailed, ExecutorUnavailable, SubmissionError
from daemon.executors.slurm_api import JobRecord, JobRequest, Versions, exit_status
from daemon.site.subprocesses import run

# One line per job or array task: id|array id|state|reason|wait status|comment. The comment is
# last: it is split off whole whatever it holds.
SQUEUE_FORMAT = "JobArrayID:|,ArrayJobID:|,State:|,Reason:|,exit_code:|,Comment:"

# What the tools print when the controller is away or busy: worth trying again later.
TRANSIENT = re.compile(
    r"unable to contact slurm controller|socket timed out|resource temporarily unavailable"
    r"|temporarily unable|zero bytes were transmitted|connection refused|try again"
    r"|communication connection failure|timed out after",
    re.IGNORECASE,
)


def sbatch_args(request: JobRequest) -> list[str]:
    """The sbatch command line for a request: every option an argument, the script last."""
    args = [
        "sbatch", "--parsable", "--no-requeue",
        f"--job-name={request.name}",
        f"--comment={request.comment}",
        f"--chdir={request.work_dir}",
        f"--output={request.output}",
        f"--time={request.time_minutes}",
        f"--mem={request.memory_mb}M",
        f"--cpus-per-task={request.cpus_per_task}",
        f"--ntasks={request.ntasks}",
    ]  # fmt: skip
    if request.gpus:
        args.append(f"--gres=gpu:{request.gpus}")
    if request.array:
        args.append(f"--array={request.array}")
    for option, value in (
        ("partition", request.partition),
        ("account", request.account),
        ("qos", request.qos),
        ("constraint", request.constraint),
    ):
        if value:
            args.append(f"--{option}={value}")
    return [*args, str(request.script)]


def parse_sbatch(stdout: str) -> str:
    """The job id that ``sbatch --parsable`` printed ("123" or "123;cluster")."""
    lines = [line for line in stdout.strip().splitlines() if line.strip()]
    if not lines:
        raise SubmissionError("sbatch printed no job id")
    job_id = lines[-1].split(";", 1)[0].strip()
    if not job_id.isdigit():
        raise SubmissionError(f"sbatch printed {lines[-1]!r}, not a job id")
    return job_id


def parse_squeue(stdout: str) -> list[JobRecord]:
    """Records from squeue in :data:`SQUEUE_FORMAT`; lines that do not fit are skipped."""
    records = []
    for line in stdout.splitlines():
        parts = line.split("|", 5)
        if len(parts) != 6 or not parts[0].strip():
            continue
        job_id, _, state, reason, raw_exit, comment = (p.strip() for p in parts)
        records.append(
            JobRecord(
                id=job_id,
                state=state,
                reason=reason,
                exit_code=exit_status(int(raw_exit)) if raw_exit.isdigit() else None,
                comment="" if comment == "(null)" else comment,
            )
        )
    return records


def compress_ids(job_ids: Iterable[str]) -> list[str]:
    """Job ids as few as scancel needs: array tasks of one array as ``123_[1,3-5]``."""
    singles: list[str] = []
    tasks: dict[str, list[int]] = {}
    for job_id in dict.fromkeys(job_ids):
        base, sep, task = job_id.partition("_")
        if sep and task.isdigit():
            tasks.setdefault(base, []).append(int(task))
        else:
            singles.append(job_id)
    return singles + [f"{base}_[{_ranges(sorted(ts))}]" for base, ts in tasks.items()]


def _ranges(numbers: Sequence[int]) -> str:
    parts, start = [], 0
    for i in range(1, len(numbers) + 1):
        if i == len(numbers) or numbers[i] != numbers[i - 1] + 1:
            first, last = numbers[start], numbers[i - 1]
            parts.append(str(first) if first == last else f"{first}-{last}")
            start = i
    return ",".join(parts)


def parse_show_config(stdout: str) -> dict[str, str]:
    """``scontrol show config`` as a mapping (``SLURM_VERSION = 22.05.8``: "22.05.8")."""
    found = {}
    for line in stdout.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() and " " not in key.strip():
            found[key.strip()] = value.strip()
    return found


def transient(exc: CommandFailed) -> bool:
    """Whether a failed tool call may succeed later (the controller is away or busy)."""
    return exc.returncode == 124 or bool(TRANSIENT.search(exc.stderr + exc.stdout))


class CliClient:
    name = "cli"

    def __init__(self, *, environment: Mapping[str, str], timeout: float) -> None:
        self.environment = dict(environment)
        self.timeout = timeout
        self.counts: Counter[str] = Counter()

    def _run(self, kind: str, command: Sequence[str], env: Mapping[str, str] | None = None) -> str:
        """Run one tool. Only a refused submission is a SubmissionError; any other failure
        means Slurm cannot tell us now (ExecutorUnavailable)."""
        self.counts[kind] += 1
        try:
            return run(command, timeout=self.timeout, env=env or self.environment)
        except CommandFailed as exc:
            lines = (exc.stderr or exc.stdout).strip().splitlines()
            said = f"{command[0]} exited with {exc.returncode}: {lines[-1] if lines else ''}"
            if kind == "submit" and not transient(exc):
                raise SubmissionError(said) from None
            raise ExecutorUnavailable(said) from None

    def submit(self, request: JobRequest) -> str:
        return parse_sbatch(self._run("submit", sbatch_args(request), request.environment))

    def jobs(self) -> list[JobRecord]:
        command = ["squeue", "--me", "--noheader", "--array", "--states=all"]
        return parse_squeue(self._run("jobs", [*command, f"--Format={SQUEUE_FORMAT}"]))

    def cancel(self, job_ids: Sequence[str]) -> None:
        if job_ids:
            self._run("cancel", ["scancel", "--quiet", *compress_ids(job_ids)])

    def versions(self) -> Versions:
        client = self._run("versions", ["sbatch", "--version"]).strip()
        config = parse_show_config(self._run("versions", ["scontrol", "show", "config"]))
        return Versions(f"cli {client.split()[-1]}", config.get("SLURM_VERSION", "unknown"))

    def partitions(self) -> list[str]:
        out = self._run("partitions", ["sinfo", "--noheader", "--format=%R"])
        return sorted({line.strip() for line in out.splitlines() if line.strip()})
