"""The status file in each batch folder: what the data owner reads at a glance.

``render`` is pure; ``write`` puts the text in place atomically. Plain text, UTF-8, for people:
the state, progress, each problem with its location and a next step, and the history.
"""

from __future__ import annotations

import datetime as dt
import errno
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog

from daemon.contract.errors import ManifestError
from daemon.contract.heldfolder import HeldFolder
from daemon.contract.jobspec import Problem
from daemon.core.manifest import CANCEL_NAME, MANIFEST_NAME, STATUS_NAME, parse_manifest
from daemon.core.manifest_schema import Kind
from daemon.core.readiness import Timing
from daemon.core.records import Batch, Event, Job, RootRecord, images_progress
from daemon.core.states import BatchState, JobState
from daemon.core.visible import visible
from daemon.loop.intake import inside_root
from daemon.store import Store

log = structlog.get_logger("watchd.reporter")

UNWRITTEN = f"{STATUS_NAME} not written: "  # a note in the batch's history

HEADLINES = {
    BatchState.WAITING: "WAITING for the inputs to be complete",
    BatchState.QUEUED: "QUEUED: inputs complete, jobs waiting for their turn",
    BatchState.RUNNING: "RUNNING",
    BatchState.DONE: "DONE",
    BatchState.FAILED: "FAILED",
    BatchState.CANCELLED: "CANCELLED",
}


@dataclass(frozen=True)
class StatusInput:
    batch: Batch
    jobs: tuple[Job, ...]
    waiting: tuple[Problem, ...]  # what a waiting batch still waits for
    events: tuple[Event, ...]  # the batch's own (job events are for `watchctl show`)
    settle_seconds: float
    timeout_seconds: float
    pause: RootRecord | None = None  # the batch's drop root, when an operator paused it
    retry_taken: bool = True  # whether the daemon would take `watchctl retry` (manifest valid)


def render(status: StatusInput, now: float) -> str:
    b = status.batch
    lines = [
        "watchd status of this folder",
        "",
        f"State:     {HEADLINES[b.state]}",
        f"Updated:   {_time(now)}",
        f"Batch:     #{b.id}, revision {b.revision}, {b.kind.value if b.kind else 'unknown kind'}"
        + (f', "{b.title}"' if b.title else ""),
    ]
    if status.pause is not None and not b.state.terminal:
        lines.append(f"Paused:    {_paused(status.pause)}")
    if b.owner:
        lines.append(f"Owner:     {b.owner}" + (f" <{b.contact}>" if b.contact else ""))
    if b.owned_by is not None:
        owners = f"user {b.owner_user}, group {b.owner_group}"
        lines.append(f"Charged:   {owners} (the owners of this folder on the share)")
    if status.jobs:
        lines.append(f"Progress:  {_progress(status.jobs)}")
    if b.state not in (BatchState.WAITING, BatchState.FAILED) or status.jobs:
        lines.append(f"Results:   {_relative(b.run_dir, b.path)}{os.sep}")
    lines += ["", *_body(status)]
    lines += ["", "History (UTC):", *(_event_line(e) for e in status.events)]
    # Each value (a title, a file name, a reason) stays on its line: none can forge another.
    return "\n".join(map(visible, lines)) + "\n"


def _body(status: StatusInput) -> list[str]:
    b = status.batch
    if b.state is BatchState.WAITING:
        deadline = _time(b.updated_at + status.timeout_seconds)
        text = _problem_lines("Still waiting for", status.waiting)
        return [
            *text,
            f"Next step: copy what is missing. The batch starts {status.settle_seconds:g} s "
            f"after the last input stops changing; if inputs are still incomplete at "
            f"{deadline} it fails.",
        ]
    if b.state is BatchState.DONE:
        run = _relative(b.run_dir, b.path)
        return [
            "Finished. Outputs:",
            f"  report:   {run}/report.html",
            f"  summary:  {run}/summary.json",
            *(
                [f"  masks:    {run}/masks/", f"  table:    {run}/table.csv"]
                if b.kind is Kind.INFERENCE
                else [f"  training: {run}/training/"]
            ),
        ]
    if b.state is BatchState.FAILED:
        return [
            f"Why: {b.reason}",
            *_problem_lines("What went wrong", b.problems),
            f"Next step: {_after_failure(status)}",
        ]
    if b.state is BatchState.CANCELLED:
        return [f"Why: {b.reason}", *_after_cancel(b)]
    if b.state is BatchState.QUEUED and b.hold:
        return [f"Held: {b.hold}"]
    return [f"Latest: {b.reason}"]


def _after_cancel(b: Batch) -> list[str]:
    """What the owner does to run a batch again that they cancelled themselves."""
    if CANCEL_NAME not in b.reason:
        return []
    return [
        f"Next step: to run it again, remove {CANCEL_NAME} from this folder, then save "
        f"{MANIFEST_NAME} again (a changed manifest starts a new revision) or ask an operator "
        f"to run `watchctl retry {b.id}`."
    ]


def _after_failure(status: StatusInput) -> str:
    """What the owner can do about a failed batch: only steps that watchd then takes."""
    b = status.batch
    if not status.retry_taken:  # the planner refuses a retry of a refused manifest
        return (
            f"fix what is listed and save {MANIFEST_NAME} again: watchd takes a changed "
            "manifest in as a new revision (a retry cannot help: the manifest itself was refused)."
        )
    if b.watch_inputs:  # incomplete at the timeout: watched for changes for one more timeout
        until = _time(b.updated_at + status.timeout_seconds)
        return (
            f"copy what is missing: until {until} watchd checks the inputs again as soon as "
            f"they change; after that, ask an operator to run `watchctl retry {b.id}`."
        )
    return (
        f"fix what is listed, then ask an operator to run `watchctl retry {b.id}` (the inputs "
        f"are checked anew and the failed jobs run again), or save a changed {MANIFEST_NAME} "
        "(it starts a new revision)."
    )


def _paused(pause: RootRecord) -> str:
    since = f" since {_time(pause.paused_at)}" if pause.paused_at is not None else ""
    by = f" by {pause.paused_by}" if pause.paused_by else ""
    return f"the drop folder was paused{by}{since}: no new job starts until it is resumed"


def _problem_lines(title: str, problems: Sequence[Problem]) -> list[str]:
    if not problems:
        return []
    return [f"{title} ({len(problems)}):", *(f"  - {p.render()}" for p in problems), ""]


def _progress(jobs: Sequence[Job]) -> str:
    done = sum(1 for j in jobs if j.state is JobState.SUCCEEDED)
    running = sum(1 for j in jobs if j.state.live)
    failed = sum(1 for j in jobs if j.state is JobState.FAILED)
    text = f"{done} of {len(jobs)} jobs done, {running} running"
    text += f", {failed} failed" if failed else ""
    images_done, images = images_progress(jobs)
    return f"{images_done:,} of {images:,} images; {text}" if images else text


def _event_line(event: Event) -> str:
    if event.to_state is None:
        return f"  {_time(event.at)}  note  {event.reason}"
    came_from = event.from_state.value if event.from_state else "·"
    moved = f"{came_from} → {event.to_state.value}"
    return f"  {_time(event.at)}  {moved}  {event.reason}"


def _relative(path: str, base: Path) -> str:
    try:
        return Path(path).relative_to(base).as_posix()
    except ValueError:
        return path


def _time(at: float) -> str:
    return dt.datetime.fromtimestamp(at, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


def write(folder: Path, text: str) -> None:
    """Replace the folder's status file; raises OSError when the folder cannot be written.

    The batch folder is held from its drop root and written by the rule of
    :mod:`daemon.contract.heldfolder` (a link or FIFO planted at the name is replaced, never
    followed). The daemon is the only writer in the batch folder itself, so a temporary of the
    exact shape the rule makes still lying there was left by a daemon killed mid-write: it is
    removed (an input is never of that shape; nothing below the folder is touched).
    """
    with HeldFolder.batch(folder.parent, folder.name) as held:
        try:
            held.write_text(STATUS_NAME, text, fsync=False)
        except OSError as exc:
            full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
            if not (full and _overwrite(held, text)):
                raise
        held.remove_strays(below=False)


def _overwrite(held: HeldFolder, text: str) -> bool:
    """With the share full, a new file cannot be made, but the old status file's blocks can be
    written again: overwrite it in place if the text fits in them (one write call; not atomic,
    the one exception, because a stale "RUNNING" would mislead the owner more)."""
    data = text.encode("utf-8")
    try:
        fd = os.open(STATUS_NAME, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=held.fd)
        with os.fdopen(fd, "r+b") as handle:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:  # never into a file elsewhere
                return False
            if len(data) > os.fstat(handle.fileno()).st_blocks * 512:
                return False
            handle.write(data)
            handle.truncate()
    except OSError:
        return False
    return True


def gather(store: Store, batch: Batch, waiting: tuple[Problem, ...], timing: Timing) -> StatusInput:
    """What the status file of ``batch`` shows, read from the store."""
    history = tuple(store.events(batch.id, limit=50, jobs=False))
    pause = next((r for r in store.roots() if r.path == batch.root and r.paused), None)
    return StatusInput(
        batch, tuple(store.jobs([batch.id])), waiting, history,
        timing.settle_seconds, timing.timeout_seconds, pause, _retry_taken(store, batch),
    )  # fmt: skip


def _retry_taken(store: Store, batch: Batch) -> bool:
    """Whether the daemon would take a retry of this batch: not when it has no valid manifest
    (refused, or no longer valid under this watchd's rules; see ``planner._apply_intent``)."""
    if batch.kind is None:
        return False
    if batch.state is not BatchState.FAILED:
        return True
    try:
        parse_manifest(store.manifest_text(batch.id).encode())
    except ManifestError:
        return False
    return True


def publish(
    store: Store, batch_id: int, waiting: tuple[Problem, ...], timing: Timing, now: float
) -> None:
    """Write a batch's status file, if it is its folder's newest revision and the folder is a
    real folder inside its drop root (never through a link to elsewhere)."""
    batch = store.batch(batch_id)
    latest = store.latest_revision(batch.root, batch.folder)
    if latest is None or latest.id != batch.id or not inside_root(Path(batch.root), batch.folder):
        return
    try:
        write(batch.path, render(gather(store, batch, waiting, timing), now))
    except OSError as exc:
        _unwritten(store, batch, exc, now)


def _unwritten(store: Store, batch: Batch, exc: OSError, now: float) -> None:
    """The owner cannot read what happened (the file there is stale, or missing): the operator
    must, in the log and in the batch's history (``watchctl show``), once until it changes."""
    log.warning("cannot write status file", batch_id=batch.id, error=str(exc))
    note = f"{UNWRITTEN}{exc.strerror or exc}; its owner does not see this batch's state"
    last = store.events(batch.id, limit=1, jobs=False)
    if not last or last[-1].reason != note:
        store.note(batch.id, note, now)
