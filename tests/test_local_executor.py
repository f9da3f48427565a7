"""The local executor adopts the jobs an earlier daemon started, even one started the instant
before that daemon died (before it could write launch.json): nothing runs twice."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from daemon.executors import Accepted, Phase, Submission
from daemon.executors.local import LAUNCH_FILE, LocalExecutor


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
