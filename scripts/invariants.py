"""What must hold after a fuzz case (scripts/fuzz_campaign.py): each check returns its
violations, one line each (empty: none).

Besides what held before (every batch ends with a reason, no exception logged, watchctl
neither fails nor hangs), issue 25's:

- the canary's token (a file only the service may read) is nowhere: not in a file under the
  drop root, in the spool, in the registry, in a row of any table of the database, in the
  daemon's log or in what watchctl prints; neither as it is, nor in hex, nor in base64;
- nothing forged (scripts/forgeries.py's MARKER) was read: it is in none of those either (but
  in the files the expert forged under the drop root);
- every job ran from the spec the daemon wrote: each spec in the spool names its own batch's
  folder, run folder, work folder and job;
- nothing is written outside the batch folders and the spool: the state folder holds the
  database and its lock only, the drop root only the batch folders (and the leases forged at
  the old name), the case's folder nothing new;
- the expert was refused every attempt on the spool and could not read the canary (journal);
- no drop root was given up to another watchd (there is none);
- a sweep registered one of its own trials' candidates.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import sqlite3
import stat
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import forgeries
import fuzz_site
import hostile

from daemon.contract.spool import RUNS_DIR, work_dir
from daemon.site.config import Config
from daemon.store import Store

T = TypeVar("T")
WATCHCTL_AT_ONCE = 4
DATABASE_FILES = {"watchd.sqlite", "watchd.sqlite-wal", "watchd.sqlite-shm", "watchd.lock"}
DONE = "all jobs succeeded"
LOST_ROOT = ("drop root taken by another watchd", "drop root held by another watchd")
CHUNK = 1 << 20


def reading(config: Config, ask: Callable[[Store], T]) -> T | None:
    """What ``ask`` reads from the daemon's store; None while there is none (never creates it)
    or it cannot be read."""
    if not config.daemon.database.exists():
        return None
    try:
        store = Store(config.daemon.database)
        try:
            return ask(store)
        finally:
            store.close()
    except sqlite3.Error:
        return None


# -- the batches, the log, watchctl ----------------------------------------------------------------


def endings(config: Config, case: Sequence[hostile.Hostile]) -> list[str]:
    """Every folder has a batch that ended with a reason."""
    root = str(config.roots[0].path)
    found = reading(config, lambda store: [store.latest_revision(root, h.name) for h in case])
    violations = []
    for h, batch in zip(case, found or [None] * len(case), strict=True):
        if batch is None:
            violations.append(f"{h.name!r}: no batch recorded")
        elif not batch.state.terminal:
            violations.append(f"{h.name!r}: still {batch.state.value} at the end ({batch.reason})")
        elif not batch.reason:
            violations.append(f"{h.name!r}: ended {batch.state.value} without a reason")
    return violations


def batches_ended(config: Config) -> Counter[str]:
    """How the case's batches ended (by state, with the reason where not done), and how many of
    them ran a job."""
    batches = reading(config, lambda store: store.batches()) or []
    jobs = reading(config, lambda store: store.jobs()) or []
    ran = {job.batch_id for job in jobs}
    ended = [b.state.value + ("" if b.reason == DONE else f" ({b.reason[:40]})") for b in batches]
    return Counter(ended + ["ran jobs" for b in batches if b.id in ran])


def log_events(log: Path) -> Iterator[dict[str, Any] | str]:
    """The daemon's log: each line's event, or the line where it is not JSON."""
    for line in log.read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            yield line
            continue
        yield event if isinstance(event, dict) else line


def logged_exceptions(log: Path) -> list[str]:
    """Log events that carry a traceback (anything the daemon did not expect is a bug), each
    told once with how often it came; and roots given up to another watchd (there is none)."""
    found: Counter[str] = Counter()
    printed = False  # in a printed traceback: its last line (unindented) says what was raised
    for event in log_events(log):
        if isinstance(event, str):
            if "Traceback" in event:
                printed = True
            elif printed and event[:1] not in ("", " ", "\t"):
                found[f"the daemon printed a traceback: {event.strip()[:200]}"] += 1
                printed = False
        elif "exception" in event:
            last = str(event["exception"]).strip().splitlines()[-1][:200]
            found[f"the daemon logged {event.get('event')!r} with {last}"] += 1
        elif event.get("event") in LOST_ROOT:
            found[f"the daemon logged {event['event']!r} ({event.get('holder')})"] += 1
    if printed:  # cut off (the daemon killed mid-print)
        found["the daemon printed a traceback"] += 1
    return [f"{what} ({n} times)" if n > 1 else what for what, n in found.items()]


def watchctl_outputs(
    config: Config, timeout: float, bin_dir: Path, said: list[bytes]
) -> list[str]:  # fmt: skip
    """status, batches, jobs, show of every batch, logs of every job: each a subprocess with a
    time limit, run side by side; no traceback of its own (on stderr: what it prints may hold a
    job's traceback), no hang, exit status 0 or 1 (an Error: line). What they print is added
    to ``said``."""
    batch_ids = reading(config, lambda store: [b.id for b in store.batches()]) or []
    job_ids = reading(config, lambda store: [j.id for j in store.jobs()]) or []
    commands = [["status"], ["batches"], ["jobs"]]
    commands += [["show", str(b)] for b in batch_ids] + [
        ["show", str(b), "--json"] for b in batch_ids
    ]
    commands += [["logs", str(j)] for j in job_ids]
    found = []
    for i in range(0, len(commands), WATCHCTL_AT_ONCE):
        running = [(c, _watchctl(config, c, bin_dir)) for c in commands[i : i + WATCHCTL_AT_ONCE]]
        deadline = time.monotonic() + timeout
        found += [v for c, p in running for v in _verdict(c, p, deadline, said)]
    return found


def _watchctl(config: Config, command: list[str], bin_dir: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [str(bin_dir / "watchctl"), *command, "--config", str(config.source)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip


def _verdict(
    command: list[str], proc: subprocess.Popen[bytes], deadline: float, said: list[bytes]
) -> list[str]:  # fmt: skip
    name = "watchctl " + " ".join(command)
    try:
        out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        fuzz_site.kill_group(proc.pid)
        proc.communicate()
        return [f"{name}: hung (killed after the time limit)"]
    said += [out, err]
    text = err.decode(errors="replace")
    if "Traceback" in text:
        return [f"{name}: traceback: {text.strip().splitlines()[-1][:200]}"]
    if proc.returncode not in (0, 1):
        return [f"{name}: exit status {proc.returncode}: {text.strip()[-200:]}"]
    return []


# -- what was read, and where it went --------------------------------------------------------------


def forms(secret: str) -> list[bytes]:
    """``secret`` as it is, in hex and in base64 at each of the three alignments (the part of
    each encoding that depends on the secret alone), standard and URL-safe."""
    raw = secret.encode()
    found = [raw, raw.hex().encode()]
    for pad in range(3):
        start, end = -(-pad // 3) * 4, (pad + len(raw)) // 3 * 4
        for encode in (base64.b64encode, base64.urlsafe_b64encode):
            found.append(encode(b"\0" * pad + raw)[start:end])
    return found


class Finder:
    """Where ``forms`` of a secret turn up (and, with ``window``, any part of it that long, as
    it is: an error message that quotes a file's first bytes): in files (never through a link,
    never a FIFO; some inodes left out), a database's every row, texts."""

    def __init__(self, secret: str, skip: Iterable[int] = (), window: int = 0) -> None:
        parts = range(len(secret) - window + 1) if window else ()
        self.forms = forms(secret) + [secret[i : i + window].encode() for i in parts]
        self.skip = set(skip)
        self.longest = max(len(f) for f in self.forms)

    def holds(self, data: bytes) -> bool:
        return any(f in data for f in self.forms)

    def in_file(self, path: Path) -> bool:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return False
        with os.fdopen(fd, "rb") as handle:
            st = os.fstat(handle.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_ino in self.skip:
                return False
            tail = b""
            while chunk := handle.read(CHUNK):
                if self.holds(tail + chunk):
                    return True
                tail = chunk[-self.longest :]
        return False

    def in_tree(self, top: Path) -> list[Path]:
        return [Path(d) / f for d, _, files in os.walk(top) for f in files
                if self.in_file(Path(d) / f)]  # fmt: skip

    def in_database(self, database: Path) -> list[str]:
        """The tables with a row that holds it (every table, every row)."""
        if not database.exists():
            return []
        con = sqlite3.connect(database)
        try:
            tables = [
                r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")
            ]
            rows = {t: con.execute(f'SELECT * FROM "{t}"') for t in tables}
            return [t for t in tables if any(self.holds(repr(row).encode()) for row in rows[t])]
        finally:
            con.close()


def found_anywhere(
    finder: Finder, what: str, config: Config, trees: Sequence[Path], log: Path,
    said: list[bytes],
) -> list[str]:  # fmt: skip
    """Where ``finder`` finds its secret: in files of ``trees``, the database, the log, what
    watchctl said."""
    found = [f"{what} in {p}" for top in trees for p in finder.in_tree(top)]
    found += [
        f"{what} in the database's table {t}" for t in finder.in_database(config.daemon.database)
    ]
    if finder.in_file(log):
        found.append(f"{what} in the daemon's log")
    if any(finder.holds(text) for text in said):
        found.append(f"{what} in what watchctl printed")
    return found


# -- the spool, the state, the drop root -----------------------------------------------------------


def specs(config: Config) -> list[str]:
    """Each spec in the spool is the one the daemon wrote for its job: it names its batch's
    folder, run folder and work folder, and its own job."""
    spool = config.daemon.spool_dir
    batches = reading(config, lambda store: {b.id: b for b in store.batches()}) or {}
    found = []
    for path in sorted(spool.glob(f"{RUNS_DIR}/b*/*/jobs/*/spec.json")):
        batch_id = int(path.parents[3].name[1:])
        batch = batches.get(batch_id)
        try:
            spec = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            found.append(f"{path}: not a spec ({exc})")
            continue
        if batch is None:
            found.append(f"{path}: a spec of batch {batch_id}, which the daemon never recorded")
            continue
        expected = {"batch_dir": str(batch.path), "run_dir": batch.run_dir,
                    "work_dir": str(work_dir(spool, batch.id, batch.run_dir)),
                    "job_name": path.parent.name}  # fmt: skip
        found += [f"{path}: {key} is {spec.get(key)!r}, not {value!r}"
                  for key, value in expected.items() if spec.get(key) != value]  # fmt: skip
    return found


def written_outside(state: Path, made: Path, names: Iterable[str]) -> list[str]:
    """The state folder holds the database and its lock only; the drop root (as the expert
    made it) only the batch folders ``names`` and the leases forged at the old name."""
    allowed = {*names, forgeries.OLD_LEASE, ".forged-" + forgeries.OLD_LEASE}
    found = [
        f"state folder: {n!r} written" for n in sorted(set(os.listdir(state)) - DATABASE_FILES)
    ]
    found += [f"drop root: {n!r} written" for n in sorted(set(os.listdir(made)) - allowed)]
    return found


def intruder_said(journal: Path) -> tuple[list[str], Counter[str], set[int]]:
    """What the expert's journal says: its attempts that were not refused (violations), how
    each attempt ended (counts), and the inodes of the files it forged."""
    violations, inodes = [], set()
    lines = journal / "journal.jsonl"
    for line in lines.read_text().splitlines() if lines.exists() else []:
        note = json.loads(line)
        if note["event"] == "not refused":
            violations.append(f"the expert's {note['op']} of {note['target']} was not refused: "
                              f"{note['path']}")  # fmt: skip
        elif note["event"] == "forged":
            inodes.add(note["inode"])
        else:
            violations.append(f"the intruder: {note}")
    try:
        counts = Counter(json.loads((journal / "counts.json").read_text()))
    except (OSError, ValueError) as exc:
        return [*violations, f"the intruder left no counts ({exc})"], Counter(), inodes
    return violations, counts, inodes


def sweep_winners(registry: Path, spool: Path) -> list[str]:
    """Every version a sweep registered is one of its trials' candidates, as the trial wrote
    it in the spool."""
    genuine = {_digest(p) for p in spool.glob(f"{RUNS_DIR}/*/*/trials/*/candidate.pt")}
    return [f"registry: {p.relative_to(registry)} is no trial's candidate"
            for p in sorted((registry / hostile.SWEPT).rglob("weights.pt"))
            if _digest(p) not in genuine]  # fmt: skip


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
