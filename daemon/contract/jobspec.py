"""The contract between the daemon and the programs that jobs run.

A job is ``python -m pipelines.<pipeline> JOB_DIR``. The daemon writes ``JOB_DIR/spec.json``
(a :class:`JobSpec`, JSON, never a pickle) before it submits; the pipeline writes
``JOB_DIR/result.json`` (a :class:`JobResult`) as its last act, atomically. The local and the
Slurm executor launch the identical command, and an operator can run it by hand. ``JOB_DIR``
lies in the service's spool (:mod:`daemon.contract.spool`), never in a batch folder: a job
trusts the spec it reads there, and the owner of the batch folder cannot write it.

The result file, not the executor's exit status, is the truth of what a job did: a cluster
forgets finished jobs and a restarted daemon has no exit status for a process it did not start.
A job that ended without a result file crashed (killed, out of memory) and may be retried.

This module is pure data and JSON; the pipelines import it, the daemon writes it.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SPEC_VERSION = 2  # 2: job folders in the spool (work_dir)
SPEC_FILE = "spec.json"
RESULT_FILE = "result.json"
PROGRESS_FILE = "progress.json"  # an inference job's images done so far and when it expects to end:
# {"done": n, "total": m, "due_at": wall-clock seconds or null}
LOG_FILE = "log.txt"
# The socket of the resident device an inference job hands its batches to (the local executor's
# executor.local.resident_device: pipelines/inference/remote.py), in the job's environment
RESIDENT_DEVICE_ENV = "WATCHD_RESIDENT_DEVICE"
# Set ("1") for every job and warm start of an executor with resident devices: an inference job's
# warm start then imports no torch (its job hands its batches over)
RESIDENT_DEVICES_ENV = "WATCHD_RESIDENT_DEVICES"
JOBS_DIR = "jobs"  # under a run's work folder (in the spool): one folder per job
LOGS_DIR = "logs"  # under a run's results folder (the owner's): each ended job's log, copied


def owner_log(job_name: str) -> str:
    """Where the owner reads a job's log, below the run's results folder."""
    return f"{LOGS_DIR}/{job_name}.log"


class Pipeline(enum.Enum):
    """The programs a job can run: ``python -m pipelines.<value>``."""

    TRAIN = "train"
    INFER = "infer"
    SWEEP = "sweep"  # compares a sweep's trials and registers the best
    ASSEMBLE = "assemble"  # the label images of slides split across inference jobs
    REPORT = "report"

    @property
    def module(self) -> str:
        return f"pipelines.{self.value}"


class ErrorKind(enum.Enum):
    """Why a job failed; decides whether running it again can help."""

    INPUT = "input"  # the data or the manifest is wrong: the owner must act, no retry
    MODEL = "model"  # the named model is missing or refused: no retry
    INTERNAL = "internal"  # a bug or a resource problem: retried up to the attempt limit
    LOST = "lost"  # the daemon's word, never a job's: it ended without a result (killed, OOM)

    @property
    def retryable(self) -> bool:
        return self in (ErrorKind.INTERNAL, ErrorKind.LOST)


def job_dir(work_dir: str | Path, name: str) -> Path:
    """The folder of job ``name`` of a run, in the run's work folder in the spool: its spec,
    result, progress, log and launch record."""
    return Path(work_dir) / JOBS_DIR / name


class Role(enum.Enum):
    """What an input is to its batch."""

    IMAGE = "image"
    MASK = "mask"  # ground truth for training, paired with the image of the same file stem


@dataclass(frozen=True)
class InputFile:
    """One input of a batch, as the manifest lists it (paths relative to the batch folder)."""

    path: str
    size: int | None = None
    sha256: str | None = None
    role: Role = Role.IMAGE

    def as_dict(self) -> dict[str, Any]:
        """The fields as JSON takes them: ``dataclasses.asdict`` copies deeply and costs some
        20 µs an input, a second for the 55,000 inputs of one batch."""
        return {
            "path": self.path,
            "size": self.size,
            "sha256": self.sha256,
            "role": self.role.value,
        }

    @classmethod
    def from_dict(cls, item: Mapping[str, Any]) -> InputFile:
        return cls(item["path"], item.get("size"), item.get("sha256"), Role(item["role"]))


def inputs_json(inputs: Sequence[InputFile]) -> list[dict[str, Any]]:
    return [item.as_dict() for item in inputs]


@dataclass(frozen=True)
class ModelRef:
    """A model in the registry: a name and a version number, ``latest`` or ``best``."""

    name: str
    version: str = "latest"


@dataclass(frozen=True)
class Shard:
    index: int = 0
    count: int = 1


@dataclass(frozen=True)
class Resources:
    """What one job may use. ``tasks`` > 1: that many processes (DDP ranks), each with ``cpus``
    threads and ``gpus`` GPUs; under Slurm they are started by ``srun`` (``--ntasks``)."""

    cpus: int = 1
    gpus: int = 0
    tasks: int = 1


@dataclass(frozen=True)
class Identity:
    """Which folder a name meant when it was accepted: its device and inode, and the drop
    root's inode then (the rule that holds a folder by it is
    :mod:`daemon.contract.heldfolder`'s)."""

    device: int
    inode: int
    root: int | None = None  # None: not known (batches taken in before it was recorded)

    @classmethod
    def of(cls, st: os.stat_result, root: os.stat_result | None = None) -> Identity:
        return cls(st.st_dev, st.st_ino, None if root is None else root.st_ino)

    def same(self, other: Identity) -> bool:
        """Whether ``other`` is this folder. A folder swapped under the name has another inode
        in the same drop root. The device number is not compared, and a drop root that is
        itself another (its inode changed too) means the share was mounted again: an NFS or
        sshfs outage brings the same folders back under new numbers (sshfs numbers inodes
        afresh at every mount)."""
        if self.inode == other.inode:
            return True
        return None not in (self.root, other.root) and self.root != other.root


@dataclass(frozen=True)
class JobSpec:
    """Everything a pipeline needs, with absolute paths; written by the daemon as spec.json.

    ``run_dir`` is the run's results folder in the batch folder (the owner's: only what is
    meant for the owner is written there, through the held batch folder); ``work_dir`` the
    run's folder in the spool (the service's: what the jobs hand each other)."""

    job_id: int
    job_name: str
    pipeline: Pipeline
    attempt: int
    batch_id: int
    batch_revision: int
    batch_kind: str
    batch_dir: str
    run_dir: str
    work_dir: str
    manifest_sha256: str
    inputs: tuple[InputFile, ...]
    model: ModelRef
    registry_dir: str
    params: Mapping[str, Any] = field(default_factory=dict)
    shard: Shard = Shard()
    resources: Resources = Resources()
    title: str = ""
    # The batch folder the batch was taken in from: a job holds batch_dir only if it is still
    # that folder (None: not checked, for specs written before it was recorded, or by hand).
    batch_identity: Identity | None = None
    spec_version: int = SPEC_VERSION

    @property
    def job_dir(self) -> Path:
        return job_dir(self.work_dir, self.job_name)

    def to_json(self) -> str:
        data = dataclasses.asdict(dataclasses.replace(self, inputs=()))
        data["inputs"] = inputs_json(self.inputs)
        data["pipeline"] = self.pipeline.value
        data["params"] = dict(self.params)
        return json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> JobSpec:
        data = json.loads(text)
        if data.get("spec_version") != SPEC_VERSION:
            raise ValueError(f"unsupported job spec version {data.get('spec_version')!r}")
        data["pipeline"] = Pipeline(data["pipeline"])
        data["inputs"] = tuple(InputFile.from_dict(item) for item in data["inputs"])
        data["model"] = ModelRef(**data["model"])
        data["shard"] = Shard(**data["shard"])
        data["resources"] = Resources(**data["resources"])
        identity = data.get("batch_identity")
        data["batch_identity"] = None if identity is None else Identity(**identity)
        return cls(**data)


@dataclass(frozen=True)
class Problem:
    """One thing wrong, said so that the data owner can act: where, what, and what to do."""

    where: str
    message: str
    hint: str = ""

    def render(self) -> str:
        text = f"{self.where}: {self.message}" if self.where else self.message
        return f"{text} — {self.hint}" if self.hint else text


MAX_PROBLEMS = 20  # listed for one batch; the rest are counted (status file, log, database)


def summarised(problems: Sequence[Problem], limit: int = MAX_PROBLEMS) -> tuple[Problem, ...]:
    """The first ``limit`` problems, then one saying how many more there were: what a data
    owner reads (and the log and the database keep) stays small whatever the input."""
    if len(problems) <= limit:
        return tuple(problems)
    more = f"{len(problems) - limit:,}".replace(",", " ")
    return (*problems[:limit], Problem("", f"… and {more} more like these"))


@dataclass(frozen=True)
class JobError:
    kind: ErrorKind
    message: str
    problems: tuple[Problem, ...] = ()
    traceback: str = ""


@dataclass(frozen=True)
class JobResult:
    """What a pipeline reports when it ends; written last, atomically, as result.json."""

    ok: bool
    pipeline: str
    finished_at: str
    summary: Mapping[str, Any] = field(default_factory=dict)
    error: JobError | None = None

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["summary"] = dict(self.summary)
        if self.error is not None:
            data["error"]["kind"] = self.error.kind.value
        return json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> JobResult:
        data = json.loads(text)
        error = data.get("error")
        if error is not None:
            data["error"] = JobError(
                kind=ErrorKind(error["kind"]),
                message=error["message"],
                problems=tuple(Problem(**p) for p in error.get("problems", ())),
                traceback=error.get("traceback", ""),
            )
        return cls(**data)
