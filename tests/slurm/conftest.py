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
from slurm_scenario import cluster, slurm_config, stage_inference, start_cluster, train_model

from daemon.contract.spool import work_dir
from daemon.core.states import BatchState
from daemon.site.config import Config, load_config

# The daemon's Slurm client in these tests. CI has no pyslurm for this Slurm release: there the
# command-line client runs them. With a matching pyslurm installed, the same tests check the
# pyslurm client by hand: WATCHD_TEST_SLURM_CLIENT=pyslurm scripts/test tests/slurm
CLIENT = os.environ.get("WATCHD_TEST_SLURM_CLIENT", "cli")


@pytest.fixture(scope="session")
def slurm_conf() -> Iterator[Path]:
    """The running test cluster's slurm.conf (started here if scripts/test did not)."""
    if os.geteuid() != 0:
        pytest.skip("the local Slurm cluster needs root (scripts/slurm-cluster installs Slurm)")
    if shutil.which("apt-get") is None and shutil.which("slurmctld") is None:
        pytest.skip("no apt-get to install Slurm, and Slurm is not installed")
    was_up = cluster("status").returncode == 0
    yield start_cluster()
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
    real pipeline starts (once the job's log is open: the crash is in the log), the named jobs
    crash (``crash``: job name → "once" or "always"), all
    crashing jobs of one round together, or every job waits ``sleep`` seconds."""

    def make(crash: dict[str, str] | None = None, sleep: float = 0.0) -> str:
        crash = crash or {}
        lines = [
            "#!/bin/bash",
            'job_dir=${!#}; name=$(basename "$job_dir")',
            "attempt=$(grep -o '\"attempt\": [0-9]*' \"$job_dir/spec.json\" | grep -o '[0-9]*$')",
            f'case "$2" in pipelines.*) ;; *) exec {sys.executable} "$@" ;; esac',
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
    return slurm_config(tmp_path, root, registry, slurm_conf, CLIENT, **sections)


@dataclass(frozen=True)
class Trained:
    registry: Path
    handle: str  # the training job's Slurm handle
    run_dir: Path
    work_dir: Path  # the run's work folder in the spool


@pytest.fixture(scope="session")
def slurm_training(tmp_path_factory: pytest.TempPathFactory, slurm_conf: Path) -> Trained:
    """A registry with one tiny model, trained by a training drop that ran on the cluster (one
    job under srun, with one of the node's fake GPUs asked for in the manifest)."""
    base = tmp_path_factory.mktemp("slurm-training")
    batch, train = train_model(base, slurm_conf, CLIENT)
    assert batch.state is BatchState.DONE, batch.reason
    spool = load_config(base / "config.toml").daemon.spool_dir
    work = work_dir(spool, batch.id, batch.run_dir)
    return Trained(base / "registry", str(train.handle), Path(batch.run_dir), work)


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
    return lambda name="staged", count=6, extra="": stage_inference(
        tmp_path / "staging" / name, count, extra
    )
