"""The one state machine: batch and job states with their transition tables.

Pure. The store is the only writer of a state, and it checks every change against these
tables inside the transaction that also appends the audit event.

Batch lifecycle::

    manifest found ─▶ WAITING ─inputs complete, settled─▶ QUEUED ─first job out─▶ RUNNING ─▶ DONE
         │               │                                  │                      │
         │ invalid       │ timeout, bad input               │                      │
         ▼               ▼                                  ▼                      ▼
       FAILED ◀──────────┴──────────────────────────────────┴──────────────────────┘
    (WAITING, QUEUED and RUNNING also go to CANCELLED: an operator's cancel, or a newer
    revision of the manifest superseding this one)

A batch that failed or was cancelled goes back to WAITING on an operator's retry; a batch that
is DONE goes back to WAITING on a requeue. Every other state change is refused.

Job lifecycle::

    PENDING ──submit──▶ SUBMITTED ──starts──▶ RUNNING ──result──▶ SUCCEEDED | FAILED
       ▲  │                 │                   │
       │  └─ refused ──▶ FAILED / CANCELLED ◀───┘ (cancel, or ended without a result)
       └──────── retry ◀───────┘
       └──────── requeue ◀── SUCCEEDED (an operator's requeue runs every job of the batch again)

A pending job goes to FAILED when the executor refuses it for good (e.g. Slurm refused it
``max_refusals`` times): it never ran, and its batch fails with the executor's word.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping


class Phase(enum.Enum):
    """What the executor says of a job it was given."""

    QUEUED = "queued"
    RUNNING = "running"
    ENDED = "ended"
    UNKNOWN = "unknown"  # no record of it: forgotten by the executor, or never started


class BatchState(enum.Enum):
    WAITING = "waiting"  # accepted; waiting for every input to be present, complete and settled
    QUEUED = "queued"  # inputs ready; jobs planned, none submitted yet
    RUNNING = "running"  # at least one job handed to the executor
    DONE = "done"  # every job succeeded and the report is written
    FAILED = "failed"  # ended with a reason the data owner can act on
    CANCELLED = "cancelled"  # stopped by an operator or superseded by a newer manifest

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_BATCH_STATES


class JobState(enum.Enum):
    PENDING = "pending"  # planned; not handed to the executor (again) yet
    SUBMITTED = "submitted"  # the executor has it; not started
    RUNNING = "running"
    SUCCEEDED = "succeeded"  # its result file says ok
    FAILED = "failed"  # its result file says why, or it ended without one
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_JOB_STATES

    @property
    def live(self) -> bool:
        """Handed to the executor and not known to have ended."""
        return self in (JobState.SUBMITTED, JobState.RUNNING)


TERMINAL_BATCH_STATES = frozenset({BatchState.DONE, BatchState.FAILED, BatchState.CANCELLED})
TERMINAL_JOB_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})

# A batch is created in one of these (a valid manifest waits; an invalid one fails at once).
INITIAL_BATCH_STATES = frozenset({BatchState.WAITING, BatchState.FAILED})

BATCH_TRANSITIONS: Mapping[BatchState, frozenset[BatchState]] = {
    BatchState.WAITING: frozenset({BatchState.QUEUED, BatchState.FAILED, BatchState.CANCELLED}),
    BatchState.QUEUED: frozenset({BatchState.RUNNING, BatchState.FAILED, BatchState.CANCELLED}),
    BatchState.RUNNING: frozenset({BatchState.DONE, BatchState.FAILED, BatchState.CANCELLED}),
    BatchState.DONE: frozenset({BatchState.WAITING}),  # requeue
    BatchState.FAILED: frozenset({BatchState.WAITING}),  # retry
    BatchState.CANCELLED: frozenset({BatchState.WAITING}),  # retry
}

JOB_TRANSITIONS: Mapping[JobState, frozenset[JobState]] = {
    JobState.PENDING: frozenset({JobState.SUBMITTED, JobState.FAILED, JobState.CANCELLED}),
    JobState.SUBMITTED: frozenset(
        {JobState.RUNNING, JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED}
    ),
    JobState.RUNNING: frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED}),
    JobState.SUCCEEDED: frozenset({JobState.PENDING}),  # requeue
    JobState.FAILED: frozenset({JobState.PENDING}),  # retry
    JobState.CANCELLED: frozenset({JobState.PENDING}),  # retry
}


def batch_can_move(current: BatchState | None, target: BatchState) -> bool:
    """Whether a batch may go from ``current`` (None: not created yet) to ``target``."""
    if current is None:
        return target in INITIAL_BATCH_STATES
    return target in BATCH_TRANSITIONS[current]


def job_can_move(current: JobState | None, target: JobState) -> bool:
    """Whether a job may go from ``current`` (None: not created yet) to ``target``."""
    if current is None:
        return target is JobState.PENDING
    return target in JOB_TRANSITIONS[current]
