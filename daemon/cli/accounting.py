"""watchctl's commands for a facility of many owners (registered in :mod:`daemon.cli.watchctl`):
``usage`` (what each owner, group or account used), ``quota`` (the quotas in force and what
they used; an operator's quota, recorded as an intent the daemon applies), and the queue that
``watchctl status`` shows: who waits for a slot and why, which batches a quota holds."""

from __future__ import annotations

import getpass
import json
import os
import time
from collections.abc import Sequence
from typing import Annotated, Any

import typer

from daemon.cli.base import ConfigOption, JsonOption, console, open_store, shown
from daemon.contract.errors import WatchdError
from daemon.core.fairshare import Standing
from daemon.core.jobplan import Sharding
from daemon.core.owners import Period, Quota
from daemon.core.planner import BatchView, Policy, Snapshot, fair_turns
from daemon.core.quotas import Account, quota_json
from daemon.core.records import Batch, IntentAction, Job
from daemon.core.states import JobState
from daemon.executors.slurm_accounting import SacctLine, sacct_usage
from daemon.site.config import Config
from daemon.store import Store

BY = ("owner", "group", "account")
# Hours in the JSON to the microhour (3.6 ms): a job of a few images warm-started uses ~0.1 s
# of CPU, which four digits (0.36 s) showed as none
HOURS_DIGITS = 6


# -- the queue (watchctl status) -----------------------------------------------------------------


def slots(cfg: Config) -> int | None:
    """The slots the fair order shares out (None: Slurm queues without a limit)."""
    if cfg.executor.kind == "local":
        return cfg.executor.local.max_parallel
    return cfg.executor.slurm.max_jobs or None


def queue(cfg: Config, active: Sequence[tuple[Batch, Sequence[Job]]]) -> dict[str, Any]:
    """Who waits and why: each owner's (or group's) running and pending jobs, its share of the
    slots and why its jobs wait, as the daemon's fair order sees it now; and the batches a quota
    holds, with the line their owners read."""
    views = tuple(BatchView(b, None, tuple(j)) for b, j in active)
    pending = [job for _, jobs in active for job in _open_stage(jobs)]
    live = sum(1 for _, jobs in active for j in jobs if j.state.live)
    room = slots(cfg)
    accounts = cfg.accounts.table()
    snapshot = Snapshot(
        now=time.time(), policy=_POLICY, batches=views, accounts=accounts,
        free_slots=None if room is None else room - live,
    )  # fmt: skip
    # as the daemon's next round will leave it (it hands out free slots at once)
    standings = [_standing(s) for s in fair_turns(snapshot, pending).standings]
    held = [
        {"id": b.id, "folder": b.folder, "owner": b.owner_user, "group": b.owner_group,
         "hold": b.hold}
        for b, _ in active if b.hold
    ]  # fmt: skip
    return {"slots": room, "fair_by": accounts.fair_by.value, "owners": standings, "held": held}


_POLICY = Policy(Sharding(), max_attempts=1, executor="")  # not used by the fair order


def _open_stage(jobs: Sequence[Job]) -> list[Job]:
    """A batch's pending jobs that may go out: those of its first stage not done."""
    stage = min((j.stage for j in jobs if j.state is not JobState.SUCCEEDED), default=0)
    return [j for j in jobs if j.state is JobState.PENDING and j.stage == stage]


def _standing(standing: Standing) -> dict[str, Any]:
    return {
        "subject": standing.subject,
        "running": standing.running,
        "pending": standing.pending,
        "share": None if standing.share is None else round(standing.share, 2),
        "waits": standing.waits,
    }


def print_queue(data: dict[str, Any]) -> None:
    from rich.table import Table

    if data["owners"]:
        room = "no fixed number of" if data["slots"] is None else str(data["slots"])
        table = Table(title=f"Queue: {room} slots, shared by {data['fair_by']}",
                      title_justify="left")  # fmt: skip
        for column in ("who", "live", "pending", "share", "waits because"):
            table.add_column(column)
        for row in data["owners"]:
            share = "" if row["share"] is None else f"{row['share']:g}"
            table.add_row(shown(row["subject"]), str(row["running"]), str(row["pending"]), share,
                          shown(row["waits"]))  # fmt: skip
        console.print(table)
    for row in data["held"]:
        console.print(f"held: batch {row['id']} {shown(row['folder'])}: {shown(row['hold'])}")


# -- watchctl usage ------------------------------------------------------------------------------


def usage_command(
    since: Annotated[str, typer.Option(help="over this last age: 30m, 2h, 1d, 30d")] = "30d",
    by: Annotated[str, typer.Option(help="owner, group or account")] = "owner",
    config: ConfigOption = None,
    as_json: JsonOption = False,
) -> None:
    """What each owner, group or account used: batches, images, job attempts, CPU-hours,
    GPU-hours, bytes in and out, as the jobs measured them (attempts that ended in the period).

    On Slurm, also what Slurm's accounting (sacct) says of the same jobs, where it is on."""
    from daemon.cli.read import parse_age

    if by not in BY:
        raise typer.BadParameter(f"{by!r}: expected one of {', '.join(BY)}", param_hint="'--by'")
    cfg, store = open_store(config)
    start = time.time() - parse_age(since)
    lines = store.usage_by(by, start)
    slurm = _slurm_view(cfg, store, start) if cfg.executor.kind == "slurm" else None
    rows = [_usage_row(by, line.__dict__) for line in lines]
    if as_json:
        print(json.dumps({"since": since, "by": by, "usage": rows, "slurm": slurm}, indent=2))
        return
    _print_usage(rows, by, since)
    if slurm is not None:
        _print_slurm(slurm)


def _usage_row(by: str, line: dict[str, Any]) -> dict[str, Any]:
    row = {by: line.pop("key") or "(none)", **line}
    for key in ("cpu_hours", "gpu_hours", "wall_hours"):
        row[key] = round(row[key], HOURS_DIGITS)
    return row


def _print_usage(rows: Sequence[dict[str, Any]], by: str, since: str) -> None:
    from rich.table import Table

    table = Table(title=f"Usage over the last {since}, by {by}", title_justify="left")
    columns = (by, "batches", "jobs", "images", "CPU-h", "GPU-h", "bytes in", "bytes out")
    for column in columns:
        table.add_column(column, justify="left" if column == by else "right")
    for r in rows:
        table.add_row(
            shown(r[by]), str(r["batches"]), str(r["jobs"]), f"{r['images']:,}",
            f"{r['cpu_hours']:.3f}", f"{r['gpu_hours']:.3f}", _bytes(r["bytes_in"]),
            _bytes(r["bytes_out"]),
        )  # fmt: skip
    if not rows:
        console.print(f"no job ended in the last {since}")
        return
    console.print(table)


def _bytes(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    return str(n)


def _slurm_view(cfg: Config, store: Store, since: float) -> dict[str, Any]:
    """What sacct says of the jobs that ended since ``since`` (by account only: Slurm knows
    the service's user, not the folder's), or why it says nothing."""
    handles = store.handles_since(since)
    conf = cfg.executor.slurm.slurm_conf
    env = {**os.environ, "SLURM_CONF": str(conf)} if conf else None
    found, note = sacct_usage(
        [h for h, _ in handles], cfg.executor.slurm.command_timeout_seconds, env
    )
    totals: dict[str, dict[str, float]] = {}
    for line in found:
        row = totals.setdefault(line.account or "(none)", {"jobs": 0, "cpu_hours": 0.0,
                                                           "gpu_hours": 0.0})  # fmt: skip
        row["jobs"] += 1
        row["cpu_hours"] += line.cpu_s / 3600
        row["gpu_hours"] += line.gpu_s / 3600
    return {"note": note, "by_account": totals, "lines": [_sacct(x) for x in found]}


def _sacct(line: SacctLine) -> dict[str, Any]:
    return {"job": line.job, "account": line.account, "cpu_s": line.cpu_s, "gpu_s": line.gpu_s}


def _print_slurm(slurm: dict[str, Any]) -> None:
    if slurm["note"]:
        console.print(f"sacct: {shown(slurm['note'])}")
    for account, row in sorted(slurm["by_account"].items()):
        console.print(
            f"sacct, account {shown(account)}: {row['jobs']:.0f} jobs, "
            f"{row['cpu_hours']:.3f} CPU-h (allocated), {row['gpu_hours']:.3f} GPU-h"
        )


# -- watchctl quota ------------------------------------------------------------------------------


def quota_command(
    subject: Annotated[
        str | None, typer.Argument(help="user:NAME or group:NAME (none: list the quotas)")
    ] = None,
    images: Annotated[int | None, typer.Option(min=0, help="images per period")] = None,
    cpu_hours: Annotated[float | None, typer.Option(min=0, help="CPU-hours per period")] = None,
    gpu_hours: Annotated[float | None, typer.Option(min=0, help="GPU-hours per period")] = None,
    per: Annotated[str, typer.Option(help="day or month (UTC)")] = "month",
    lift: Annotated[
        bool, typer.Option("--lift", help="drop the operator's quota: the config's applies")
    ] = False,
    config: ConfigOption = None,
    as_json: JsonOption = False,
) -> None:
    """The quotas in force, what each used this period and when it frees; with a subject and
    limits, set that subject's quota (an intent the daemon applies at its next tick).

    A batch over its owner's or its group's quota waits QUEUED until the quota frees or is
    raised: `watchctl quota user:alice --images 200000` raises it for this and later months."""
    cfg, store = open_store(config)
    if subject is None:
        if images is not None or cpu_hours is not None or gpu_hours is not None or lift:
            raise WatchdError("name the subject whose quota to set: user:NAME or group:NAME")
        _list_quotas(cfg, store, as_json)
        return
    kind, _, name = subject.partition(":")
    if kind not in ("user", "group") or not name:
        raise WatchdError(f"{subject!r}: name a subject as user:NAME or group:NAME")
    if per not in ("day", "month"):
        raise typer.BadParameter(f"{per!r}: expected day or month", param_hint="'--per'")
    if lift:
        value = ""
    elif images is None and cpu_hours is None and gpu_hours is None:
        raise WatchdError("give --images, --cpu-hours or --gpu-hours (or --lift)")
    else:
        value = quota_json(Quota(Period(per), images, cpu_hours, gpu_hours))
    intent = store.add_subject_intent(
        IntentAction.QUOTA, subject, value, time.time(), getpass.getuser()
    )
    console.print(
        f"quota of {shown(subject)} recorded (intent {intent.id}); the daemon applies it at "
        "its next tick"
    )


def quota_accounts(cfg: Config, store: Store, now: float) -> list[Account]:
    """Every subject with a quota in force: the config's users and groups, an operator's, and
    (under a default quota) every owner with a batch."""
    accounts = cfg.accounts.table()
    subjects: dict[str, Quota | None] = {}
    for name, rule in accounts.users.items():
        subjects[f"user:{name}"] = rule.quota or accounts.default.quota
    for name, rule in accounts.groups.items():
        subjects[f"group:{name}"] = rule.quota
    if accounts.default.quota is not None:
        for user in store.owner_users():
            subjects.setdefault(f"user:{user}", accounts.default.quota)
    for record in store.set_quotas():
        subjects.setdefault(record.subject, None)
    found = [store.quota_account(s, q, now) for s, q in sorted(subjects.items())]
    return [a for a in found if a is not None]


def _list_quotas(cfg: Config, store: Store, as_json: bool) -> None:
    import datetime as dt

    def when(at: float) -> str:
        return dt.datetime.fromtimestamp(at, dt.UTC).strftime("%Y-%m-%d %H:%M UTC")

    rows = [
        {"subject": a.subject, "quota": a.quota.describe(), "set_by": a.set_by or "config.toml",
         "images_used": a.used.images, "cpu_hours_used": round(a.used.cpu_hours, HOURS_DIGITS),
         "gpu_hours_used": round(a.used.gpu_hours, HOURS_DIGITS), "frees_at": when(a.frees_at)}
        for a in quota_accounts(cfg, store, time.time())
    ]  # fmt: skip
    if as_json:
        print(json.dumps({"quotas": rows}, indent=2))
        return
    if not rows:
        console.print("no quotas: none in [accounts] of the config, none set with watchctl quota")
        return
    for r in rows:
        console.print(
            f"{shown(r['subject'])}: {shown(r['quota'])} (set by {shown(r['set_by'])}); used "
            f"{r['images_used']:,} images, {r['cpu_hours_used']:g} CPU-h, "
            f"{r['gpu_hours_used']:g} GPU-h; the period ends {r['frees_at']}"
        )
