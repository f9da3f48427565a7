"""Running watchd against the local test cluster (scripts/slurm-cluster): shared by the Slurm
tests and the Slurm benchmark scripts.

- :func:`start_cluster` starts the cluster (idempotent) and says where its slurm.conf is;
- :func:`slurm_config` writes a config that sends jobs to it, tuned for fast runs;
- :func:`train_model` trains a tiny model through it (one training job under srun), giving the
  registry that inference batches use.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import synth
import tomli_w
from replay import Replay, copy_slowly, manifest_text

from daemon.core.manifest_schema import Kind
from daemon.core.records import Batch, Job
from daemon.site import logs
from daemon.site.config import Config, load_config
from daemon.store import Store

REPO = Path(__file__).resolve().parent.parent
CLUSTER = REPO / "scripts" / "slurm-cluster"
MODEL = "spheroid-unet"
TINY_TRAINING = {"epochs": 2, "batch_size": 4, "depth": 2, "width": 8, "learning_rate": 0.01}


def cluster(*args: str) -> subprocess.CompletedProcess[str]:
    """Run scripts/slurm-cluster (start, stop, status, env, stop-controller, ...)."""
    return subprocess.run([str(CLUSTER), *args], capture_output=True, text=True, timeout=600)


def start_cluster() -> Path:
    """Start the cluster if it is not running; its slurm.conf."""
    started = cluster("start")
    if started.returncode != 0:
        raise RuntimeError(f"scripts/slurm-cluster start failed: {started.stderr.strip()}")
    line = cluster("env").stdout.strip()  # export SLURM_CONF=...
    return Path(line.split("=", 1)[1].strip("'\""))


def node_gpus(slurm_conf: Path) -> int:
    """The test node's (fake) GPUs: 2, or 0 where the machine refused to make device nodes."""
    env = {**os.environ, "SLURM_CONF": str(slurm_conf)}
    out = subprocess.run(["sinfo", "-h", "-o", "%G"], env=env, capture_output=True, text=True)
    found = re.search(r"gpu:(\d+)", out.stdout)
    return int(found.group(1)) if found else 0


@contextlib.contextmanager
def drill_ground(prefix: str) -> Iterator[tuple[Path, Path]]:
    """For a script: quiet logs, the cluster running, a scratch folder; (slurm.conf, folder).
    The folder is removed at the end, and the controller started again if left stopped."""
    logs.configure("console", "warning")
    conf = start_cluster()
    base = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield conf, base
    finally:
        if cluster("status").returncode != 0:
            cluster("start-controller")
        shutil.rmtree(base, ignore_errors=True)


def slurm_config(
    base: Path, root: Path, registry: Path, slurm_conf: Path, client: str = "cli", **sections: Any
) -> Config:
    """A config for ``base`` that sends jobs to the test cluster, with fast ticks and short
    pauses; ``sections`` override values (``slurm={...}`` those of ``[executor.slurm]``)."""
    slurm = {
        "client": client, "slurm_conf": str(slurm_conf), "python": sys.executable,
        "poll_seconds": 0.5, "result_grace_seconds": 0.0, "array_throttle": 4,
        "time_minutes": 10, "memory_mb": 1024, "max_gpus": 2, "retry_attempts": 1,
        "retry_wait_seconds": 0.5, "max_backoff_seconds": 2.0, "command_timeout_seconds": 30,
    }  # fmt: skip
    document: dict[str, Any] = {
        "daemon": {"state_dir": str(base / "state"), "tick_seconds": 0.05,
                   "heartbeat_seconds": 0.5, "rescan_seconds": 2.0, "shutdown_grace_seconds": 0},
        "roots": [{"path": str(root), "observer": "inotify", "poll_seconds": 0.2}],
        "intake": {"settle_seconds": 0.3, "timeout_seconds": 120, "check_seconds": 0.1},
        "planner": {"shard_size": 2, "max_attempts": 2},
        "executor": {"kind": "slurm", "slurm": slurm},
        "registry": {"path": str(registry)},
        "jobs": {"wandb_mode": "disabled"},
    }  # fmt: skip
    for name, values in sections.items():
        if name == "slurm":
            document["executor"]["slurm"] = {**slurm, **values}
        else:
            document[name] = {**document.get(name, {}), **values}
    path = base / "config.toml"
    path.write_text(tomli_w.dumps(document))
    return load_config(path)


def batches_and_jobs(config: Config) -> list[tuple[Batch, list[Job]]]:
    store = Store(config.daemon.database)
    try:
        return [(b, store.jobs([b.id])) for b in store.batches()]
    finally:
        store.close()


def train_model(base: Path, slurm_conf: Path, client: str = "cli") -> tuple[Batch, Job]:
    """Train a tiny model through the cluster, into ``base/registry``; the training batch and
    its training job. The manifest asks for one of the node's (fake) GPUs, if it has any."""
    root = base / "drop"
    root.mkdir(parents=True)
    config = slurm_config(base, root, base / "registry", slurm_conf, client)
    staging = base / "staging"
    synth.make_batch(staging, "training", count=8, size=48, seed=3)
    text = manifest_text(staging, Kind.TRAINING, model=MODEL, params=TINY_TRAINING)
    gpus = min(1, node_gpus(slurm_conf))
    (staging / "manifest.toml").write_bytes(text + f"\n[resources]\ngpus = {gpus}\n".encode())
    with Replay(config) as replay:
        replay.run(copy_slowly(staging, root / "training", 0.0, 0.01), timeout=300)
    ((batch, jobs),) = batches_and_jobs(config)
    return batch, jobs[0]


def stage_inference(folder: Path, count: int, extra: str = "") -> Path:
    """An inference batch (images + manifest, ``extra`` appended to it) in ``folder``."""
    synth.make_batch(folder, "inference", count=count, size=48, seed=7)
    text = manifest_text(folder, Kind.INFERENCE, model=MODEL, version="latest")
    (folder / "manifest.toml").write_bytes(text + extra.encode())
    return folder
