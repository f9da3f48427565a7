"""Benchmark: a whole-slide image through the daemon on the local Slurm cluster, segmented by one
task and by region tasks, in the same run.

Two synthetic pyramidal slides (scripts/synth.py, written tile by tile, ``--tissue`` of their
droplets kept, in islands, the rest glass): one of ``--crop``² pixels (a slide of its own,
same seed, not cut out of the large one), then one of ``--size``² (the small one first: its
comparison comes back in a minute, before hours on the large one). Each slide is written once
under OUT/slide/ and kept for the next run. ``--rows``: of the large slide only its strip of
that many rows with the most tissue, as wide as the slide (a job's memory grows with the
slide's width, its time with the area: the strip shows the first at a fraction of the time).
Each is dropped twice, as a batch of that one image, into a daemon whose jobs go to the test
cluster (scripts/slurm-cluster) through the CLI client: ``one``, ``planner.region_bytes = 0``
(one task segments the slide); ``regions``, region_bytes just above the file's size divided by
``--regions`` (that many region tasks in the batch's one Slurm array, ``--throttle`` at once,
then the assembly job). region_bytes is a site setting, so the two are two daemons of the same
code and configuration but for it, run one after the other, with the same model.

Printed for each run: queued → done (the daemon's own events); each job's wall time (its
running → ended events), its own time and peak RSS; the windows run and skipped as glass and
the objects (table.csv); the object table's rows. Per slide: the speed-up; the label images
compared level by level, chunk by chunk over the chunks either stored (never a whole level 0
in memory: unstored chunks are background in both); the object tables. Then PASS or FAIL
against the targets: every job's peak RSS <= 2 GB, level-0 pixel agreement >= 0.999 (target
exact), the same objects. Peak RSS is Slurm's MaxRSS (sacct) where the cluster keeps
accounting; the test cluster keeps none (no slurmdbd, jobacct_gather/none), so it is each
job's own VmHWM, in its result.json (a job is one process: the reader starts
no workers with one CPU).

    .venv/bin/python scripts/bench_accuracy.py --train 96 --test 16   # the model, once
    .venv/bin/python scripts/bench_slide.py --size 16384 --crop 8192 --regions 4
    .venv/bin/python scripts/bench_slide.py   # 100,000² (the slide alone takes ~40 min here)
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import tomli_w
import zarr

sys.path.insert(0, str(Path(__file__).resolve().parent))
import synth
from bench_batch import BatchDaemon
from bench_share import _commit
from replay import manifest_text
from slurm_scenario import start_cluster

from daemon.core.manifest_schema import Kind
from pipelines.omezarr import CHUNK, LABEL_NAME

REPO = Path(__file__).resolve().parent.parent
IMAGE = "images/slide.tif"
LABELS = Path("masks") / f"{IMAGE}.ome.zarr" / "labels" / LABEL_NAME
OBJECTS = Path("objects") / f"{IMAGE}.csv"
RSS_TARGET_MB = 2048
AGREEMENT_TARGET = 0.999


@dataclass
class SlideDaemon(BatchDaemon):
    """A daemon whose jobs go to the test cluster, splitting files over ``region_bytes``."""

    region_bytes: int = 0

    def config(self, **intake: object) -> Path:
        path = super().config(**intake)
        document = {
            **tomllib.loads(path.read_text()),
            "planner": {"region_bytes": self.region_bytes},
        }
        path.write_text(tomli_w.dumps(document))
        return path


@dataclass(frozen=True)
class Task:
    name: str
    pipeline: str
    handle: str  # the Slurm job, "array_task"
    region: int | None
    state: str
    wall_s: float | None  # running → ended, the daemon's events (polled: ±1 s)
    own_s: float | None  # the job's own elapsed_s (without the interpreter's start)
    rss_mb: float | None
    error: str


@dataclass
class Run:
    name: str
    state: str  # the batch's: done, failed, cancelled or "timed out"
    seconds: float  # queued → done (or → the end)
    tasks: list[Task]
    results: Path | None
    row: dict[str, str] | None  # the slide's row of table.csv
    daemon_log: Path


def slide_path(out: Path, size: int, tissue: float, seed: int, rows: int | None = None) -> Path:
    """Where :func:`slide_file` keeps the slide (its strip of ``rows`` rows)."""
    where = "" if rows is None else f"-{synth.densest_rows(size, seed, tissue, rows)}+{rows}"
    return out / f"slide-{size}{where}-{tissue}-{seed}.tif"


def slide_file(out: Path, size: int, tissue: float, seed: int, rows: int | None = None) -> Path:
    """The slide, written once per size, share of tissue and seed (it takes a while); with
    ``rows``, its strip of that many rows with the most tissue (synth.densest_rows)."""
    strip = None if rows is None else (synth.densest_rows(size, seed, tissue, rows), rows)
    path = slide_path(out, size, tissue, seed, rows)
    if not path.exists():
        started = time.monotonic()
        partial = path.with_suffix(".part.tif")
        synth.write_slide(partial, size, seed, tissue=tissue, rows=strip)
        os.rename(partial, path)
        print(f"wrote {path}: {path.stat().st_size:,} bytes in "
              f"{time.monotonic() - started:.0f} s")  # fmt: skip
    return path


def run_batch(name: str, base: Path, slide: Path, args: argparse.Namespace, slurm: dict[str, Any],
              region_bytes: int) -> Run:  # fmt: skip
    """Drop ``slide`` as a batch into a fresh daemon and wait until the batch ends."""
    shutil.rmtree(base, ignore_errors=True)
    folder = base / "drop" / "slide"
    (folder / "images").mkdir(parents=True)
    daemon = SlideDaemon(name, REPO, base / "drop", base / "drop", base / "state",
                         registry=args.registry, slurm=slurm,
                         region_bytes=region_bytes)  # fmt: skip
    daemon.env = {"SLURM_CONF": slurm["slurm_conf"]}
    daemon.start()
    try:
        os.link(slide, folder / IMAGE)  # the same file for both runs, not a copy
        text = manifest_text(folder, Kind.INFERENCE, model=args.model, version="latest")
        (folder / ".manifest.part").write_bytes(text)
        os.rename(folder / ".manifest.part", folder / "manifest.toml")
        state, ended = wait_ended(daemon, args.timeout)
        queued = daemon.state_at("slide", "queued") or ended
        results = run_dir(folder)
        tasks = job_tasks(daemon)
        if state == "timed out":
            cancel(tasks, slurm["slurm_conf"])
    finally:
        daemon.stop()
    return Run(name, state, ended - queued, tasks, results, table_row(results),
               base / "state" / "daemon.log")  # fmt: skip


def run_dir(folder: Path) -> Path | None:
    """The batch's one results/<run>/ folder, if it has one."""
    if not (folder / "results").is_dir():
        return None
    found = [p for p in (folder / "results").iterdir() if p.is_dir()]
    return found[0] if len(found) == 1 else None


def wait_ended(daemon: SlideDaemon, timeout: float) -> tuple[str, float]:
    """(the batch's end state, when) once it is done, failed or cancelled; or "timed out"."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for state in ("done", "failed", "cancelled"):
            if (at := daemon.state_at("slide", state)) is not None:
                return state, at
        time.sleep(0.5)
    return "timed out", time.time()


def job_tasks(daemon: SlideDaemon) -> list[Task]:
    """The batch's jobs, from the daemon's database and each job's result.json (in the spool)."""
    rows = daemon.query(
        "SELECT j.name, j.pipeline, j.handle, j.params, j.state,"
        " (SELECT min(at) FROM events WHERE job_id = j.id AND to_state = 'running'),"
        " (SELECT max(at) FROM events WHERE job_id = j.id"
        "  AND to_state IN ('succeeded', 'failed', 'cancelled'))"
        " FROM jobs j JOIN batches b ON j.batch_id = b.id WHERE b.folder = 'slide'"
        " ORDER BY j.stage, j.shard_index"
    )
    tasks = []
    for name, pipeline, handle, params, state, started, ended in rows:
        found = next((daemon.spool / "runs").glob(f"*/*/jobs/{name}/result.json"), None)
        result = json.loads(found.read_text()) if found else {}
        summary, error = result.get("summary") or {}, result.get("error") or {}
        region = json.loads(str(params)).get("region")
        wall = float(ended) - float(started) if started and ended else None  # type: ignore[arg-type]
        tasks.append(Task(str(name), str(pipeline), str(handle or "").removeprefix("slurm:"),
                          None if region is None else int(region["index"]), str(state), wall,
                          summary.get("elapsed_s"), summary.get("peak_rss_mb"),
                          str(error.get("message", ""))))  # fmt: skip
    return tasks


def cancel(tasks: list[Task], slurm_conf: str) -> None:
    """Cancel a timed-out batch's jobs still on the cluster (they would slow the next run)."""
    live = {
        t.handle.split("_")[0] for t in tasks if t.handle and t.state in ("submitted", "running")
    }
    if live:
        env = {**os.environ, "SLURM_CONF": slurm_conf}
        subprocess.run(["scancel", *sorted(live)], env=env, capture_output=True, timeout=60)


def table_row(results: Path | None) -> dict[str, str] | None:
    table = results / "table.csv" if results else None
    if table is None or not table.exists():
        return None
    with open(table, newline="", encoding="utf-8") as handle:
        rows = [r for r in csv.DictReader(handle) if r["path"] == IMAGE]
    return rows[0] if rows else None


def sacct_rss(tasks: list[Task], slurm_conf: str) -> tuple[dict[str, float], str]:
    """Slurm's MaxRSS (MB) of each task, over its steps; empty and why where sacct has none."""
    ids = [t.handle for t in tasks if t.handle]
    env = {**os.environ, "SLURM_CONF": slurm_conf}
    done = subprocess.run(["sacct", "-n", "-P", "-j", ",".join(ids), "--format=JobID,MaxRSS"],
                          env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    if done.returncode != 0:
        return {}, done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "sacct failed"
    units = {"K": 1 / 1024, "M": 1.0, "G": 1024.0}
    found: dict[str, float] = {}
    for line in done.stdout.splitlines():
        job, _, rss = line.partition("|")
        if rss and rss[-1] in units:
            task = job.split(".")[0]
            found[task] = max(found.get(task, 0.0), float(rss[:-1]) * units[rss[-1]])
    return found, "" if found else "sacct answered without MaxRSS"


def _chunks(level: Path) -> set[tuple[int, int]]:
    """The chunks a level stores (background chunks are not): keys ``row/col`` or ``row.col``."""
    meta = json.loads((level / ".zarray").read_text())
    if meta.get("dimension_separator", ".") == "/":
        rows = [r for r in level.iterdir() if r.is_dir() and r.name.isdigit()]
        return {(int(r.name), int(c.name)) for r in rows for c in r.iterdir() if c.name.isdigit()}
    keys = [p.name.split(".") for p in level.iterdir() if p.name[:1].isdigit()]
    return {(int(k[0]), int(k[1])) for k in keys if len(k) == 2}


@dataclass(frozen=True)
class Level:
    key: str
    pixels: int
    differing: int
    stored: tuple[int, int]  # chunks stored by the first, by the second


def compare_labels(first: Path, second: Path) -> list[Level]:
    """Two label images, level by level: pixels differing over the chunks either stores."""
    a_group, b_group = zarr.open_group(str(first), mode="r"), zarr.open_group(str(second), mode="r")
    keys = [d["path"] for d in a_group.attrs["multiscales"][0]["datasets"]]
    other = [d["path"] for d in b_group.attrs["multiscales"][0]["datasets"]]
    if keys != other:
        raise SystemExit(f"the label images' levels differ: {keys} and {other}")
    levels = []
    for key in keys:
        a, b = a_group[key], b_group[key]
        if a.shape != b.shape or a.dtype != b.dtype:
            raise SystemExit(f"level {key}: {a.shape} {a.dtype} and {b.shape} {b.dtype}")
        a_chunks, b_chunks = _chunks(first / key), _chunks(second / key)
        differing = 0
        for row, col in sorted(a_chunks | b_chunks):
            ys, xs = slice(row * CHUNK, (row + 1) * CHUNK), slice(col * CHUNK, (col + 1) * CHUNK)
            differing += int(np.count_nonzero(a[ys, xs] != b[ys, xs]))
        levels.append(Level(key, int(np.prod(a.shape)), differing, (len(a_chunks), len(b_chunks))))
    return levels


def object_rows(run: Run) -> int | None:
    table = run.results / OBJECTS if run.results else None
    return len(table.read_text().splitlines()) - 1 if table and table.exists() else None


def report_run(run: Run, slurm_rss: dict[str, float]) -> None:
    row = run.row or {}
    print(f"  {run.name}: {run.state}, queued → {run.state} {run.seconds:.1f} s; table.csv: "
          f"{row.get('objects', '?')} objects, windows run {row.get('windows_run', '?')}, "
          f"skipped as glass {row.get('windows_glass', '?')}; object table "
          f"{object_rows(run)} rows")  # fmt: skip
    for t in run.tasks:
        region = "-" if t.region is None else str(t.region)
        rss = slurm_rss.get(t.handle, t.rss_mb)
        print(f"    {t.name:<20} {t.pipeline:<8} region {region:>3}  Slurm {t.handle:<8} "
              f"{t.state:<9} wall {_num(t.wall_s, 6, 1)} s  own {_num(t.own_s, 6, 1)} s  "
              f"peak RSS {_num(rss, 5, 0)} MB")  # fmt: skip
        if t.error:
            print(f"      error: {t.error}")
    if run.state != "done":
        jobs = f"{run.daemon_log.parent / 'spool'}/runs/*/*/jobs/*/log.txt and "
        print(f"    logs: {jobs}{run.daemon_log}")


def _num(value: float | None, width: int, digits: int) -> str:
    return f"{value:>{width}.{digits}f}" if value is not None else "?".rjust(width)


def compare_runs(name: str, one: Run, regions: Run, cores: int, throttle: int) -> list[str]:
    """Print the speed-up and the agreement of one slide's two runs; its verdict lines."""
    verdicts = [rss_verdict(name, [one, regions])]
    if one.state == "done" and regions.state == "done":
        print_speed_up(one, regions, cores, throttle)
    else:
        verdicts.append(_verdict(False, f"{name}: both batches done", "see above"))
    if one.results is None or regions.results is None:
        return verdicts
    return verdicts + agreement_verdicts(name, one.results, regions.results)


def print_speed_up(one: Run, regions: Run, cores: int, throttle: int) -> None:
    region_tasks = [t for t in regions.tasks if t.region is not None]
    arrays = ", ".join(sorted({t.handle.split("_")[0] for t in region_tasks}))
    bound = min(cores, throttle, max(len(region_tasks), 1))
    print(f"  speed-up, regions against one task: {one.seconds:.1f} s / {regions.seconds:.1f} s = "
          f"{one.seconds / regions.seconds:.2f} ({len(region_tasks)} region tasks run, Slurm "
          f"array {arrays}, {throttle} at once; bound: {bound}, the region tasks that run at "
          f"once on {cores} cores, one CPU each)")  # fmt: skip
    work = [sum(t.own_s or 0 for t in r.tasks if t.pipeline == "infer") for r in (one, regions)]
    assembly = sum(t.own_s or 0 for t in regions.tasks if t.pipeline == "assemble")
    print(f"  inference work (the jobs' own seconds): one task {work[0]:.1f} s, the region tasks "
          f"{work[1]:.1f} s in all ({work[1] / max(work[0], 1e-9) - 1:+.0%}); assembly "
          f"{assembly:.1f} s")  # fmt: skip


def agreement_verdicts(name: str, one: Path, regions: Path) -> list[str]:
    """Print the label images' and object tables' comparison; its verdict lines."""
    if not (one / LABELS).is_dir() or not (regions / LABELS).is_dir():
        return [_verdict(False, f"{name}: both label images written", f"{LABELS} missing")]
    levels = compare_labels(one / LABELS, regions / LABELS)
    for level in levels:
        print(f"  label level {level.key}: {level.pixels:,} pixels, chunks stored "
              f"{level.stored[0]:,} / {level.stored[1]:,}, {level.differing:,} differ")  # fmt: skip
    agree = 1 - levels[0].differing / levels[0].pixels
    equal = "yes" if all(level.differing == 0 for level in levels) else "no"
    tables = [r / OBJECTS for r in (one, regions)]
    rows = [len(t.read_text().splitlines()) - 1 if t.exists() else None for t in tables]
    same = None not in rows and tables[0].read_bytes() == tables[1].read_bytes()
    print(f"  object tables: {rows[0]} and {rows[1]} rows; byte for byte equal: "
          f"{'yes' if same else 'no'}")  # fmt: skip
    return [
        _verdict(agree >= AGREEMENT_TARGET, f"{name}: level-0 pixel agreement >= "
                 f"{AGREEMENT_TARGET}", f"{agree:.6f}; every level exactly equal: {equal}"),
        _verdict(rows[0] == rows[1] and rows[0] is not None, f"{name}: the same objects",
                 f"{rows[0]} and {rows[1]} rows"),
    ]  # fmt: skip


def rss_verdict(name: str, runs: list[Run]) -> str:
    """Every job's peak RSS within the target (a job without a figure fails it)."""
    known = [(t.rss_mb, t.name, r.name) for r in runs for t in r.tasks if t.rss_mb is not None]
    missing = [t.name for r in runs for t in r.tasks if t.rss_mb is None]
    rss, job, run = max(known) if known else (0.0, "none", "")
    detail = f"largest {rss:.0f} MB, {run} {job}" + (f"; no figure: {missing}" if missing else "")
    ok = rss <= RSS_TARGET_MB and not missing
    return _verdict(ok, f"{name}: every job's peak RSS <= {RSS_TARGET_MB} MB", detail)


def _verdict(ok: bool, what: str, detail: str) -> str:
    return f"{'PASS' if ok else 'FAIL'}  {what}: {detail}"


def node_cpus(slurm_conf: str) -> str:
    env = {**os.environ, "SLURM_CONF": slurm_conf}
    done = subprocess.run(["sinfo", "-h", "-o", "%c"], env=env, capture_output=True, text=True)
    return done.stdout.strip() or "?"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/watchd-bench"))
    parser.add_argument("--size", type=int, default=100_000, help="the large slide's side")
    parser.add_argument("--crop", type=int, default=8192, help="the small slide's side")
    parser.add_argument("--tissue", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--rows", type=int, help="only the large slide's strip of this many "
                        "rows with the most tissue (as wide as the slide: a job's memory "
                        "grows with the width, its time with the area)")  # fmt: skip
    parser.add_argument("--regions", type=int, default=16, help="region tasks per slide")
    parser.add_argument("--throttle", type=int, help="region tasks at once (default: the cores)")
    parser.add_argument("--registry", type=Path, help="default: OUT/registry")
    parser.add_argument("--model", default="bench-unet")
    parser.add_argument("--timeout", type=float, default=6 * 3600, help="seconds per batch")
    args = parser.parse_args()
    args.registry = (args.registry or args.out / "registry").resolve()
    if not (args.registry / args.model).is_dir():
        raise SystemExit(f"no model {args.model} in {args.registry}: run bench_accuracy.py first")
    cores = len(os.sched_getaffinity(0))
    throttle = args.throttle or cores
    out = args.out.resolve() / "slide"
    out.mkdir(parents=True, exist_ok=True)
    conf = str(start_cluster())
    slurm = {"client": "cli", "slurm_conf": conf, "python": sys.executable,
             "array_throttle": throttle, "cpus_per_task": 1, "time_minutes": 600,
             "memory_mb": 4096, "poll_seconds": 1.0}  # fmt: skip
    print(f"code {_commit(REPO)}; model {args.model} ({args.registry}); this machine: {cores} "
          f"cores; the test node claims {node_cpus(conf)} CPUs; every job 1 CPU (one torch "
          f"thread); region tasks {throttle} at once")  # fmt: skip
    verdicts: list[str] = []
    if args.crop != args.size:
        verdicts += one_slide(args.crop, None, out, args, slurm, cores, throttle)
    verdicts += one_slide(args.size, args.rows, out, args, slurm, cores, throttle)
    print("targets:")
    for line in verdicts:
        print(f"  {line}")
    passed = all(line.startswith("PASS") for line in verdicts)
    print(f"overall: {'PASS' if passed else 'FAIL'}")
    return 0 if passed else 1


def one_slide(size: int, rows: int | None, out: Path, args: argparse.Namespace,
              slurm: dict[str, Any], cores: int, throttle: int) -> list[str]:  # fmt: skip
    """Both runs of one slide (its strip of ``rows`` rows), printed; the verdict lines."""
    slide = slide_file(out, size, args.tissue, args.seed, rows)
    name = f"{size:,}²" if rows is None else f"{size:,} × {rows:,} strip"
    nbytes = slide.stat().st_size
    region_bytes = -(-nbytes // args.regions)
    print(f"slide {name} ({nbytes:,} bytes, {args.tissue:.0%} of the slide's droplets kept): "
          f"region_bytes {region_bytes:,} → {-(-nbytes // region_bytes)} regions")  # fmt: skip
    if rows is not None:
        first = synth.densest_rows(size, args.seed, args.tissue, rows)
        share = synth.tissue_cells(size, args.seed, args.tissue)[
            first // synth.CELL : (first + rows) // synth.CELL].mean()  # fmt: skip
        print(f"  the {size:,}² slide's rows {first:,}..{first + rows:,}, the most tissue: "
              f"{share:.1%} of their droplet cells")  # fmt: skip
    base = out / (str(size) if rows is None else f"{size}x{rows}")
    one = run_batch("one", base / "one", slide, args, slurm, 0)
    regions = run_batch("regions", base / "regions", slide, args, slurm, region_bytes)
    slurm_rss, why = sacct_rss(one.tasks + regions.tasks, slurm["slurm_conf"])
    print("  peak RSS: " + ("Slurm's MaxRSS (sacct)" if slurm_rss else
          f"each job's own VmHWM (result.json); sacct: {why}"))  # fmt: skip
    for run in (one, regions):
        report_run(run, slurm_rss)
    if slurm_rss:  # the verdict on Slurm's figure, where there is one
        for run in (one, regions):
            run.tasks = [replace(t, rss_mb=slurm_rss.get(t.handle, t.rss_mb)) for t in run.tasks]
    return compare_runs(name, one, regions, cores, throttle)


if __name__ == "__main__":
    raise SystemExit(main())
