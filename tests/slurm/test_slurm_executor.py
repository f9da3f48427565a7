"""The Slurm executor's own rules, against an in-memory Slurm behind the client Protocol (the
real cluster is in test_slurm_daemon.py): how often it asks, what it does when Slurm refuses
or is away, and what a forgotten job looks like."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import pytest

from daemon.config import SlurmExecutorSection
from daemon.errors import ExecutorUnavailable, SubmissionError
from daemon.executors import Phase, Submission
from daemon.executors.slurm import SlurmExecutor, job_environment
from daemon.executors.slurm_api import JobRecord, JobRequest, Versions


class MemorySlurm:
    """Slurm as a dictionary: ``down`` makes every call fail as an absent controller does,
    ``refuse`` makes submissions fail as a refused one does."""

    name = "memory"

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.records: dict[str, JobRecord] = {}
        self.cancelled: list[str] = []
        self.down = False
        self.refuse = ""
        self.next_id = 100

    def _call(self, kind: str) -> None:
        self.counts[kind] += 1
        if self.down:
            raise ExecutorUnavailable("Unable to contact slurm controller (connect failure)")

    def submit(self, request: JobRequest) -> str:
        self._call("submit")
        if self.refuse:
            raise SubmissionError(self.refuse)
        self.next_id += 1
        job_id = str(self.next_id)
        tasks = int(request.array.split("-")[1].split("%")[0]) + 1 if request.array else 0
        ids = [f"{job_id}_{t}" for t in range(tasks)] or [job_id]
        for i in ids:
            self.records[i] = JobRecord(i, "PENDING", "None", 0, request.comment)
        return job_id

    def jobs(self) -> list[JobRecord]:
        self._call("jobs")
        return list(self.records.values())

    def cancel(self, job_ids: Sequence[str]) -> None:
        self._call("cancel")
        self.cancelled += job_ids

    def versions(self) -> Versions:
        self._call("versions")
        return Versions("memory 22.05", "22.05.8")

    def partitions(self) -> list[str]:
        self._call("partitions")
        return ["debug"]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


SITE = SlurmExecutorSection(poll_seconds=10, retry_attempts=1, max_backoff_seconds=60)


def executor(slurm: MemorySlurm, clock: Clock) -> SlurmExecutor:
    return SlurmExecutor(slurm, SITE, job_environment({}, None), threading.Event(), clock)


def shards(tmp_path: Path, count: int) -> list[Submission]:
    jobs = tmp_path / "results" / "r" / "jobs"
    names = [f"b000001-infer-{i:04d}" for i in range(count)]
    return [
        Submission(i, name, "pipelines.infer", jobs / name, group="b000001-infer", attempt=1)
        for i, name in enumerate(names)
    ]


def test_polls_within_the_interval_answer_from_the_last_query_and_a_submission_asks_afresh(
    tmp_path: Path,
) -> None:
    slurm, clock = MemorySlurm(), Clock()
    ex = executor(slurm, clock)
    handles = ex.submit(shards(tmp_path, 3))
    assert handles == ["slurm:101_0", "slurm:101_1", "slurm:101_2"]
    for _ in range(5):
        assert {s.phase for s in ex.poll(handles).values()} == {Phase.QUEUED}
        clock.now += 1
    assert slurm.counts["jobs"] == 2  # the look before the first submission, then one poll
    clock.now += 10
    slurm.records["101_1"] = JobRecord("101_1", "FAILED", "NonZeroExitCode", 1, "")
    status = ex.poll(handles)["slurm:101_1"]
    assert (status.phase, status.exit_code, status.reason) == (
        Phase.ENDED, 1, "Slurm: FAILED (NonZeroExitCode)"
    )  # fmt: skip
    assert slurm.counts["jobs"] == 3


def test_a_job_slurm_no_longer_knows_is_unknown_for_the_result_file_to_decide(
    tmp_path: Path,
) -> None:
    slurm, clock = MemorySlurm(), Clock()
    ex = executor(slurm, clock)
    (handle,) = ex.submit(shards(tmp_path, 1))
    slurm.records.clear()  # purged after MinJobAge
    clock.now += 60
    status = ex.poll([handle])[handle]
    assert (status.phase, status.reason) == (Phase.UNKNOWN, "no longer known to Slurm")


def test_a_refused_submission_is_not_tried_again_before_the_pause_is_over(tmp_path: Path) -> None:
    slurm, clock = MemorySlurm(), Clock()
    ex = executor(slurm, clock)
    slurm.refuse = "sbatch exited with 1: Invalid partition name specified"
    with pytest.raises(SubmissionError, match="Invalid partition"):
        ex.submit(shards(tmp_path, 2))
    with pytest.raises(SubmissionError, match="trying again later"):
        ex.submit(shards(tmp_path, 2))
    assert slurm.counts["submit"] == 1
    slurm.refuse = ""
    clock.now += 61
    assert ex.submit(shards(tmp_path, 2)) == ["slurm:101_0", "slurm:101_1"]


def test_a_cancel_slurm_could_not_take_is_delivered_when_it_answers_again(tmp_path: Path) -> None:
    slurm, clock = MemorySlurm(), Clock()
    ex = executor(slurm, clock)
    handles = ex.submit(shards(tmp_path, 2))
    slurm.down = True
    with pytest.raises(ExecutorUnavailable):
        ex.cancel(handles)
    assert slurm.cancelled == []
    slurm.down = False
    clock.now += 61  # past the gate's pause
    ex.poll(handles)
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
