"""The local machine's GPUs, handed to its jobs: each job its own, through CUDA_VISIBLE_DEVICES.

With ``[executor.local] gpus = N``, the GPUs numbered 0 … N-1 (as CUDA numbers them) each take
at most ``jobs_per_gpu`` jobs at once. A job that asks for G GPUs gets the G least taken that
have room (numbered from 0 inside the job, as under Slurm), or waits until they have; a job that
asks for none gets none (CUDA_VISIBLE_DEVICES empty: it cannot take a GPU from a job that has
one). Without ``gpus`` every job sees what the daemon sees, as before. Pure: the local
executor holds and frees the seats as its jobs start and end.
"""

from __future__ import annotations

from collections.abc import Sequence

VISIBLE = "CUDA_VISIBLE_DEVICES"


class GpuSeats:
    """Which GPU each running job holds, and how many jobs each GPU has."""

    def __init__(self, gpus: int, per_gpu: int) -> None:
        self.per_gpu = per_gpu
        self.jobs = [0] * gpus  # running jobs per GPU
        self.held: dict[str, tuple[int, ...]] = {}  # job handle → its GPUs

    @property
    def seats(self) -> int:
        return len(self.jobs) * self.per_gpu

    def free(self, count: int) -> tuple[int, ...] | None:
        """The ``count`` GPUs with the fewest jobs that have room for one more (lowest number
        first among equals), or None while fewer than ``count`` have room."""
        room = sorted((jobs, gpu) for gpu, jobs in enumerate(self.jobs) if jobs < self.per_gpu)
        if len(room) < count:
            return None
        return tuple(sorted(gpu for _, gpu in room[:count]))

    def hold(self, handle: str, gpus: Sequence[int]) -> None:
        """``handle``'s job runs on ``gpus`` (known ones only: a record may be stale)."""
        taken = tuple(g for g in gpus if 0 <= g < len(self.jobs))
        self.release(handle)
        for gpu in taken:
            self.jobs[gpu] += 1
        self.held[handle] = taken

    def release(self, handle: str) -> None:
        for gpu in self.held.pop(handle, ()):
            self.jobs[gpu] -= 1


def visible(gpus: Sequence[int]) -> dict[str, str]:
    """The environment that gives a job ``gpus`` (none: no GPU at all)."""
    return {VISIBLE: ",".join(map(str, gpus))}
