"""Benchmark: a large inference batch planned and submitted to Slurm as ONE throttled array.

Makes a batch of tiny image files (55,000 by default) with a pattern manifest, runs the real
daemon loop against the local test cluster (scripts/slurm-cluster), and measures the time from
the manifest landing in the drop folder to every shard submitted, with the number of Slurm
calls the daemon made. The tasks run ``/bin/true`` and are cancelled right after submission:
this measures intake, readiness, planning and submission, not inference.

The baseline, measured in the same run on the same cluster: what a naive executor does, one
``sbatch`` per shard (up to ``--baseline-jobs`` of them; beyond that the time is extrapolated
from the measured rate, and said so).

Usage (as root)::

    .venv/bin/python scripts/bench_slurm_submit.py [--images 55000] [--shard-size 0]
        [--throttle 50] [--client cli|pyslurm] [--baseline-jobs 1000]
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import numpy as np
from bench_share import placeholder_model
from PIL import Image
from replay import Replay
from slurm_scenario import batches_and_jobs, drill_ground, slurm_config

from daemon.core.manifest import MANIFEST_NAME
from daemon.core.states import BatchState, JobState
from daemon.executors.slurm import SlurmExecutor, choose_client, job_environment
from daemon.executors.slurm_api import JobRecord, JobRequest, SlurmClient, Versions
from daemon.executors.slurm_cli import CliClient
from daemon.loop.service import Service

T = TypeVar("T")

MANIFEST = """\
watchd = 1
kind = "inference"
title = "submission benchmark"

[owner]
name = "bench"

[model]
name = "spheroid-unet"

[[patterns]]
glob = "images/*.png"
count = {count}
"""


def tiny_png() -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.full((8, 8), 128, dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def make_images(folder: Path, count: int) -> float:
    """``count`` tiny PNG files in ``folder/images``; seconds it took."""
    started = time.monotonic()
    images = folder / "images"
    images.mkdir(parents=True)
    data = tiny_png()
    for i in range(count):
        (images / f"img_{i:05d}.png").write_bytes(data)
    return time.monotonic() - started


def naive_baseline(env: dict[str, str], base: Path, jobs: int) -> float:
    """Seconds for ``jobs`` separate sbatch calls (cancelled after)."""
    client = CliClient(environment=env, timeout=60)
    script = base / "true.sh"
    script.write_text("#!/bin/bash\ntrue\n")
    request = JobRequest(
        name="naive", comment="naive", script=script, work_dir=base, output="/dev/null",
        time_minutes=5, memory_mb=64, environment=env,
    )  # fmt: skip
    started = time.monotonic()
    ids = [client.submit(request) for _ in range(jobs)]
    took = time.monotonic() - started
    client.cancel(ids)
    return took


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=55_000)
    parser.add_argument("--shard-size", type=int, default=0, help="0: sized (the default)")
    parser.add_argument("--throttle", type=int, default=50)
    parser.add_argument("--client", choices=("cli", "pyslurm"), default="cli")
    parser.add_argument("--baseline-jobs", type=int, default=1000)
    args = parser.parse_args(argv)
    with drill_ground("watchd-bench-") as (conf, base):
        return run(args, conf, base)


def run(args: argparse.Namespace, conf: Path, base: Path) -> int:
    root = base / "drop"
    folder = root / "plate 55k"
    print(f"generating {args.images:,} images ...", flush=True)
    made = make_images(folder, args.images)
    sizing = f"shards of {args.shard_size}" if args.shard_size else "shards sized to the throttle"
    print(f"  {made:.1f} s; {sizing}")
    config = slurm_config(
        base, root, placeholder_model(base / "registry", "spheroid-unet"), conf, args.client,
        intake={"settle_seconds": 0.0, "check_seconds": 0.1},
        planner={"shard_size": args.shard_size, "max_attempts": 1},
        slurm={"python": "/bin/true", "array_throttle": args.throttle,
               "max_array_tasks": 100_000, "poll_seconds": 5.0},
    )  # fmt: skip
    site = config.executor.slurm
    env = job_environment(os.environ, conf)
    client = Timed(choose_client(site, env))
    executor = SlurmExecutor(client, site, env, threading.Event())
    with Replay(config, executor) as replay:
        before, spent = client.counts.copy(), client.seconds  # the start-up self-test
        landed = time.time()
        (folder / MANIFEST_NAME).write_text(MANIFEST.format(count=args.images))
        reached = watch(replay.service, steps(client), landed)
        calls, seconds = client.counts - before, client.seconds - spent
        ((_, jobs),) = batches_and_jobs(config)
        executor.cancel([str(j.handle) for j in jobs])
    arrays = sorted({str(j.handle).removeprefix("slurm:").split("_")[0] for j in jobs})
    print(f"watchd: {args.images:,} images → {len(jobs):,} shards submitted as "
          f"{len(arrays)} array(s) {', '.join(arrays)} with throttle %{args.throttle}")  # fmt: skip
    for label, at in reached.items():
        print(f"  manifest → {label}: {at:.2f} s (end of the tick that got there)")
    took = reached["all submitted"]
    listed = ", ".join(f"{kind} {n}" for kind, n in sorted(calls.items()))
    print(f"  Slurm calls: {sum(calls.values())} ({listed}), {seconds:.2f} s in them")
    measured = min(len(jobs), args.baseline_jobs)
    naive_took = naive_baseline(env, base, measured)
    naive = naive_took * len(jobs) / measured
    how = "measured" if measured == len(jobs) else f"extrapolated from {measured:,} measured"
    print(f"baseline, one sbatch per shard: {naive:.2f} s for {len(jobs):,} jobs ({how}), "
          f"{len(jobs):,} Slurm calls")  # fmt: skip
    made = sum(calls.values())
    print(f"ratio, Slurm submission, watchd / baseline: time {seconds / naive:.2g}, "
          f"calls {made} / {len(jobs):,} = {made / len(jobs):.2g}")  # fmt: skip
    whole = f"intake, {args.images:,} inputs checked, planning, {len(jobs):,} spec files"
    print(f"ratio, manifest → submitted ({whole}) / the baseline: {took / naive:.2f}")
    return 0


def watch(
    service: Service, conditions: list[tuple[str, Callable[[Service], bool]]], since: float
) -> dict[str, float]:
    """Tick the daemon until every condition held; when each first held (seconds after
    ``since``, at the end of a tick: one tick may reach several)."""
    reached: dict[str, float] = {}
    deadline = time.monotonic() + 900
    while len(reached) < len(conditions) and time.monotonic() < deadline:
        service.tick(time.time())
        for label, holds in conditions:
            if label not in reached and holds(service):
                reached[label] = time.time() - since
        time.sleep(0.01)
    return reached


def steps(client: Timed) -> list[tuple[str, Callable[[Service], bool]]]:
    """Each step of the way, as a condition on the daemon, in order."""

    def state(wanted: set[BatchState]) -> Callable[[Service], bool]:
        return lambda s: any(b.state in wanted for b in s.store.batches())

    return [
        ("batch recorded", lambda s: bool(s.store.batches())),
        ("inputs complete, queued", state({BatchState.QUEUED, BatchState.RUNNING})),
        ("jobs planned", lambda s: bool(s.store.jobs())),
        ("all submitted", lambda s: client.counts["submit"] > 0
         and not s.store.jobs(states=[JobState.PENDING])),
    ]  # fmt: skip


class Timed:
    """The daemon's Slurm client, with the time spent in Slurm calls added up."""

    def __init__(self, real: SlurmClient) -> None:
        self.real, self.name, self.counts, self.seconds = real, real.name, real.counts, 0.0

    def _timed(self, fn: Callable[[], T]) -> T:
        started = time.monotonic()
        try:
            return fn()
        finally:
            self.seconds += time.monotonic() - started

    def submit(self, request: JobRequest) -> str:
        return self._timed(lambda: self.real.submit(request))

    def jobs(self) -> list[JobRecord]:
        return self._timed(self.real.jobs)

    def cancel(self, job_ids: Sequence[str]) -> None:
        self._timed(lambda: self.real.cancel(job_ids))

    def versions(self) -> Versions:
        return self._timed(self.real.versions)

    def partitions(self) -> list[str]:
        return self._timed(self.real.partitions)


if __name__ == "__main__":
    sys.exit(main())
