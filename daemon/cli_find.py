"""``watchctl batches``, ``jobs`` and ``logs`` (registered in :mod:`daemon.cli`): finding
batches and jobs, and reading (or following) a job's log. Read-only; each takes ``--json``."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import click
import typer
from rich.table import Table

from daemon import joblog, overview
from daemon.cli_base import ConfigOption, JsonOption, console, find_root, open_store
from daemon.errors import WatchdError
from daemon.records import Job
from daemon.states import BatchState, JobState
from daemon.store import Store

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


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
    limit: Annotated[int, typer.Option(min=1, help="at most this many, newest first")] = 50,
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
    if as_json:
        print(overview.to_json({"batches": rows}))
        return
    if not rows:
        console.print("no batches match")
        return
    indexes = {str(r.path): i for i, r in enumerate(cfg.roots)}
    table = Table(title=f"Batches (newest first, at most {limit})", title_justify="left")
    for column in ("id", "root", "folder", "kind", "state", "owner", "jobs", "created", "reason"):
        table.add_column(column)
    for row in rows:
        table.add_row(
            str(row["id"]), str(indexes.get(row["root"], row["root"])), row["folder"],
            row["kind"] or "", row["state"], row["owner"],
            f"{row['jobs_done']}/{row['jobs_total']}", _short(row["created_at"]), row["reason"],
        )  # fmt: skip
    console.print(table)


def jobs_command(
    batch_id: Annotated[int | None, typer.Argument(help="one batch's jobs (default: all)")] = None,
    state: Annotated[
        list[JobState] | None, typer.Option("--state", help="only these states (repeatable)")
    ] = None,
    limit: Annotated[int, typer.Option(min=1, help="at most this many, the newest")] = 200,
    config: ConfigOption = None,
    as_json: JsonOption = False,
) -> None:
    """Jobs: of one batch or of all, by state."""
    _, store = open_store(config)
    if batch_id is not None:
        store.batch(batch_id)  # NotFound for an unknown batch
    found = store.jobs([batch_id] if batch_id is not None else None, state, limit=limit)
    rows = [overview.job_summary(j) for j in found]
    if as_json:
        print(overview.to_json({"jobs": rows}))
        return
    if not rows:
        console.print("no jobs match")
        return
    table = Table(title="Jobs", title_justify="left")
    columns = ("id", "batch", "name", "state", "attempts", "handle", "exit", "updated", "reason")
    for column in columns:
        table.add_column(column)
    for r in rows:
        table.add_row(
            str(r["id"]), str(r["batch_id"]), r["name"], r["state"], str(r["attempts"]),
            r["handle"] or "", "" if r["exit_code"] is None else str(r["exit_code"]),
            _short(r["updated_at"]), r["reason"],
        )  # fmt: skip
    console.print(table)


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
    _, store = open_store(config)
    found = _job(store, job)
    path = joblog.log_path(store.batch(found.batch_id), found)
    if follow:
        _follow(store, found, path, lines)
        return
    try:
        last = joblog.tail(path, lines)
    except FileNotFoundError:
        state = found.state.value
        raise WatchdError(f"job {found.name} has no log yet (it is {state}): {path}") from None
    except OSError as exc:
        raise WatchdError(f"cannot read {path}: {exc.strerror}") from None
    text = [*last.lines, *([last.partial.decode("utf-8", "replace")] if last.partial else [])]
    if as_json:
        data: dict[str, Any] = {"job": overview.job_summary(found), "path": str(path)}
        print(overview.to_json({**data, "lines": text}))
        return
    for line in text:
        print(line)


def _follow(store: Store, job: Job, path: Path, lines: int) -> None:
    try:
        try:
            last = joblog.tail(path, lines)
        except FileNotFoundError:
            note = f"(job {job.name} is {job.state.value}: its log begins when it runs)"
            print(note, file=sys.stderr, flush=True)
            follower = joblog.Follower(path)
        else:
            for line in last.lines:
                print(line, flush=True)
            follower = joblog.Follower(path, last.end, last.partial)
        joblog.follow(store, job.id, follower, lambda line: print(line, flush=True))
    except KeyboardInterrupt:
        return  # Ctrl-C ends following; nothing went wrong


def _job(store: Store, named: str) -> Job:
    return store.job(int(named)) if named.isdigit() else store.job_named(named)


def _short(iso: str | None) -> str:
    """2026-11-21T10:04:05+00:00 → 2026-11-21 10:04:05 (UTC, as every time watchctl shows)."""
    return (iso or "").replace("T", " ").removesuffix("+00:00")
