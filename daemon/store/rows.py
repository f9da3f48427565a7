"""Rows to records and back, for every part of the store: the column lists, the decoders,
and the ``casefold`` SQL function."""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from daemon.contract.jobspec import ErrorKind, Pipeline, Problem
from daemon.core.manifest_schema import Kind
from daemon.core.records import Batch, Event, Intent, IntentAction, Job
from daemon.core.states import BatchState, JobState

_BATCH_COLUMNS = ", ".join(Batch.__dataclass_fields__)  # all but the manifest's text
_JOB_COLUMNS = ", ".join(
    f.name
    for f in Job.__dataclass_fields__.values()  # every column but the inputs
)


def _storable(row_id: int) -> bool:
    """Whether an id can name a row at all: SQLite's integers are 64 bits, and a larger one
    (``watchctl show 1000000000000000000000000000000``) names no batch rather than overflowing."""
    return -(2**63) <= row_id < 2**63


def _casefold(text: str | None) -> str:
    return (text or "").casefold()


def _dump_problems(problems: Sequence[Problem]) -> str:
    return json.dumps([asdict(p) for p in problems], ensure_ascii=False)


def _event(row: dict[str, Any]) -> Event:
    state = BatchState if row["job_id"] is None else JobState
    row = dict(row)
    for key in ("from_state", "to_state"):
        row[key] = state(row[key]) if row[key] is not None else None
    return Event(**row)


def _value(member: enum.Enum | None) -> Any:
    """An enum's value as a column holds it (None stays None)."""
    return None if member is None else member.value


def _batch(row: dict[str, Any]) -> Batch:
    row = dict(row)
    row["state"] = BatchState(row["state"])
    row["kind"] = None if row["kind"] is None else Kind(row["kind"])
    row["problems"] = tuple(Problem(**p) for p in json.loads(row["problems"]))
    return Batch(**row)


def _job(row: dict[str, Any]) -> Job:
    row = dict(row)
    row["params"] = json.loads(row["params"])
    row["state"] = JobState(row["state"])
    row["pipeline"] = Pipeline(row["pipeline"])
    row["error_kind"] = None if row["error_kind"] is None else ErrorKind(row["error_kind"])
    return Job(**row)


def _intent(row: dict[str, Any]) -> Intent:
    return Intent(**{**row, "action": IntentAction(row["action"])})
