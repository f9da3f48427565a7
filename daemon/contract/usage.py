"""What a job used, as it measured it: wall and CPU time, GPU time, bytes read and written.

A job measures itself (:class:`Meter`, started when its work starts) and reports the figures in
its result's summary under ``usage``, whether it succeeded or not; the daemon charges them to
the batch's owner (``watchctl usage``, quotas). The figures are the kernel's: CPU time of the
job's process and of its children that ended (getrusage), bytes it passed to read and write
calls while working (``/proc/self/io``'s rchar and wchar: the inputs, the model, the masks,
tables and ledgers; not the libraries loaded before), and GPU time as the wall time its GPUs
were held.
"""

from __future__ import annotations

import math
import resource
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

USAGE_KEY = "usage"  # where a result's summary holds it


@dataclass(frozen=True)
class JobUsage:
    wall_s: float = 0.0
    cpu_s: float = 0.0
    gpu_s: float = 0.0
    bytes_in: int = 0
    bytes_out: int = 0

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)

    @classmethod
    def from_summary(cls, summary: Mapping[str, Any]) -> JobUsage | None:
        """The usage a result's summary reports, or None where it says none (or nonsense:
        every figure must be a finite number, at least 0)."""
        found = summary.get(USAGE_KEY)
        if not isinstance(found, Mapping):
            return None
        values: dict[str, Any] = {}
        for name, kind in (("wall_s", float), ("cpu_s", float), ("gpu_s", float),
                           ("bytes_in", int), ("bytes_out", int)):  # fmt: skip
            value = found.get(name, 0)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                return None
            if not math.isfinite(value) or value < 0 or value > 1e18:
                return None
            values[name] = kind(value)
        return cls(**values)


def _io() -> tuple[int, int]:
    """(bytes read, bytes written) by this process so far: rchar and wchar; (0, 0) where
    there is no /proc."""
    found = {}
    try:
        with open("/proc/self/io", encoding="ascii") as io:
            for line in io:
                key, _, value = line.partition(":")
                found[key] = int(value)
    except (OSError, ValueError):
        return 0, 0
    return found.get("rchar", 0), found.get("wchar", 0)


def _cpu() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class Meter:
    """Started when a job's work starts; :meth:`read` says what it used since."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.cpu = _cpu()
        self.io = _io()

    def read(self, gpus: int = 0) -> JobUsage:
        wall = max(0.0, time.monotonic() - self.started)
        read, written = _io()
        return JobUsage(
            wall_s=round(wall, 3),
            cpu_s=round(max(0.0, _cpu() - self.cpu), 3),
            gpu_s=round(wall * max(0, gpus), 3),
            bytes_in=max(0, read - self.io[0]),
            bytes_out=max(0, written - self.io[1]),
        )
