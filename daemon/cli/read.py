"""watchctl's reading commands (registered in :mod:`daemon.cli.watchctl`): status, batches
(filtered), show, jobs, and logs (a job's log, read or followed). They only read the database and
the job logs, so they work while the daemon is down; each takes ``--json``."""

from __future__ import annotations

import re
import signal
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Annotated, Any

import click
import typer
from rich.table import Table

from daemon.cli import accounting, joblog, overview
from daemon.cli.base import (
    ConfigOption,
    JsonOption,
    console,
    find_root,
    liveness,
    open_store,
    shown,
)
from daemon.contract.errors import WatchdError
from daemon.contract.heldfolder import UnsafeEntry
from daemon.core.records import Batch, Job
from daemon.core.states import BatchState, JobState
from daemon.core.visible import visible
from daemon.site.access import denied
from daemon.site.claims import read_lease
from daemon.store import Store

MAX_LIMIT = 1_000_000  # --limit: more rows than anyone reads, and within SQLite's integers
UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def status_command(config: ConfigOption = None, as_json: JsonOption = False) -> None:
    """Whether the daemon is alive, the drop roots, batches per state, what runs, what failed.

    A paused drop root says who paused it and since when."""
    cfg, store = open_store(config)
    beat = store.heartbeat()
    live = liveness(beat, time.time(), cfg.daemon.heartbeat_seconds)
    now = time.time()
    spool, lease_seconds = cfg.daemon.spool_dir, cfg.daemon.lease_seconds
    leases = {str(r.path): read_lease(spool, r.path, now, lease_seconds) for r in cfg.roots}
    roots = overview.roots(
        [str(r.path) for r in cfg.roots], store.roots(), live.get("info", {}), leases,
        str(cfg.daemon.database), time.time(),
    )  # fmt: skip
    active = [(b, store.jobs([b.id])) for b in store.active_batches()]
    failures = [(b, store.jobs([b.id])) for b in _open_failures(store, 5)]
    data = overview.status(live, store.counts(), active, failures, roots)
    data["queue"] = accounting.queue(cfg, active)
    if as_json:
        print(overview.to_json(data))
        return
    _print_status(data)
    accounting.print_queue(data["queue"])


def _open_failures(store: Store, most: int) -> list[Batch]:
    """The newest failed batches that no later revision of their folder has replaced (a
    manifest fixed, a folder made readable): what still needs someone to act."""
    failed = store.batches([BatchState.FAILED], limit=10 * most, newest_first=True)
    latest = [b for b in failed if _latest(store, b)]
    return latest[:most]


def _latest(store: Store, batch: Batch) -> bool:
    newest = store.latest_revision(batch.root, batch.folder)
    return newest is not None and newest.id == batch.id


def _print_status(data: dict[str, Any]) -> None:
    d = data["daemon"]
    where = (
        f" (pid {d['pid']} on {d['host']}, heartbeat {d['heartbeat_age_s']} s ago)"
        if d.get("pid")
        else ""
    )
    console.print(f"[bold]watchd[/bold]: {d['state']}{where}")
    console.print("batches: " + ", ".join(f"{n} {s}" for s, n in data["counts"].items()))
    for root in data["roots"]:
        note = f" ({root['mode']})" if root["mode"] else ""
        if root["lost"]:
            note += " [red]UNAVAILABLE[/red]"
        if root["paused"]:
            note += (
                f" [yellow]PAUSED[/yellow] by {shown(root['paused_by'])} since {root['paused_at']}"
            )
        if root["held_elsewhere"]:
            note += f" [red]HELD BY ANOTHER[/red] {shown(root['lease']['holder'])}"
        elif root["lease"]:
            note += f", lease: pid {root['lease']['pid']} on {shown(root['lease']['host'])}"
        console.print(f"root {root['index']}: {shown(root['path'])}{note}")
    if data["active"]:
        rows = [{**r, "progress": progress(r)} for r in data["active"]]
        columns = ("id", "folder", "kind", "state", "progress", "reason")
        console.print(_records("Active", columns, rows))
    if data["recent_failures"]:
        rows = [{**r, "first problem": (r["problems"] or [""])[0]} for r in data["recent_failures"]]
        failed = ("id", "folder", "updated_at", "reason", "first problem")
        console.print(_records("Last failures", failed, rows))


def _grid(title: str, columns: Sequence[str], rows: Iterable[Sequence[object]]) -> Table:
    """A table of cells shown literally (None shows as nothing)."""
    table = Table(title=title, title_justify="left")
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*(shown(cell) for cell in row))
    return table


def _records(title: str, columns: Sequence[str], records: Iterable[dict[str, Any]]) -> Table:
    """A table of these keys of each record."""
    return _grid(title, columns, ([r[c] for c in columns] for r in records))


def show_command(
    batch_id: Annotated[int, typer.Argument(help="batch id (see watchctl status)")],
    config: ConfigOption = None,
    as_json: JsonOption = False,
) -> None:
    """One batch: its state, problems, jobs and history."""
    _, store = open_store(config)
    batch = store.batch(batch_id)
    data = overview.batch_detail(
        batch, store.jobs([batch.id]), store.events(batch.id), store.intents_of(batch.id)
    )
    if as_json:
        print(overview.to_json(data))
        return
    console.print(
        f"[bold]batch {data['id']}[/bold] {shown(data['path'])} (revision {data['revision']})"
    )
    for key in ("kind", "state", "reason", "owner", "contact", "run_dir", "manifest_sha256"):
        console.print(f"  {key + ':':<17}{shown(data[key])}")
    if batch.problems:
        console.print("  problems:")
        for p in batch.problems:
            console.print(f"    - {shown(p.render())}")
    columns = ("id", "name", "state", "attempts", "handle", "exit_code", "reason")
    console.print(_records("Jobs", columns, data["jobs"]))
    history = (
        (
            e["at"],
            e["job_id"],
            f"{e['from'] or '·'} → {e['to']}" if e["to"] else "note",
            e["reason"],
        )
        for e in data["history"]
    )
    console.print(_grid("History (UTC)", ("at", "job", "change", "reason"), history))
    if data["requests"]:
        asked = ("id", "at", "action", "by", "outcome")
        console.print(_records("Requests (UTC)", asked, data["requests"]))


def parse_age(text: str) -> float:
    """``90s``, ``30m``, ``2h``, ``1d``, ``1w``, or combined (``1h30m``), in seconds."""
    compact = text.strip().lower()
    if not re.fullmatch(r"(?:\d+(?:\.\d+)?[smhdw])+", compact):
        raise typer.BadParameter(
            f"{text!r}: expected an age such as 30m, 2h, 1d or 1h30m", param_hint="'--since'"
        )
    return sum(float(n) * UNITS[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)([smhdw])", compact))


def batches_command(
    state: Annotated[
        list[BatchState] | None, typer.Option("--state", help="only these states (repeatable)")
    ] = None,
    owner: Annotated[str | None, typer.Option(help="owner contains this (any case)")] = None,
    root: Annotated[str | None, typer.Option(help="only this drop root: its path or index")] = None,
    since: Annotated[
        str | None, typer.Option(help="created within this age: 30m, 2h, 1d", show_default=False)
    ] = None,
    limit: Annotated[
        int, typer.Option(min=1, max=MAX_LIMIT, help="at most this many, newest first")
    ] = 50,
    config: ConfigOption = None,
    as_json: JsonOption = False,
) -> None:
    """Batches, newest first, filtered by state, owner, drop root and age."""
    age = parse_age(since) if since is not None else None
    cfg, store = open_store(config)
    found = store.batches(
        state,
        limit=limit,
        newest_first=True,
        owner=owner,
        root=str(find_root(cfg, root).path) if root is not None else None,
        since=time.time() - age if age is not None else None,
    )
    counts = store.job_counts(b.id for b in found)
    rows = [overview.batch_row(b, counts[b.id]) for b in found]
    if _said_all("batches", rows, as_json):
        return
    indexes = {str(r.path): i for i, r in enumerate(cfg.roots)}
    cells = (
        (r["id"], indexes.get(r["root"], r["root"]), r["folder"], r["kind"], r["state"],
         r["owner"], f"{r['jobs_done']}/{r['jobs_total']}", _short(r["created_at"]), r["reason"])
        for r in rows
    )  # fmt: skip
    columns = ("id", "root", "folder", "kind", "state", "owner", "jobs", "created", "reason")
    console.print(_grid(f"Batches (newest first, at most {limit})", columns, cells))


def jobs_command(
    batch_id: Annotated[int | None, typer.Argument(help="one batch's jobs (default: all)")] = None,
    state: Annotated[
        list[JobState] | None, typer.Option("--state", help="only these states (repeatable)")
    ] = None,
    limit: Annotated[
        int, typer.Option(min=1, max=MAX_LIMIT, help="at most this many, the newest")
    ] = 200,
    config: ConfigOption = None,
    as_json: JsonOption = False,
) -> None:
    """Jobs: of one batch or of all, by state."""
    _, store = open_store(config)
    if batch_id is not None:
        store.batch(batch_id)  # NotFound for an unknown batch
    found = store.jobs([batch_id] if batch_id is not None else None, state, limit=limit)
    rows = [overview.job_summary(j) for j in found]
    if _said_all("jobs", rows, as_json):
        return
    cells = (
        (r["id"], r["batch_id"], r["name"], r["state"], r["attempts"], r["handle"],
         r["exit_code"], _short(r["updated_at"]), r["reason"])
        for r in rows
    )  # fmt: skip
    columns = ("id", "batch", "name", "state", "attempts", "handle", "exit", "updated", "reason")
    console.print(_grid("Jobs", columns, cells))


def logs_command(
    job: Annotated[str, typer.Argument(help="a job id or name (see watchctl jobs)")],
    lines: Annotated[int, typer.Option("--lines", "-n", min=0, help="how many last lines")] = 50,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="go on printing until the job has ended")
    ] = False,
    config: ConfigOption = None,
    as_json: JsonOption = False,
) -> None:
    """The last lines of a job's log; with --follow, its new lines until the job ends.

    Ctrl-C stops following (exit status 0)."""
    if follow and as_json:
        raise click.UsageError("--follow prints lines as they come: leave out --json")
    cfg, store = open_store(config)
    found = _job(store, job)
    log = joblog.log_file(cfg.daemon.spool_dir, store.batch(found.batch_id), found)
    if follow:
        _follow(store, found, log, lines)
        return
    try:
        last = joblog.tail(log, lines)
    except FileNotFoundError:
        state = found.state.value
        raise WatchdError(f"job {found.name} has no log yet (it is {state}): {log.path}") from None
    except PermissionError:
        raise denied(log.path, "the job's log") from None  # in the spool: the group watchd
    except OSError as exc:
        raise _unreadable(log, exc) from None
    text = [*last.lines, *([last.partial.decode("utf-8", "replace")] if last.partial else [])]
    if as_json:
        data: dict[str, Any] = {"job": overview.job_summary(found), "path": str(log.path)}
        print(overview.to_json({**data, "lines": text}))
        return
    for line in text:
        print(visible(line))


def _unreadable(log: joblog.LogFile, exc: OSError) -> WatchdError:
    """The one-line error for a log that may not be read (a link or FIFO planted in the batch
    folder is refused by name, never followed or waited on)."""
    if isinstance(exc, UnsafeEntry):
        return WatchdError(f"will not read {log.path}: {exc}")
    return WatchdError(f"cannot read {log.path}: {exc.strerror or exc}")


def _follow(store: Store, job: Job, log: joblog.LogFile, lines: int) -> None:
    """Follow the log until the job ends or Ctrl-C. Ctrl-C sets a flag the loop looks at
    (:class:`~daemon.cli.joblog.Interrupt`; a KeyboardInterrupt raised where Python swallows
    it, in a finaliser, would follow forever)."""
    stop = joblog.Interrupt()
    previous = signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        try:
            last = joblog.tail(log, lines)
        except FileNotFoundError:
            note = f"(job {job.name} is {job.state.value}: its log begins when it runs)"
            print(note, file=sys.stderr, flush=True)
            follower = joblog.Follower(log)
        else:
            for line in last.lines:
                print(visible(line), flush=True)
            follower = joblog.Follower(log, last.end, last.partial)
        joblog.follow(store, job.id, follower, _print_line, stop=stop)
    except OSError as exc:
        raise _unreadable(log, exc) from None
    finally:
        signal.signal(signal.SIGINT, previous)


def _print_line(line: str) -> None:
    print(visible(line), flush=True)


def _said_all(key: str, rows: list[dict[str, Any]], as_json: bool) -> bool:
    """Print the rows as JSON, or say that none match; whether that was all to print."""
    if as_json:
        print(overview.to_json({key: rows}))
        return True
    if not rows:
        console.print(f"no {key} match")
        return True
    return False


def _job(store: Store, named: str) -> Job:
    return store.job(int(named)) if named.isdigit() else store.job_named(named)


def _short(iso: str | None) -> str:
    """2026-11-21T10:04:05+00:00 → 2026-11-21 10:04:05 (UTC, as every time watchctl shows)."""
    return (iso or "").replace("T", " ").removesuffix("+00:00")


def progress(row: dict[str, Any]) -> str:
    """A batch's progress: images done for inference (its jobs are few and long), and jobs."""
    jobs = f"{row['jobs_done']}/{row['jobs_total']} jobs"
    if row.get("images_total"):
        return f"{row['images_done']:,}/{row['images_total']:,} images, {jobs}"
    return jobs
