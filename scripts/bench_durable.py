"""Benchmark: making the inference job's masks durable, alone — one fsync per mask against
one ``syncfs`` for all, on local disk and on a share, in one run.

N mask files (256² binary masks of synthetic spheroids, PNG-encoded and written by the job's
own :func:`pipelines.images.write_mask` into a :class:`pipelines.inference.masks.MaskFolders`
folder, as the finish workers write them) are written by W forked writer processes (the job's
finish workers are forked processes, one per CPU: :mod:`pipelines.inference.pool`), each its
own share of the names, in these modes:

- ``none``: written and renamed, nothing made durable (the floor: the write path's own cost);
- ``fsync``: (a) one fsync per mask as it is written, in the writer (``fsync=True``);
- ``syncfs``: (b) all written, then one :func:`pipelines.inference.durable.sync_filesystem`
  (the job's Committer does one per :data:`pipelines.inference.stages.COMMIT_IMAGES` masks or
  per second: for N up to that, exactly this);
- ``durable``: (c) what the job does on that filesystem: :func:`durable.each_file` of the
  folder decides, then (a) or (b) as ``pipelines/infer.py`` and the Committer do.

Every mode runs with 1 writer and with ``--workers`` W, the modes interleaved (their order
turned each round), ``--rounds`` times; before each timed run the filesystem is synced
(untimed), so no mode pays for what the one before left dirty. Printed per filesystem:
files/s (median of the rounds), the durability's own cost in ms per file (over ``none``),
and (b)/(a), (c)/(a) at the same W.

On FUSE (sshfs) a syncfs is not passed on to the server (durable.py's docstring): (b) there
makes nothing durable on the server and is shown for its cost only, marked so; (c) is (a).
syncfs commits the whole filesystem, other processes' writes included: on a shared machine
(b) pays for theirs too.

    .venv/bin/python scripts/bench_durable.py                  # a tmp folder on local disk
    .venv/bin/python scripts/bench_durable.py --files 500 --rounds 3 --workers 2 \\
        --share /var/lib/watchd-netshare/mount                  # and the sshfs share
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.synchronize import Event
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import synth

from daemon.contract.heldfolder import HeldFolder
from daemon.site.mounts import filesystem_type
from pipelines.images import write_mask
from pipelines.inference import durable
from pipelines.inference.masks import MaskFolders
from pipelines.inference.stages import COMMIT_IMAGES
from pipelines.layout import mask_name

MASK_SIZE = 256
DISTINCT_MASKS = 32  # drawn once, written in turn: drawing costs more than writing
MODES = ("none", "fsync", "syncfs", "durable")
LABEL = {"none": "none", "fsync": "(a) fsync", "syncfs": "(b) syncfs", "durable": "(c) durable"}


@dataclass(frozen=True)
class Target:
    """A filesystem under test: the benchmark's own folder on it."""

    name: str
    folder: Path
    fstype: str
    fuse: bool  # durable.each_file: a syncfs is not passed on to the server


def masks(count: int) -> list[np.ndarray]:
    """Spheroid masks as the job writes them (bool, 256²)."""
    return [synth.sample(7, index, MASK_SIZE).mask for index in range(count)]


def write_share(run: HeldFolder, drawn: list[np.ndarray], names: range, fsync: bool) -> None:
    """One writer's masks, by the job's write path (held mask folder, write then rename)."""
    folders = MaskFolders(run)
    try:
        for index in names:
            folder, name = folders.of(f"plate/img_{index:06d}.png")
            write_mask(folder, mask_name(name), drawn[index % len(drawn)], fsync=fsync)
    finally:
        folders.close()


def _writer(run: HeldFolder, drawn: list[np.ndarray], names: range, fsync: bool, go: Event) -> None:
    go.wait()
    write_share(run, drawn, names, fsync)


def timed_run(
    run: HeldFolder, drawn: list[np.ndarray], files: int, writers: int, mode: str
) -> float:
    """Seconds from the writers' start to the masks durable as ``mode`` makes them."""
    each = durable.each_file(run.fd) if mode == "durable" else mode == "fsync"
    sync_after = mode == "syncfs" or (mode == "durable" and not each)
    context = multiprocessing.get_context("fork")
    go = context.Event()
    processes = [
        context.Process(target=_writer, args=(run, drawn, range(k, files, writers), each, go))
        for k in range(writers)
    ]
    for process in processes:
        process.start()
    durable.sync_filesystem(run.fd)  # what was dirty before is not this run's to pay
    started = time.perf_counter()
    go.set()
    for process in processes:
        process.join()
    if sync_after:
        durable.sync_filesystem(run.fd)
    seconds = time.perf_counter() - started
    if failed := [p.exitcode for p in processes if p.exitcode != 0]:
        raise RuntimeError(f"{mode}: writer(s) exited with {failed}")
    return seconds


def target(name: str, parent: Path) -> Target:
    folder = Path(tempfile.mkdtemp(prefix="bench-durable-", dir=parent))
    with HeldFolder.open(folder) as held:
        fuse = durable.each_file(held.fd)
    return Target(name, folder, filesystem_type(folder) or "unknown", fuse)


def measure(place: Target, drawn: list[np.ndarray], files: int, writer_counts: list[int],
            rounds: int) -> dict[tuple[str, int], list[float]]:  # fmt: skip
    """files/s of every (mode, writers), ``rounds`` each, the modes interleaved."""
    rates: dict[tuple[str, int], list[float]] = {}
    for number in range(rounds):
        for writers in writer_counts:
            turn = number % len(MODES)  # no mode always first
            for mode in MODES[turn:] + MODES[:turn]:
                folder = place.folder / f"{mode}-{writers}-{number}"
                folder.mkdir()
                with HeldFolder.open(folder) as run:
                    seconds = timed_run(run, drawn, files, writers, mode)
                shutil.rmtree(folder)
                rates.setdefault((mode, writers), []).append(files / seconds)
        print(f"  {place.name}: round {number + 1}/{rounds} done, {load()}", flush=True)
    return rates


def report(
    place: Target, rates: dict[tuple[str, int], list[float]], writer_counts: list[int]
) -> None:
    chosen = "fsync each (FUSE)" if place.fuse else "syncfs"
    print(f"\n{place.name}: {place.fstype} at {place.folder.parent}; durable.py chooses {chosen}")
    print(f"{'mode':<12} {'W':>2} {'files/s':>9} {'ms/file':>8} {'durability ms/file':>19}  note")
    median = {key: statistics.median(values) for key, values in rates.items()}
    for writers in writer_counts:
        floor = 1000 / median[("none", writers)]
        for mode in MODES:
            rate = median[(mode, writers)]
            extra = f"{1000 / rate - floor:19.3f}" if mode != "none" else f"{'':19}"
            note = "NOT durable on the server: cost only" if place.fuse and mode == "syncfs" else ""
            print(f"{LABEL[mode]:<12} {writers:>2} {rate:9.0f} {1000 / rate:8.3f} {extra}  {note}")
        a = median[("fsync", writers)]
        print(f"{'':12} {writers:>2} (b)/(a) {median[('syncfs', writers)] / a:.2f}"
              f"{' (not durable)' if place.fuse else ''}, "
              f"(c)/(a) {median[('durable', writers)] / a:.2f}")  # fmt: skip
    if len(writer_counts) > 1:
        one, many = writer_counts
        print(f"{'':12} (a) W={many} ÷ W={one}: "
              f"{median[('fsync', many)] / median[('fsync', one)]:.2f}")  # fmt: skip


def load() -> str:
    return f"load {' '.join(f'{value:.2f}' for value in os.getloadavg())}"


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dir",
        type=Path,
        default=Path(tempfile.gettempdir()),
        help="a folder on the local disk (a subfolder is made and removed)",
    )
    parser.add_argument("--share", type=Path, help="a folder on a share, measured too")
    parser.add_argument("--files", type=int, default=500, help="masks per timed run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--workers",
        type=int,
        default=os.cpu_count() or 1,
        help="writer processes besides 1, as the job's finish workers (its CPUs)",
    )
    args = parser.parse_args(argv)
    for folder in filter(None, (args.dir, args.share)):
        if not folder.is_dir():
            parser.error(f"{folder}: not a folder")
    if args.files < 1 or args.rounds < 1 or args.workers < 1:
        parser.error("--files, --rounds and --workers must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    writer_counts = sorted({1, args.workers})
    print(f"{args.files} masks of {MASK_SIZE}² per run, writers {writer_counts}, {args.rounds} "
          f"round(s); the Committer syncs every {COMMIT_IMAGES} masks or second; "
          f"{os.cpu_count()} cores")  # fmt: skip
    print(f"start: {uptime()}", flush=True)
    drawn = masks(min(DISTINCT_MASKS, args.files))
    places = [("local", args.dir)] + ([("share", args.share)] if args.share else [])
    for name, parent in places:
        place = target(name, parent)
        try:
            report(place, measure(place, drawn, args.files, writer_counts, args.rounds),
                   writer_counts)  # fmt: skip
        finally:
            shutil.rmtree(place.folder, ignore_errors=True)
    print(f"\nend: {uptime()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
