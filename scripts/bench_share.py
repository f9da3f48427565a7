"""Intake on a real network share (scripts/netshare: sshfs), the old code against the new, in
one run: both daemons watch a root of their own on the mount, side by side, and are fed the
same writes, made on the server side (no inotify event reaches the mount, as with NFS).

1. Copy: a batch of --images small files whose manifest (listing every file with its size, as
   `watchctl manifest` writes it) lands first and whose images arrive over --minutes. Counted
   per daemon with `strace -f` attached for the copy: stat-family and directory-listing calls
   of the daemon's own threads (not of the jobs it starts), total and per input. Loop
   responsiveness: the largest gap between heartbeats (heartbeat_seconds below tick_seconds,
   so one per tick); a small batch dropped halfway: dropped → queued; the last file landed →
   queued.
2. Polls: a root holding --ended ended batch folders (refused manifests, so that each daemon
   ends them at once) and --active batches still waiting: calls per poll over a window.

    python scripts/bench_share.py --old /path/to/checkout/of/the/old/code
    python scripts/bench_share.py --old ../wt-old --images 2000 --minutes 1 --ended 500
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import tomli_w

REPO = Path(__file__).resolve().parent.parent
SHARE = Path(os.environ.get("WATCHD_SHARE_DIR", "/var/lib/watchd-netshare"))
TIMING = {"settle_seconds": 5.0, "check_seconds": 2.0, "timeout_seconds": 86400.0}
IMAGE = b"\x89PNG" + b"x" * 1020  # a small file: readiness never reads it
SYSCALLS = "%%stat,getdents64"  # the stat family (stat, lstat, fstat, newfstatat, statx), listing


@dataclass
class Daemon:
    name: str
    code: Path
    server: Path  # its root, server side
    mount: Path  # its root, through the mount
    state: Path
    process: subprocess.Popen[bytes] | None = None
    env: dict[str, str] = field(default_factory=dict)  # over the environment, for the daemon

    def config(self, **intake: object) -> Path:
        document = {
            "daemon": {"state_dir": str(self.state), "tick_seconds": 1.0, "heartbeat_seconds": 0.5},
            "roots": [{"path": str(self.mount), "observer": "auto", "poll_seconds": 2.0}],
            "intake": {**TIMING, "watch_ended_seconds": 0.0, **intake},
            "executor": {"local": {"max_parallel": 1}},
            "registry": {"path": str(placeholder_model(self.state / "registry", "none"))},
            "jobs": {"wandb_mode": "disabled"},
        }  # fmt: skip
        path = self.state / "config.toml"
        path.write_text(tomli_w.dumps(document))
        return path

    def start(self) -> None:
        self.state.mkdir(parents=True, exist_ok=True)
        code = f"import sys; sys.argv = ['watchd', 'run', '--config', {str(self.config())!r}];"
        code += " from daemon.watchd import watchd_main; watchd_main()"
        # the code first; then the daemon's own (env) and the caller's (wheels on a GPU node)
        path = os.pathsep.join(filter(None, [str(self.code), self.env.get("PYTHONPATH"),
                                             os.environ.get("PYTHONPATH")]))  # fmt: skip
        env = {**os.environ, **self.env, "PYTHONPATH": path}
        with open(self.state / "daemon.log", "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-c", code], cwd=self.code, env=env, stdout=log, stderr=log
            )
        deadline = time.monotonic() + 60
        while self.beat() is None:
            if time.monotonic() > deadline:
                raise SystemExit(f"{self.name}: no heartbeat in 60 s, see {self.state}/daemon.log")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=120)

    def query(self, sql: str, *params: object) -> list[tuple[object, ...]]:
        """Read the daemon's database with plain SQL: the old code's schema is older."""
        database = self.state / "watchd.sqlite"
        if not database.exists():
            return []
        try:
            with sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=10) as db:
                return list(db.execute(sql, params))
        except sqlite3.OperationalError:  # the schema is still being made
            return []

    def beat(self) -> float | None:
        rows = self.query("SELECT beat_at FROM heartbeat WHERE id = 1")
        return float(rows[0][0]) if rows else None  # type: ignore[arg-type]

    def queued_at(self, folder: str) -> float | None:
        rows = self.query(
            "SELECT min(e.at) FROM events e JOIN batches b ON e.batch_id = b.id"
            " WHERE b.folder = ? AND e.job_id IS NULL AND e.to_state = 'queued'",
            folder,
        )
        return float(rows[0][0]) if rows and rows[0][0] is not None else None  # type: ignore[arg-type]

    def counts(self) -> dict[str, int]:
        rows = self.query("SELECT state, count(*) FROM batches GROUP BY state")
        return {str(state): int(n) for state, n in rows}  # type: ignore[call-overload]


class Counting:
    """``strace -f`` attached to a daemon for a window: the calls its own threads made. The
    jobs it starts are its children too; their files (one per thread or process, ``-ff``) hold
    an ``execve`` and are left out: they are the jobs' calls, not the daemon's."""

    def __init__(self, pid: int, out: Path) -> None:
        self.out = out
        out.mkdir(parents=True)
        trace = f"trace={SYSCALLS},execve"
        self.process = subprocess.Popen(
            ["strace", "-f", "-ff", "-e", trace, "-o", str(out / "t"), "-p", str(pid)],
            stderr=subprocess.DEVNULL,
        )
        time.sleep(1.0)  # attached to every thread

    def stop(self) -> dict[str, int]:
        self.process.send_signal(signal.SIGINT)
        self.process.wait(timeout=120)
        calls: dict[str, int] = {}
        for traced in self.out.iterdir():
            lines = traced.read_text(errors="replace").splitlines()
            if any(line.startswith("execve(") for line in lines):
                continue  # a job
            for line in lines:
                name = line.partition("(")[0]
                if name and name.isidentifier():
                    calls[name] = calls.get(name, 0) + 1
        return calls


class Beats(threading.Thread):
    """Samples a daemon's heartbeat: the largest gap between two beats while it runs."""

    def __init__(self, daemon: Daemon) -> None:
        super().__init__(daemon=True)
        self.source, self.stopping = daemon, threading.Event()
        self.beats: list[float] = []

    def run(self) -> None:
        while not self.stopping.wait(0.1):
            beat = self.source.beat()
            if beat is not None and (not self.beats or beat != self.beats[-1]):
                self.beats.append(beat)

    def largest_gap(self) -> float:
        return max((b - a for a, b in zip(self.beats, self.beats[1:], strict=False)), default=0.0)


def placeholder_model(registry: Path, name: str) -> Path:
    """A registry in which intake finds the model ``name`` (a version folder, no weights: the
    benchmarks that name it measure intake, never its jobs' results); the registry's path."""
    (registry / name / "v0001").mkdir(parents=True, exist_ok=True)
    return registry


def manifest(files: list[str], size: int) -> str:
    lines = ['watchd = 1\nkind = "inference"\n[owner]\nname = "bench"\n[model]\nname = "none"\n']
    lines += [f'[[files]]\npath = "{f}"\nsize = {size}\n' for f in files]
    return "".join(lines)


def write_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(".tmp-" + path.name)
    temporary.write_text(text)
    os.rename(temporary, path)


def copy_phase(daemons: list[Daemon], images: int, minutes: float, work: Path) -> None:
    names = [f"images/img_{i:05d}.png" for i in range(images)]
    for d in daemons:
        (d.server / "big" / "images").mkdir(parents=True)
        write_atomically(d.server / "big" / "manifest.toml", manifest(names, len(IMAGE)))
    counts = [Counting(d.process.pid, work / f"strace-{d.name}") for d in daemons]  # type: ignore[union-attr]
    beats = [Beats(d) for d in daemons]
    for b in beats:
        b.start()
    began, small_at = time.time(), None
    for i, name in enumerate(names):
        target = began + minutes * 60 * (i + 1) / images
        time.sleep(max(0.0, target - time.time()))
        for d in daemons:
            (d.server / "big" / name).write_bytes(IMAGE)
        if small_at is None and i >= images // 2:
            small_at = time.time()
            for d in daemons:
                drop_small(d.server / "small")
    landed = time.time()
    waited = {d.name: wait_queued(d, "big", 600) for d in daemons}
    calls = [c.stop() for c in counts]
    for b in beats:
        b.stopping.set()
    print(f"copy: {images:,} images over {minutes:g} min (manifest first), server side")
    for d, c, b in zip(daemons, calls, beats, strict=True):
        total = sum(c.values())
        small = d.queued_at("small")
        small_delay = f"{small - small_at:.1f} s" if small and small_at else "not queued"
        print(
            f"  {d.name}: {total:,} calls ({total / images:.2f} per input: "
            + ", ".join(f"{k} {v:,}" for k, v in sorted(c.items()))
            + f"); largest gap between ticks {b.largest_gap():.2f} s; small batch dropped"
            f" halfway → queued {small_delay}; last file landed → queued"
            f" {waited[d.name] - landed:.1f} s"
        )
    old, new = (sum(c.values()) for c in calls)
    print(f"  ratio new/old, calls over the copy: {new / max(old, 1):.4f} (target <= 0.1)")


def drop_small(folder: Path) -> None:
    names = [f"images/s_{i}.png" for i in range(4)]
    (folder / "images").mkdir(parents=True)
    for name in names:
        (folder / name).write_bytes(IMAGE)
    write_atomically(folder / "manifest.toml", manifest(names, len(IMAGE)))


def wait_queued(daemon: Daemon, folder: str, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        at = daemon.queued_at(folder)
        if at is not None:
            return at
        time.sleep(0.5)
    raise SystemExit(f"{daemon.name}: '{folder}' not queued within {timeout:.0f} s")


def poll_phase(daemons: list[Daemon], ended: int, active: int, window: float, work: Path) -> None:
    for d in daemons:
        for i in range(ended):
            folder = d.server / f"ended {i:05d}"
            folder.mkdir()
            (folder / "manifest.toml").write_text("watchd = 1\nkind = 'refused'\n")
        for i in range(active):
            folder = d.server / f"active {i:02d}"
            folder.mkdir()
            write_atomically(folder / "manifest.toml", manifest([f"img_{i}.png"], len(IMAGE)))
    for d in daemons:
        deadline = time.monotonic() + 1200
        while time.monotonic() < deadline:
            counts = d.counts()
            if counts.get("failed", 0) >= ended and counts.get("waiting", 0) >= active:
                break
            time.sleep(2)
    time.sleep(10)  # the ended folders let go (watch_ended_seconds = 0)
    polls = window / 2.0
    counts = [Counting(d.process.pid, work / f"strace-poll-{d.name}") for d in daemons]  # type: ignore[union-attr]
    time.sleep(window)
    calls = [sum(c.stop().values()) for c in counts]
    print(f"polls: a root of {ended:,} ended batch folders and {active} waiting, {window:g} s")
    for d, c in zip(daemons, calls, strict=True):
        print(f"  {d.name}: {c:,} calls, {c / polls:,.0f} per poll (poll_seconds 2)")
    print(f"  ratio new/old, calls per poll: {calls[1] / max(calls[0], 1):.4f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", type=Path, required=True, help="a checkout of the old code")
    parser.add_argument("--images", type=int, default=55_000)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--ended", type=int, default=10_000)
    parser.add_argument("--active", type=int, default=10)
    parser.add_argument("--window", type=float, default=20.0, help="seconds of polls counted")
    args = parser.parse_args()
    if shutil.which("strace") is None:
        subprocess.run(["apt-get", "install", "-y", "-q", "strace"], check=True)
    subprocess.run([str(REPO / "scripts" / "netshare"), "start"], check=True)
    work = Path(tempfile.mkdtemp(prefix="watchd-bench-share-"))
    run = f"bench {os.getpid()}"
    daemons = [
        Daemon(name, code, SHARE / "server" / run / name, SHARE / "mount" / run / name,
               work / f"state-{name}")
        for name, code in (("old", args.old.resolve()), ("new", REPO))
    ]  # fmt: skip
    for d in daemons:
        d.server.mkdir(parents=True)
    print(f"old: {args.old.resolve()} ({_commit(args.old)}); new: {REPO} ({_commit(REPO)})")
    print(f"share: fuse.sshfs at {SHARE / 'mount'}, attribute and listing cache 3 s")
    try:
        for d in daemons:
            d.start()
        copy_phase(daemons, args.images, args.minutes, work)
        poll_phase(daemons, args.ended, args.active, args.window, work)
    finally:
        for d in daemons:
            d.stop()
        shutil.rmtree(SHARE / "server" / run, ignore_errors=True)
    print(f"logs and strace summaries: {work}")
    return 0


def _commit(checkout: Path) -> str:
    """The commit ``checkout`` is (``git describe``); "?" where it is not the top of a git work
    tree: an archive of a commit unpacked inside another repository would show that one's."""
    top = subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "--show-toplevel"],
        capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    if not top or Path(top).resolve() != checkout.resolve():
        return "?"
    done = subprocess.run(
        ["git", "-C", str(checkout), "describe", "--always", "--dirty"],
        capture_output=True, text=True,
    )  # fmt: skip
    return re.sub(r"\s+", "", done.stdout) or "?"


if __name__ == "__main__":
    sys.exit(main())
