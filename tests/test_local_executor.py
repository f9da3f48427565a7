"""The local executor adopts the jobs an earlier daemon started, even one started the instant
before that daemon died (before it could write launch.json): nothing runs twice."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from daemon.contract.jobspec import Pipeline, Resources
from daemon.core.manifest import ResourceRequest
from daemon.core.states import Phase
from daemon.executors import Accepted, Refused, Submission
from daemon.executors.local import LAUNCH_FILE, LocalExecutor
from daemon.site.config import LocalExecutorSection


def test_a_job_started_just_before_a_crash_is_adopted_not_started_again(tmp_path: Path) -> None:
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "sleeper.py").write_text("import time\ntime.sleep(60)\n")
    job_dir = tmp_path / "jobs" / "b000001-infer-0000"
    job_dir.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "lib")}
    sub = Submission(1, job_dir.name, "sleeper", job_dir, env=env)
    first = LocalExecutor(max_parallel=2, env=env)
    (accepted,) = first.submit([sub])
    assert isinstance(accepted, Accepted)
    handle = accepted.handle
    (job_dir / LAUNCH_FILE).unlink()  # the daemon died before writing it down
    first.close()
    second = LocalExecutor(max_parallel=2, env=env)
    try:
        assert second.submit([sub]) == [Accepted(handle)]
        assert second.poll([handle])[handle].phase is Phase.RUNNING
    finally:
        pid = int(handle.split(":")[1])
        os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while second.poll([handle])[handle].phase is Phase.RUNNING and time.monotonic() < deadline:
            time.sleep(0.05)
        os.waitpid(pid, 0)  # it is this test's child: reap it


def test_a_first_submission_starts_the_job(tmp_path: Path) -> None:
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "quick.py").write_text("print('ran')\n")
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "lib")}
    executor = LocalExecutor(max_parallel=1, env=env)
    (accepted,) = executor.submit([Submission(1, "job", "quick", job_dir, env=env)])
    assert isinstance(accepted, Accepted)
    handle = accepted.handle
    deadline = time.monotonic() + 30
    while (
        status := executor.poll([handle])[handle]
    ).phase is Phase.RUNNING and time.monotonic() < deadline:
        time.sleep(0.05)
    assert status.phase is Phase.ENDED and status.exit_code == 0
    assert (job_dir / "log.txt").read_text().strip() == "ran"


def test_a_jobs_end_wakes_the_loop_at_once_and_is_then_polled(tmp_path: Path) -> None:
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "nap.py").write_text("import time; time.sleep(0.5)\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "lib")}
    executor = LocalExecutor(max_parallel=2, env=env)
    woken = threading.Event()
    executor.wake_on_end(woken.set)
    handles = []
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
        (accepted,) = executor.submit([Submission(1, name, "nap", tmp_path / name, env=env)])
        assert isinstance(accepted, Accepted)
        handles.append(accepted.handle)
    try:
        assert not woken.is_set()
        assert woken.wait(30), "no wake when the jobs ended"
        deadline = time.monotonic() + 30
        while any(s.phase is Phase.RUNNING for s in executor.poll(handles).values()):
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        executor.close()


def planted(job_dir: Path, kind: str, target: Path) -> None:
    log = job_dir / "log.txt"
    if kind == "link":
        log.symlink_to(target)
    elif kind == "hard link":
        os.link(target, log)
    else:
        os.mkfifo(log)


@pytest.mark.parametrize(
    ("kind", "what"),
    [
        ("link", "is a symbolic link, not a regular file"),
        ("hard link", "has other hard links: it may be a file outside the folder"),
        ("fifo", "is a FIFO, not a regular file"),
    ],
)
def test_a_log_planted_in_the_job_folder_refuses_the_job_and_nothing_is_written_through_it(
    tmp_path: Path, kind: str, what: str
) -> None:
    """The batch folder's owner plants ``log.txt`` before the job starts: pointing at a file
    the daemon's user may write (the registry's weights), or a FIFO that would block the
    daemon in posix_spawn for ever. The job is refused with that reason, at once; the file
    elsewhere is unchanged and no process was started."""
    weights = tmp_path / "registry" / "weights.pt"
    weights.parent.mkdir()
    weights.write_bytes(b"model bytes")
    batch = tmp_path / "batch"
    job_dir = batch / "results" / "run" / "jobs" / "b000001-infer-0000"
    job_dir.mkdir(parents=True)
    planted(job_dir, kind, weights)
    executor = LocalExecutor(max_parallel=1, python="/bin/echo")
    sub = Submission(1, job_dir.name, "pipelines.infer", job_dir, batch_dir=batch)
    (answer,) = executor.submit([sub])
    assert answer == Refused(
        f"cannot start b000001-infer-0000: 'log.txt' {what}: remove it, watchd makes it itself"
    )
    assert weights.read_bytes() == b"model bytes"
    assert not (job_dir / LAUNCH_FILE).exists()


def test_a_job_folder_planted_as_a_link_out_of_the_batch_refuses_the_job(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    batch = tmp_path / "batch"
    jobs = batch / "results" / "run" / "jobs"
    jobs.mkdir(parents=True)
    (jobs / "job").symlink_to(elsewhere)
    executor = LocalExecutor(max_parallel=1, python="/bin/echo")
    (answer,) = executor.submit([Submission(1, "job", "m", jobs / "job", batch_dir=batch)])
    assert isinstance(answer, Refused)
    assert "'results/run/jobs/job' is a symbolic link, not a folder" in answer.reason
    assert list(elsewhere.iterdir()) == []


def test_a_launch_record_naming_another_process_is_not_adopted(tmp_path: Path) -> None:
    """``launch.json`` lies in the batch's owner's folder: one planted to name a process that
    is not this job (which a cancel would then signal) is not believed; the job is started."""
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "quick.py").write_text("print('ran')\n")
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    me = os.getpid()
    with open(f"/proc/{me}/stat") as stat_file:
        ticks = stat_file.read().rsplit(")", 1)[1].split()[19]
    (job_dir / LAUNCH_FILE).write_text(f'{{"handle": "local:{me}:{ticks}"}}')
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "lib")}
    executor = LocalExecutor(max_parallel=1, env=env)
    (accepted,) = executor.submit([Submission(1, "job", "quick", job_dir, env=env)])
    assert isinstance(accepted, Accepted) and accepted.handle != f"local:{me}:{ticks}"
    pid = int(accepted.handle.split(":")[1])
    os.waitpid(pid, 0)


def test_the_executor_shapes_each_job_from_its_section_within_its_bounds() -> None:
    """What the rest of the daemon asks of an executor instead of reading its section: the
    bounds checked at intake and what one job gets (shaped once, capped at the bounds)."""
    limits = LocalExecutorSection(cpus_per_job=3, max_gpus=1, inference_gpus=1, max_tasks=2)
    executor = LocalExecutor(max_parallel=1, limits=limits)
    assert executor.bounds() == {"gpus": 1, "tasks": 2}
    assert executor.allocation(Pipeline.INFER, ResourceRequest()) == Resources(3, 1, 1)
    assert executor.allocation(Pipeline.TRAIN, ResourceRequest(gpus=4, tasks=8)) == Resources(
        3, 1, 2
    )
    assert executor.allocation(Pipeline.REPORT, ResourceRequest(gpus=1)) == Resources(3, 0, 1)
    assert executor.result_grace() == 0.0
