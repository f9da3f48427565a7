"""Benchmark: how fast a dropped inference batch comes back, against what the machine can compute.

A batch of ``--images`` synthetic ``--size``² images is dropped (images first, the manifest
renamed in last) into a running daemon with its default configuration (local executor,
``max_parallel`` 2, one thread per job). Measured from the daemon's own events: queued → done
(every mask, the table and the report written) and manifest → done, as images per second.

The machine's limit is the bare forward pass of the same model over the same images already
decoded in memory (channels-last, inference mode, batch 1): the better of one process with
``--cpus`` threads and ``--cpus`` processes with one thread each, over the first
``--limit-images`` of them, measured before each run and after the last.

The old code (``--old``, a checkout of the code before the change) and the new one run in this
invocation, interleaved, ``--rounds`` times each, against the same images and model (an
untrained U-Net of the demo's shape: the timing is a trained one's).

``--slurm``: the daemons send the jobs to the local test cluster (scripts/slurm-cluster) through
the CLI client, the array throttled to ``--cpus`` tasks and a status query at most every 2 s;
every sbatch, squeue, scancel and scontrol they run is counted (through a folder of wrappers
first on their PATH).

``--standin``: the daemons' jobs run with the net replaced by a zero-cost stand-in
(``scripts/standin_job.py``, put in every process of theirs by a ``sitecustomize`` first on
their PYTHONPATH), without the object step (the stand-in's masks make it ~14× as costly as a
trained net's), and the limit is the host side's instead: one stand-in job of the new code over
the whole batch on ``--cpus`` cores, its images/s over its images alone (start-up aside, as the
forward pass's limit leaves it aside). What a batch then loses against it is the daemon's and
the jobs' fixed costs (planning, starts, waves of shards, the report): on a GPU node, where the
net costs next to nothing per image, that is what stands between a batch and the GPU's rate.

``--resume`` then drops one more batch on the new code, kills the daemon and its jobs (SIGKILL,
as a node that dies) when about half the images are done, starts it again and counts the
images segmented twice (ledger lines beyond one per image, in the run's ledgers in the daemon's
spool); it fails unless every image ends done and fewer are redone than the ledger held.
Local executor only.

    .venv/bin/python scripts/bench_batch.py --old ../wt-old [--images 1500] [--rounds 2]
    .venv/bin/python scripts/bench_batch.py --old ../wt-old --slurm --images 10000 --rounds 1
    .venv/bin/python scripts/bench_batch.py --old ../wt-old --standin --images 4096
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tomli_w
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import synth
from bench_share import Daemon, _commit
from slurm_scenario import start_cluster
from standin_job import THRESHOLD, site_folder

from daemon.contract import spool
from daemon.core.records import Batch, Job
from daemon.site.subprocesses import process_start_ticks
from daemon.store import Store
from models import registry
from models.unet import UNet
from pipelines.images import decode
from pipelines.layout import LEDGER_DIR

REPO = Path(__file__).resolve().parent.parent
MODEL = "spheroid-unet"
ARCHITECTURE = {"depth": 3, "width": 16}  # what the demo trains (the training defaults)


@dataclass
class BatchDaemon(Daemon):
    """A daemon on a local drop root with the defaults of its own code; only the paths set."""

    registry: Path = Path()
    slurm: dict[str, object] | None = None  # [executor.slurm] when the jobs go to Slurm

    def config(self, **intake: object) -> Path:
        daemon = {"state_dir": str(self.state)}
        config_code = (self.code / "daemon" / "site" / "config.py").read_text(encoding="utf-8")
        if "spool_dir" in config_code:  # a code from before the spool has none
            daemon["spool_dir"] = str(self.spool)
        document: dict[str, object] = {
            "daemon": daemon,
            "roots": [{"path": str(self.mount)}],
            "registry": {"path": str(self.registry)},
            "jobs": {"wandb_mode": "disabled"},
        }
        if self.slurm is not None:
            document["executor"] = {"kind": "slurm", "slurm": self.slurm}
        path = self.state / "config.toml"
        path.write_text(tomli_w.dumps(document))
        return path

    @property
    def spool(self) -> Path:
        return self.state / "spool"

    def state_at(self, folder: str, state: str) -> float | None:
        rows = self.query(
            "SELECT min(e.at) FROM events e JOIN batches b ON e.batch_id = b.id"
            " WHERE b.folder = ? AND e.job_id IS NULL AND e.to_state = ?",
            folder, state,
        )  # fmt: skip
        return float(rows[0][0]) if rows and rows[0][0] is not None else None  # type: ignore[arg-type]

    def jobs(self, folder: str) -> int:
        rows = self.query(
            "SELECT count(*) FROM jobs j JOIN batches b ON j.batch_id = b.id WHERE b.folder = ?",
            folder,
        )
        return int(rows[0][0]) if rows else 0  # type: ignore[call-overload]


SLURM_COMMANDS = ("sbatch", "squeue", "scancel", "scontrol", "sacct")


def counting_path(folder: Path) -> str:
    """A folder of wrappers that log each Slurm command run to ``calls.log`` and run the real
    one, as PATH for a daemon: its Slurm calls, counted from outside."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in SLURM_COMMANDS:
        real = shutil.which(name)
        if real is None:
            continue
        wrapper = folder / name
        wrapper.write_text(f'#!/bin/sh\necho {name} >> "{folder}/calls.log"\nexec {real} "$@"\n')
        wrapper.chmod(0o755)
    return f"{folder}:{os.environ.get('PATH', '')}"


def slurm_calls(folder: Path) -> dict[str, int]:
    log = folder / "calls.log"
    names = log.read_text().split() if log.exists() else []
    return {name: names.count(name) for name in SLURM_COMMANDS if name in names}


def drop(template: Path, root: Path, name: str) -> tuple[Path, float]:
    """Copy the images in, then rename the manifest into place: (folder, when it landed)."""
    folder = root / name
    shutil.copytree(template / "images", folder / "images")
    text = (template / "manifest.toml").read_text()
    (folder / ".manifest.toml.part").write_text(text)
    landed = time.time()
    os.rename(folder / ".manifest.toml.part", folder / "manifest.toml")
    return folder, landed


def wait_done(daemon: BatchDaemon, name: str, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while (done := daemon.state_at(name, "done")) is None:
        if daemon.state_at(name, "failed") is not None:
            raise SystemExit(f"{daemon.name}: {name} failed; see {daemon.state}/daemon.log")
        if time.monotonic() > deadline:
            raise SystemExit(f"{daemon.name}: {name} not done in {timeout:.0f} s")
        time.sleep(0.2)
    return done


def _forward(net: UNet, images: list[np.ndarray], threads: int) -> float:
    """Seconds for the bare forward pass (plus sigmoid) over ``images``, one at a time."""
    torch.set_num_threads(threads)
    net = net.to(memory_format=torch.channels_last)
    with torch.inference_mode():
        for image in images[:2]:  # warm-up: the first calls allocate
            net(torch.from_numpy(image)[None, None].contiguous(memory_format=torch.channels_last))
        started = time.perf_counter()
        for image in images:
            stack = torch.from_numpy(image)[None, None]
            torch.sigmoid(net(stack.contiguous(memory_format=torch.channels_last)))
    return time.perf_counter() - started


def _forward_part(args: tuple[dict[str, object], list[np.ndarray]]) -> float:
    state, images = args
    net = UNet(**ARCHITECTURE)
    net.load_state_dict(state)  # type: ignore[arg-type]
    return _forward(net.eval(), images, 1)


def limit(net: UNet, images: list[np.ndarray], cpus: int) -> tuple[float, float]:
    """Images/s of the bare forward pass: (one process × ``cpus`` threads, ``cpus`` processes
    × one thread, each over its share of the images, timed from the first start to the last
    end of the forward passes)."""
    threaded = len(images) / _forward(net, images, cpus)
    parts = [images[i::cpus] for i in range(cpus)]
    state = {k: v.clone() for k, v in net.state_dict().items()}
    with multiprocessing.get_context("spawn").Pool(cpus) as pool:
        seconds = pool.map(_forward_part, [(state, part) for part in parts])
    return threaded, len(images) / max(seconds)


def one_run(
    daemon: BatchDaemon, template: Path, name: str, images: int, timeout: float = 3600
) -> dict[str, float]:
    _, landed = drop(template, daemon.mount, name)
    done = wait_done(daemon, name, timeout)
    queued = daemon.state_at(name, "queued") or landed
    return {
        "queued_to_done": images / (done - queued),
        "manifest_to_done": images / (done - landed),
        "seconds": done - queued,
        "jobs": daemon.jobs(name),
    }


def resume(daemon: BatchDaemon, template: Path, images: int) -> str:
    """Kill the daemon and its jobs halfway through a batch, start it again: images redone.

    Fails unless every image ends done and the restarted jobs skip what the ledger holds."""
    name = "resume"
    drop(template, daemon.mount, name)
    deadline = time.monotonic() + 3600
    while _ledger_lines(daemon, name)[0] < images // 2:
        if daemon.state_at(name, "failed") is not None or time.monotonic() > deadline:
            raise SystemExit(f"resume: half the images never in the ledger; see {daemon.state}")
        time.sleep(0.2)
    assert daemon.process is not None
    daemon.process.kill()
    daemon.process.wait()
    killed = _kill_jobs(daemon, name)
    before = _ledger_lines(daemon, name)[0]
    daemon.start()
    wait_done(daemon, name, 3600)
    lines, distinct = _ledger_lines(daemon, name)
    report = (
        f"killed the daemon and {killed} job(s) with {before:,} of {images:,} images in the "
        f"ledger; after the restart {distinct:,} images done, {lines - distinct} segmented twice"
    )
    if distinct != images or lines - distinct >= max(before, 1):
        raise SystemExit(f"resume: not resumed from the ledger: {report}")
    return report


def _newest_run(daemon: BatchDaemon, name: str) -> tuple[Batch | None, list[Job]]:
    """The newest revision of the batch in folder ``name`` and its jobs, from the daemon's
    store (the new code's: the resume run is on the new code only)."""
    store = Store(daemon.state / "watchd.sqlite")
    try:
        batch = store.latest_revision(str(daemon.mount), name)
        return batch, store.jobs([batch.id]) if batch else []
    finally:
        store.close()


def _kill_jobs(daemon: BatchDaemon, name: str) -> int:
    """SIGKILL the live local jobs of ``name``, as a node that dies: each job's launcher leads
    its own session, with the job in its process group. Only this daemon's jobs, never another
    run's on the same machine. Waits until they are gone: how many were killed."""
    _, jobs = _newest_run(daemon, name)
    pids = []
    for job in jobs:
        if job.state.live and job.handle and job.handle.startswith("local:"):
            _, pid, ticks = job.handle.split(":")
            if process_start_ticks(int(pid)) == int(ticks):  # not a reused pid
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(int(pid), signal.SIGKILL)
                    pids.append(int(pid))
    deadline = time.monotonic() + 30
    while any(process_start_ticks(pid) is not None for pid in pids):
        if time.monotonic() > deadline:
            raise SystemExit(f"resume: jobs {pids} still there 30 s after SIGKILL")
        time.sleep(0.1)
    return len(pids)


def _ledger_lines(daemon: BatchDaemon, name: str) -> tuple[int, int]:
    """(lines, distinct inputs) over every shard's ledger of the newest run of ``name``, in the
    run's work folder in the daemon's spool."""
    batch, _ = _newest_run(daemon, name)
    if batch is None:
        return 0, 0
    ledgers = spool.work_dir(daemon.spool, batch.id, batch.run_dir) / LEDGER_DIR
    lines, paths = 0, set()
    for shard in ledgers.glob("*.jsonl"):
        for line in shard.read_text().splitlines():
            try:
                paths.add(json.loads(line)["path"])
            except (ValueError, KeyError):
                continue  # a torn last line
            lines += 1
    return lines, len(paths)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", type=Path, required=True, help="a checkout of the old code")
    parser.add_argument("--images", type=int, default=1500)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cpus", type=int, default=2)
    parser.add_argument("--limit-images", type=int, default=500)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--slurm", action="store_true", help="jobs to the local test cluster")
    parser.add_argument("--standin", action="store_true",
                        help="a zero-cost net: the host side's limit, the fixed costs")  # fmt: skip
    args = parser.parse_args()
    slurm_conf = start_cluster() if args.slurm else None
    work = Path(tempfile.mkdtemp(prefix="watchd-bench-batch-"))
    torch.manual_seed(0)
    net = UNet(**ARCHITECTURE).eval()
    registry.register(work / "registry", MODEL, net.state_dict(),
                      {"architecture": net.architecture()})  # fmt: skip
    template = work / "template"
    files = synth.make_batch(template, "inference", args.images, args.size, seed=7)
    standin = {"threshold": THRESHOLD, "min_object_area": 16, "split_neck": 0.0}
    params = [f"--param={k}={v}" for k, v in standin.items()] if args.standin else []
    subprocess.run(
        [str(REPO / ".venv/bin/watchctl"), "manifest", str(template), "--kind", "inference",
         "--model", MODEL, "--owner", "Bench", *params],
        check=True, capture_output=True,
    )  # fmt: skip
    decoded = [decode(p.read_bytes()) for p in files[: args.limit_images]]
    print(f"old: {args.old.resolve()} ({_commit(args.old)}); new: {REPO} ({_commit(REPO)})")
    where = f"Slurm test cluster ({slurm_conf}), throttle %{args.cpus}" if args.slurm else "local"
    where += ", the net stood in" if args.standin else ""
    print(f"{args.images:,} images {args.size}², {args.cpus} cores, {where}; work in {work}")
    daemons = [
        BatchDaemon(name, code, work / name, work / name / "drop", work / name / "state",
                    registry=work / "registry")
        for name, code in (("old", args.old.resolve()), ("new", REPO))
    ]  # fmt: skip
    if slurm_conf is not None:
        for d in daemons:
            d.env = {"PATH": counting_path(work / d.name / "bin"), "SLURM_CONF": str(slurm_conf)}
            d.slurm = {"client": "cli", "slurm_conf": str(slurm_conf), "python": sys.executable,
                       "array_throttle": args.cpus, "poll_seconds": 2.0,
                       "result_grace_seconds": 0.0, "memory_mb": 3072}  # fmt: skip
    if args.standin:
        for d in daemons:
            d.env["PYTHONPATH"] = str(site_folder(work / d.name / "standin"))

    def measure_limit() -> None:
        if args.standin:
            from bench_host import host_rate  # (it imports this module, through bench_slide)

            whole, inner = host_rate(template, work / "registry", MODEL, args.cpus, standin)
            limits.append(inner)
            print(f"limit: {inner:.1f} images/s (one stand-in job on {args.cpus} cores, over "
                  f"its images; {whole:.1f} start to end)")  # fmt: skip
            return
        threaded, processes = limit(net, decoded, args.cpus)
        limits.append(max(threaded, processes))
        print(f"limit: {threaded:.1f} images/s (1 process × {args.cpus} threads), "
              f"{processes:.1f} ({args.cpus} processes × 1 thread)")  # fmt: skip

    limits: list[float] = []
    rates: dict[str, list[dict[str, float]]] = {d.name: [] for d in daemons}
    try:
        for d in daemons:
            d.mount.mkdir(parents=True)
            d.start()
        for round_ in range(args.rounds):
            for d in daemons:
                measure_limit()
                run = one_run(d, template, f"round-{round_}", args.images)
                rates[d.name].append(run)
                print(f"{d.name}: {run['jobs']:.0f} jobs, queued → done {run['seconds']:.1f} s = "
                      f"{run['queued_to_done']:.1f} images/s; manifest → done "
                      f"{run['manifest_to_done']:.1f} images/s")  # fmt: skip
        measure_limit()
        best = statistics.median(limits)
        print(f"machine limit (median of {len(limits)}): {best:.1f} images/s")
        for name, runs in rates.items():
            queued = statistics.median(r["queued_to_done"] for r in runs)
            landed = statistics.median(r["manifest_to_done"] for r in runs)
            print(f"{name}: efficiency queued → done {queued / best:.2f}, "
                  f"manifest → done {landed / best:.2f} (medians of {len(runs)})")  # fmt: skip
        if slurm_conf is not None:
            for d in daemons:
                calls = slurm_calls(work / d.name / "bin")
                listed = ", ".join(f"{name} {n}" for name, n in calls.items())
                print(f"{d.name}: Slurm commands run over {args.rounds} batch(es) and the "
                      f"start: {sum(calls.values())} ({listed})")  # fmt: skip
        if args.resume and slurm_conf is None:
            print(f"resume: {resume(daemons[1], template, args.images)}")
    finally:
        for d in daemons:
            d.stop()
    print(f"logs: {work}/*/state/daemon.log")
    return 0


if __name__ == "__main__":
    sys.exit(main())
