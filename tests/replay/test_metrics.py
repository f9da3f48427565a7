"""The Prometheus endpoint: off by default; when enabled, a real HTTP GET over loopback during
a real run returns the batches by state, the queue's age, job durations, scan durations and
failures by kind, with the values of what just happened."""

from __future__ import annotations

import shutil
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import synth
from conftest import MODEL
from prometheus_client.parser import text_string_to_metric_families
from replay import Replay, copy_slowly, manifest_text, write_atomically

from daemon.core.manifest_schema import Kind
from daemon.core.states import BatchState
from daemon.loop.service import Service
from daemon.site.config import Config

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def test_metrics_are_off_by_default(config_for: Callable[..., Config]) -> None:
    with Replay(config_for()) as replay:
        assert replay.service.metrics.port is None


def test_a_scrape_after_real_batches_shows_states_queue_age_durations_and_failures(
    config_for: Callable[..., Config], staged: Callable[..., Path], drop_root: Path, tmp_path: Path
) -> None:
    """One batch ends done (two inference shards and a report), one fails because its jobs
    find its model's weights damaged, one is refused for its manifest, one still waits for a
    file."""
    config = config_for(metrics={"enabled": True, "port": 0})
    damaged = config.registry.path / "damaged"  # registered, as intake sees; unloadable
    shutil.copytree(config.registry.path / MODEL, damaged)
    for weights in damaged.rglob("weights.pt"):
        weights.write_bytes(weights.read_bytes()[:-1] + b"!")
    unknown = tmp_path / "staging" / "unknown model"
    synth.make_batch(unknown, "inference", count=2, size=64, seed=5)
    (unknown / "manifest.toml").write_bytes(
        manifest_text(unknown, Kind.INFERENCE, model="damaged", version="latest")
    )
    waiting = staged("waiting", count=2)
    steps = [
        *copy_slowly(staged("good", count=6), drop_root / "good", 0.0, 0.01),
        *copy_slowly(unknown, drop_root / "unknown model", 0.0, 0.01),
        write_atomically(drop_root / "refused" / "manifest.toml", b"watchd = 1\nkind = [", 0.0),
        write_atomically(
            drop_root / "waiting" / "manifest.toml", (waiting / "manifest.toml").read_bytes(), 0.0
        ),
    ]
    (drop_root / "refused").mkdir()
    (drop_root / "waiting").mkdir()

    def settled(service: Service) -> bool:
        counts = service.store.counts()
        return counts[BatchState.DONE] == 1 and counts[BatchState.FAILED] == 2

    with Replay(config) as replay:
        replay.run(steps, until=settled, timeout=180)
        time.sleep(config.daemon.heartbeat_seconds)
        replay.service.tick(time.time())  # a heartbeat after the last change
        port = replay.service.metrics.port
        assert port is not None
        samples = scrape(port)

    assert value(samples, "watchd_batches", state="done") == 1
    assert value(samples, "watchd_batches", state="failed") == 2
    assert value(samples, "watchd_batches", state="waiting") == 1
    assert value(samples, "watchd_batches_ended_total", state="done") == 1
    assert value(samples, "watchd_batch_failures_total", kind="manifest") == 1
    assert value(samples, "watchd_batch_failures_total", kind="job_model") == 1
    assert 0 < value(samples, "watchd_oldest_batch_age_seconds", state="waiting") < 180
    assert value(samples, "watchd_oldest_batch_age_seconds", state="queued") == 0
    assert value(samples, "watchd_live_jobs") == 0
    assert value(samples, "watchd_job_failures_total", error_kind="model") >= 1

    infer = {"pipeline": "infer", "outcome": "succeeded"}
    assert value(samples, "watchd_job_duration_seconds_count", **infer) == 2
    assert value(samples, "watchd_job_duration_seconds_sum", **infer) > 0
    report = {"pipeline": "report", "outcome": "succeeded"}
    assert value(samples, "watchd_job_duration_seconds_count", **report) == 1
    assert value(samples, "watchd_scan_duration_seconds_count", root=str(drop_root)) >= 1
    assert abs(value(samples, "watchd_last_tick_timestamp_seconds") - time.time()) < 60
