"""Prometheus metrics: recorded by the loop, served read-only over HTTP when enabled.

The loop is the only writer: it sets the gauges at each heartbeat and counts endings, failures
and scans as it meets them. A thread of prometheus_client's HTTP server only reads them at each
scrape; it never touches the database. prometheus_client (the reference client, pure Python,
no dependencies) does the text format, histograms and content negotiation, which are easy to
get subtly wrong by hand.

Counters start from zero at each start of the daemon, as Prometheus expects of a process
(``rate()`` and ``increase()`` handle the reset).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from wsgiref.simple_server import WSGIServer

import prometheus_client
import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from daemon.contract.jobspec import ErrorKind
from daemon.contract.usage import JobUsage
from daemon.core.records import Job
from daemon.core.states import BatchState, JobState
from daemon.site.config import MetricsSection

log = structlog.get_logger("watchd.metrics")

ACTIVE_STATES = (BatchState.WAITING, BatchState.QUEUED, BatchState.RUNNING)
JOB_BUCKETS = (10, 30, 60, 300, 900, 1800, 3600, 4 * 3600, 12 * 3600, 24 * 3600, 72 * 3600)
SCAN_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class Metrics:
    """The daemon's metrics, in a registry of their own (never the library's global one)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.batches = Gauge("watchd_batches", "Batches by state.", ["state"], registry=r)
        self.oldest = Gauge(
            "watchd_oldest_batch_age_seconds",
            "How long the longest-standing batch has been in each active state (0: none).",
            ["state"], registry=r,
        )  # fmt: skip
        self.live_jobs = Gauge(
            "watchd_live_jobs", "Jobs handed to the executor and not ended.", registry=r
        )
        self.lost_roots = Gauge(
            "watchd_drop_roots_unavailable", "Drop roots that cannot be read now.", registry=r
        )
        self.last_tick = Gauge(
            "watchd_last_tick_timestamp_seconds", "When the main loop last ticked.", registry=r
        )
        self.job_seconds = Histogram(
            "watchd_job_duration_seconds",
            "Jobs from submission to their end, by pipeline and outcome.",
            ["pipeline", "outcome"], buckets=JOB_BUCKETS, registry=r,
        )  # fmt: skip
        self.scan_seconds = Histogram(
            "watchd_scan_duration_seconds",
            "Catch-up scans of one drop root.",
            ["root"], buckets=SCAN_BUCKETS, registry=r,
        )  # fmt: skip
        self.batch_endings = Counter(
            "watchd_batches_ended", "Batches that ended, by final state.", ["state"], registry=r
        )
        self.batch_failures = Counter(
            "watchd_batch_failures",
            "Failed batches by kind: manifest, inputs, job_<error kind> or other.",
            ["kind"], registry=r,
        )  # fmt: skip
        self.job_failures = Counter(
            "watchd_job_failures", "Failed job attempts by error kind.", ["error_kind"], registry=r
        )
        self.intake_errors = Counter(
            "watchd_intake_errors",
            "Batch folders whose intake raised an unexpected error.",
            registry=r,
        )
        self.mails = Counter(
            "watchd_mails", "E-mails to batch owners by outcome.", ["outcome"], registry=r
        )
        # What each group's jobs used (the batch folder's group, as the share reports it).
        self.group_jobs = Counter(
            "watchd_group_jobs", "Ended job attempts by group and outcome.",
            ["group", "outcome"], registry=r,
        )  # fmt: skip
        self.group_images = Counter(
            "watchd_group_images", "Images of succeeded inference jobs by group.", ["group"],
            registry=r,
        )  # fmt: skip
        self.group_cpu = Counter(
            "watchd_group_cpu_seconds", "CPU time the jobs measured, by group.", ["group"],
            registry=r,
        )  # fmt: skip
        self.group_gpu = Counter(
            "watchd_group_gpu_seconds", "GPU time the jobs held, by group.", ["group"],
            registry=r,
        )  # fmt: skip
        self.group_bytes = Counter(
            "watchd_group_bytes", "Bytes the jobs read (in) and wrote (out), by group.",
            ["group", "direction"], registry=r,
        )  # fmt: skip
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    # -- serving ---------------------------------------------------------------------------------

    def serve(self, section: MetricsSection) -> None:
        """Listen for scrapes if the configuration asks for it. A port that cannot be had is
        logged, and the daemon goes on without metrics: they must never stop the batches."""
        if not section.enabled:
            return
        try:
            self._server, self._thread = prometheus_client.start_http_server(
                section.port, section.address, registry=self.registry
            )
        except OSError as exc:
            log.error(
                "metrics endpoint unavailable",
                address=section.address, port=section.port, error=str(exc),
            )  # fmt: skip
            return
        log.info("serving metrics", address=section.address, port=self.port)

    @property
    def port(self) -> int | None:
        """The port scrapes go to (the real one when the configuration said 0)."""
        return None if self._server is None else int(self._server.server_port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join()
        self._server = self._thread = None

    # -- recording (the loop only) ----------------------------------------------------------------

    def beat(
        self,
        counts: Mapping[BatchState, int],
        entered: Mapping[BatchState, float],
        live_jobs: int,
        lost_roots: int,
        now: float,
    ) -> None:
        """The gauges, from what the loop read at its heartbeat."""
        for state in BatchState:
            self.batches.labels(state.value).set(counts.get(state, 0))
        for state in ACTIVE_STATES:
            since = entered.get(state)
            self.oldest.labels(state.value).set(0 if since is None else max(0.0, now - since))
        self.live_jobs.set(live_jobs)
        self.lost_roots.set(lost_roots)

    def ticked(self, now: float) -> None:
        self.last_tick.set(now)

    def scanned(self, root: Path, seconds: float) -> None:
        self.scan_seconds.labels(str(root)).observe(seconds)

    def job_ended(self, job: Job) -> None:
        """A job reached SUCCEEDED, FAILED or CANCELLED (called once per attempt's end)."""
        if job.state is JobState.FAILED:
            self.job_failures.labels(_known(job.error_kind)).inc()
        if job.submitted_at is not None and job.finished_at is not None:
            seconds = max(0.0, job.finished_at - job.submitted_at)
            self.job_seconds.labels(job.pipeline.value, job.state.value).observe(seconds)

    def charged(self, group: str, job: Job, usage: JobUsage | None) -> None:
        """An ended attempt was charged to ``group`` ('' for batches taken in before owners
        were recorded: counted as "unknown")."""
        group = group or "unknown"
        self.group_jobs.labels(group, job.state.value).inc()
        if job.state is JobState.SUCCEEDED and job.images:
            self.group_images.labels(group).inc(job.images)
        if usage is not None:
            self.group_cpu.labels(group).inc(usage.cpu_s)
            self.group_gpu.labels(group).inc(usage.gpu_s)
            self.group_bytes.labels(group, "in").inc(usage.bytes_in)
            self.group_bytes.labels(group, "out").inc(usage.bytes_out)

    def batch_ended(
        self, state: BatchState, from_state: BatchState | None, jobs: Sequence[Job]
    ) -> None:
        self.batch_endings.labels(state.value).inc()
        if state is BatchState.FAILED:
            self.batch_failures.labels(failure_kind(from_state, jobs)).inc()


def failure_kind(from_state: BatchState | None, jobs: Sequence[Job]) -> str:
    """Why a batch failed, as a label with few values: its manifest was refused (it was
    created failed), its inputs were wrong or incomplete (it failed while waiting), a job
    failed for good (``job_`` + the job's error kind), or something else (an unwritable
    results folder, an internal error)."""
    if from_state is None:
        return "manifest"
    if from_state is BatchState.WAITING:
        return "inputs"
    failed = [j for j in jobs if j.state is JobState.FAILED]
    if failed:
        return "job_" + _known(failed[0].error_kind)
    return "other"


def _known(error_kind: ErrorKind | None) -> str:
    return error_kind.value if error_kind is not None else "other"
