"""The local executor hands each job its own GPUs (CUDA_VISIBLE_DEVICES), at most jobs_per_gpu
jobs on one; a job that asks for none sees none; a job that finds no GPU free waits."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from daemon.contract.errors import ConfigError
from daemon.core.states import Phase
from daemon.executors import Accepted, Deferred, Submission
from daemon.executors.gpus import GpuSeats
from daemon.executors.local import LocalExecutor
from daemon.site.config import LocalExecutorSection, parse_config

SHOW = """\
import os, pathlib, sys, time
print("visible=" + os.environ.get("CUDA_VISIBLE_DEVICES", "unset"), flush=True)
while not pathlib.Path(sys.argv[1], "stop").exists():
    time.sleep(0.05)
"""


def test_each_job_gets_the_least_taken_gpus_with_room_and_gives_them_back() -> None:
    seats = GpuSeats(3, 2)
    assert seats.seats == 6
    assert seats.free(1) == (0,)
    seats.hold("a", (0,))
    assert seats.free(2) == (1, 2)  # the untaken first
    seats.hold("b", (1, 2))
    seats.hold("c", (0,))  # GPU 0 is full (2 jobs)
    assert seats.free(2) == (1, 2) and seats.free(3) is None
    seats.hold("d", (1, 2))
    assert seats.free(1) is None and seats.free(0) == ()
    seats.release("c")
    assert seats.free(1) == (0,)
    seats.hold("e", (7, 0))  # a record naming a GPU this machine does not hand out
    assert seats.held["e"] == (0,) and seats.free(1) is None
    seats.release("nobody")
    assert seats.jobs == [2, 2, 2]


def _job(tmp_path: Path, name: str, gpus: int, env: dict[str, str]) -> Submission:
    job_dir = tmp_path / "jobs" / name
    job_dir.mkdir(parents=True)
    return Submission(1, name, "show", job_dir, gpus=gpus, env=env)


def _seen(job_dir: Path) -> str:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = (job_dir / "log.txt").read_text() if (job_dir / "log.txt").exists() else ""
        if text.startswith("visible="):
            return text.split()[0].removeprefix("visible=")
        time.sleep(0.05)
    raise AssertionError(f"{job_dir.name} said nothing")


def _end(executor: LocalExecutor, handle: str, job_dir: Path) -> None:
    (job_dir / "stop").touch()
    deadline = time.monotonic() + 30
    while executor.poll([handle])[handle].phase is Phase.RUNNING:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_jobs_run_on_gpus_of_their_own_and_one_that_finds_none_free_waits(
    tmp_path: Path,
) -> None:
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "show.py").write_text(SHOW)
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "lib")}
    limits = LocalExecutorSection(max_parallel=8, gpus=2, max_gpus=2, inference_gpus=1)
    executor = LocalExecutor(max_parallel=8, env=env, limits=limits)
    assert executor.width() == 2  # inference shards side by side: one per GPU
    subs = [_job(tmp_path, name, gpus, env)
            for name, gpus in (("a", 1), ("b", 1), ("c", 1), ("cpu", 0))]  # fmt: skip
    handles: dict[str, str] = {}
    try:
        handed = executor.submit(subs)
        assert isinstance(handed[2], Deferred) and "waits for 1 GPU(s) of 2" in handed[2].reason
        for sub, answer in zip(subs, handed, strict=True):
            if isinstance(answer, Accepted):
                handles[sub.name] = answer.handle
        assert {name: _seen(tmp_path / "jobs" / name) for name in handles} == {
            "a": "0", "b": "1", "cpu": ""}  # fmt: skip
        _end(executor, handles.pop("a"), tmp_path / "jobs" / "a")
        (again,) = executor.submit([subs[2]])
        assert isinstance(again, Accepted)
        handles["c"] = again.handle
        assert _seen(tmp_path / "jobs" / "c") == "0"
        executor.close()
        later = LocalExecutor(max_parallel=8, env=env, limits=limits)  # a restarted daemon
        assert later.submit([subs[1]]) == [Accepted(handles["b"])]  # adopted, on its GPU 1
        assert later.seats is not None and later.seats.jobs == [0, 1]
    finally:
        for name, handle in handles.items():
            (tmp_path / "jobs" / name / "stop").touch()
            pid = int(handle.split(":")[1])
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                os.kill(pid, signal.SIGTERM)


def test_a_manifest_may_not_ask_for_more_gpus_than_the_machine_hands_out(tmp_path: Path) -> None:
    data = {"roots": [{"path": "d"}], "executor": {"local": {"gpus": 1, "max_gpus": 2}}}
    with pytest.raises(ConfigError, match="max_gpus = 2 is above gpus = 1"):
        parse_config(data, source=tmp_path / "config.toml")
    shared = LocalExecutorSection(gpus=4, jobs_per_gpu=2, max_gpus=2, inference_gpus=1)
    assert LocalExecutor(max_parallel=16, limits=shared).width() == 8
    assert LocalExecutor(max_parallel=3, limits=shared).width() == 3
    assert LocalExecutor(max_parallel=3).width() == 3
