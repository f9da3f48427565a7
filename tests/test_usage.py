"""What a job measures of itself (the kernel's figures), and how the daemon reads it back."""

from __future__ import annotations

import os
from pathlib import Path

from daemon.contract.usage import USAGE_KEY, JobUsage, Meter


def test_a_meter_counts_the_cpu_time_and_the_bytes_read_and_written_since_it_started(
    tmp_path: Path,
) -> None:
    meter = Meter()
    data = os.urandom(1 << 20)
    (tmp_path / "f").write_bytes(data)
    assert (tmp_path / "f").read_bytes() == data
    sum(i * i for i in range(200_000))  # some CPU time
    used = meter.read(gpus=2)
    assert used.bytes_out >= len(data) and used.bytes_in >= len(data)
    assert used.cpu_s > 0 and used.wall_s > 0
    assert abs(used.gpu_s - 2 * used.wall_s) < 0.01  # two GPUs held all along


def test_usage_travels_in_a_results_summary_and_nonsense_reads_as_none() -> None:
    used = JobUsage(wall_s=1.5, cpu_s=2.25, gpu_s=0.0, bytes_in=10, bytes_out=20)
    assert JobUsage.from_summary({USAGE_KEY: used.to_dict()}) == used
    assert JobUsage.from_summary({}) is None
    for bad in ({"cpu_s": -1}, {"cpu_s": float("inf")}, {"bytes_in": "10"}, {"wall_s": True}, []):
        assert JobUsage.from_summary({USAGE_KEY: bad}) is None
