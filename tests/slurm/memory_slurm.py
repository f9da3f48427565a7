"""Slurm as a dictionary, behind the SlurmClient Protocol: for the executor's own rules (how
often it asks, what it does when Slurm refuses or is away) without the real cluster."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

from daemon.contract.errors import ExecutorUnavailable, SubmissionError
from daemon.executors.slurm_api import JobRecord, JobRequest, Versions


class MemorySlurm:
    """``down`` makes every call fail as an absent controller does; ``refuse`` maps a job
    name's prefix to the message with which Slurm refuses such submissions ("" refuses all)."""

    name = "memory"

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.records: dict[str, JobRecord] = {}
        self.cancelled: list[str] = []
        self.submitted: list[str] = []  # the names of the requests taken, in order
        self.down = False
        self.refuse: dict[str, str] = {}
        self.next_id = 100

    def _call(self, kind: str) -> None:
        self.counts[kind] += 1
        if self.down:
            raise ExecutorUnavailable("Unable to contact slurm controller (connect failure)")

    def submit(self, request: JobRequest) -> str:
        self._call("submit")
        for prefix, message in self.refuse.items():
            if request.name.startswith(prefix):
                raise SubmissionError(message)
        self.next_id += 1
        job_id = str(self.next_id)
        tasks = int(request.array.split("-")[1].split("%")[0]) + 1 if request.array else 0
        ids = [f"{job_id}_{t}" for t in range(tasks)] or [job_id]
        for i in ids:
            self.records[i] = JobRecord(i, "PENDING", "None", 0, request.comment)
        self.submitted.append(request.name)
        return job_id

    def jobs(self) -> list[JobRecord]:
        self._call("jobs")
        return list(self.records.values())

    def cancel(self, job_ids: Sequence[str]) -> None:
        self._call("cancel")
        self.cancelled += job_ids
        for job_id in job_ids:
            if job_id in self.records:
                self.records[job_id] = replace(self.records[job_id], state="CANCELLED")

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
