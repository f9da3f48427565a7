"""The local executor adopts the jobs an earlier daemon started, even one started the instant
before that daemon died (before it could write launch.json): nothing runs twice. Every job has
a time limit and a limit on standing still, kept by its launcher: no input holds a slot for
ever."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from daemon.contract.jobspec import Pipeline, Resources
from daemon.core.manifest import ResourceRequest
from daemon.core.states import Phase
from daemon.executors import Accepted, Refused, Status, Submission
from daemon.executors.local import LAUNCH_FILE, LocalExecutor
from daemon.executors.local_job import STALLED, TIMED_OUT
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
def test_a_log_that_is_not_a_file_of_its_own_refuses_the_job_and_nothing_is_written_through_it(
    tmp_path: Path, kind: str, what: str
) -> None:
    """The job folder is in the spool, which no data owner can write; should a link or a FIFO
    stand as ``log.txt`` all the same, the job is refused with that reason, at once (a FIFO
    would block the daemon in posix_spawn for ever); the file elsewhere is unchanged and no
    process was started."""
    weights = tmp_path / "registry" / "weights.pt"
    weights.parent.mkdir()
    weights.write_bytes(b"model bytes")
    job_dir = tmp_path / "spool" / "runs" / "b000001" / "run" / "jobs" / "b000001-infer-0000"
    job_dir.mkdir(parents=True)
    planted(job_dir, kind, weights)
    executor = LocalExecutor(max_parallel=1, python="/bin/echo")
    sub = Submission(1, job_dir.name, "pipelines.infer", job_dir)
    (answer,) = executor.submit([sub])
    assert answer == Refused(
        f"cannot start b000001-infer-0000: 'log.txt' {what}: remove it, watchd makes it itself"
    )
    assert weights.read_bytes() == b"model bytes"
    assert not (job_dir / LAUNCH_FILE).exists()


def test_a_job_folder_that_is_a_link_refuses_the_job(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    jobs = tmp_path / "spool" / "jobs"
    jobs.mkdir(parents=True)
    (jobs / "job").symlink_to(elsewhere)
    executor = LocalExecutor(max_parallel=1, python="/bin/echo")
    (answer,) = executor.submit([Submission(1, "job", "m", jobs / "job")])
    assert isinstance(answer, Refused)
    assert "Not a directory" in answer.reason  # O_DIRECTORY | O_NOFOLLOW on a link
    assert list(elsewhere.iterdir()) == []


def _until_ended(executor: LocalExecutor, handle: str, seconds: float) -> Status:
    deadline = time.monotonic() + seconds
    while (status := executor.poll([handle])[handle]).phase is Phase.RUNNING:
        assert time.monotonic() < deadline, "the job was not ended"
        time.sleep(0.1)
    return status


def test_a_job_that_stands_still_is_ended_saying_why(tmp_path: Path) -> None:
    """A job blocked for good (a FIFO read, a hung share) writes nothing more to its log: past
    ``stall_minutes`` its launcher ends it, says so as the log's last line, and exits with
    its own status, which the executor turns into the reason."""
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "stuck.py").write_text("import time\nprint('started', flush=True)\n"
                                               "time.sleep(600)\n")  # fmt: skip
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "lib")}
    limits = LocalExecutorSection(stall_minutes=0.05)  # 3 s
    executor = LocalExecutor(max_parallel=1, env=env, limits=limits)
    started = time.monotonic()
    (accepted,) = executor.submit([Submission(1, "job", "stuck", job_dir, env=env)])
    assert isinstance(accepted, Accepted)
    status = _until_ended(executor, accepted.handle, 60)
    assert 3 <= time.monotonic() - started < 30
    assert (status.exit_code, status.reason) == (
        STALLED, "ended by watchd: it made no progress (executor.local.stall_minutes)"
    )
    log = (job_dir / "log.txt").read_text().splitlines()
    assert log[0] == "started"
    assert log[-1] == ("watchd: ended by watchd: it made no progress "
                       "(executor.local.stall_minutes) for 0.05 minutes: its log and progress "
                       "unchanged")  # fmt: skip
    assert not os.path.exists(f"/proc/{accepted.handle.split(':')[1]}")


def test_a_job_that_keeps_writing_its_log_is_not_taken_for_stalled(tmp_path: Path) -> None:
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "busy.py").write_text(
        "import time\nfor i in range(8):\n    print(i, flush=True)\n    time.sleep(1)\n"
    )
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "lib")}
    executor = LocalExecutor(max_parallel=1, env=env,
                             limits=LocalExecutorSection(stall_minutes=0.05))  # fmt: skip
    (accepted,) = executor.submit([Submission(1, "job", "busy", job_dir, env=env)])
    assert isinstance(accepted, Accepted)
    status = _until_ended(executor, accepted.handle, 60)
    assert (status.exit_code, status.reason) == (0, "")


def test_the_launcher_ends_a_job_past_its_time_limit(tmp_path: Path) -> None:
    """The time limit (the manifest's ``[resources] time_minutes``, else the site's, in
    seconds for the launcher), whatever the job writes meanwhile."""
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    chatty = "import time\nwhile True:\n    print('busy', flush=True)\n    time.sleep(0.2)\n"
    started = time.monotonic()
    with open(job_dir / "log.txt", "wb") as log:
        done = subprocess.run(
            [sys.executable, "-m", "daemon.executors.local_job", str(job_dir), "2", "0", "--",
             sys.executable, "-c", chatty],
            stdout=log, stderr=subprocess.STDOUT, timeout=60, check=False,
        )  # fmt: skip
    assert done.returncode == TIMED_OUT and 2 <= time.monotonic() - started < 30
    assert (job_dir / "log.txt").read_text().splitlines()[-1] == (
        "watchd: ended by watchd: it ran past its time limit ([resources] time_minutes): "
        "0.0333333 minutes"
    )


def test_a_manifest_asks_for_a_time_limit_within_the_sites_bound() -> None:
    executor = LocalExecutor(max_parallel=1,
                             limits=LocalExecutorSection(time_minutes=30, max_time_minutes=90))
    assert executor.bounds()["time_minutes"] == 90


def test_a_launch_record_naming_another_process_is_not_adopted(tmp_path: Path) -> None:
    """A ``launch.json`` that names a process which is not this job (which a cancel would then
    signal) is not believed; the job is started."""
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
    assert executor.bounds() == {"time_minutes": 7 * 24 * 60, "gpus": 1, "tasks": 2}
    assert executor.allocation(Pipeline.INFER, ResourceRequest()) == Resources(3, 1, 1)
    assert executor.allocation(Pipeline.TRAIN, ResourceRequest(gpus=4, tasks=8)) == Resources(
        3, 1, 2
    )
    assert executor.allocation(Pipeline.REPORT, ResourceRequest(gpus=1)) == Resources(3, 0, 1)
    assert executor.result_grace() == 0.0
