"""Fault campaign: replay drop scenarios while killing the daemon (and sometimes a worker) at
random moments, restart it, and check the invariants after every run.

Each run: a fresh drop root and database, a real `watchd run` process (local executor, real
pipelines), a scenario of inference batches copied in slowly (manifest last), a training batch,
and sometimes a broken manifest; SIGKILLs of the daemon at random moments (each followed by a
restart) and of random running jobs. When every batch has ended and the daemon is stopped:

- every dropped folder has a batch, and every batch ended done or failed, with a reason;
- exactly once: one terminal event per batch, no job attempt past the limit;
- no half-written output: every mask opens, every table has a row per image, every JSON
  parses, and no temporary file is left in any batch folder;
- the database passes SQLite's integrity check.

    python scripts/fault_campaign.py --runs 100            # the full campaign
    python scripts/fault_campaign.py --runs 3 --seed 7     # what CI runs
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import synth
import tomli_w
from PIL import Image
from replay import Replay, copy_slowly, manifest_text

from daemon.core.manifest import STATUS_NAME
from daemon.core.manifest_schema import Kind
from daemon.core.records import Batch
from daemon.core.states import BatchState
from daemon.site import logs
from daemon.site.config import Config, load_config
from daemon.store import Store

BIN = Path(sys.executable).parent
MODEL = "spheroid-unet"
TINY = {"epochs": 2, "batch_size": 4, "depth": 2, "width": 8, "learning_rate": 0.01}


@dataclass
class Run:
    number: int
    daemon_kills: int = 0
    worker_kills: int = 0
    batches: int = 0
    violations: list[str] = field(default_factory=list)
    seconds: float = 0.0


def write_config(base: Path, root: Path, registry: Path, **sections: dict[str, Any]) -> Config:
    """The campaign's configuration; ``sections``: keys that replace its own, by section (the
    fuzz campaign's faster heartbeat, shorter timeouts, spool; ``roots``: the drop root's)."""
    document: dict[str, Any] = {
        "daemon": {"state_dir": str(base / "state"), "tick_seconds": 0.1,
                   "heartbeat_seconds": 1.0, "rescan_seconds": 2.0,
                   "shutdown_grace_seconds": 5.0, "log_format": "json"},
        "roots": [{"path": str(root), "observer": "inotify"}],
        "intake": {"settle_seconds": 0.3, "check_seconds": 0.1, "timeout_seconds": 120},
        "planner": {"shard_size": 2, "max_attempts": 4},
        "executor": {"local": {"max_parallel": 2}},
        "registry": {"path": str(registry)},
        "jobs": {"wandb_mode": "disabled"},
    }  # fmt: skip
    for name, values in sections.items():
        if name == "roots":
            document["roots"] = [{**document["roots"][0], **values}]
        else:
            document[name] = {**document[name], **values}
    base.mkdir(parents=True, exist_ok=True)
    path = base / "config.toml"
    path.write_text(tomli_w.dumps(document))
    return load_config(path)


def train_seed_model(base: Path) -> Path:
    """One tiny model, trained by a real training drop, that every run's inference uses."""
    root, registry = base / "seed drop", base / "seed registry"
    root.mkdir()
    staging = base / "seed staging"
    synth.make_batch(staging, "training", count=8, size=32, seed=1)
    (staging / "manifest.toml").write_bytes(
        manifest_text(staging, Kind.TRAINING, model=MODEL, params=TINY)
    )
    with Replay(write_config(base / "seed", root, registry)) as replay:
        replay.run(copy_slowly(staging, root / "seed", 0.0, 0.01), timeout=300)
    return registry


def stage_scenario(rng: random.Random, staging: Path) -> dict[str, Path]:
    """Folders to drop: two or three inference batches, a training batch, maybe a broken one."""
    folders = {}
    for i in range(rng.randint(2, 3)):
        folder = staging / f"plate {i} ä"
        synth.make_batch(
            folder, "inference", count=rng.randint(2, 5), size=32, seed=rng.randint(0, 999)
        )
        (folder / "manifest.toml").write_bytes(
            manifest_text(folder, Kind.INFERENCE, model=MODEL, version="latest")
        )
        folders[folder.name] = folder
    training = staging / "annotated"
    synth.make_batch(training, "training", count=6, size=32, seed=rng.randint(0, 999))
    (training / "manifest.toml").write_bytes(
        manifest_text(training, Kind.TRAINING, model=MODEL, params=TINY)
    )
    folders[training.name] = training
    if rng.random() < 0.5:
        broken = staging / "broken 'q'"
        synth.make_batch(broken, "inference", count=1, size=32, seed=1)
        (broken / "manifest.toml").write_text('watchd = 1\nkind = "inference"\n[owner\n')
        folders[broken.name] = broken
    return folders


def start(config: Config, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen([str(BIN / "watchd"), "run", "--config", str(config.source)],
                                stdout=out, stderr=subprocess.STDOUT)  # fmt: skip


def snapshot(config: Config) -> list[Batch] | None:
    try:
        store = Store(config.daemon.database)
        try:
            return store.batches()
        finally:
            store.close()
    except sqlite3.Error:
        return None


def live_job_pids(config: Config) -> list[int]:
    try:
        store = Store(config.daemon.database)
        try:
            handles = [j.handle for j in store.jobs() if j.state.live and j.handle]
        finally:
            store.close()
    except sqlite3.Error:
        return []
    return [int(h.split(":")[1]) for h in handles if h.startswith("local:")]


def one_run(
    number: int, rng: random.Random, base: Path, seed_registry: Path, deadline: float
) -> Run:
    run = Run(number)
    started = time.monotonic()
    root, staging = base / "drop", base / "staging"
    root.mkdir(parents=True)
    registry = base / "registry"
    shutil.copytree(seed_registry, registry)
    config = write_config(base, root, registry)
    folders = stage_scenario(rng, staging)
    run.batches = len(folders)
    log = base / "daemon.log"
    daemon = start(config, log)
    copiers = [
        copy_slowly(src, root / name, rng.uniform(0, 2), rng.uniform(0.01, 0.2))
        for name, src in folders.items()
    ]
    steps = sorted(step for steps in copiers for step in steps)
    kills = sorted(rng.uniform(0.3, 10.0) for _ in range(rng.randint(1, 3)))
    worker_kills = sorted(rng.uniform(1.0, 12.0) for _ in range(rng.choice([0, 0, 1, 2])))
    try:
        while time.monotonic() - started < deadline:
            elapsed = time.monotonic() - started
            while steps and steps[0].at <= elapsed:
                steps.pop(0).do()
            if kills and kills[0] <= elapsed:
                kills.pop(0)
                daemon.send_signal(signal.SIGKILL)
                daemon.wait()
                run.daemon_kills += 1
                time.sleep(rng.uniform(0.0, 1.0))
                daemon = start(config, log)
            if worker_kills and worker_kills[0] <= elapsed:
                worker_kills.pop(0)
                pids = live_job_pids(config)
                if pids:
                    try:
                        os.killpg(rng.choice(pids), signal.SIGKILL)
                        run.worker_kills += 1
                    except ProcessLookupError:
                        pass
            batches = snapshot(config)
            if not steps and not kills and batches is not None and len(batches) >= len(folders) \
                    and all(b.state.terminal for b in batches):  # fmt: skip
                break
            time.sleep(0.05)
        else:
            run.violations.append(f"not finished within {deadline:.0f} s")
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(timeout=60)
        except subprocess.TimeoutExpired:
            daemon.kill()
            run.violations.append("daemon did not stop on SIGTERM within 60 s")
    wait_for_orphans(config)
    run.violations += check(config, root, folders)
    run.seconds = time.monotonic() - started
    return run


def wait_for_orphans(config: Config, timeout: float = 60.0) -> None:
    """Jobs outlive a killed daemon; let them end before looking at their outputs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(
        os.path.exists(f"/proc/{p}") for p in live_job_pids(config)
    ):
        time.sleep(0.2)


def check(config: Config, root: Path, folders: dict[str, Path]) -> list[str]:
    problems = []
    store = Store(config.daemon.database)
    try:
        if store.integrity() != "ok":
            problems.append(f"database integrity: {store.integrity()}")
        latest = {name: store.latest_revision(str(root), name) for name in folders}
        for name, batch in latest.items():
            if batch is None:
                problems.append(f"{name}: lost (no batch recorded)")
                continue
            if not batch.state.terminal:
                problems.append(f"{name}: ended {batch.state.value}, not done or failed")
            if not batch.reason:
                problems.append(f"{name}: ended without a reason")
            ends = [
                e
                for e in store.events(batch.id, jobs=False)
                if isinstance(e.to_state, BatchState) and e.to_state.terminal
            ]
            if len(ends) != 1:
                problems.append(f"{name}: {len(ends)} terminal events, not exactly one")
            if name.startswith("broken"):
                if batch.state is not BatchState.FAILED:
                    problems.append(f"{name}: a broken manifest ended {batch.state.value}")
            elif batch.state is not BatchState.DONE:
                problems.append(f"{name}: ended {batch.state.value}: {batch.reason}")
            for job in store.jobs([batch.id]):
                if job.attempts > config.planner.max_attempts:
                    problems.append(f"{name}: job {job.name} ran {job.attempts} times")
            if batch.state is BatchState.DONE:
                problems += outputs_whole(batch, folders[name])
        for folder in root.iterdir():
            leftovers = [p for p in folder.rglob(".tmp-*")]
            if leftovers:
                problems.append(
                    f"{folder.name}: temporary files left: {[p.name for p in leftovers][:3]}"
                )
    finally:
        store.close()
    return problems


def outputs_whole(batch: Batch, source: Path) -> list[str]:
    run = Path(batch.run_dir)
    problems = []
    try:
        json.loads((run / "summary.json").read_text())
        if "</html>" not in (run / "report.html").read_text():
            problems.append(f"{batch.folder}: report.html is cut short")
        if (batch.path / STATUS_NAME).read_text().count("State:     DONE") != 1:
            problems.append(f"{batch.folder}: the status file does not say DONE")
        if batch.kind is Kind.INFERENCE:
            images = sorted(p.relative_to(source).as_posix() for p in (source / "images").iterdir())
            with open(run / "table.csv", newline="") as handle:
                rows = sorted(r["path"] for r in csv.DictReader(handle))
            if rows != images:
                problems.append(f"{batch.folder}: table rows {len(rows)} for {len(images)} images")
            for image in images:
                with Image.open(run / "masks" / image) as mask:
                    mask.load()
    except (OSError, ValueError, KeyError) as exc:
        problems.append(f"{batch.folder}: an output is missing or damaged: {exc}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--deadline", type=float, default=240.0, help="seconds per run at most")
    parser.add_argument("--keep", action="store_true", help="keep the folders of failed runs")
    args = parser.parse_args()
    logs.configure("console", "warning")
    base = Path(tempfile.mkdtemp(prefix="watchd-campaign-"))
    rng = random.Random(args.seed)
    print(f"fault campaign: {args.runs} runs, seed {args.seed}, in {base}", flush=True)
    seed_registry = train_seed_model(base)
    runs = []
    for number in range(1, args.runs + 1):
        run_dir = base / f"run {number:03d}"
        run = one_run(number, random.Random(rng.random()), run_dir, seed_registry, args.deadline)
        runs.append(run)
        verdict = "ok" if not run.violations else "VIOLATED: " + "; ".join(run.violations)
        line = f"run {number:3d}: {run.batches} batches, {run.daemon_kills} daemon kills, "
        line += f"{run.worker_kills} worker kills, {run.seconds:5.1f} s: {verdict}"
        print(line, flush=True)
        if not run.violations or not args.keep:
            shutil.rmtree(run_dir, ignore_errors=True)
    violations = sum(len(r.violations) for r in runs)
    print(f"\nruns: {len(runs)}, batches: {sum(r.batches for r in runs)}, "
          f"daemon kills: {sum(r.daemon_kills for r in runs)}, "
          f"worker kills: {sum(r.worker_kills for r in runs)}, "
          f"invariant violations: {violations}")  # fmt: skip
    if not args.keep or violations == 0:
        shutil.rmtree(base, ignore_errors=True)
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
