"""Run a pipeline job by hand, as an executor would: write spec.json, start the program, read
result.json. Used by the benchmark scripts (the same command runs under the local executor,
under Slurm and by hand)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from daemon.contract.checksums import sha256_of
from daemon.contract.jobspec import (
    LOG_FILE,
    RESULT_FILE,
    SPEC_FILE,
    InputFile,
    JobResult,
    JobSpec,
    ModelRef,
    Pipeline,
    Resources,
    Role,
)


@dataclass(frozen=True)
class Finished:
    spec: JobSpec
    returncode: int
    result: JobResult | None
    wall_s: float
    peak_rss_mb: float  # the job process's largest resident set size (its own VmHWM)

    @property
    def summary(self) -> Mapping[str, Any]:
        return self.result.summary if self.result else {}


def inputs_of(
    batch_dir: Path, files: Iterable[Path], checksums: bool = False
) -> tuple[InputFile, ...]:
    """Inputs for ``files``; those under a ``masks`` folder are ground truth. An OME-Zarr store
    (a folder) has no size or checksum of its own."""
    items = []
    for path in sorted(files):
        relative = path.relative_to(batch_dir).as_posix()
        if path.is_dir():
            items.append(InputFile(relative))
            continue
        digest = sha256_of(path) if checksums else None
        role = Role.MASK if "masks" in Path(relative).parts[:-1] else Role.IMAGE
        items.append(InputFile(relative, path.stat().st_size, digest, role))
    return tuple(items)


SPENT = "spent"  # beside the batch folder: the outputs of runs before, set aside


def work_dir_for(batch_dir: Path) -> Path:
    """The work folder of a run of jobs started by hand on ``batch_dir``: in a spool beside
    the batch folder (the daemon's is its configured spool), never inside it."""
    return batch_dir.parent / "spool" / batch_dir.name


def set_aside(batch_dir: Path) -> None:
    """Move the outputs of the last job run on ``batch_dir`` (its run folder, its work folder)
    into ``spent/`` beside it, so that the next job segments every input again (its ledger
    would skip those done). Moved, not removed, until the benchmark ends (:func:`remove_spent`):
    on ext4 without a journal, as this development machine's root is, a new file's inode is
    found by stepping over every inode freed in the last 60 s (360 s while its table block is
    dirty) one by one (the kernel's ``recently_deleted``), so removing a run's thousands of
    masks made each later run slower than the one before (docs/benchmarks.md)."""
    spent = batch_dir.parent / SPENT
    spent.mkdir(exist_ok=True)
    for outputs in (batch_dir / "results", work_dir_for(batch_dir)):
        if outputs.exists():
            outputs.rename(spent / f"{len(list(spent.iterdir()))}-{outputs.name}")


def remove_spent(batch_dir: Path) -> None:
    """Remove what :func:`set_aside` moved aside (once no job is measured any more)."""
    shutil.rmtree(batch_dir.parent / SPENT, ignore_errors=True)


def run(
    batch_dir: Path,
    pipeline: Pipeline,
    inputs: tuple[InputFile, ...],
    registry: Path,
    model: ModelRef,
    params: Mapping[str, Any],
    *,
    name: str,
    kind: str,
    cpus: int = 2,
    gpus: int = 0,
    env: Mapping[str, str] | None = None,
) -> Finished:
    """Write the spec of job ``name`` (results in ``batch_dir/results``, the job folder in
    :func:`work_dir_for`) and run it to its end."""
    spec = JobSpec(
        job_id=1, job_name=name, pipeline=pipeline, attempt=1, batch_id=1, batch_revision=1,
        batch_kind=kind, batch_dir=str(batch_dir), run_dir=str(batch_dir / "results"),
        work_dir=str(work_dir_for(batch_dir)), manifest_sha256="0" * 64, inputs=inputs,
        model=model, registry_dir=str(registry), params=dict(params),
        resources=Resources(cpus=cpus, gpus=gpus), title=f"benchmark {name}",
    )  # fmt: skip
    spec.job_dir.mkdir(parents=True, exist_ok=True)
    (spec.job_dir / SPEC_FILE).write_text(spec.to_json(), encoding="utf-8")
    (spec.job_dir / RESULT_FILE).unlink(missing_ok=True)
    environment = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": str(cpus),
                   **(env or {})}  # fmt: skip
    started = time.perf_counter()
    with open(spec.job_dir / LOG_FILE, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", pipeline.module, str(spec.job_dir)],
            cwd=spec.job_dir, stdout=log, stderr=subprocess.STDOUT, env=environment,
        )  # fmt: skip
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - started
    result_path = spec.job_dir / RESULT_FILE
    result = JobResult.from_json(result_path.read_text("utf-8")) if result_path.exists() else None
    # the job's own VmHWM (result.json); wait4's maximum also counts what this process held
    # when it forked the job, so it is only the fallback (a job that wrote no summary)
    summary = result.summary if result is not None and result.summary else {}
    peak = float(summary.get("peak_rss_mb") or usage.ru_maxrss / 1024)
    if process.returncode != 0:
        sys.stderr.write((spec.job_dir / LOG_FILE).read_text("utf-8")[-3000:])
    return Finished(spec, process.returncode, result, wall, peak)
