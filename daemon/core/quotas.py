"""Quotas: what an owner or a group may use per calendar day or month (UTC), and whether a batch
may start under them. Pure.

A quota counts images (those of the subject's batches that ended this period, and of its
batches still running: committed), CPU-hours and GPU-hours (what the subject's jobs measured,
as their attempts ended this period). A batch whose owner's or group's quota would be passed
waits QUEUED before its first job; one already running goes on to its end. Its status line says
whose quota it is, how much is used, and when it frees: at the start of the next period, or when
an operator raises it (``watchctl quota``).
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass

from daemon.core.owners import Period, Quota


@dataclass(frozen=True)
class Used:
    images: int = 0
    cpu_hours: float = 0.0
    gpu_hours: float = 0.0


@dataclass(frozen=True)
class Account:
    """One subject's quota and what it used in the quota's current period."""

    subject: str  # user:alice or group:lab
    quota: Quota
    used: Used
    since: float  # the period's start
    frees_at: float  # the next period's start
    set_by: str = ""  # who set it with watchctl quota ('' : the site's config.toml)


def period(per: Period, now: float) -> tuple[float, float]:
    """The UTC calendar day or month ``now`` falls in: (start, end) as timestamps."""
    at = dt.datetime.fromtimestamp(now, dt.UTC)
    if per is Period.DAY:
        start = at.replace(hour=0, minute=0, second=0, microsecond=0)
        end = start + dt.timedelta(days=1)
    else:
        start = at.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        end = (start + dt.timedelta(days=32)).replace(day=1)
    return start.timestamp(), end.timestamp()


def _when(at: float) -> str:
    return dt.datetime.fromtimestamp(at, dt.UTC).strftime("%Y-%m-%d %H:%M UTC")


def _whose(subject: str) -> str:
    kind, _, name = subject.partition(":")
    return f"{'group' if kind == 'group' else 'user'} {name}"


def refusal(account: Account, images: int) -> str:
    """Why a batch of ``images`` images may not start under ``account`` ('' when it may)."""
    quota, used = account.quota, account.used
    per = "today" if quota.per is Period.DAY else f"this {quota.per.value}"
    said = ""
    if quota.images is not None and used.images + images > quota.images:
        need = f"this batch needs {images:,}"
        if images > quota.images:
            need += ", more than the whole quota"
        said = f"{used.images:,} of {quota.images:,} images used {per} ({need})"
    elif quota.cpu_hours is not None and used.cpu_hours >= quota.cpu_hours:
        said = f"{used.cpu_hours:.1f} of {quota.cpu_hours:g} CPU-hours used {per}"
    elif quota.gpu_hours is not None and used.gpu_hours >= quota.gpu_hours:
        said = f"{used.gpu_hours:.1f} of {quota.gpu_hours:g} GPU-hours used {per}"
    if not said:
        return ""
    frees = (
        "it does not free by itself: an operator must raise it (watchctl quota)"
        if quota.images is not None and images > quota.images
        else f"it frees at {_when(account.frees_at)}, or when an operator raises it "
        "(watchctl quota)"
    )
    every = "daily" if quota.per is Period.DAY else "monthly"
    return f"over the {every} quota of {_whose(account.subject)}: {said}; {frees}"


def quota_json(quota: Quota | None) -> str:
    """A quota as a ``watchctl quota`` intent carries it ('' lifts the operator's quota)."""
    if quota is None:
        return ""
    return json.dumps({"per": quota.per.value, "images": quota.images,
                       "cpu_hours": quota.cpu_hours, "gpu_hours": quota.gpu_hours})  # fmt: skip


def parse_quota(text: str) -> Quota | None:
    """The quota an intent carries (None: lift it); ValueError for anything else."""
    if not text:
        return None
    data = json.loads(text)
    if not isinstance(data, dict) or set(data) - {"per", "images", "cpu_hours", "gpu_hours"}:
        raise ValueError(f"not a quota: {text[:200]!r}")
    images, cpu, gpu = data.get("images"), data.get("cpu_hours"), data.get("gpu_hours")
    for name, value in (("images", images), ("cpu_hours", cpu), ("gpu_hours", gpu)):
        ok = value is None or (not isinstance(value, bool) and isinstance(value, (int, float))
                               and 0 <= value < 1e15)  # fmt: skip
        if not ok:
            raise ValueError(f"{name} must be a number of at least 0, not {value!r}")
    if images is not None and not isinstance(images, int):
        raise ValueError(f"images must be a whole number, not {images!r}")
    per = Period(data.get("per", "month"))
    return Quota(
        per, images, None if cpu is None else float(cpu), None if gpu is None else float(gpu)
    )
