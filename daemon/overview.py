"""What ``watchctl`` shows, as plain data: liveness from the heartbeat, counts, running and
failed batches, one batch in full. Pure; the CLI renders it as tables or as JSON.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from daemon.records import Batch, Event, Heartbeat, Job
from daemon.states import BatchState, JobState


def liveness(
    beat: Heartbeat | None, now: float, heartbeat_seconds: float, pid_alive: bool | None
) -> dict[str, Any]:
    """Whether the daemon is alive: a recent heartbeat, no clean stop since, and (when it runs
    on this host) its process still there."""
    if beat is None:
        return {"alive": False, "state": "never started", "heartbeat_age_s": None}
    age = now - beat.beat_at
    if beat.stopped_at is not None:
        state, alive = f"stopped at {iso(beat.stopped_at)}", False
    elif pid_alive is False or age > 3 * heartbeat_seconds + 5:
        state, alive = f"not running (last heartbeat {age:.0f} s ago)", False
    else:
        state, alive = "running", True
    return {
        "alive": alive,
        "state": state,
        "pid": beat.pid,
        "host": beat.host,
        "version": beat.version,
        "started_at": iso(beat.started_at),
        "heartbeat_age_s": round(age, 1),
        "info": beat.info,
    }


def batch_summary(batch: Batch, jobs: Sequence[Job]) -> dict[str, Any]:
    done = sum(1 for j in jobs if j.state is JobState.SUCCEEDED)
    return {
        "id": batch.id,
        "folder": batch.folder,
        "root": batch.root,
        "revision": batch.revision,
        "kind": batch.kind,
        "state": batch.state.value,
        "owner": batch.owner,
        "reason": batch.reason,
        "jobs_done": done,
        "jobs_total": len(jobs),
        "jobs_running": sum(1 for j in jobs if j.state.live),
        "created_at": iso(batch.created_at),
        "updated_at": iso(batch.updated_at),
    }


def status(
    live: dict[str, Any],
    counts: dict[BatchState, int],
    active: Sequence[tuple[Batch, Sequence[Job]]],
    failures: Sequence[tuple[Batch, Sequence[Job]]],
) -> dict[str, Any]:
    return {
        "daemon": live,
        "counts": {state.value: n for state, n in counts.items()},
        "active": [batch_summary(b, j) for b, j in active],
        "recent_failures": [
            {**batch_summary(b, j), "problems": [p.render() for p in b.problems[:5]]}
            for b, j in failures
        ],
    }


def batch_detail(batch: Batch, jobs: Sequence[Job], events: Sequence[Event]) -> dict[str, Any]:
    return {
        **batch_summary(batch, jobs),
        "path": str(batch.path),
        "run_dir": batch.run_dir,
        "manifest_sha256": batch.manifest_sha256,
        "contact": batch.contact,
        "title": batch.title,
        "problems": [asdict(p) for p in batch.problems],
        "detail": batch.detail,
        "jobs": [
            {
                "id": j.id,
                "name": j.name,
                "pipeline": j.pipeline.value,
                "state": j.state.value,
                "attempts": j.attempts,
                "handle": j.handle,
                "exit_code": j.exit_code,
                "error_kind": j.error_kind,
                "reason": j.reason,
            }
            for j in jobs
        ],
        "history": [
            {
                "at": iso(e.at),
                "job_id": e.job_id,
                "from": e.from_state.value if e.from_state else None,
                "to": e.to_state.value if e.to_state else None,
                "reason": e.reason,
            }
            for e in events
        ],
    }


def iso(at: float | None) -> str | None:
    if at is None:
        return None
    return dt.datetime.fromtimestamp(at, dt.UTC).isoformat(timespec="seconds")


def to_json(data: Any) -> str:
    return json.dumps(data, indent=2, ensure_ascii=False)
