"""Benchmark: the peak memory of a whole-slide image's infer job at the slide's full width,
old code against new, in one run.

A job segments a large image window by window in bands of rows as wide as the image, so its
memory grows with the slide's width, not its height: the strip of ``--rows`` rows of the
``--width``² synthetic slide (scripts/synth.py, ``--tissue`` of its droplets kept, in islands)
that holds the most tissue (``synth.densest_rows``: the fullest bands) stands for the whole
slide at a fraction of the time. It is written once under OUT/slide/ (where bench_slide.py,
which runs it on the Slurm cluster with ``--rows``, keeps it), by a child process (a job's
``getrusage`` maximum starts from what its parent held when it forked: this one stays small).
The infer job then runs on it as an executor runs it (scripts/jobrun.py, one CPU): as one
task, and as region 2 of 4 (the slide split in four), with the old code (``--old``, a
checkout of the code before the change) and then the new one. Printed per job: wall time,
peak RSS (the job's result.json: its VmHWM, or getrusage's maximum in code before VmHWM),
objects, windows run and skipped; then whether the new code's outputs equal the old's (the
label image level by level, the object table and the table row byte for byte; a region's
record array by array), and PASS or FAIL against 2 GB per job.

    .venv/bin/python scripts/bench_accuracy.py --train 96 --test 16   # the model, once
    git worktree add /tmp/watchd-old <commit before the change>
    .venv/bin/python scripts/bench_slide_memory.py --old /tmp/watchd-old
"""

from __future__ import annotations

import argparse
import csv
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import jobrun
import synth
from bench_share import _commit
from bench_slide import (
    IMAGE,
    LABELS,
    OBJECTS,
    RSS_TARGET_MB,
    _verdict,
    compare_labels,
    slide_path,
)

from daemon.contract.jobspec import InputFile, ModelRef, Pipeline

REPO = Path(__file__).resolve().parent.parent
PARAMS = {"batch_size": 1, "channel": None, "glass_tolerance": 0.05, "gpu_batch_size": 16,
          "max_whole_pixels": 4_194_304, "min_object_area": 0, "mixed_precision": True,
          "threshold": 0.5, "tile_overlap": 64, "tile_size": 512}  # fmt: skip
JOBS = {"one task": None, "region 2 of 4": {"index": 1, "count": 4, "image": IMAGE}}


def strip_file(args: argparse.Namespace) -> Path:
    """The strip (bench_slide's, kept under OUT/slide/), written by a child process."""
    path = slide_path(args.out / "slide", args.width, args.tissue, args.seed, args.rows)
    if not path.exists():
        code = (f"import sys; sys.path.insert(0, {str(REPO / 'scripts')!r}); import bench_slide; "
                f"from pathlib import Path; bench_slide.slide_file(Path({str(path.parent)!r}), "
                f"{args.width}, {args.tissue}, {args.seed}, {args.rows})")  # fmt: skip
        subprocess.run([sys.executable, "-c", code], check=True)
    first = synth.densest_rows(args.width, args.seed, args.tissue, args.rows)
    share = synth.tissue_cells(args.width, args.seed, args.tissue)[
        first // synth.CELL : (first + args.rows) // synth.CELL].mean()  # fmt: skip
    print(f"strip: rows {first:,}..{first + args.rows:,} of the {args.width:,}² slide, "
          f"{args.width:,} wide, {share:.1%} of its droplet cells tissue (the slide: "
          f"{args.tissue:.0%})")  # fmt: skip
    return path


def run_job(code: Path, strip: Path, base: Path, name: str, region: Any,
            args: argparse.Namespace) -> jobrun.Finished:  # fmt: skip
    """The infer job of ``code`` on the strip in a fresh batch folder ``base``."""
    shutil.rmtree(base, ignore_errors=True)
    (base / "images").mkdir(parents=True)
    os.link(strip, base / IMAGE)  # the same file for every job, not a copy
    params = dict(PARAMS) if region is None else {**PARAMS, "region": region}
    return jobrun.run(
        base, Pipeline.INFER, (InputFile(IMAGE, strip.stat().st_size),), args.registry,
        ModelRef(args.model), params, name=name.replace(" ", "-"), kind="inference", cpus=1,
        env={"PYTHONPATH": str(code)},
    )  # fmt: skip


def region_record(base: Path) -> dict[str, np.ndarray]:
    found = sorted((base / "results").rglob("region-0001.npz"))
    if not found:
        return {}
    with np.load(found[0], allow_pickle=False) as record:
        return {key: record[key] for key in record.files}


def windows(base: Path, region: Any) -> str:
    """The windows the job ran and skipped as glass: its table row's, or its region record's."""
    if region is not None:
        record = region_record(base)
        found = {k: int(record[k]) for k in ("windows_run", "windows_glass") if k in record}
    else:
        part = base / "results" / "parts" / "table-0000.csv"
        found = next(csv.DictReader(part.open())) if part.exists() else {}
    return f"windows run {found.get('windows_run', '?')}, glass {found.get('windows_glass', '?')}"


def same_outputs(old: Path, new: Path, region: Any) -> str:
    """Whether the new code's job left what the old one did; what differs."""
    if region is not None:
        a, b = region_record(old), region_record(new)
        if not a or not b:
            return "no: a region record is missing"
        differing = [k for k in a if k not in b or not np.array_equal(a[k], b[k])]
        return "yes (the region record, array by array)" if not differing else f"no: {differing}"
    levels = compare_labels(old / "results" / LABELS, new / "results" / LABELS)
    differing = sum(level.differing for level in levels)
    tables = [(old / "results" / f).read_bytes() == (new / "results" / f).read_bytes()
              for f in (OBJECTS, Path("parts") / "table-0000.csv")]  # fmt: skip
    said = (
        f"{len(levels)} label levels, {differing:,} pixels differ; object table equal: "
        f"{'yes' if tables[0] else 'no'}; table row equal: {'yes' if tables[1] else 'no'}"
    )
    return ("yes: " if differing == 0 and all(tables) else "no: ") + said


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", type=Path, required=True, help="a checkout of the old code")
    parser.add_argument("--out", type=Path, default=Path("/tmp/watchd-bench"))
    parser.add_argument("--width", type=int, default=100_000, help="the slide's side")
    parser.add_argument("--rows", type=int, default=4096, help="the strip's rows")
    parser.add_argument("--tissue", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--registry", type=Path, help="default: OUT/registry")
    parser.add_argument("--model", default="bench-unet")
    args = parser.parse_args()
    args.registry = args.registry or args.out / "registry"
    if not (args.registry / args.model).is_dir():
        raise SystemExit(f"no model {args.model} in {args.registry}: run bench_accuracy.py")
    work = args.out / "slide-memory"
    strip = strip_file(args)
    codes = {"old": args.old.resolve(), "new": REPO}
    print(
        f"old: {_commit(codes['old'])}; new: {_commit(REPO)}; every job 1 CPU; this "
        f"process {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB"
    )
    verdicts = []
    for job, region in JOBS.items():
        peaks, bases = {}, {which: work / f"{which}-{job.split()[0]}" for which in codes}
        for which, code in codes.items():
            done = run_job(code, strip, bases[which], job, region, args)
            summary = done.summary
            peaks[which] = done.peak_rss_mb
            print(f"  {job:14} {which}: exit {done.returncode}, wall {done.wall_s:6.1f} s, peak "
                  f"RSS {done.peak_rss_mb:5.0f} MB, objects {summary.get('objects', '-')}, "
                  f"{windows(bases[which], region)}")  # fmt: skip
            if done.returncode != 0:
                return 1
        print(f"  {job:14} new / old peak RSS: {peaks['new'] / peaks['old']:.2f}; outputs "
              f"equal: {same_outputs(bases['old'], bases['new'], region)}")  # fmt: skip
        verdicts.append(_verdict(peaks["new"] <= RSS_TARGET_MB, f"{job}, new code: peak RSS "
                                 f"<= {RSS_TARGET_MB} MB", f"{peaks['new']:.0f} MB"))  # fmt: skip
    print("targets:")
    for line in verdicts:
        print(f"  {line}")
    return 0 if all(line.startswith("PASS") for line in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
