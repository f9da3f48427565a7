"""Soak: thousands of small batches through a real daemon, with injected faults, while its RSS
and CPU are sampled; then an idle period.

Drops go into one drop root for --minutes: small inference batches that really run (a few
32² images each), and, in between, faulty ones that cost the daemon but not the CPU: manifests
refused at once, models that do not exist (refused at intake), inputs that never complete (the
batch times out); running jobs are killed now and then. The daemon thus ends up tracking
--batches batches (10,000 by default), each one taken in through its real intake.
Every --sample seconds the daemon's RSS (VmRSS), CPU (utime+stime) and inotify watches are
read from /proc.
After the drops, --idle minutes with nothing to do give the idle CPU.

Targets: idle CPU <= 1 % of a core; RSS <= 150 MB with 10,000 batches tracked, flat within
10 % after warm-up (the first quarter of the run).

    python scripts/soak.py                          # the hour: 60 min of drops, 5 min idle
    python scripts/soak.py --minutes 3 --batches 400 --idle 1     # a quick look
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import synth
import tomli_w
from fault_campaign import MODEL, train_seed_model
from replay import manifest_text

from daemon.core.manifest_schema import Kind
from daemon.core.states import BatchState
from daemon.site import logs
from daemon.site.config import Config, load_config
from daemon.store import Store

BIN = Path(sys.executable).parent
TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Sample:
    at: float  # seconds since start
    rss_mb: float
    cpu_seconds: float
    tracked: int
    active: int
    watches: int  # inotify watches the daemon holds


def write_config(
    base: Path, root: Path, registry: Path, *, rescan_seconds: float = 300.0, **intake: float
) -> Config:
    """The soak's configuration; ``intake``: more keys of [intake] (the defaults otherwise)."""
    document = {
        "daemon": {"state_dir": str(base / "state"), "tick_seconds": 1.0, "heartbeat_seconds": 5.0,
                   "rescan_seconds": rescan_seconds, "log_format": "json", "log_level": "warning"},
        "roots": [{"path": str(root), "observer": "inotify"}],
        "intake": {"settle_seconds": 0.5, "check_seconds": 1.0, "timeout_seconds": 30, **intake},
        "planner": {"shard_size": 8, "max_attempts": 2},
        "executor": {"local": {"max_parallel": 2}},
        "registry": {"path": str(registry)},
        "jobs": {"wandb_mode": "disabled"},
    }  # fmt: skip
    path = base / "config.toml"
    path.write_text(tomli_w.dumps(document))
    return load_config(path)


def read_proc(pid: int) -> tuple[float, float]:
    """RSS in MB and CPU seconds (user + system) of process ``pid``."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kb = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return rss_kb / 1024, (int(fields[11]) + int(fields[12])) / TICKS


def counts(config: Config) -> tuple[int, int]:
    """Batches tracked, and those queued or running (the waiting ones are mostly timeouts)."""
    try:
        store = Store(config.daemon.database)
        try:
            by_state = store.counts()
        finally:
            store.close()
    except sqlite3.Error:
        return 0, 0
    busy = by_state[BatchState.QUEUED] + by_state[BatchState.RUNNING]
    return sum(by_state.values()), busy


class Dropper:
    """Makes the batches: a template of each kind staged once, copied for every drop."""

    def __init__(self, base: Path, root: Path, rng: random.Random) -> None:
        self.root, self.rng, self.count = root, rng, 0
        self.good = base / "template good"
        synth.make_batch(self.good, "inference", count=3, size=32, seed=3)
        (self.good / "manifest.toml").write_bytes(
            manifest_text(self.good, Kind.INFERENCE, model=MODEL, version="latest")
        )
        self.unknown_model = (
            (self.good / "manifest.toml").read_text().replace(f'name = "{MODEL}"', 'name = "nope"')
        )
        self.incomplete = (
            self.good / "manifest.toml"
        ).read_text() + '\n[[files]]\npath = "never.png"\nsize = 9\n'

    def drop(self, kind: str) -> None:
        self.count += 1
        folder = self.root / f"{kind} {self.count:05d}"
        shutil.copytree(self.good / "images", folder / "images")
        text = {
            "good": (self.good / "manifest.toml").read_text(),
            "refused": 'watchd = 1\nkind = "inference"\n[owner\n',
            "unknown-model": self.unknown_model,
            "incomplete": self.incomplete,
        }[kind]
        (folder / ".manifest.partial").write_text(text)
        os.replace(folder / ".manifest.partial", folder / "manifest.toml")


def kill_a_worker(config: Config, rng: random.Random) -> bool:
    try:
        store = Store(config.daemon.database)
        try:
            handles = [j.handle for j in store.jobs() if j.state.live and j.handle]
        finally:
            store.close()
    except sqlite3.Error:
        return False
    if not handles:
        return False
    try:
        os.killpg(int(rng.choice(handles).split(":")[1]), signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--batches", type=int, default=10_000)
    parser.add_argument("--idle", type=float, default=5.0, help="idle minutes at the end")
    parser.add_argument(
        "--drain", type=float, default=10.0, help="minutes to wait for the queue to empty first"
    )
    parser.add_argument("--sample", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    logs.configure("console", "warning")
    rng = random.Random(args.seed)
    base = Path(tempfile.mkdtemp(prefix="watchd-soak-"))
    print(
        f"soak: {args.minutes:g} min of drops towards {args.batches:,} batches, "
        f"then {args.idle:g} min idle, in {base}",
        flush=True,
    )
    registry = train_seed_model(base)
    root = base / "drop"
    root.mkdir()
    config = write_config(base, root, registry)
    dropper = Dropper(base, root, rng)
    with open(base / "daemon.log", "wb") as log:
        daemon = subprocess.Popen(
            [str(BIN / "watchd"), "run", "--config", str(config.source)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    samples: list[Sample] = []
    kills = 0
    try:
        start = time.monotonic()
        drop_until = start + args.minutes * 60
        next_sample = start
        while dropper.count < args.batches:  # past the minutes, the rest go at once
            _, active = counts(config)
            left = max(1.0, drop_until - time.monotonic())
            cheap_per_good = max(0, (args.batches - dropper.count) / max(1.0, left / 2.0) - 1)
            if active < 4:
                dropper.drop("good")
            for _ in range(int(cheap_per_good) + (rng.random() < cheap_per_good % 1)):
                dropper.drop(rng.choice(["refused", "refused", "unknown-model", "incomplete"]))
            if rng.random() < 0.01 and kill_a_worker(config, rng):
                kills += 1
            if time.monotonic() >= next_sample:
                samples.append(sample(daemon.pid, start, config))
                print(format_sample(samples[-1]), flush=True)
                next_sample += args.sample
            time.sleep(2.0)
        print(
            f"drops done: {dropper.count:,} batches dropped, {kills} workers killed; "
            "waiting for the queue",
            flush=True,
        )
        while counts(config)[1] > 0 and time.monotonic() < drop_until + args.drain * 60:
            time.sleep(5)
        idle_from = sample(daemon.pid, start, config)
        if idle_from.active:
            print(f"note: {idle_from.active} batches still active after {args.drain:g} min: "
                  "the idle figure below includes their work", flush=True)  # fmt: skip
        time.sleep(args.idle * 60)
        idle_to = sample(daemon.pid, start, config)
        samples += [idle_from, idle_to]
        print(
            format_sample(idle_from) + "  (idle from)\n" + format_sample(idle_to) + "  (idle to)",
            flush=True,
        )
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=120)
    return report(samples, idle_from, idle_to, base)


def inotify_watches(pid: int) -> int:
    """How many inotify watches process ``pid`` holds (its /proc fdinfo)."""
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:inotify":
                count += Path(f"/proc/{pid}/fdinfo/{fd}").read_text().count("inotify wd:")
        except OSError:
            continue
    return count


def sample(pid: int, start: float, config: Config) -> Sample:
    rss, cpu = read_proc(pid)
    tracked, active = counts(config)
    return Sample(time.monotonic() - start, rss, cpu, tracked, active, inotify_watches(pid))


def format_sample(s: Sample) -> str:
    return (
        f"{s.at / 60:6.1f} min  RSS {s.rss_mb:6.1f} MB  CPU {s.cpu_seconds:8.1f} s  "
        f"tracked {s.tracked:6,}  busy {s.active:4}  watches {s.watches:5,}"
    )


def report(samples: list[Sample], idle_from: Sample, idle_to: Sample, base: Path) -> int:
    idle_cpu = (
        (idle_to.cpu_seconds - idle_from.cpu_seconds) / max(1e-9, idle_to.at - idle_from.at) * 100
    )
    warm = [s for s in samples if s.at >= samples[-1].at * 0.25]
    rss_after_warmup = [s.rss_mb for s in warm]
    spread = (
        (max(rss_after_warmup) - min(rss_after_warmup)) / statistics.median(rss_after_warmup) * 100
    )
    busy = [b for a, b in itertools.pairwise(samples) if b.at > a.at and b is not idle_to]
    busy_cpu = [
        (b.cpu_seconds - a.cpu_seconds) / (b.at - a.at) * 100
        for a, b in zip(samples, busy, strict=False)
        if b.at > a.at
    ]
    print(f"\nbatches tracked at the end: {idle_to.tracked:,}")
    print(
        f"daemon RSS: max {max(s.rss_mb for s in samples):.1f} MB; after warm-up "
        f"{min(rss_after_warmup):.1f}–{max(rss_after_warmup):.1f} MB, "
        f"spread {spread:.1f} % of the median"
    )
    print(
        "daemon CPU while dropping: median "
        f"{statistics.median(busy_cpu) if busy_cpu else 0:.1f} % of a core"
    )
    print(
        f"daemon CPU idle ({(idle_to.at - idle_from.at) / 60:.1f} min): {idle_cpu:.2f} % of a core"
    )
    ok = (
        idle_cpu <= 1.0
        and max(s.rss_mb for s in samples) <= 150
        and spread <= 10
        and idle_to.tracked >= 10_000
    )
    print(
        "targets (idle CPU <= 1 %, RSS <= 150 MB, flat within 10 %, >= 10,000 tracked): "
        + ("met" if ok else "NOT met")
    )
    shutil.rmtree(base, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
