"""Fixtures for the pipeline tests: synthetic batches, hand-written job specs, real job runs.

Jobs run as the executors run them: ``python -m pipelines.<name> JOB_DIR`` in a subprocess with
cwd JOB_DIR and stdout+stderr in ``JOB_DIR/log.txt``. One tiny model is trained per session
and shared by the inference and report tests (which copy the registry before damaging it).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import jobrun
import pytest

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
    Shard,
)

ROOT = Path(__file__).resolve().parents[2]
MODEL_NAME = "spheroids"
TRAIN_PARAMS = {
    "epochs": 2,
    "batch_size": 4,
    "learning_rate": 0.01,
    "val_fraction": 0.25,
    "seed": 0,
    "depth": 2,
    "width": 8,
    "patience": 3,
}
INFER_PARAMS = {"threshold": 0.5, "min_object_area": 4}
NO_SHARDING = Shard()
ONE_CPU = Resources(cpus=1)


@dataclass(frozen=True)
class JobRun:
    """A finished job: its spec, exit status, result (None if it crashed) and log text."""

    spec: JobSpec
    returncode: int
    result: JobResult | None
    log: str

    @property
    def run_dir(self) -> Path:
        return Path(self.spec.run_dir)

    @property
    def work_dir(self) -> Path:
        return Path(self.spec.work_dir)


@dataclass(frozen=True)
class TrainedModel:
    registry: Path
    name: str
    run: JobRun


def _load_synth() -> ModuleType:
    path = ROOT / "scripts" / "synth.py"
    loaded = sys.modules.get("synth")
    if loaded is not None and Path(loaded.__file__ or "").resolve() == path:
        return loaded  # already imported (tests/conftest.py puts scripts/ on sys.path)
    spec = importlib.util.spec_from_file_location("synth", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["synth"] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def synth() -> ModuleType:
    """scripts/synth.py, imported from its path (scripts/ is not a package)."""
    return _load_synth()


inputs_for = jobrun.inputs_of  # manifest-style inputs; files under ``masks/`` are masks


def write_spec(
    batch_dir: Path,
    pipeline: Pipeline,
    inputs: tuple[InputFile, ...],
    *,
    registry: Path,
    model: ModelRef,
    params: Mapping[str, Any],
    shard: Shard = NO_SHARDING,
    job_name: str | None = None,
    batch_kind: str = "inference",
    resources: Resources = ONE_CPU,
) -> JobSpec:
    """Write spec.json for a job of ``batch_dir`` (run_dir is ``batch_dir/results``, the work
    folder a spool's beside the batch folder: :func:`jobrun.work_dir_for`)."""
    name = job_name or f"{pipeline.value}-{shard.index:04d}"
    spec = JobSpec(
        job_id=abs(hash((str(batch_dir), name))) % 10**6,
        job_name=name,
        pipeline=pipeline,
        attempt=1,
        batch_id=1,
        batch_revision=1,
        batch_kind=batch_kind,
        batch_dir=str(batch_dir),
        run_dir=str(batch_dir / "results"),
        work_dir=str(jobrun.work_dir_for(batch_dir)),
        manifest_sha256="ab" * 32,
        inputs=inputs,
        model=model,
        registry_dir=str(registry),
        params=dict(params),
        shard=shard,
        resources=resources,
        title="test batch",
    )
    spec.job_dir.mkdir(parents=True, exist_ok=True)
    (spec.job_dir / SPEC_FILE).write_text(spec.to_json(), encoding="utf-8")
    return spec


def run_job(spec: JobSpec, wrapper: Sequence[str] = ()) -> JobRun:
    """Run the job as an executor would and read back what it left; ``wrapper`` is a command
    that runs it (e.g. setpriv, to run it without some privilege)."""
    job_dir = spec.job_dir
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONWARNINGS": ""}
    with open(job_dir / LOG_FILE, "wb") as log:
        completed = subprocess.run(
            [*wrapper, sys.executable, "-m", spec.pipeline.module, str(job_dir)],
            cwd=job_dir,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            timeout=240,
            check=False,
        )
    result_path = job_dir / RESULT_FILE
    result = JobResult.from_json(result_path.read_text("utf-8")) if result_path.exists() else None
    return JobRun(spec, completed.returncode, result, (job_dir / LOG_FILE).read_text("utf-8"))


@pytest.fixture(scope="session")
def run() -> Callable[..., JobRun]:
    return run_job


@pytest.fixture(scope="session")
def trained(tmp_path_factory: pytest.TempPathFactory, synth: ModuleType) -> TrainedModel:
    """One tiny model (16 images of 64², depth 2, width 8, 2 epochs) trained by a real job."""
    root = tmp_path_factory.mktemp("trained")
    batch_dir, registry = root / "training batch", root / "registry"
    files = synth.make_batch(batch_dir, "training", count=16, size=64, seed=1)
    spec = write_spec(
        batch_dir,
        Pipeline.TRAIN,
        inputs_for(batch_dir, files, checksums=True),
        registry=registry,
        model=ModelRef(MODEL_NAME),
        params=TRAIN_PARAMS,
        batch_kind="training",
    )
    job = run_job(spec)
    assert job.returncode == 0, job.log
    return TrainedModel(registry=registry, name=MODEL_NAME, run=job)


@dataclass(frozen=True)
class InferredBatch:
    """An inference batch segmented by two shard jobs with the session's model."""

    batch_dir: Path
    inputs: tuple[InputFile, ...]
    shards: tuple[JobRun, ...]
    model: TrainedModel


def _mixed_batch(batch_dir: Path, synth: ModuleType) -> list[Path]:
    """PNG 8-bit and TIFF 16-bit images, in folders and names with spaces, quotes, non-ASCII."""
    files = synth.make_batch(batch_dir, "inference", count=3, size=64, seed=2)
    files += synth.make_batch(batch_dir / "plate 2 ü", "inference", 2, 72, 3, fmt="tif", bits=16)
    odd = batch_dir / "images" / 'it\'s a "test".png'
    files[0].rename(odd)
    return [odd, *files[1:]]


@pytest.fixture(scope="session")
def inferred(
    tmp_path_factory: pytest.TempPathFactory, synth: ModuleType, trained: TrainedModel
) -> InferredBatch:
    batch_dir = tmp_path_factory.mktemp("inference") / "drop folder"
    inputs = inputs_for(batch_dir, _mixed_batch(batch_dir, synth), checksums=True)
    halves = (inputs[:3], inputs[3:])
    runs = []
    for index, shard_inputs in enumerate(halves):
        spec = write_spec(
            batch_dir,
            Pipeline.INFER,
            shard_inputs,
            registry=trained.registry,
            model=ModelRef(trained.name, "latest"),
            params=INFER_PARAMS,
            shard=Shard(index, len(halves)),
        )
        runs.append(run_job(spec))
    return InferredBatch(batch_dir, inputs, tuple(runs), trained)


@pytest.fixture(scope="session")
def job_spec() -> Callable[..., JobSpec]:
    """:func:`write_spec`: write spec.json for a job of a batch folder."""
    return write_spec


@pytest.fixture(scope="session")
def manifest_inputs() -> Callable[..., tuple[InputFile, ...]]:
    """:func:`inputs_for`: manifest-style inputs for files of a batch folder."""
    return inputs_for


@pytest.fixture(scope="session")
def train_params() -> dict[str, Any]:
    return dict(TRAIN_PARAMS)


@pytest.fixture(scope="session")
def infer_params() -> dict[str, Any]:
    return dict(INFER_PARAMS)

