"""Fixtures for the Slurm tests: the real one-node cluster of scripts/slurm-cluster, configs
that send jobs to it, and a registry holding a model trained through it.

``scripts/test`` starts the cluster before pytest and stops it after; run on their own, these
fixtures start it (and stop it at the end). Tests that need it skip only where it cannot run:
not root, or no apt-get to install Slurm.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import synth
import tomli_w
from replay import Replay, copy_slowly, manifest_text

from daemon.config import Config, load_config
from daemon.manifest import Kind
from daemon.states import BatchState
from daemon.store import Store

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "scripts" / "slurm-cluster"
MODEL = "spheroid-unet"
TINY_TRAINING = {"epochs": 2, "batch_size": 4, "depth": 2, "width": 8, "learning_rate": 0.01}


def cluster(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(CLUSTER), *args], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="session")
def slurm_conf() -> Iterator[Path]:
    """The running test cluster's slurm.conf (started here if scripts/test did not)."""
    if os.geteuid() != 0:
        pytest.skip("the local Slurm cluster needs root (scripts/slurm-cluster installs Slurm)")
    if shutil.which("apt-get") is None and shutil.which("slurmctld") is None:
        pytest.skip("no apt-get to install Slurm, and Slurm is not installed")
    was_up = cluster("status").returncode == 0
    started = cluster("start")
    assert started.returncode == 0, started.stderr
    line = cluster("env").stdout.strip()  # export SLURM_CONF=...
    conf = Path(line.split("=", 1)[1].strip("'\""))
    yield conf
    if not was_up:
        cluster("stop")


@pytest.fixture
def slurm_env(slurm_conf: Path) -> dict[str, str]:
    return {**os.environ, "SLURM_CONF": str(slurm_conf)}


def slurm(env: dict[str, str], *args: str) -> str:
    """Run a Slurm tool, as an operator would, to look at what the daemon did."""
    return subprocess.run(args, env=env, capture_output=True, text=True, check=True).stdout


def job_fields(env: dict[str, str], job_id: str) -> list[dict[str, str]]:
    """``scontrol show job -o ID``: one mapping per record (an array has one per task). Only
    values without spaces are read right, which is all the tests look at."""
    out = slurm(env, "scontrol", "show", "job", "-o", job_id)
    return [dict(re.findall(r"(\w+)=(\S*)", line)) for line in out.splitlines() if line.strip()]


@pytest.fixture
def node_python(tmp_path: Path) -> Callable[..., str]:
    """An interpreter for the compute node that misbehaves on purpose, as nodes do: before the
    real pipeline starts, the named jobs crash (``crash``: job name → "once" or "always"), all
    crashing jobs of one round together, or every job waits ``sleep`` seconds."""

    def make(crash: dict[str, str] | None = None, sleep: float = 0.0) -> str:
        crash = crash or {}
        lines = [
            "#!/bin/bash",
            'job_dir=${!#}; name=$(basename "$job_dir")',
            "attempt=$(grep -o '\"attempt\": [0-9]*' \"$job_dir/spec.json\" | grep -o '[0-9]*$')",
            f"sleep {sleep}",
        ]
        for name, how in crash.items():
            when = '[ "$attempt" = 1 ]' if how == "once" else "true"
            lines += [
                f'if [ "$name" = {name} ] && {when}; then',
                '  touch "$job_dir/../crash-$attempt-$name"',
                f'  for _ in $(seq 100); do [ $(ls "$job_dir/.." | grep -c "^crash-$attempt-") -ge {len(crash)} ] && break; sleep 0.1; done',
                '  echo "simulated node crash" >&2; exit 1',
                "fi",
            ]
        lines.append(f'exec {sys.executable} "$@"')
        path = tmp_path / "node-python"
        path.write_text("\n".join(lines) + "\n")
        path.chmod(0o755)
        return str(path)

    return make


def write_config(
    tmp_path: Path, root: Path, registry: Path, slurm_conf: Path, **sections: dict
) -> Config:
    """A config that sends jobs to the test cluster, with fast ticks and short pauses."""
    slurm_section = {
        "client": "cli", "slurm_conf": str(slurm_conf), "python": sys.executable,
        "poll_seconds": 0.5, "array_throttle": 4, "time_minutes": 10, "memory_mb": 1024,
        "max_gpus": 2, "retry_attempts": 1, "retry_wait_seconds": 0.5,
        "max_backoff_seconds": 2.0, "command_timeout_seconds": 30,
    }  # fmt: skip
    document: dict = {
        "daemon": {"state_dir": str(tmp_path / "state"), "tick_seconds": 0.05,
                   "heartbeat_seconds": 0.5, "rescan_seconds": 2.0, "shutdown_grace_seconds": 0},
        "roots": [{"path": str(root), "observer": "inotify", "poll_seconds": 0.2}],
        "intake": {"settle_seconds": 0.3, "timeout_seconds": 120, "check_seconds": 0.1},
        "planner": {"shard_size": 2, "max_attempts": 2},
        "executor": {"kind": "slurm", "slurm": slurm_section},
        "registry": {"path": str(registry)},
        "jobs": {"wandb_mode": "disabled"},
    }  # fmt: skip
    for name, values in sections.items():
        if name == "slurm":
            document["executor"]["slurm"] = {**slurm_section, **values}
        else:
            document[name] = {**document[name], **values}
    path = tmp_path / "config.toml"
    path.write_text(tomli_w.dumps(document))
    return load_config(path)


@dataclass(frozen=True)
class Trained:
    registry: Path
    handle: str  # the training job's Slurm handle
    run_dir: Path


@pytest.fixture(scope="session")
def slurm_training(tmp_path_factory: pytest.TempPathFactory, slurm_conf: Path) -> Trained:
    """A registry with one tiny model, trained by a training drop that ran on the cluster (one
    job under srun, with one of the node's fake GPUs asked for in the manifest)."""
    base = tmp_path_factory.mktemp("slurm-training")
    root, registry = base / "drop", base / "registry"
    root.mkdir()
    config = write_config(base, root, registry, slurm_conf)
    staging = base / "staging"
    synth.make_batch(staging, "training", count=8, size=48, seed=3)
    text = manifest_text(staging, Kind.TRAINING, model=MODEL, params=TINY_TRAINING)
    (staging / "manifest.toml").write_bytes(text + b"\n[resources]\ngpus = 1\n")
    with Replay(config) as replay:
        replay.run(copy_slowly(staging, root / "training", 0.0, 0.01), timeout=300)
    store = Store(config.daemon.database)
    try:
        (batch,) = store.batches()
        assert batch.state is BatchState.DONE, batch.reason
        (train, _report) = store.jobs([batch.id])
    finally:
        store.close()
    return Trained(registry, str(train.handle), Path(batch.run_dir))


@pytest.fixture
def registry(tmp_path: Path, slurm_training: Trained) -> Path:
    """A private copy of the registry trained on the cluster."""
    copy = tmp_path / "registry"
    shutil.copytree(slurm_training.registry, copy)
    return copy


@pytest.fixture
def config_for(
    tmp_path: Path, drop_root: Path, registry: Path, slurm_conf: Path
) -> Callable[..., Config]:
    return lambda **sections: write_config(tmp_path, drop_root, registry, slurm_conf, **sections)


@pytest.fixture
def staged(tmp_path: Path) -> Callable[..., Path]:
    """An inference batch (images + manifest) in a staging folder outside the drop root."""

    def make(name: str = "staged", count: int = 6, extra: str = "") -> Path:
        folder = tmp_path / "staging" / name
        synth.make_batch(folder, "inference", count=count, size=48, seed=7)
        text = manifest_text(folder, Kind.INFERENCE, model=MODEL, version="latest")
        (folder / "manifest.toml").write_bytes(text + extra.encode())
        return folder

    return make
