"""The command-line Slurm client against the real cluster: submit, look, cancel; and
``watchctl doctor`` showing the executor's self-test."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import CLIENT, write_config

from daemon.executors.slurm_api import JobRecord, JobRequest
from daemon.executors.slurm_cli import CliClient

pytestmark = pytest.mark.slurm


def sleeper(folder: Path, seconds: int) -> Path:
    script = folder / "sleep.sh"
    script.write_text(f"#!/bin/bash\necho started $SLURM_ARRAY_TASK_ID\nsleep {seconds}\n")
    return script


def wait_for(
    client: CliClient, ids: set[str], done: Callable[[dict[str, JobRecord]], bool]
) -> dict[str, JobRecord]:
    deadline = time.monotonic() + 30
    while True:
        seen = {r.id: r for r in client.jobs() if r.id in ids}
        if done(seen) or time.monotonic() > deadline:
            return seen
        time.sleep(0.3)


def test_the_cli_client_submits_a_throttled_array_sees_every_task_and_cancels_them(
    tmp_path: Path, slurm_env: dict[str, str]
) -> None:
    client = CliClient(environment=slurm_env, timeout=30)
    work = tmp_path / "work dir 'q'"
    (work / "logs").mkdir(parents=True)
    request = JobRequest(
        name="watchd-test", comment="watchd:watchd-test:0123456789abcdef",
        script=sleeper(tmp_path, 60), work_dir=work, output="logs/%A_%a.out",
        time_minutes=5, memory_mb=128, array="0-3%2", environment=slurm_env,
    )  # fmt: skip
    array = client.submit(request)
    ids = {f"{array}_{t}" for t in range(4)}
    seen = wait_for(client, ids, lambda s: sum(r.state == "RUNNING" for r in s.values()) == 2)
    assert sorted(r.state for r in seen.values()) == ["PENDING", "PENDING", "RUNNING", "RUNNING"]
    assert {r.reason for r in seen.values() if r.state == "PENDING"} == {"JobArrayTaskLimit"}
    assert {r.comment for r in seen.values()} == {"watchd:watchd-test:0123456789abcdef"}
    client.cancel(sorted(ids))
    seen = wait_for(client, ids, lambda s: {r.state for r in s.values()} == {"CANCELLED"})
    assert {r.state for r in seen.values()} == {"CANCELLED"}
    assert sorted((work / "logs").iterdir())  # the running tasks wrote into the quoted folder
    assert client.counts["submit"] == 1 and client.counts["cancel"] == 1


def test_the_cli_client_reports_a_failed_job_with_its_exit_code_and_slurms_reason(
    tmp_path: Path, slurm_env: dict[str, str]
) -> None:
    client = CliClient(environment=slurm_env, timeout=30)
    script = tmp_path / "fail.sh"
    script.write_text("#!/bin/bash\nexit 3\n")
    request = JobRequest(
        name="watchd-fail", comment="c", script=script, work_dir=tmp_path,
        output="%j.out", time_minutes=5, memory_mb=128, environment=slurm_env,
    )  # fmt: skip
    job = client.submit(request)
    seen = wait_for(client, {job}, lambda s: job in s and s[job].state == "FAILED")
    assert seen[job] == JobRecord(job, "FAILED", "NonZeroExitCode", 3, "c")


def test_the_cli_client_says_which_release_and_partitions_the_cluster_has(
    slurm_env: dict[str, str],
) -> None:
    client = CliClient(environment=slurm_env, timeout=30)
    versions = client.versions()
    assert versions.controller.startswith(versions.client.split()[-1][:5])
    assert client.partitions() == ["debug"]


def watchctl(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [str(Path(sys.executable).parent / "watchctl"), *args, "--config", str(config)]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_watchctl_doctor_shows_the_slurm_self_test(
    tmp_path: Path, drop_root: Path, slurm_conf: Path
) -> None:
    config = write_config(tmp_path, drop_root, tmp_path / "registry", slurm_conf)
    done = watchctl(config.source, "doctor", "--json")
    assert done.returncode == 0, done.stderr
    everything = {c["name"]: c for c in json.loads(done.stdout)["checks"]}
    checks = {n: c for n, c in everything.items() if "slurm" in n}  # the executor's self-test
    versions = ["pyslurm release"] if CLIENT == "pyslurm" else []  # its release is Slurm's?
    expected = ["slurm client", "slurm controller", *versions, "slurm partitions"]
    assert list(checks) == expected
    assert all(c["ok"] for c in everything.values())
    assert checks["slurm controller"]["detail"].startswith("Slurm 22.05")
    assert checks["slurm partitions"]["detail"] == "the default; there are debug"


def test_watchctl_doctor_fails_on_a_partition_the_cluster_does_not_have(
    tmp_path: Path, drop_root: Path, slurm_conf: Path
) -> None:
    config = write_config(tmp_path, drop_root, tmp_path / "registry", slurm_conf,
                          slurm={"partition": "gpu-a100"})  # fmt: skip
    done = watchctl(config.source, "doctor")
    assert done.returncode == 3
    assert "FAIL slurm partition: 'gpu-a100' among debug" in done.stdout
    assert "     hint: set executor.slurm.partition to one the cluster has" in done.stdout
    assert done.stderr == "Error: 1 check(s) failed: slurm partition\n"
