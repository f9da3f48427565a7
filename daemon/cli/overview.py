"""What ``watchctl`` shows, as plain data: liveness from the heartbeat, counts, the drop roots,
running and failed batches, lists of batches and jobs, one batch in full. Pure; the CLI renders
it as tables or as JSON.
"""

from __future__ import annotations

import datetime as dt
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

from daemon.core import visible
from daemon.core.records import Batch, Event, Heartbeat, Intent, Job, RootRecord, images_progress
from daemon.core.states import BatchState, JobState
from daemon.site.claims import Holder


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
    """A batch with its jobs counted by state and, for inference, its images done."""
    done, images = images_progress(jobs)
    return {
        **batch_row(batch, Counter(j.state for j in jobs)),
        "images_done": done,
        "images_total": images,
    }


def batch_row(batch: Batch, jobs: Mapping[JobState, int]) -> dict[str, Any]:
    """A batch with its jobs counted by state."""
    return {
        "id": batch.id,
        "folder": batch.folder,
        "root": batch.root,
        "revision": batch.revision,
        "kind": batch.kind.value if batch.kind else None,
        "state": batch.state.value,
        "owner": batch.owner,
        "owner_user": batch.owner_user,
        "owner_group": batch.owner_group,
        "reason": batch.reason,
        "hold": batch.hold,
        "jobs_done": jobs.get(JobState.SUCCEEDED, 0),
        "jobs_total": sum(jobs.values()),
        "jobs_running": sum(n for state, n in jobs.items() if state.live),
        "created_at": iso(batch.created_at),
        "updated_at": iso(batch.updated_at),
    }


def status(
    live: dict[str, Any],
    counts: dict[BatchState, int],
    active: Sequence[tuple[Batch, Sequence[Job]]],
    failures: Sequence[tuple[Batch, Sequence[Job]]],
    roots: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    return {
        "daemon": live,
        "counts": {state.value: n for state, n in counts.items()},
        "roots": list(roots),
        "active": [batch_summary(b, j) for b, j in active],
        "recent_failures": [
            {**batch_summary(b, j), "problems": [p.render() for p in b.problems[:5]]}
            for b, j in failures
        ],
    }


def batch_detail(
    batch: Batch, jobs: Sequence[Job], events: Sequence[Event], intents: Sequence[Intent] = ()
) -> dict[str, Any]:
    """A batch in full, with the operators' requests on it and what the daemon made of them."""
    return {
        **batch_summary(batch, jobs),
        "path": str(batch.path),
        "run_dir": batch.run_dir,
        "manifest_sha256": batch.manifest_sha256,
        "contact": batch.contact,
        "title": batch.title,
        "problems": [asdict(p) for p in batch.problems],
        "detail": batch.detail,
        "jobs": [job_summary(j) for j in jobs],
        "requests": [
            {
                "id": i.id,
                "at": iso(i.at),
                "action": i.action.value,
                "by": i.requested_by,
                "applied_at": iso(i.applied_at),
                "outcome": i.outcome if i.applied_at is not None else "pending",
            }
            for i in intents
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


def job_summary(job: Job) -> dict[str, Any]:
    return {
        "id": job.id,
        "batch_id": job.batch_id,
        "name": job.name,
        "pipeline": job.pipeline.value,
        "state": job.state.value,
        "attempts": job.attempts,
        "handle": job.handle,
        "exit_code": job.exit_code,
        "error_kind": job.error_kind.value if job.error_kind else None,
        "reason": job.reason,
        "updated_at": iso(job.updated_at),
    }


def roots(
    configured: Sequence[str],
    records: Sequence[RootRecord],
    info: Mapping[str, Any],
    leases: Mapping[str, Holder | None],
    database: str,
    now: float,
) -> list[dict[str, Any]]:
    """The configured drop roots, in order (their index names them in watchctl), with how the
    daemon last said it watches each (``info``: the heartbeat's), whether one is paused, and
    which daemon holds its lease (``held_elsewhere``: one with another ``database``)."""
    paused = {r.path: r for r in records if r.paused}
    modes, lost = info.get("roots", {}), set(info.get("lost_roots", ()))
    return [
        {
            "index": index,
            "path": path,
            "mode": modes.get(path),
            "lost": path in lost,
            "paused": path in paused,
            "paused_by": paused[path].paused_by if path in paused else None,
            "paused_at": iso(paused[path].paused_at) if path in paused else None,
            **lease(leases.get(path), database, now),
        }
        for index, path in enumerate(configured)
    ]


def lease(holder: Holder | None, database: str, now: float) -> dict[str, Any]:
    """A drop root's lease: who holds it (as written in it) and whether that is another daemon
    than this configuration's."""
    if holder is None:
        return {"lease": None, "held_elsewhere": False}
    held = {
        "holder": holder.describe(), "host": holder.host, "pid": holder.pid,
        "database": holder.database, "renewed_at": iso(holder.renewed_at),
        "renewed_s_ago": round(now - holder.renewed_at, 1),
    }  # fmt: skip
    return {"lease": held, "held_elsewhere": holder.database != database}


def iso(at: float | None) -> str | None:
    if at is None:
        return None
    return dt.datetime.fromtimestamp(at, dt.UTC).isoformat(timespec="seconds")


def to_json(data: Any) -> str:
    """What ``--json`` prints: faithful, and safe on a terminal (see :mod:`daemon.core.visible`)."""
    return visible.to_json(data, indent=2)
