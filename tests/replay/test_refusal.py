"""A job the local executor cannot start (no such interpreter) fails its batch with the reason,
where the owner reads it, instead of being offered again forever; a job that stands still is
ended and its batch fails saying why, while the other batches go on: no input holds a slot for
ever."""

from __future__ import annotations

import sys
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
    tmp_path: Path, drop_root: Path, staged: Callable[..., Path], registry: Path
) -> None:
    python = tmp_path / "no such" / "python"
    # the registry has the model: intake refuses a batch naming one it does not have
    config = write_config(tmp_path, drop_root, registry,
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


def test_a_job_that_stands_still_is_ended_and_its_batch_fails_saying_why(
    tmp_path: Path, drop_root: Path, staged: Callable[..., Path], registry: Path
) -> None:
    """The jobs' interpreter is a stand-in that blocks for good on the inference shards of one
    folder (as a job blocked on a hung share would), and runs everything else for real. With
    ``stall_minutes`` of 24 s (a real job, importing torch on a loaded machine, may say nothing
    for several seconds) and one slot, that batch's job is ended, tried again, ended again, and
    its batch fails with the launcher's reason; the batch dropped after it still runs. No warm
    starts: a job forked from a launcher started ahead never runs the stand-in's command."""
    python = tmp_path / "python"
    python.write_text(
        "#!/bin/bash\n"
        'if [ "$1 $2" = "-m pipelines.infer" ] && grep -q stuck "$3/spec.json"; then\n'
        "  echo 'reading the images'; exec sleep 600\n"
        "fi\n"
        f'exec {sys.executable} "$@"\n'
    )
    python.chmod(0o755)
    config = write_config(
        tmp_path, drop_root, registry,
        executor={"local": {"max_parallel": 1, "python": str(python), "stall_minutes": 0.4,
                            "warm_starts": 0}},
    )  # fmt: skip
    steps = copy_slowly(staged("stuck", count=2), drop_root / "stuck", 0, 0.01)
    steps += copy_slowly(staged("after", count=2), drop_root / "after", 1.0, 0.01)
    with Replay(config) as replay:
        replay.run(steps, timeout=240)
    store = Store(config.daemon.database)
    try:
        stuck, after = (next(b for b in store.batches() if b.folder == f) for f in ("stuck", "after"))
        (job, *_) = store.jobs([stuck.id])
    finally:
        store.close()
    assert after.state is BatchState.DONE
    said = "ended by watchd: it made no progress (executor.local.stall_minutes)"
    assert stuck.state is BatchState.FAILED and said in stuck.reason
    assert job.attempts == 2 and job.error_kind is ErrorKind.LOST
    status = (drop_root / "stuck" / STATUS_NAME).read_text()
    assert said in status
    log = (Path(stuck.run_dir) / "logs" / f"{job.name}.log").read_text()
    assert log.count("reading the images") == 2 and log.rstrip().endswith(
        f"watchd: {said} for 0.4 minutes: its log and progress unchanged"
    )
