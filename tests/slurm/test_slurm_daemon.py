"""The real daemon loop sending the real pipelines to the real one-node Slurm cluster."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from conftest import Trained, job_fields
from replay import Replay, copy_slowly
from slurm_scenario import batches_and_jobs, cluster, node_gpus

from daemon.contract.errors import ExecutorUnavailable
from daemon.contract.jobspec import ErrorKind
from daemon.contract.spool import work_dir
from daemon.core.manifest import STATUS_NAME
from daemon.core.records import Batch, IntentAction, Job
from daemon.core.states import BatchState, JobState
from daemon.executors.slurm import SlurmExecutor, job_environment, make_slurm_executor
from daemon.executors.slurm_api import JobRecord, JobRequest, SlurmClient, Versions
from daemon.executors.slurm_cli import CliClient
from daemon.loop.factory import build_service
from daemon.loop.service import Service
from daemon.site.config import Config
from daemon.store import Store

pytestmark = pytest.mark.slurm


def executor_for(config: Config) -> SlurmExecutor:
    return make_slurm_executor(config.executor.slurm, os.environ, threading.Event())


def slurm_ids(jobs: Sequence[Job]) -> list[str]:
    return [str(j.handle).removeprefix("slurm:") for j in jobs]


def starts(job_dir: Path) -> int:
    """How many times the job script started this job (its log says so once per start)."""
    return (job_dir / "log.txt").read_text().count("watchd: Slurm job ")


def some_running(service: Service) -> bool:
    return bool(service.store.jobs(states=[JobState.RUNNING]))


def job_dir(config: Config, batch: Batch, job: Job) -> Path:
    return work_dir(config.daemon.spool_dir, batch.id, batch.run_dir) / "jobs" / job.name


def test_a_training_batch_is_one_job_under_srun_with_the_gpu_its_manifest_asked_for(
    slurm_training: Trained, slurm_env: dict[str, str], slurm_conf: Path
) -> None:
    (record,) = job_fields(slurm_env, slurm_training.handle.removeprefix("slurm:"))
    assert record["JobState"] == "COMPLETED"
    log = (slurm_training.work_dir / "jobs" / "b000001-train" / "log.txt").read_text()
    if node_gpus(slurm_conf):
        assert record["TresPerNode"] == "gres:gpu:1"
        assert "GPUs 0," in log  # Slurm gave the job one of the node's (fake) GPUs
    else:  # scripts/slurm-cluster said so: this machine refused to make the device nodes
        assert "GPUs none," in log
    launches = slurm_training.work_dir / "jobs" / "slurm"
    (tasks,) = [t for t in launches.glob("*.tasks") if t.read_text() == "b000001-train\t1\n"]
    script = tasks.with_suffix(".sh").read_text()
    assert "-m daemon.executors.slurm_job" in script  # the log is opened by the rule first
    assert "srun --kill-on-bad-exit=1" in script


def test_an_inference_batch_goes_out_as_one_throttled_array_and_ends_done(
    config_for: Callable[..., Config],
    staged: Callable[..., Path],
    drop_root: Path,
    slurm_env: dict[str, str],
) -> None:
    config = config_for(slurm={"array_throttle": 2})
    executor = executor_for(config)
    with Replay(config, executor) as replay:
        took = replay.run(
            copy_slowly(staged(count=6), drop_root / "plate 1 ä", 0, 0.01), timeout=180
        )
    ((batch, jobs),) = batches_and_jobs(config)
    assert batch.state is BatchState.DONE, batch.reason
    shards, report = jobs[:-1], jobs[-1]
    array = {i.split("_")[0] for i in slurm_ids(shards)}
    assert len(array) == 1 and sorted(slurm_ids(shards)) == [f"{min(array)}_{t}" for t in range(3)]
    tasks = job_fields(slurm_env, min(array))
    assert {t["ArrayTaskThrottle"] for t in tasks} == {"2"}
    assert "_" not in slurm_ids([report])[0]
    counts = executor.client.counts
    assert counts["submit"] == 2  # the array and the report
    # one status query per poll cycle, whatever the number of jobs
    assert counts["jobs"] <= took / config.executor.slurm.poll_seconds + counts["submit"] + 2
    assert all(starts(job_dir(config, batch, j)) == 1 and j.attempts == 1 for j in jobs)
    masks = sorted((Path(batch.run_dir) / "masks").rglob("*.png"))
    assert len(masks) == 6 and (Path(batch.run_dir) / "report.html").is_file()


def test_only_the_failed_shards_go_out_again_as_a_smaller_array(
    config_for: Callable[..., Config],
    staged: Callable[..., Path],
    drop_root: Path,
    node_python: Callable[..., str],
) -> None:
    crash = {"b000001-infer-0001": "once", "b000001-infer-0003": "once"}
    config = config_for(slurm={"python": node_python(crash)})
    executor = executor_for(config)
    with Replay(config, executor) as replay:
        replay.run(copy_slowly(staged(count=8), drop_root / "plate", 0, 0.01), timeout=180)
    ((batch, jobs),) = batches_and_jobs(config)
    assert batch.state is BatchState.DONE, batch.reason
    shards = {j.name: j for j in jobs if j.name.startswith("b000001-infer")}
    retried = [shards[name] for name in crash]
    assert [j.attempts for j in retried] == [2, 2]
    assert all(j.attempts == 1 for name, j in shards.items() if name not in crash)
    kept = [j for name, j in shards.items() if name not in crash]
    first = {i.split("_")[0] for i in slurm_ids(kept)}
    second = {i.split("_")[0] for i in slurm_ids(retried)}
    assert len(first) == 1 and first.isdisjoint(second)  # no shard that succeeded goes again
    # Failures seen by one status query go out again as one smaller array; a crash that the
    # next query sees (its task started late on a loaded node) goes out by itself.
    assert executor.client.counts["submit"] == 2 + len(second)  # + the first array, the report
    if len(second) == 1:
        assert sorted(slurm_ids(retried)) == [f"{min(second)}_0", f"{min(second)}_1"]
    store = Store(config.daemon.database)
    retries = [e.job_id for e in store.events(batch.id) if e.reason == "retry 2 of 2"]
    store.close()
    assert sorted(retries) == sorted(j.id for j in retried)


def test_a_shard_that_keeps_failing_fails_the_batch_with_slurms_reason_and_its_log_tail(
    config_for: Callable[..., Config],
    staged: Callable[..., Path],
    drop_root: Path,
    node_python: Callable[..., str],
) -> None:
    """The shard crashes at once, each time; its result is waited for a grace period (a share
    may show it late) before the attempt counts as lost."""
    python = node_python({"b000001-infer-0000": "always"})
    config = config_for(slurm={"python": python, "result_grace_seconds": 2.0})
    with Replay(config, executor_for(config)) as replay:
        replay.run(copy_slowly(staged(count=4), drop_root / "plate", 0, 0.01), timeout=180)
    ((batch, jobs),) = batches_and_jobs(config)
    assert batch.state is BatchState.FAILED
    assert jobs[0].attempts == 2 and jobs[0].state is JobState.FAILED
    store = Store(config.daemon.database)
    events = [e for e in store.events(batch.id) if e.job_id == jobs[0].id]
    store.close()
    submitted = next(e.at for e in events if e.to_state is JobState.SUBMITTED)
    failed = next(e.at for e in events if e.to_state is JobState.FAILED)
    assert failed - submitted >= 2.0
    status = (drop_root / "plate" / STATUS_NAME).read_text()
    assert (
        "job b000001-infer-0000 failed after 2 attempt(s): ended without a result (exit code 1)"
        in status
    )
    assert "Slurm: FAILED (NonZeroExitCode)" in status
    assert "log ends: " in status and "simulated node crash" in status


class LostReply:
    """Slurm's controller accepts the first submission, but its answer never arrives (the
    submit times out): the daemon cannot know the jobs exist."""

    def __init__(self, real: SlurmClient) -> None:
        self.real = real
        self.name = real.name
        self.counts = real.counts
        self.lost = 0

    def submit(self, request: JobRequest) -> str:
        job_id = self.real.submit(request)
        if self.lost == 0:
            self.lost += 1
            raise ExecutorUnavailable(f"sbatch timed out after 60 s (it was job {job_id})")
        return job_id

    def jobs(self) -> list[JobRecord]:
        return self.real.jobs()

    def cancel(self, job_ids: Sequence[str]) -> None:
        self.real.cancel(job_ids)

    def versions(self) -> Versions:
        return self.real.versions()

    def partitions(self) -> list[str]:
        return self.real.partitions()


def run_until(service: Service, done: Callable[[], bool], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        service.tick(time.time())
        time.sleep(0.05)


def test_restarts_adopt_the_jobs_slurm_has_and_never_submit_twice(
    config_for: Callable[..., Config],
    staged: Callable[..., Path],
    drop_root: Path,
    node_python: Callable[..., str],
) -> None:
    """1: the first submit is accepted but its answer lost, and the daemon stops before trying
    again; 2: a new daemon finds the array by its comment instead of submitting it, and stops
    while the jobs run; 3: another re-adopts the running jobs and sees the batch through."""
    config = config_for(slurm={"python": node_python(sleep=3)})
    site, env = config.executor.slurm, job_environment(os.environ, config.executor.slurm.slurm_conf)
    cli = CliClient(environment=env, timeout=30)
    lossy = SlurmExecutor(LostReply(cli), site, env, threading.Event())
    steps = copy_slowly(staged(count=6), drop_root / "plate", 0, 0.01)
    with Replay(config, lossy) as replay:
        replay.run(steps, until=lambda _: cli.counts["submit"] == 1, timeout=60)
    ((batch, jobs),) = batches_and_jobs(config)
    assert all(j.state is JobState.PENDING and j.attempts == 0 for j in jobs)

    second = executor_for(config)
    service = build_service(config, second)
    service.start()
    run_until(
        service, lambda: all(j.state is JobState.RUNNING for j in batches_and_jobs(config)[0][1])
    )
    service.shutdown()
    assert second.client.counts["submit"] == 0

    third = executor_for(config)
    with Replay(config, third) as replay:
        replay.run(timeout=120)
    ((batch, jobs),) = batches_and_jobs(config)
    assert batch.state is BatchState.DONE, batch.reason
    assert (
        cli.counts["submit"] + second.client.counts["submit"] + third.client.counts["submit"] == 2
    )
    assert all(j.attempts == 1 and starts(job_dir(config, batch, j)) == 1 for j in jobs)


def test_a_controller_outage_holds_submissions_while_new_batches_are_taken_in(
    config_for: Callable[..., Config],
    staged: Callable[..., Path],
    drop_root: Path,
    node_python: Callable[..., str],
    slurm_conf: Path,
) -> None:
    """slurmctld stops while the first batch's jobs run; a second batch dropped meanwhile is
    taken in and waits; when the controller is back both end done, every job run once."""
    config = config_for(slurm={"python": node_python(sleep=4)})
    executor = executor_for(config)
    first, second = staged("first", count=4), staged("second", count=4)
    with Replay(config, executor) as replay:
        replay.run(copy_slowly(first, drop_root / "first", 0, 0.01),
                   until=some_running, timeout=60)  # fmt: skip
        assert cluster("stop-controller").returncode == 0
        try:
            replay.run(copy_slowly(second, drop_root / "second", 0, 0.01),
                       until=lambda s: bool(s.store.jobs(states=[JobState.PENDING])),
                       timeout=60)  # fmt: skip
            outage_jobs = {b.folder: [j.state for j in js] for b, js in batches_and_jobs(config)}
            outage_states = {b.folder: b.state for b, _ in batches_and_jobs(config)}
            time.sleep(2)
        finally:
            assert cluster("start-controller").returncode == 0
        replay.run(timeout=180)
    assert set(outage_jobs["second"]) == {JobState.PENDING}  # taken in, not submitted
    assert outage_states["second"] is BatchState.QUEUED  # RUNNING only once Slurm took a job
    done = batches_and_jobs(config)
    assert [b.state for b, _ in done] == [BatchState.DONE, BatchState.DONE]
    for batch, jobs in done:
        assert all(j.attempts == 1 and starts(job_dir(config, batch, j)) == 1 for j in jobs)


def test_watchctl_cancel_cancels_the_slurm_jobs(
    config_for: Callable[..., Config],
    staged: Callable[..., Path],
    drop_root: Path,
    node_python: Callable[..., str],
    slurm_env: dict[str, str],
) -> None:
    config = config_for(slurm={"python": node_python(sleep=60), "array_throttle": 1})
    with Replay(config, executor_for(config)) as replay:
        replay.run(copy_slowly(staged(count=6), drop_root / "plate", 0, 0.01),
                   until=some_running, timeout=60)  # fmt: skip
        replay.service.store.add_intent(IntentAction.CANCEL, 1, time.time(), "tester")
        replay.run(timeout=30)
    ((batch, jobs),) = batches_and_jobs(config)
    assert batch.state is BatchState.CANCELLED
    array = slurm_ids(jobs)[0].split("_")[0]
    assert slurm_states_settle(slurm_env, array) == {"CANCELLED"}


def slurm_states_settle(slurm_env: dict[str, str], array: str, seconds: float = 20) -> set[str]:
    """The states Slurm gives the array's tasks, once all are CANCELLED or ``seconds`` passed."""
    deadline = time.monotonic() + seconds
    while True:
        states = {r["JobState"] for r in job_fields(slurm_env, array)}
        if states == {"CANCELLED"} or time.monotonic() > deadline:
            return states
        time.sleep(0.5)


def test_a_cancel_made_while_the_controller_is_down_is_delivered_by_the_next_daemon(
    config_for: Callable[..., Config],
    staged: Callable[..., Path],
    drop_root: Path,
    node_python: Callable[..., str],
    slurm_env: dict[str, str],
) -> None:
    """The operator cancels while slurmctld is down and the daemon stops before it is back:
    the batch is cancelled in the store at once, and the next daemon, with no job live, still
    delivers the cancel to Slurm."""
    config = config_for(slurm={"python": node_python(sleep=60), "array_throttle": 1})
    with Replay(config, executor_for(config)) as replay:
        replay.run(copy_slowly(staged(count=4), drop_root / "plate", 0, 0.01),
                   until=some_running, timeout=60)  # fmt: skip
        assert cluster("stop-controller").returncode == 0
        try:
            replay.service.store.add_intent(IntentAction.CANCEL, 1, time.time(), "tester")
            replay.run(until=lambda s: bool(s.store.batches([BatchState.CANCELLED])), timeout=60)
            kept = replay.service.store.kept_cancels()
        finally:
            assert cluster("start-controller").returncode == 0
    ((_, jobs),) = batches_and_jobs(config)
    assert sorted(kept) == sorted(str(j.handle) for j in jobs)
    array = slurm_ids(jobs)[0].split("_")[0]
    assert {r["JobState"] for r in job_fields(slurm_env, array)} & {"RUNNING", "PENDING"}
    with Replay(config, executor_for(config)) as replay:
        replay.run(until=lambda s: not s.store.kept_cancels(), timeout=60)
    assert slurm_states_settle(slurm_env, array) == {"CANCELLED"}


def test_a_batch_slurm_refuses_fails_with_slurms_message_and_holds_no_other_back(
    config_for: Callable[..., Config], staged: Callable[..., Path], drop_root: Path
) -> None:
    """The first batch asks for more GPUs than any node has (within watchd's bound): Slurm
    refuses its array each time. The second batch goes out and ends done meanwhile; the first
    fails after ``max_refusals`` refusals, never RUNNING, with Slurm's message for its owner."""
    config = config_for(slurm={"max_gpus": 8, "max_refusals": 2, "max_backoff_seconds": 1.0})
    greedy = staged("greedy", count=2, extra="\n[resources]\ngpus = 3\n")
    executor = executor_for(config)
    with Replay(config, executor) as replay:
        replay.run(copy_slowly(greedy, drop_root / "greedy", 0, 0.01),
                   until=lambda s: executor.client.counts["submit"] == 1, timeout=60)  # fmt: skip
        replay.run(copy_slowly(staged("plain", count=2), drop_root / "plain", 0, 0.01),
                   timeout=180)  # fmt: skip
    (refused, refused_jobs), (plain, _) = batches_and_jobs(config)
    assert plain.state is BatchState.DONE, plain.reason
    assert refused.state is BatchState.FAILED
    # Slurm's own words, as either client passes them on (sbatch's stderr, or pyslurm's error)
    message = "Requested node configuration is not available"
    assert "refused by the slurm executor: Slurm refused it 2 time(s): " in refused.reason
    assert refused.reason.endswith(message)
    assert {(j.state, j.error_kind) for j in refused_jobs} == {(JobState.FAILED, ErrorKind.INPUT)}
    store = Store(config.daemon.database)
    moves = [e.to_state.value for e in store.events(refused.id) if e.job_id is None]
    store.close()
    assert BatchState.RUNNING.value not in moves
    assert message in (drop_root / "greedy" / STATUS_NAME).read_text()


def test_resources_above_the_sites_bounds_are_refused_in_the_status_file(
    config_for: Callable[..., Config], staged: Callable[..., Path], drop_root: Path
) -> None:
    config = config_for()
    extra = "\n[resources]\ngpus = 3\ntime_minutes = 100000\n"
    with Replay(config, executor_for(config)) as replay:
        replay.run(copy_slowly(staged(count=2, extra=extra), drop_root / "plate", 0, 0.01))
    ((batch, jobs),) = batches_and_jobs(config)
    assert batch.state is BatchState.FAILED and jobs == []
    status = (drop_root / "plate" / STATUS_NAME).read_text()
    assert "manifest.toml, resources.gpus: asks for 3, more than this site allows (2)" in status
    assert "resources.time_minutes: asks for 100000, more than this site allows (1440)" in status
