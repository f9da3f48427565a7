"""Benchmark: one whole-slide image through the daemon on the local Slurm cluster, segmented by
one task and by region tasks, in the same run.

A synthetic pyramidal slide of ``--size``² pixels (``--tissue`` of its droplets kept, in
islands, the rest glass; scripts/synth.py, written tile by tile) is dropped twice, into two
daemons run one after the other on the same cluster (scripts/slurm-cluster): ``one`` with
``planner.region_bytes = 0`` (one task segments the slide), ``regions`` with region_bytes set
so the slide is split into ``--regions`` region jobs (one Slurm array, ``--throttle`` tasks at
once), then the assembly job. The registry's model ``--model`` segments it.

Printed for each: queued → done (the daemon's own events), every job's wall time and peak RSS
(its process's ``getrusage``, in its result.json), the windows run and skipped as glass; then
the speed-up, and the agreement of the two label images: every level compared chunk by chunk
over the chunks either stored (never a whole level 0 in memory), and the object tables' rows.

    .venv/bin/python scripts/bench_accuracy.py --train 96 --test 16   # the model, once
    .venv/bin/python scripts/bench_slide.py --size 8192 --regions 4
    .venv/bin/python scripts/bench_slide.py --size 100000 --regions 16
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tomli_w
import zarr

sys.path.insert(0, str(Path(__file__).resolve().parent))
import synth
from bench_batch import BatchDaemon, wait_done
from replay import manifest_text
from slurm_scenario import start_cluster

from daemon.core.manifest_schema import Kind
from pipelines.omezarr import CHUNK, LABEL_NAME

REPO = Path(__file__).resolve().parent.parent


@dataclass
class SlideDaemon(BatchDaemon):
    """A daemon whose jobs go to the test cluster, splitting files over ``region_bytes``."""

    region_bytes: int = 0

    def config(self, **intake: object) -> Path:
        path = super().config(**intake)
        document = {**_toml(path), "planner": {"region_bytes": self.region_bytes}}
        path.write_text(tomli_w.dumps(document))
        return path


def _toml(path: Path) -> dict[str, Any]:
    return tomllib.loads(path.read_text())


@dataclass
class Run:
    name: str
    seconds: float  # queued → done
    jobs: list[dict[str, Any]]  # name, pipeline, elapsed_s, peak_rss_mb
    row: dict[str, str]  # the slide's row of table.csv
    results: Path


def slide_file(out: Path, size: int, tissue: float, seed: int) -> Path:
    """The slide, written once per size, share of tissue and seed (it takes a while)."""
    path = out / f"slide-{size}-{tissue}-{seed}.tif"
    if not path.exists():
        started = time.monotonic()
        partial = path.with_suffix(".part.tif")
        synth.write_slide(partial, size, seed, tissue=tissue)
        os.rename(partial, path)
        print(f"wrote {path.name}: {path.stat().st_size:,} bytes in "
              f"{time.monotonic() - started:.0f} s")  # fmt: skip
    return path


def run_batch(
    name: str, out: Path, slide: Path, args: argparse.Namespace, slurm: dict[str, Any],
    region_bytes: int,
) -> Run:  # fmt: skip
    base = out / name
    shutil.rmtree(base, ignore_errors=True)
    root = base / "drop"
    (root / "slide" / "images").mkdir(parents=True)
    daemon = SlideDaemon(name, REPO, root, root, base / "state", registry=args.registry,
                         slurm=slurm, region_bytes=region_bytes)  # fmt: skip
    daemon.start()
    try:
        folder = root / "slide"
        os.link(slide, folder / "images" / "slide.tif")
        text = manifest_text(folder, Kind.INFERENCE, model=args.model, version="latest")
        (folder / ".manifest.part").write_bytes(text)
        os.rename(folder / ".manifest.part", folder / "manifest.toml")
        done = wait_done(daemon, "slide", args.timeout)
        queued = daemon.state_at("slide", "queued")
        assert queued is not None
    finally:
        daemon.stop()
    (results,) = (folder / "results").iterdir()
    jobs = []
    for job_dir in sorted((results / "jobs").iterdir()):
        found = job_dir / "result.json"
        if found.exists():
            result = json.loads(found.read_text())
            summary = result.get("summary") or {}
            jobs.append({"name": job_dir.name, "pipeline": result["pipeline"],
                         "elapsed_s": summary.get("elapsed_s"),
                         "peak_rss_mb": summary.get("peak_rss_mb")})  # fmt: skip
    with open(results / "table.csv", newline="", encoding="utf-8") as handle:
        (row,) = list(csv.DictReader(handle))
    return Run(name, done - queued, jobs, row, results)


def _chunks(level: Path) -> set[tuple[int, int]]:
    """The chunks a level stores (keys ``row/column``; background chunks are not stored)."""
    found = set()
    for row in level.iterdir():
        if row.is_dir() and row.name.isdigit():
            found |= {(int(row.name), int(c.name)) for c in row.iterdir() if c.name.isdigit()}
    return found


def agreement(one: Path, other: Path) -> list[tuple[int, int, int]]:
    """(level, pixels, differing pixels) of two label images, level by level."""
    first = zarr.open_group(str(one / "labels" / LABEL_NAME), mode="r")
    second = zarr.open_group(str(other / "labels" / LABEL_NAME), mode="r")
    levels = []
    for dataset in first.attrs["multiscales"][0]["datasets"]:
        key = dataset["path"]
        a, b = first[key], second[key]
        if a.shape != b.shape:
            raise SystemExit(f"level {key}: shapes {a.shape} and {b.shape}")
        chunks = _chunks(one / "labels" / LABEL_NAME / key) | _chunks(
            other / "labels" / LABEL_NAME / key
        )
        differing = 0
        for row, col in chunks:
            ys = slice(row * CHUNK, (row + 1) * CHUNK)
            xs = slice(col * CHUNK, (col + 1) * CHUNK)
            differing += int(np.count_nonzero(a[ys, xs] != b[ys, xs]))
        levels.append((int(key), int(np.prod(a.shape)), differing))
    return levels


def report(run: Run) -> None:
    row = run.row
    print(f"{run.name}: queued → done {run.seconds:.1f} s; {row['objects']} objects; windows "
          f"run {row['windows_run']}, skipped as glass {row['windows_glass']}")  # fmt: skip
    for job in run.jobs:
        print(f"  {job['name']:<24} {job['pipeline']:<8} {job['elapsed_s']:>7.1f} s  "
              f"peak RSS {job['peak_rss_mb']:>6.0f} MB")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/watchd-bench"))
    parser.add_argument("--size", type=int, default=100_000)
    parser.add_argument("--tissue", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--regions", type=int, default=16)
    parser.add_argument("--throttle", type=int, default=2, help="region tasks at once")
    parser.add_argument("--registry", type=Path, help="default: OUT/registry")
    parser.add_argument("--model", default="bench-unet")
    parser.add_argument("--timeout", type=float, default=6 * 3600)
    args = parser.parse_args()
    args.registry = (args.registry or args.out / "registry").resolve()
    if not (args.registry / args.model).is_dir():
        raise SystemExit(f"no model {args.model} in {args.registry}: run bench_accuracy.py first")
    out = args.out.resolve() / "slide"
    out.mkdir(parents=True, exist_ok=True)
    slide = slide_file(out, args.size, args.tissue, args.seed)
    size = slide.stat().st_size
    conf = start_cluster()
    slurm = {"client": "cli", "slurm_conf": str(conf), "python": sys.executable,
             "array_throttle": args.throttle, "time_minutes": 600, "memory_mb": 4096,
             "poll_seconds": 1.0}  # fmt: skip
    cores = os.cpu_count()
    print(f"slide {args.size:,}² ({size:,} bytes, {args.tissue:.0%} of its droplets kept), "
          f"model {args.model}; this machine: {cores} cores; Slurm array throttle "
          f"{args.throttle}")  # fmt: skip
    one = run_batch("one", out, slide, args, slurm, 0)
    report(one)
    regions = run_batch("regions", out, slide, args, slurm, -(-size // args.regions))
    report(regions)
    label = Path("masks/images/slide.tif.ome.zarr")
    levels = agreement(one.results / label, regions.results / label)
    total, differing = levels[0][1], levels[0][2]
    objects = [len((r.results / "objects/images/slide.tif.csv").read_text().splitlines()) - 1
               for r in (one, regions)]  # fmt: skip
    rss = max(j["peak_rss_mb"] for r in (one, regions) for j in r.jobs)
    region_jobs = sum(1 for j in regions.jobs if j["pipeline"] == "infer")
    print(f"speed-up, regions against one task: {one.seconds / regions.seconds:.2f} "
          f"({region_jobs} region jobs, {args.throttle} at once, on {cores} cores)")  # fmt: skip
    for level, pixels, differ in levels:
        print(f"  level {level}: {pixels:,} pixels, {differ:,} differ")
    agree = 1 - differing / total
    verdict = ("PASS" if agree >= 0.999 else "FAIL") + (" (equal)" if differing == 0 else "")
    print(f"pixel agreement (level 0): {agree:.6f} (target >= 0.999): {verdict}")
    print(f"objects in the object tables: one task {objects[0]:,}, regions {objects[1]:,}: "
          f"{'PASS' if objects[0] == objects[1] else 'FAIL'}")  # fmt: skip
    print(f"largest peak RSS of a job: {rss:.0f} MB (target <= 2048 MB): "
          f"{'PASS' if rss <= 2048 else 'FAIL'}")  # fmt: skip
    return 0 if agree >= 0.999 and objects[0] == objects[1] and rss <= 2048 else 1


if __name__ == "__main__":
    raise SystemExit(main())
