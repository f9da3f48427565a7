"""A job the local executor cannot start (no such interpreter) fails its batch with the reason,
where the owner reads it, instead of being offered again forever."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from conftest import write_config
from replay import Replay, copy_slowly

from daemon.contract.jobspec import ErrorKind
from daemon.contract.spool import work_dir
from daemon.core.manifest import STATUS_NAME
from daemon.core.states import BatchState, JobState
from daemon.store import Store


def test_a_job_the_local_executor_cannot_start_fails_its_batch_with_the_reason(
    tmp_path: Path, drop_root: Path, staged: Callable[..., Path]
) -> None:
    python = tmp_path / "no such" / "python"
    config = write_config(tmp_path, drop_root, tmp_path / "registry",
                          executor={"local": {"max_parallel": 2, "python": str(python)}})  # fmt: skip
    with Replay(config) as replay:
        replay.run(copy_slowly(staged(count=4), drop_root / "plate", 0, 0.01), timeout=60)
    store = Store(config.daemon.database)
    try:
        (batch,) = store.batches()
        jobs = store.jobs([batch.id])
        moves = [e.to_state.value for e in store.events(batch.id) if e.job_id is None]
    finally:
        store.close()
    assert batch.state is BatchState.FAILED
    said = f"cannot start b000001-infer-0000: [Errno 2] No such file or directory: '{python}'"
    assert batch.reason == f"job b000001-infer-0000 failed: refused by the local executor: {said}"
    (job,) = jobs
    assert (job.state, job.error_kind, job.attempts) == (JobState.FAILED, ErrorKind.INPUT, 0)
    assert moves == ["waiting", "queued", "failed"]  # never RUNNING: nothing ran
    assert said in (drop_root / "plate" / STATUS_NAME).read_text()
    log = work_dir(config.daemon.spool_dir, batch.id, batch.run_dir) / "jobs" / job.name / "log.txt"
    assert log.read_text().endswith(f"watchd: refused by the local executor: {said}\n")
