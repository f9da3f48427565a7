"""Fault drill: slurmctld stopped for 60 s in the middle of a run; every batch still completes,
exactly once.

Against the local test cluster (scripts/slurm-cluster), the real daemon loop sends real
inference batches (a tiny model trained through the cluster first). While the first batches'
jobs run, slurmctld is stopped; more batches are dropped during the outage; after ``--outage``
seconds the controller is started again. The script then checks and prints the invariants:

1. every batch ends done;
2. every job ran once: one attempt, one start in its log, one result;
3. Slurm's own record of finished jobs (jobcomp) holds each array task and each report once;
4. every image has one mask and one table row;
5. the batches dropped during the outage were taken in during it and submitted after it.

Usage (as root)::

    .venv/bin/python scripts/slurm_outage.py [--outage 60] [--client cli|pyslurm]

Exit status 0 when every invariant holds.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from replay import Replay, copy_slowly
from slurm_scenario import (
    batches_and_jobs,
    cluster,
    drill_ground,
    slurm_config,
    stage_inference,
    train_model,
)

from daemon.contract.spool import work_dir
from daemon.core.records import Batch, Job
from daemon.core.states import BatchState, JobState
from daemon.executors.slurm import make_slurm_executor
from daemon.loop.service import Service
from daemon.site.config import Config

IMAGES = 8  # per batch: 4 shards of 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outage", type=float, default=60.0, help="seconds slurmctld is down")
    parser.add_argument("--before", type=int, default=3, help="batches dropped before it")
    parser.add_argument("--during", type=int, default=2, help="batches dropped during it")
    parser.add_argument("--client", choices=("cli", "pyslurm"), default="cli")
    args = parser.parse_args(argv)
    with drill_ground("watchd-outage-") as (conf, base):
        return drill(args, conf, base)


def drill(args: argparse.Namespace, conf: Path, base: Path) -> int:
    print("training a tiny model through the cluster ...", flush=True)
    train_model(base / "training", conf, args.client)
    root = base / "drop"
    root.mkdir()
    config = slurm_config(
        base, root, base / "training" / "registry", conf, args.client,
        slurm={"poll_seconds": 1.0, "retry_attempts": 2, "retry_wait_seconds": 1.0,
               "max_backoff_seconds": 10.0},
    )  # fmt: skip
    names = [f"plate-{i}" for i in range(args.before + args.during)]
    staged = {n: stage_inference(base / "staging" / n, IMAGES) for n in names}
    executor = make_slurm_executor(config.executor.slurm, os.environ, threading.Event())
    with Replay(config, executor) as replay:
        drop = [s for n in names[: args.before] for s in copy_slowly(staged[n], root / n, 0, 0)]
        replay.run(drop, until=lambda s: running(s) >= 2, timeout=120)
        print(f"{running(replay.service)} jobs running: stopping slurmctld", flush=True)
        down = time.time()
        assert cluster("stop-controller").returncode == 0
        later = [s for n in names[args.before :] for s in copy_slowly(staged[n], root / n, 5, 0)]
        replay.run(later, until=lambda _: time.time() - down >= args.outage, timeout=600)
        up = time.time()
        assert cluster("start-controller").returncode == 0
        print(f"slurmctld back after {up - down:.0f} s; running until every batch ends",
              flush=True)  # fmt: skip
        replay.run(timeout=600)
    return report(config, names[args.before :], down, up, conf)


def running(service: Service) -> int:
    return len(service.store.jobs(states=[JobState.RUNNING]))


def report(config: Config, dropped_during: list[str], down: float, up: float, conf: Path) -> int:
    found = batches_and_jobs(config)
    spool = config.daemon.spool_dir
    record = jobcomp(conf.parent.parent / "log" / "jobcomp.txt")
    checks = [
        ("every batch ends done", all(b.state is BatchState.DONE for b, _ in found)),
        ("every job ran once (1 attempt, 1 start, 1 result)",
         all(ran_once(spool, b, j) for b, jobs in found for j in jobs)),
        ("Slurm recorded each task and report once",
         all(recorded_once(spool, b, jobs, record) for b, jobs in found)),
        ("every image has one mask and one table row", all(outputs_whole(b) for b, _ in found)),
        ("batches dropped during the outage were taken in during it and submitted after it",
         all(down <= b.created_at <= up and min(j.submitted_at or 0 for j in jobs) >= up
             for b, jobs in found if b.folder in dropped_during)),
    ]  # fmt: skip
    jobs = sum(len(js) for _, js in found)
    print(f"\n{len(found)} batches, {jobs} jobs, slurmctld down {up - down:.0f} s")
    for label, ok in checks:
        print(f"  [{'ok' if ok else 'FAILED'}] {label}")
    return 0 if all(ok for _, ok in checks) else 1


def ran_once(spool: Path, batch: Batch, job: Job) -> bool:
    folder = work_dir(spool, batch.id, batch.run_dir) / "jobs" / job.name
    starts = (folder / "log.txt").read_text().count("watchd: Slurm job ")
    return job.attempts == 1 and starts == 1 and (folder / "result.json").is_file()


def jobcomp(path: Path) -> Counter[tuple[str, str]]:
    """Slurm's finished-job record: how many jobs (array tasks) per (work dir, job name)."""
    counts: Counter[tuple[str, str]] = Counter()
    for line in path.read_text(errors="replace").splitlines():
        name, workdir = re.search(r"Name=(\S+)", line), re.search(r"WorkDir=(\S+)", line)
        if name and workdir:
            counts[(workdir.group(1), name.group(1))] += 1
    return counts


def recorded_once(
    spool: Path, batch: Batch, jobs: list[Job], record: Counter[tuple[str, str]]
) -> bool:
    workdir = str(work_dir(spool, batch.id, batch.run_dir) / "jobs")
    shards = sum(1 for j in jobs if "-infer-" in j.name)
    prefix = f"b{batch.id:06d}"
    return (
        record[(workdir, f"{prefix}-infer")] == shards
        and record[(workdir, f"{prefix}-report")] == 1
    )


def outputs_whole(batch: Batch) -> bool:
    run = Path(batch.run_dir)
    with open(run / "table.csv", newline="") as handle:
        rows = [r["path"] for r in csv.DictReader(handle)]
    masks = list((run / "masks").rglob("*.png"))
    return len(masks) == IMAGES and sorted(rows) == sorted(set(rows)) and len(rows) == IMAGES


if __name__ == "__main__":
    sys.exit(main())
