"""The daemon with the Slurm executor in front of an in-memory Slurm (behind the client
Protocol; the executor's clock is the test's): what a refused submission, an outage and an
undelivered cancel do to batches, jobs, job folders and the store. No cluster needed."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from conftest import write_config
from memory_slurm import Clock, MemorySlurm
from replay import Replay, copy_slowly
from slurm_scenario import MODEL, batches_and_jobs

from daemon.contract.jobspec import SPEC_FILE, ErrorKind
from daemon.contract.spool import work_dir
from daemon.core.manifest import STATUS_NAME
from daemon.core.records import IntentAction, Job
from daemon.core.states import BatchState, JobState
from daemon.executors.slurm import SlurmExecutor
from daemon.loop.factory import build_service
from daemon.loop.service import Service
from daemon.site.config import Config
from daemon.store import Store

REFUSAL = "sbatch exited with 1: sbatch: error: Batch job submission failed: Requested node configuration is not available"


def memory_config(tmp_path: Path, drop_root: Path, **slurm: object) -> Config:
    """A Slurm config whose slurm.conf is never read: the executor is given MemorySlurm. Its
    registry lists the staged batches' model (a version folder: intake refuses a model the
    registry does not list), whose weights no job loads: MemorySlurm runs nothing."""
    fake_conf = tmp_path / "unused-slurm.conf"
    registry = tmp_path / "registry"
    (registry / MODEL / "v0001").mkdir(parents=True)
    return write_config(tmp_path, drop_root, registry, fake_conf, slurm=slurm)


def memory_executor(config: Config, slurm: MemorySlurm, clock: Clock) -> SlurmExecutor:
    return SlurmExecutor(slurm, config.executor.slurm, {}, threading.Event(), clock)


def jobs_of(service: Service, folder: str) -> list[Job]:
    (batch,) = [b for b in service.store.batches() if b.folder == folder]
    return service.store.jobs([batch.id])


def spec_files(service: Service) -> dict[str, tuple[int, int]]:
    """Each job's spec.json as (inode, mtime): a rewrite (temp file + rename) changes both."""
    found = {}
    for batch in service.store.batches():
        work = work_dir(service.config.daemon.spool_dir, batch.id, batch.run_dir)
        for spec in (work / "jobs").glob(f"*/{SPEC_FILE}"):
            found[spec.parent.name] = (spec.stat().st_ino, spec.stat().st_mtime_ns)
    return found


def test_a_batch_slurm_refuses_fails_with_slurms_word_while_another_goes_out(
    tmp_path: Path, drop_root: Path, staged: Callable[..., Path]
) -> None:
    """Slurm refuses batch 1's array every time; batch 2, dropped after it, goes out at once.
    Batch 1 is offered again after the pause, and its second refusal fails its jobs (input
    error) and the batch, whose status file gives Slurm's message. It was never RUNNING."""
    config = memory_config(tmp_path, drop_root, max_refusals=2, max_backoff_seconds=60)
    slurm, clock = MemorySlurm(), Clock()
    slurm.refuse = {"b000001": REFUSAL}
    with Replay(config, memory_executor(config, slurm, clock)) as replay:
        replay.run(copy_slowly(staged("refused"), drop_root / "refused", 0, 0.01),
                   until=lambda s: slurm.counts["submit"] == 1, timeout=60)  # fmt: skip
        replay.run(copy_slowly(staged("fine"), drop_root / "fine", 0, 0.01),
                   until=lambda s: bool(s.store.batches([BatchState.RUNNING])), timeout=60)  # fmt: skip
        assert {j.state for j in jobs_of(replay.service, "refused")} == {JobState.PENDING}
        assert slurm.counts["submit"] == 2  # the refused array is not asked again yet
        clock.now += 61
        replay.run(until=lambda s: bool(s.store.batches([BatchState.FAILED])), timeout=30)
    (refused, refused_jobs), (fine, fine_jobs) = batches_and_jobs(config)
    assert slurm.submitted == ["b000002-infer"] and slurm.counts["submit"] == 3
    assert fine.state is BatchState.RUNNING
    assert {j.state for j in fine_jobs} == {JobState.SUBMITTED}
    assert refused.state is BatchState.FAILED
    assert refused.reason.endswith(
        f"failed: refused by the slurm executor: Slurm refused it 2 time(s): {REFUSAL}"
    )
    assert {(j.state, j.error_kind, j.attempts) for j in refused_jobs} == {
        (JobState.FAILED, ErrorKind.INPUT, 0)
    }
    store = Store(config.daemon.database)
    moves = [e.to_state.value for e in store.events(refused.id) if e.job_id is None]
    store.close()
    assert moves == ["waiting", "queued", "failed"]
    status = (drop_root / "refused" / STATUS_NAME).read_text()
    assert "Batch job submission failed: Requested node configuration is not available" in status


def test_while_slurm_is_away_specs_are_not_rewritten_and_slurm_is_not_asked_each_tick(
    tmp_path: Path, drop_root: Path, staged: Callable[..., Path]
) -> None:
    config = memory_config(tmp_path, drop_root)
    slurm, clock = MemorySlurm(), Clock()
    slurm.down = True
    executor = memory_executor(config, slurm, clock)
    with Replay(config, executor) as replay:
        replay.run(copy_slowly(staged(count=4), drop_root / "plate", 0, 0.01),
                   until=lambda s: slurm.counts["jobs"] == 1, timeout=60)  # fmt: skip
        written = spec_files(replay.service)
        assert len(written) == 2  # prepared once, for the try that found Slurm away
        asked = sum(slurm.counts.values())
        ticks = 0

        def twenty_ticks(_: Service) -> bool:
            nonlocal ticks
            ticks += 1
            return ticks >= 20

        replay.run(until=twenty_ticks)
        assert sum(slurm.counts.values()) == asked  # the gate is shut: no submission tried
        assert spec_files(replay.service) == written
        clock.now = executor.gate.shut_until  # the pause is over: one more try
        ticks = 0
        replay.run(until=twenty_ticks)
        assert sum(slurm.counts.values()) == asked + 1
        assert spec_files(replay.service) == written  # offered again, not rewritten
    ((batch, jobs),) = batches_and_jobs(config)
    assert batch.state is BatchState.QUEUED
    assert {j.state for j in jobs} == {JobState.PENDING}


def test_an_undelivered_cancel_is_kept_across_a_restart_and_no_retry_runs_beside_it(
    tmp_path: Path, drop_root: Path, staged: Callable[..., Path]
) -> None:
    """Slurm is away when the operator cancels a running batch, then asks for a retry; the
    daemon stops. The next daemon sends the cancel first (no job of it is live any more), and
    only then hands the retried jobs to Slurm again."""
    config = memory_config(tmp_path, drop_root)
    slurm = MemorySlurm()
    clock = Clock()
    with Replay(config, memory_executor(config, slurm, clock)) as replay:
        store = replay.service.store
        replay.run(copy_slowly(staged(count=4), drop_root / "plate", 0, 0.01),
                   until=lambda s: bool(s.store.batches([BatchState.RUNNING])), timeout=60)  # fmt: skip
        handles = sorted(str(j.handle) for j in jobs_of(replay.service, "plate"))
        slurm.down = True
        store.add_intent(IntentAction.CANCEL, 1, time.time(), "tester")
        replay.run(until=lambda s: bool(s.store.batches([BatchState.CANCELLED])), timeout=30)
        assert sorted(store.kept_cancels()) == handles and slurm.cancelled == []
        store.add_intent(IntentAction.RETRY, 1, time.time(), "tester")
        replay.run(until=lambda s: bool(s.store.batches([BatchState.QUEUED])), timeout=30)
        assert {j.state for j in jobs_of(replay.service, "plate")} == {JobState.PENDING}
    assert slurm.counts["submit"] == 1 and slurm.cancelled == []

    slurm.down = False
    service = build_service(config, memory_executor(config, slurm, Clock()))
    service.start()
    try:
        (batch,) = service.store.batches()
        manifest = service.waitroom.manifest(batch)
        assert manifest is not None
        work = [(j, batch, manifest) for j in service.store.jobs([batch.id])]
        outcome = service.dispatch.submit(work, time.time())
        assert outcome.taken == () and slurm.counts["submit"] == 1  # the cancel comes first
        service.tick(time.time())
        assert sorted(slurm.cancelled) == [h.removeprefix("slurm:") for h in handles]
        assert service.store.kept_cancels() == {}
        service.tick(time.time())
        assert slurm.counts["submit"] == 2
        assert {j.state for j in service.store.jobs([batch.id])} == {JobState.SUBMITTED}
    finally:
        service.shutdown()
