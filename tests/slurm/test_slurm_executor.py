"""The Slurm executor's own rules, against an in-memory Slurm behind the client Protocol (the
real cluster is in test_slurm_daemon.py): how often it asks, what it does when Slurm refuses
or is away, and what a forgotten job looks like."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
from memory_slurm import Clock, MemorySlurm

from daemon.contract.errors import ExecutorUnavailable
from daemon.core.states import Phase
from daemon.executors import Accepted, Deferred, Handover, Refused, Submission
from daemon.executors.slurm import SlurmExecutor, job_environment
from daemon.executors.slurm_api import JobRecord
from daemon.site.config import SlurmExecutorSection

SITE = SlurmExecutorSection(
    poll_seconds=10, retry_attempts=1, retry_wait_seconds=1, max_backoff_seconds=60
)
REFUSAL = "sbatch exited with 1: sbatch: error: Batch job submission failed: Invalid partition name specified"


def executor(slurm: MemorySlurm, clock: Clock) -> SlurmExecutor:
    return SlurmExecutor(slurm, SITE, job_environment({}, None), threading.Event(), clock)


def shards(tmp_path: Path, count: int, batch: int = 1) -> list[Submission]:
    """Shards of a batch (the launch files are written beside their job folders, in a spool)."""
    jobs = tmp_path / "spool" / "runs" / f"b{batch:06d}" / "r" / "jobs"
    names = [f"b{batch:06d}-infer-{i:04d}" for i in range(count)]
    return [
        Submission(
            batch * 100 + i,
            name,
            "pipelines.infer",
            jobs / name,
            group=f"b{batch:06d}-infer",
            attempt=1,
        )
        for i, name in enumerate(names)
    ]


def handles(answers: Sequence[Handover]) -> list[str]:
    assert all(isinstance(a, Accepted) for a in answers), answers
    return [a.handle for a in answers if isinstance(a, Accepted)]


def test_polls_within_the_interval_answer_from_the_last_query_and_a_submission_asks_afresh(
    tmp_path: Path,
) -> None:
    slurm, clock = MemorySlurm(), Clock()
    ex = executor(slurm, clock)
    taken = handles(ex.submit(shards(tmp_path, 3)))
    assert taken == ["slurm:101_0", "slurm:101_1", "slurm:101_2"]
    for _ in range(5):
        assert {s.phase for s in ex.poll(taken).values()} == {Phase.QUEUED}
        clock.now += 1
    assert slurm.counts["jobs"] == 2  # the look before the first submission, then one poll
    clock.now += 10
    slurm.records["101_1"] = JobRecord("101_1", "FAILED", "NonZeroExitCode", 1, "")
    status = ex.poll(taken)["slurm:101_1"]
    assert (status.phase, status.exit_code, status.reason) == (
        Phase.ENDED, 1, "Slurm: FAILED (NonZeroExitCode)"
    )  # fmt: skip
    assert slurm.counts["jobs"] == 3


def test_a_job_slurm_no_longer_knows_is_unknown_for_the_result_file_to_decide(
    tmp_path: Path,
) -> None:
    slurm, clock = MemorySlurm(), Clock()
    ex = executor(slurm, clock)
    (handle,) = handles(ex.submit(shards(tmp_path, 1)))
    slurm.records.clear()  # purged after MinJobAge
    clock.now += 60
    status = ex.poll([handle])[handle]
    assert (status.phase, status.reason) == (Phase.UNKNOWN, "no longer known to Slurm")


def test_a_refused_launch_holds_back_only_its_own_jobs_and_gives_them_up_after_max_refusals(
    tmp_path: Path,
) -> None:
    """Batch 1's array is refused (say, its resources fit no node); batch 2's goes out in the
    same call. Batch 1's jobs are not offered to Slurm again before the pause is over, and the
    third refusal is final, with Slurm's own message."""
    slurm, clock = MemorySlurm(), Clock()
    ex = executor(slurm, clock)
    slurm.refuse = {"b000001": REFUSAL}
    first, second = shards(tmp_path, 2, batch=1), shards(tmp_path, 2, batch=2)
    answers = ex.submit(first + second)
    assert answers[:2] == [Deferred(REFUSAL)] * 2
    assert handles(answers[2:]) == ["slurm:101_0", "slurm:101_1"]
    assert slurm.submitted == ["b000002-infer"] and slurm.counts["submit"] == 2
    clock.now += 30
    held = ex.submit(first)
    assert all(isinstance(a, Deferred) and REFUSAL in a.reason for a in held)
    assert slurm.counts["submit"] == 2  # not asked again during the pause
    clock.now += 31
    assert ex.submit(first) == [Deferred(REFUSAL)] * 2
    clock.now += 61
    assert ex.submit(first) == [Refused(f"Slurm refused it 3 time(s): {REFUSAL}")] * 2
    assert slurm.counts["submit"] == 4
    slurm.refuse = {}
    clock.now += 1  # a retry of the batch starts counting again
    assert handles(ex.submit(first)) == ["slurm:102_0", "slurm:102_1"]


def test_after_a_restart_live_jobs_are_adopted_and_ended_ones_submitted_anew(
    tmp_path: Path,
) -> None:
    """A new executor looks before its first submission: an array still queued is adopted; once
    cancelled (an operator's cancel, then a retry that counts attempts anew) it is not."""
    slurm, clock = MemorySlurm(), Clock()
    batch = shards(tmp_path, 2)
    taken = handles(executor(slurm, clock).submit(batch))
    assert handles(executor(slurm, clock).submit(batch)) == taken
    slurm.cancel(["101_0", "101_1"])
    assert handles(executor(slurm, clock).submit(batch)) == ["slurm:102_0", "slurm:102_1"]
    assert slurm.counts["submit"] == 2


def test_a_job_whose_name_cannot_name_a_task_is_refused_alone(tmp_path: Path) -> None:
    slurm, clock = MemorySlurm(), Clock()
    bad = Submission(7, "x", "pipelines.infer", tmp_path / "a b", group="g", attempt=1)
    (refused, *good) = executor(slurm, clock).submit([bad, *shards(tmp_path, 2)])
    assert refused == Refused("job name 'a b' cannot name a Slurm task")
    assert handles(good) == ["slurm:101_0", "slurm:101_1"]


def test_no_slots_while_slurm_is_away_so_the_daemon_prepares_no_submission(
    tmp_path: Path,
) -> None:
    slurm, clock = MemorySlurm(), Clock()
    ex = executor(slurm, clock)
    assert ex.slots() is None
    slurm.down = True
    answers = ex.submit(shards(tmp_path, 2))
    assert all(isinstance(a, Deferred) and "Unable to contact" in a.reason for a in answers)
    assert ex.slots() == 0
    clock.now = ex.gate.shut_until
    assert ex.slots() is None  # the pause is over: the next submission asks Slurm again


def test_a_cancel_slurm_could_not_take_raises_for_the_caller_to_keep_it(tmp_path: Path) -> None:
    slurm, clock = MemorySlurm(), Clock()
    ex = executor(slurm, clock)
    taken = handles(ex.submit(shards(tmp_path, 2)))
    slurm.down = True
    with pytest.raises(ExecutorUnavailable):
        ex.cancel(taken)
    slurm.down = False
    clock.now += 61  # past the gate's pause
    ex.poll(taken)
    assert slurm.cancelled == []  # the executor keeps nothing: the dispatcher sends it again
    ex.cancel([*taken, "finished"])
    assert slurm.cancelled == ["101_0", "101_1"]


def test_jobs_get_the_daemons_environment_without_slurms_option_variables() -> None:
    environ = {"PATH": "/bin", "SBATCH_PARTITION": "x", "SLURM_JOB_ID": "9", "SLURM_CONF": "/a"}
    assert job_environment(environ, None) == {"PATH": "/bin", "SLURM_CONF": "/a"}
    assert job_environment(environ, Path("/b/slurm.conf"))["SLURM_CONF"] == "/b/slurm.conf"


def test_the_self_test_names_the_client_the_controllers_release_and_the_partition(
    tmp_path: Path,
) -> None:
    slurm, clock = MemorySlurm(), Clock()
    checks = executor(slurm, clock).self_test()
    assert [(c.name, c.ok) for c in checks] == [
        ("slurm client", True), ("slurm controller", True), ("slurm partitions", True)
    ]  # fmt: skip
    slurm.down = True
    down = executor(slurm, clock).self_test()
    assert down[-1].name == "slurm controller" and not down[-1].ok
    assert "Unable to contact slurm controller" in down[-1].detail
