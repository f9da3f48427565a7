"""The daemon killed with SIGKILL in the middle of a run, then restarted: the batch completes
exactly once, jobs that were running are re-adopted rather than run again, and no output is
half-written. The daemon here is a real `watchd run` process."""

from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from test_replay import assert_outputs_complete

from daemon.core.states import BatchState, JobState
from daemon.site.config import Config
from daemon.store import Store

WATCHD = str(Path(sys.executable).parent / "watchd")


def start_daemon(config: Config, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [WATCHD, "run", "--config", str(config.source)], stdout=out, stderr=subprocess.STDOUT
        )


def wait_for(predicate: Callable[[Store], bool], config: Config, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if config.daemon.database.exists():
            store = Store(config.daemon.database)
            try:
                if predicate(store):
                    return
            except sqlite3.OperationalError:
                pass  # the daemon is still creating the schema
            finally:
                store.close()
        time.sleep(0.05)
    raise TimeoutError(f"condition not met within {timeout} s")


def a_job_running(pipeline: str) -> Callable[[Store], bool]:
    return lambda store: any(
        j.state is JobState.RUNNING and j.pipeline.value == pipeline for j in store.jobs()
    )


@pytest.mark.parametrize("kill_during", ["infer", "report"])
def test_a_daemon_killed_mid_run_and_restarted_completes_the_batch_once(
    kill_during: str,
    config_for: Callable[..., Config],
    staged: Callable[..., Path],
    drop_root: Path,
    tmp_path: Path,
) -> None:
    # the report cold: warm, it ends ~0.15 s after its hand-over, often before a tick has seen
    # it running (CI missed it once in 120 s); cold, its imports keep it running ~0.5 s longer
    local = {"max_parallel": 1, "warm_starts": 0 if kill_during == "report" else 1}
    config = config_for(executor={"local": local}, planner={"shard_size": 2})
    log = tmp_path / "daemon.log"
    daemon = start_daemon(config, log)
    try:
        shutil.copytree(staged(count=6), drop_root / "killed ä 'x'")
        wait_for(a_job_running(kill_during), config, timeout=120)
        daemon.send_signal(signal.SIGKILL)
        daemon.wait(timeout=10)
        store = Store(config.daemon.database)
        running = [j for j in store.jobs() if j.state is JobState.RUNNING]
        store.close()
        assert running and all(_alive(j.handle) for j in running), (
            "the job should outlive the daemon"
        )
        daemon = start_daemon(config, log)
        wait_for(lambda s: s.batches()[0].state is BatchState.DONE, config, timeout=180)
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=60)
    store = Store(config.daemon.database)
    (batch,) = store.batches()
    events = store.events(batch.id)
    jobs = store.jobs([batch.id])
    store.close()
    assert [e.to_state for e in events if e.job_id is None].count(BatchState.DONE) == 1
    assert [j.attempts for j in jobs] == [1, 1, 1, 1], "a job ran twice"
    assert all(j.state is JobState.SUCCEEDED for j in jobs)
    assert sum(1 for e in events if e.to_state is JobState.SUBMITTED) == 4
    assert "re-adopting jobs" in log.read_text()
    assert_outputs_complete(batch, images=6)


def _alive(handle: str | None) -> bool:
    if not handle:
        return False
    pid = int(handle.split(":")[1])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
