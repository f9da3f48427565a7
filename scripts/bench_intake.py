"""Intake benchmarks: arrival→queued latency (inotify vs polling), a large batch's last files
landing → queued (the old code against the new), and the catch-up scan's cost.

1. Latency: a real `watchd run` (local executor, settle 0) watches a drop root; batches are
   dropped one by one (images, then the manifest renamed into place); the time from the rename
   to the batch's `batch recorded` (created_at) and `queued` events is read from the database.
2. Catch-up scan: a drop root holding --folders batch folders of --images images each. Timed,
   in the same run and interleaved: watchd's scan (root listing + one manifest stat per
   folder), the daemon's periodic rescan when nothing changed, the start-up catch-up that
   records every batch, and a baseline that walks and stats the whole tree (what a recursive
   watcher or a naive poll does).

3. Arrival (``--old``): a batch listing --arrival-images files waits with half of them for
   --arrival-wait s (its checks back off), then the other half lands by rename at once, on
   local disk with inotify, settle 5 s, checks every 2 s (bench_share.py's timing); the last
   rename → queued, for a daemon of the old code and one of the new, side by side.

    python scripts/bench_intake.py                    # latency and scan, 1,000 x 1,000
    python scripts/bench_intake.py --only latency --drops 20
    python scripts/bench_intake.py --only arrival --old ../wt-base [--arrival-images 20000]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tomli_w
from bench_share import IMAGE, TIMING, Daemon, manifest, placeholder_model, write_atomically

from daemon.core.states import BatchState
from daemon.site import logs
from daemon.site.config import load_config
from daemon.store import Store
from daemon.watcher import scan_root

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parent.parent
MANIFEST = """watchd = 1
kind = "inference"
[owner]
name = "bench"
[model]
name = "none"
[[patterns]]
glob = "images/*.png"
count = {count}
"""


def write_config(base: Path, root: Path, mode: str) -> Path:
    document = {
        "daemon": {"state_dir": str(base / f"state-{mode}"), "tick_seconds": 1.0,
                   "heartbeat_seconds": 5.0, "log_format": "json"},
        "roots": [{"path": str(root), "observer": mode, "poll_seconds": 1.0}],
        "intake": {"settle_seconds": 0.0, "check_seconds": 0.05},
        "registry": {"path": str(placeholder_model(base / "registry", "none"))},
        "jobs": {"wandb_mode": "disabled"},
    }  # fmt: skip
    path = base / f"config-{mode}.toml"
    path.write_text(tomli_w.dumps(document))
    return path


def latency(mode: str, drops: int, base: Path) -> tuple[list[float], list[float]]:
    """Seconds from manifest rename to recorded, and to queued, for each drop."""
    root = base / f"drop-{mode}"
    root.mkdir()
    config = load_config(write_config(base, root, mode))
    with open(base / f"daemon-{mode}.log", "wb") as log:
        daemon = subprocess.Popen([str(BIN / "watchd"), "run", "--config", str(config.source)],
                                  stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    recorded, queued = [], []
    try:
        time.sleep(3)  # start-up
        for i in range(drops):
            folder = root / f"batch {i}"
            (folder / "images").mkdir(parents=True)
            (folder / "images" / "a.png").write_bytes(b"x" * 100)
            (folder / ".manifest.partial").write_text(MANIFEST.format(count=1))
            arrived = time.time()
            os.replace(folder / ".manifest.partial", folder / "manifest.toml")
            at_recorded, at_queued = wait_queued(config.daemon.database, folder.name)
            recorded.append(at_recorded - arrived)
            queued.append(at_queued - arrived)
            time.sleep(0.7 + (i % 3) * 0.13)  # arrive at varied phases of the poll interval
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=60)
    return recorded, queued


def wait_queued(database: Path, folder: str, timeout: float = 30.0) -> tuple[float, float]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        store = Store(database)
        try:
            batch = next((b for b in store.batches() if b.folder == folder), None)
            if batch is not None:
                queued = [
                    e.at
                    for e in store.events(batch.id, jobs=False)
                    if e.to_state is BatchState.QUEUED
                ]
                if queued:
                    return batch.created_at, queued[0]
        finally:
            store.close()
        time.sleep(0.01)
    raise TimeoutError(f"{folder} not queued within {timeout} s")


def arrival(old: Path, images: int, wait: float, base: Path) -> None:
    """The last half of a waiting batch's files land at once: how long until it is queued."""
    daemons = [
        Daemon(name, code, base / f"root-{name}", base / f"root-{name}", base / f"state-{name}")
        for name, code in (("old", old.resolve()), ("new", REPO))
    ]  # fmt: skip
    names = [f"images/img_{i:05d}.png" for i in range(images)]
    for d in daemons:
        (d.server / "big" / "images").mkdir(parents=True)
        staging = base / f"staging-{d.name}" / "images"  # same filesystem, outside the root
        staging.mkdir(parents=True)
        for name in names:
            (staging.parent / name).write_bytes(IMAGE)
    try:
        for d in daemons:
            d.start()
        for d in daemons:
            write_atomically(d.server / "big" / "manifest.toml", manifest(names, len(IMAGE)))
            for name in names[: images // 2]:
                os.rename(base / f"staging-{d.name}" / name, d.server / "big" / name)
        time.sleep(wait)  # the checks see nothing new and back off
        landed = {}
        for d in daemons:
            for name in names[images // 2 :]:
                os.rename(base / f"staging-{d.name}" / name, d.server / "big" / name)
            landed[d.name] = time.time()
        queued = {d.name: wait_for_queued(d, 600) - landed[d.name] for d in daemons}
    finally:
        for d in daemons:
            d.stop()
    bound = TIMING["settle_seconds"] + 2 * TIMING["check_seconds"]
    print(f"arrival: {images:,} listed files, half of them waiting {wait:g} s, then the rest "
          f"renamed in at once; settle {TIMING['settle_seconds']:g} s, checks every "
          f"{TIMING['check_seconds']:g} s (local disk, inotify)")  # fmt: skip
    for name, seconds in queued.items():
        print(f"  {name}: last file landed → queued {seconds:.1f} s")
    print(f"  target: <= settle + 2 x check_seconds = {bound:g} s")


def wait_for_queued(daemon: Daemon, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while (at := daemon.queued_at("big")) is None:
        if time.monotonic() > deadline:
            raise SystemExit(f"{daemon.name}: not queued within {timeout:.0f} s")
        time.sleep(0.1)
    return at


def make_tree(root: Path, folders: int, images: int) -> None:
    for f in range(folders):
        images_dir = root / f"batch {f:04d}" / "images"
        images_dir.mkdir(parents=True)
        for i in range(images):
            os.close(os.open(images_dir / f"img_{i:04d}.png", os.O_CREAT | os.O_WRONLY, 0o644))
        (images_dir.parent / "manifest.toml").write_text(MANIFEST.format(count=images))


def full_walk(root: Path) -> int:
    """The baseline: every directory listed, every entry stat'ed."""
    count = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            os.lstat(os.path.join(dirpath, name))
            count += 1
    return count


def timed(function, repeat: int) -> list[float]:  # type: ignore[no-untyped-def]
    runs = []
    for _ in range(repeat):
        start = time.perf_counter()
        function()
        runs.append(time.perf_counter() - start)
    return runs


def catch_up(folders: int, images: int, base: Path, repeat: int) -> None:
    root = base / "big drop"
    root.mkdir()
    started = time.perf_counter()
    make_tree(root, folders, images)
    print(
        f"tree: {folders:,} folders x {images:,} images made in "
        f"{time.perf_counter() - started:.1f} s"
    )
    drop_caches_note = "(warm page cache; both sides see the same cache)"
    scans, walks = [], []
    for _ in range(repeat):  # interleaved, so machine noise hits both alike
        scans += timed(lambda: list(scan_root(root)), 1)
        walks += timed(lambda: full_walk(root), 1)
    entries = full_walk(root)
    found = len(list(scan_root(root)))
    print(
        f"watchd scan: {found:,} manifests found; median {statistics.median(scans) * 1000:.1f} ms"
    )
    print(
        f"full walk:   {entries:,} entries stat'ed; median {statistics.median(walks) * 1000:.1f} ms"
    )
    print(
        f"ratio scan / full walk: {statistics.median(scans) / statistics.median(walks):.4f} "
        + drop_caches_note
    )
    service_catch_up(base, root)


def service_catch_up(base: Path, root: Path) -> None:
    """The daemon's own catch-up: first sighting (records every batch), then a rescan."""
    from daemon.executors import make_executor
    from daemon.loop.factory import build_service

    config = load_config(write_config(base, root, "inotify"))
    service = build_service(config, make_executor(config, os.environ))
    first = timed(service.start, 1)[0]  # watches every folder, then catches up
    store = Store(config.daemon.database)
    recorded = len(store.batches())
    store.close()
    again = statistics.median(timed(lambda: service.catch_up(time.time()), 5))
    service.shutdown()
    print(f"daemon start-up (inotify on root + {recorded:,} folders, catch-up recording "
          f"{recorded:,} batches): {first:.2f} s, {first / max(recorded, 1) * 1000:.2f} ms "
          "per batch (watch, stat, read, parse, record)")  # fmt: skip
    print(f"daemon periodic rescan, nothing new: median {again * 1000:.1f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["latency", "scan", "arrival"])
    parser.add_argument("--old", type=Path, help="a checkout of the old code (arrival)")
    parser.add_argument("--arrival-images", type=int, default=20_000)
    parser.add_argument("--arrival-wait", type=float, default=60.0)
    parser.add_argument("--drops", type=int, default=15)
    parser.add_argument("--folders", type=int, default=1000)
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    logs.configure("console", "warning")
    base = Path(tempfile.mkdtemp(prefix="watchd-bench-"))
    try:
        if args.only in (None, "latency"):
            figures = {mode: latency(mode, args.drops, base) for mode in ("inotify", "polling")}
            print(
                f"arrival -> queued latency, {args.drops} drops each, settle 0 s, "
                "polling every 1 s:"
            )
            for mode, (recorded, queued) in figures.items():
                print(f"  {mode:8s} recorded: median {statistics.median(recorded) * 1000:7.1f} ms, "
                      f"max {max(recorded) * 1000:7.1f} ms | queued: median "
                      f"{statistics.median(queued) * 1000:7.1f} ms, "
                      f"max {max(queued) * 1000:7.1f} ms")  # fmt: skip
            ratio = statistics.median(figures["polling"][1]) / statistics.median(
                figures["inotify"][1]
            )
            print(f"  ratio polling / inotify (median queued): {ratio:.1f}")
        if args.only in (None, "scan"):
            catch_up(args.folders, args.images, base, args.repeat)
        if args.only == "arrival" or (args.only is None and args.old is not None):
            if args.old is None:
                raise SystemExit("--only arrival needs --old (a checkout of the old code)")
            arrival(args.old, args.arrival_images, args.arrival_wait, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
