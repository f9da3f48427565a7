"""The records of watchd: batches, jobs, events, intents, drop roots, the heartbeat. Frozen
values, as the store returns them; nothing here touches the database."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from daemon.contract.jobspec import ErrorKind, Identity, InputFile, Pipeline, Problem, Role
from daemon.core.manifest_schema import Kind
from daemon.core.owners import Owner
from daemon.core.states import BatchState, JobState


@dataclass(frozen=True)
class Batch:
    id: int
    root: str
    folder: str
    revision: int
    manifest_sha256: str
    manifest_stat: str
    kind: Kind | None  # None: the manifest was refused before its kind was known
    title: str
    owner: str
    contact: str | None
    state: BatchState
    reason: str
    problems: tuple[Problem, ...]
    detail: str = field(repr=False)
    run_dir: str
    watch_inputs: str  # failed for incomplete inputs: their fingerprint then ('' otherwise)
    created_at: float
    updated_at: float
    finished_at: float | None
    folder_device: int | None = None  # the folder's identity when the batch was taken in
    folder_inode: int | None = None
    root_inode: int | None = None  # the drop root's inode then (a share mounted again: another)
    # The folder's owner as the share reported it at intake (None: taken in before it was
    # recorded); the names as this host resolved them then.
    owner_uid: int | None = None
    owner_gid: int | None = None
    owner_user: str = ""
    owner_group: str = ""
    hold: str = ""  # why a queued batch does not start (its owner's quota); '' when it may

    @property
    def owned_by(self) -> Owner | None:
        """The folder's owner, who is charged for the batch (None: not recorded)."""
        if self.owner_uid is None or self.owner_gid is None:
            return None
        return Owner(self.owner_uid, self.owner_gid, self.owner_user, self.owner_group)

    @property
    def path(self) -> Path:
        return Path(self.root) / self.folder

    @property
    def identity(self) -> Identity | None:
        """The batch folder it was taken in from (None for batches recorded before)."""
        if self.folder_device is None or self.folder_inode is None:
            return None
        return Identity(self.folder_device, self.folder_inode, self.root_inode)


@dataclass(frozen=True)
class NewBatch:
    root: str
    folder: str
    manifest_sha256: str
    manifest_text: str
    manifest_stat: str
    kind: Kind | None
    title: str
    owner: str
    contact: str | None
    run_dir: str
    folder_device: int | None = None
    folder_inode: int | None = None
    root_inode: int | None = None
    owner_uid: int | None = None
    owner_gid: int | None = None
    owner_user: str = ""
    owner_group: str = ""


@dataclass(frozen=True)
class Job:
    id: int
    batch_id: int
    name: str
    pipeline: Pipeline
    stage: int
    shard_index: int
    shard_count: int
    state: JobState
    attempts: int
    executor: str
    handle: str | None
    exit_code: int | None
    error_kind: ErrorKind | None
    reason: str
    created_at: float
    updated_at: float
    submitted_at: float | None
    finished_at: float | None
    # This job's own parameters (a sweep trial's point), merged over the manifest's [params].
    params: Mapping[str, Any] = field(default_factory=dict)
    # ``attempts`` when an operator last started the job afresh (retry, requeue): attempts keep
    # counting, so every submission has its own number; the retry budget counts from here.
    attempts_base: int = 0
    images: int = 0  # an inference job's images
    images_done: int = 0  # … done, as its progress file said when last read
    due_at: float | None = None  # … when it expects to end, as that file said (None: unknown)

    @property
    def tries(self) -> int:
        """Attempts since the operator's last fresh start (what the retry budget counts)."""
        return self.attempts - self.attempts_base


def images_progress(jobs: Sequence[Job]) -> tuple[int, int]:
    """(images done, images) over a batch's inference jobs: a succeeded job's images all, a
    running one's as its progress file last said."""
    done = sum(j.images if j.state is JobState.SUCCEEDED else j.images_done for j in jobs)
    return done, sum(j.images for j in jobs)


@dataclass(frozen=True)
class NewJob:
    name: str
    pipeline: Pipeline
    stage: int
    shard_index: int
    shard_count: int
    inputs: tuple[InputFile, ...]
    executor: str
    inherit_inputs: bool = False  # take the inputs of the batch's stage-0 jobs (the report)
    params: Mapping[str, Any] = field(default_factory=dict)  # merged over the manifest's

    @property
    def images(self) -> int:
        """The images this job counts towards its batch's progress: an inference shard's; a
        slide split in regions counts once, in its first region's job."""
        if self.pipeline is not Pipeline.INFER:
            return 0
        region = self.params.get("region")
        images = sum(1 for item in self.inputs if item.role is Role.IMAGE)
        return images if region is None or region["index"] == 0 else 0


@dataclass(frozen=True)
class Event:
    """One line of the audit log: a state change (of a job when ``job_id`` is set, else of its
    batch), or a note (no states)."""

    id: int
    at: float
    batch_id: int | None
    job_id: int | None
    from_state: BatchState | JobState | None
    to_state: BatchState | JobState | None
    reason: str
    detail: str


class IntentAction(enum.Enum):
    """What an operator asks for with ``watchctl``: of a batch, or of a drop root."""

    RETRY = "retry"  # run the failed jobs of a failed or cancelled batch again
    CANCEL = "cancel"
    REQUEUE = "requeue"  # run every job again, a done batch's too
    PAUSE = "pause"  # take in no new batch from the root
    RESUME = "resume"
    QUOTA = "quota"  # set (or lift) an owner's or a group's quota: of a subject

    @property
    def on_subject(self) -> bool:
        return self is IntentAction.QUOTA

    @property
    def on_root(self) -> bool:
        return self in (IntentAction.PAUSE, IntentAction.RESUME)


@dataclass(frozen=True)
class Intent:
    """An operator's request, applied by the daemon: on a batch (retry, cancel, requeue), on
    a drop root (pause, resume) or on a subject (``user:alice``, ``group:lab``: a quota, its
    ``value`` the quota as JSON); exactly one of ``batch_id``, ``root`` and ``subject`` is set."""

    id: int
    at: float
    action: IntentAction
    batch_id: int | None
    requested_by: str
    applied_at: float | None
    outcome: str
    root: str | None = None
    subject: str | None = None
    value: str = ""


@dataclass(frozen=True)
class RootRecord:
    """What the daemon made of pause and resume intents on one drop root."""

    path: str
    paused: bool
    paused_by: str
    paused_at: float | None


@dataclass(frozen=True)
class Heartbeat:
    pid: int
    host: str
    version: str
    started_at: float
    beat_at: float
    stopped_at: float | None
    info: dict[str, Any]


@dataclass(frozen=True)
class JobChange:
    """Fields that change with a job's state; None means 'leave as it is'."""

    handle: str | None = None
    exit_code: int | None = None
    error_kind: ErrorKind | None = None
    new_attempt: bool = False
    reset_attempts: bool = False
    forgive_attempt: bool = False  # the attempt yielded its slot: not counted against the budget
