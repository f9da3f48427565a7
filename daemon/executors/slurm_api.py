"""The narrow interface between the Slurm executor and Slurm, with its two implementations:
the command-line tools (:mod:`daemon.executors.slurm_cli`, any Slurm release) and pyslurm
(:mod:`daemon.executors.pyslurm_client`, locked to one release).

A client says what it could not do with the errors of :mod:`daemon.contract.errors`:
``ExecutorUnavailable`` when the controller cannot be reached or asks to try again later (the
executor backs off and tries again), ``SubmissionError`` when Slurm refused the request itself.
Every client counts the calls it makes to Slurm, by kind, in ``counts`` (submit, jobs, cancel,
versions, partitions).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from daemon.core.states import Phase


@dataclass(frozen=True)
class JobRequest:
    """One batch job or job array, with every option as a value (never a shell string)."""

    name: str
    comment: str  # watchd's key: how a restarted daemon finds what it submitted
    script: Path  # a fixed template with quoted paths only (slurm_launch.job_script)
    work_dir: Path
    output: str  # Slurm's output file for the job script (/dev/null: see slurm_launch)
    time_minutes: int
    memory_mb: int
    cpus_per_task: int = 1
    ntasks: int = 1
    gpus: int = 0
    array: str | None = None  # e.g. "0-859%50"
    partition: str = ""
    account: str = ""
    qos: str = ""
    constraint: str = ""
    environment: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class JobRecord:
    """What the controller says of one job, or of one task of an array (``id`` "123_4")."""

    id: str
    state: str  # Slurm's word: PENDING, RUNNING, COMPLETED, FAILED, TIMEOUT, ...
    reason: str = ""
    exit_code: int | None = None
    comment: str = ""

    @property
    def array_id(self) -> str:
        return self.id.split("_", 1)[0]


@dataclass(frozen=True)
class Versions:
    client: str  # e.g. "cli 22.05.8" or "pyslurm 22.5.3"
    controller: str  # the controller's Slurm release, e.g. "22.05.8"


class SlurmClient(Protocol):
    name: str
    counts: Counter[str]

    def submit(self, request: JobRequest) -> str:
        """Submit; the job id (of the array, for an array)."""

    def jobs(self) -> list[JobRecord]:
        """This user's jobs the controller remembers, every array task on its own: one call."""

    def cancel(self, job_ids: Sequence[str]) -> None:
        """Cancel jobs and array tasks ("123", "123_4"); ones already gone are no error."""

    def versions(self) -> Versions: ...

    def partitions(self) -> list[str]: ...


QUEUED_STATES = frozenset(
    {"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD"}
)
# COMPLETING counts as running: the job's processes may still be writing.
RUNNING_STATES = frozenset(
    {"RUNNING", "COMPLETING", "SIGNALING", "STAGE_OUT", "SUSPENDED", "STOPPED", "RESIZING"}
)
ENDED_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL",
     "DEADLINE", "PREEMPTED", "SPECIAL_EXIT", "REVOKED"}
)  # fmt: skip


def phase_of(state: str) -> Phase:
    """Slurm's state word (as squeue or pyslurm spells it) as a Phase."""
    word = state.strip().upper().split()[0].rstrip("+") if state.strip() else ""
    if word in QUEUED_STATES:
        return Phase.QUEUED
    if word in RUNNING_STATES:
        return Phase.RUNNING
    if word in ENDED_STATES:
        return Phase.ENDED
    return Phase.UNKNOWN


def exit_status(raw: int) -> int:
    """A wait status as Slurm keeps it (``256`` for exit 1) as a shell would say it: the exit
    code, or 128 + the signal for a job killed by one."""
    signal = raw & 0x7F
    return 128 + signal if signal else (raw >> 8) & 0xFF


def describe(record: JobRecord) -> str:
    """Slurm's word on a job, for people: ``FAILED (NonZeroExitCode)``."""
    reason = record.reason if record.reason not in ("", "None", "(null)") else ""
    return f"{record.state} ({reason})" if reason else record.state


def release(text: str) -> tuple[int, int] | None:
    """The major.minor of a Slurm or pyslurm version string: "slurm 22.05.8" and "22.5.3" are
    both (22, 5): pyslurm numbers its releases after Slurm's without the leading zero."""
    match = re.search(r"(\d+)\.(\d+)", text)
    return (int(match.group(1)), int(match.group(2))) if match else None
