"""The resident device (pipelines/inference/resident.py): a real process that keeps the net
loaded across jobs, real inference jobs that hand it their batches (pipelines/inference/
remote.py), and the local executor that starts it (executor.local.resident_device). On this
machine without a GPU it runs the net on its CPU: the same code, every message and shared slab
but the GPU's own stage."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from inferjobs import MAIN_IMPORTS, read_mask, through_executor
from jobrun import work_dir_for
from labelimages import zarr_levels

from daemon.contract.jobspec import (
    RESIDENT_DEVICE_ENV,
    RESIDENT_DEVICES_ENV,
    ModelRef,
    Pipeline,
    Resources,
)
from daemon.executors.local import LocalExecutor
from daemon.site.config import LocalExecutorSection
from models import catalog
from pipelines.inference import remote
from pipelines.inference.masks import Rules

if TYPE_CHECKING:
    from conftest import InferredBatch, JobRun

    from daemon.contract.jobspec import JobSpec


def start_resident(folder: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A resident device started as the executor starts one: its socket, its stdin a pipe."""
    socket_path = str(folder / "resident.sock")
    with open(folder / "resident.log", "wb") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "pipelines.inference.resident", socket_path],
            stdin=subprocess.PIPE, stderr=log, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
    return server, socket_path


@pytest.fixture
def resident(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A resident device, listening."""
    server, socket_path = start_resident(tmp_path)
    deadline = time.monotonic() + 30
    while not os.path.exists(socket_path):
        assert server.poll() is None and time.monotonic() < deadline, "it never listened"
        time.sleep(0.02)
    yield server, socket_path
    if server.poll() is None:
        server.kill()
    server.wait()
    assert server.stdin is not None
    server.stdin.close()


def session_job(
    job_spec: Callable[..., JobSpec], inferred: InferredBatch, batch_dir: Path,
    params: dict[str, Any], cpus: int = 1,
) -> JobSpec:  # fmt: skip
    """A copy of the session's batch in ``batch_dir``, and the spec of one inference job over
    all of it with the session's model."""
    for folder in ("images", "plate 2 ü"):
        shutil.copytree(inferred.batch_dir / folder, batch_dir / folder)
    return job_spec(batch_dir, Pipeline.INFER, inferred.inputs, registry=inferred.model.registry,
                    params=params, model=ModelRef(inferred.model.name, "latest"),
                    resources=Resources(cpus=cpus))  # fmt: skip


def rows_of(batch_dir: Path, *parts: str) -> dict[str, dict[str, str]]:
    rows = {}
    for part in parts or ("table-0000.csv",):
        with open(work_dir_for(batch_dir) / "parts" / part, newline="") as handle:
            rows.update({row["path"]: row for row in csv.DictReader(handle)})
    return rows


def same_as_the_sessions(inferred: InferredBatch, batch_dir: Path) -> None:
    """Masks bit for bit and rows equal to those of the session's shards, run on their own."""
    for item in inferred.inputs:
        mine = read_mask(batch_dir / "results" / "masks" / item.path)
        theirs = read_mask(inferred.batch_dir / "results" / "masks" / item.path)
        assert np.array_equal(mine, theirs), item.path
    assert rows_of(batch_dir) == rows_of(inferred.batch_dir, "table-0000.csv", "table-0001.csv")


def connected(
    inferred: InferredBatch, socket_path: str, made: list[Any]
) -> remote.RemoteDevice | None:
    """The job's side of the session's model on the resident device at ``socket_path``;
    ``made`` gets the job's own device stage, if one is made."""
    from pipelines.inference.device import DeviceStage, load_model
    from pipelines.inference.placement import choose_device

    version = catalog.resolve(inferred.model.registry, inferred.model.name, "latest")
    rules = Rules(min_area=4, split_neck=0.0, fsync_each=False)
    params = {"threshold": 0.5, "min_object_area": 4, "split_neck": 0.0}

    def own() -> DeviceStage:
        made.append(DeviceStage(load_model(version), choose_device(0, {}, 0, params), 0.5, rules))
        return made[-1]

    return remote.connect(socket_path, "a job", str(inferred.model.registry), version, params,
                          0, rules, own)  # fmt: skip


def test_jobs_handed_to_a_resident_device_make_the_masks_and_rows_of_jobs_with_their_own_net(
    inferred: InferredBatch,
    resident: tuple[subprocess.Popen[bytes], str],
    tmp_path: Path,
    job_spec: Callable[..., Any],
    run: Callable[..., JobRun],
    infer_params: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two jobs, one after the other, on two CPUs: their masks are the session's shards' bit
    for bit and their rows the same; the first has the resident device load the model and the
    second finds it loaded; neither job's main process imports torch; both summaries name the
    resident device."""
    server, socket_path = resident
    monkeypatch.setenv(RESIDENT_DEVICE_ENV, socket_path)
    for turn, name in enumerate(("first", "second")):
        batch_dir = tmp_path / name
        spec = session_job(job_spec, inferred, batch_dir, infer_params, cpus=2)
        job = run(spec, MAIN_IMPORTS)
        assert job.returncode == 0 and job.result is not None, job.log
        imported = [line for line in job.log.splitlines() if line.startswith("the main process")]
        assert imported == [], job.log
        said = "already loaded" if turn else "loaded for this job"
        assert f"resident device {socket_path} (pid {server.pid}) on cpu" in job.log
        assert f"model {said}" in job.log, job.log
        inference = job.result.summary["inference"]
        assert inference["device"] == "cpu" and inference["precision"] == "fp32"
        assert inference["resident"] == {"pid": server.pid, "jobs_served": turn + 1,
                                         "model_was_loaded": bool(turn), "decided_by": ""}  # fmt: skip
        same_as_the_sessions(inferred, batch_dir)
    assert server.poll() is None  # it stays for the next job
    # started with -m, it imported with the collector off (pipelines/__init__.py): it froze what
    # its imports made and collects from then on, as long as it lives
    said = (tmp_path / "resident.log").read_text()
    frozen = re.search(r"torch imported, (\d+) objects frozen", said)
    assert frozen is not None and int(frozen.group(1)) > 10_000, said


def test_jobs_at_once_on_one_resident_device_each_get_their_own_masks(
    inferred: InferredBatch,
    resident: tuple[subprocess.Popen[bytes], str],
    tmp_path: Path,
    job_spec: Callable[..., Any],
    run: Callable[..., JobRun],
    infer_params: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three jobs side by side, each in a thread of the resident device of its own, their
    batches interleaved under its lock: each job's masks and rows are the session's."""
    server, socket_path = resident
    monkeypatch.setenv(RESIDENT_DEVICE_ENV, socket_path)
    specs = [session_job(job_spec, inferred, tmp_path / name, infer_params)
             for name in ("one", "two", "three")]  # fmt: skip
    with ThreadPoolExecutor(len(specs)) as pool:
        jobs = list(pool.map(run, specs))
    for job in jobs:
        assert job.returncode == 0 and job.result is not None, job.log
        assert job.result.summary["inference"]["resident"]["pid"] == server.pid
        same_as_the_sessions(inferred, Path(job.spec.batch_dir))
    said = (tmp_path / "resident.log").read_text()
    assert sorted(re.findall(r"job (infer-0000): model", said)) == ["infer-0000"] * 3, said
    assert server.poll() is None


def test_a_slide_through_a_resident_device_is_the_label_image_of_its_own_net(
    inferred: InferredBatch,
    resident: tuple[subprocess.Popen[bytes], str],
    synth: Any,
    tmp_path: Path,
    job_spec: Callable[..., Any],
    manifest_inputs: Callable[..., Any],
    run: Callable[..., JobRun],
    infer_params: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A slide segmented window by window, its windows' probabilities from the resident
    device: every level of its label image, and its object table, as its own net makes them."""
    _, socket_path = resident
    params = {**infer_params, "max_whole_pixels": 100_000, "tile_size": 256, "tile_overlap": 32}
    model = ModelRef(inferred.model.name, "1")
    jobs = {}
    for name in ("own", "resident"):
        batch_dir = tmp_path / name
        synth.write_slide(batch_dir / "images" / "slide.tif", 700, seed=4, tissue=0.3)
        inputs = manifest_inputs(batch_dir, [batch_dir / "images" / "slide.tif"], checksums=True)
        if name == "resident":
            monkeypatch.setenv(RESIDENT_DEVICE_ENV, socket_path)
        jobs[name] = run(job_spec(batch_dir, Pipeline.INFER, inputs, params=params, model=model,
                                  registry=inferred.model.registry,
                                  resources=Resources(cpus=2)))  # fmt: skip
        assert jobs[name].returncode == 0, jobs[name].log
    assert "resident device" in jobs["resident"].log and "resident device" not in jobs["own"].log
    label = "masks/images/slide.tif.ome.zarr"
    levels = [zarr_levels(tmp_path / name / "results" / label, "labels/segmentation")
              for name in ("own", "resident")]  # fmt: skip
    for mine, theirs in zip(*levels, strict=True):
        np.testing.assert_array_equal(mine, theirs)
    assert int(levels[0][0].max()) > 3  # objects found, so the comparison means something
    tables = [(tmp_path / name / "results/objects/images/slide.tif.csv").read_text()
              for name in ("own", "resident")]  # fmt: skip
    assert tables[0] == tables[1]


def test_a_resident_device_not_there_leaves_the_job_its_own_net_and_says_why(
    inferred: InferredBatch,
    tmp_path: Path,
    job_spec: Callable[..., Any],
    run: Callable[..., JobRun],
    infer_params: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gone = str(tmp_path / "gone.sock")
    monkeypatch.setenv(RESIDENT_DEVICE_ENV, gone)
    batch_dir = tmp_path / "alone"
    job = run(session_job(job_spec, inferred, batch_dir, infer_params))
    assert job.returncode == 0 and job.result is not None, job.log
    assert f"resident device {gone} not reached" in job.log
    assert "this job runs its own" in job.log
    assert "resident" not in job.result.summary["inference"]
    same_as_the_sessions(inferred, batch_dir)


def test_a_job_whose_resident_device_ends_goes_on_with_its_own_net(
    inferred: InferredBatch, resident: tuple[subprocess.Popen[bytes], str]
) -> None:
    """The job's side, driven as the stages drive it: batches come back as the net makes them.
    The resident device is killed (a daemon's restart ends it) with one batch on its way: the
    job loads its own net, gives it that batch again and every one after, and its summary says
    the resident device ended. The masks are those the resident device made of the same
    images."""
    server, socket_path = resident
    made: list[Any] = []
    device = connected(inferred, socket_path, made)
    assert device is not None
    try:
        images = [np.random.default_rng(k).random((64, 64), np.float32) for k in range(3)]
        assert device.batch_size((64, 64)) == 1  # the CPU's batch_size
        device.submit(images, "first")
        ((tag, masks, confidences),) = device.done(wait=True)
        assert tag == "first" and masks.shape == (3, 64, 64) and masks.dtype == np.uint8
        assert set(np.unique(masks)) <= {0, 1} and confidences.shape == (3,)
        wanted = masks.copy(), confidences.copy()
        assert not device.busy and device.summary()["resident"]["pid"] == server.pid
        server.stdin.close()  # type: ignore[union-attr]  # as the daemon's end: it ends
        device.submit(images, "second")  # sent before it is seen to end, or after
        server.wait()
        device.submit(images[::-1], "third")
        found = device.done(wait=True)
        while device.busy:
            found += device.done(wait=True)
        assert [tag for tag, _, _ in found] == ["second", "third"]
        np.testing.assert_array_equal(found[0][1], wanted[0])
        np.testing.assert_array_equal(found[1][1], wanted[0][::-1])
        np.testing.assert_allclose(found[0][2], wanted[1])
        assert len(made) == 1 and device.where.device == "cpu" and device.precision == "fp32"
        assert device.summary()["resident"] == {"ended_during_the_job": True}
    finally:
        device.close()


def test_a_job_started_with_its_resident_device_waits_for_it_to_listen(
    inferred: InferredBatch, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The executor starts a resident device as the first job that needs it starts: the job
    waits for it to listen rather than run a net of its own."""
    monkeypatch.setattr(remote, "CONNECT_SECONDS", 60.0)  # a loaded machine starts it slowly
    server, socket_path = start_resident(tmp_path)
    try:
        device = connected(inferred, socket_path, [])
        assert device is not None
        device.close()
    finally:
        server.kill()
        server.wait()
        assert server.stdin is not None
        server.stdin.close()


def test_a_resident_device_that_ends_after_the_last_batch_leaves_the_job_its_summary(
    inferred: InferredBatch, resident: tuple[subprocess.Popen[bytes], str]
) -> None:
    """The daemon restarts as a job hands in its last batch: the job's summary is the one the
    resident device sent with that batch, and the job loads no net to write it."""
    server, socket_path = resident
    made: list[Any] = []
    device = connected(inferred, socket_path, made)
    assert device is not None
    try:
        device.submit([np.zeros((64, 64), np.float32)], "last")
        assert len(device.done(wait=True)) == 1
        server.kill()
        server.wait()
        summary = device.summary()
        assert summary["resident"]["pid"] == server.pid and summary["precision"] == "fp32"
        assert made == [] and not device.busy
    finally:
        device.close()


def test_the_local_executor_starts_a_resident_device_names_it_to_inference_jobs_and_ends_it(
    inferred: InferredBatch,
    tmp_path: Path,
    job_spec: Callable[..., Any],
    infer_params: dict[str, Any],
) -> None:
    """``resident_device = true`` without GPUs: one resident device, started while a batch
    settles (the planner's word, with the jobs' warm starts), named to each inference job (both
    forked from warm starts: the socket is each job's, not its spare's); both jobs' masks and
    rows are the session's; closing the executor ends it and removes its socket's folder."""
    limits = LocalExecutorSection(resident_device=True)
    executor = LocalExecutor(max_parallel=1, limits=limits,
                             env={**os.environ, "WANDB_MODE": "offline"})  # fmt: skip
    executor.expect(Pipeline.INFER, Resources(cpus=2))
    assert executor.residents is not None
    (started,) = executor.residents.running.values()
    folder = executor.residents.folder
    assert os.stat(folder).st_mode & 0o777 == 0o700
    try:
        for name in ("first", "second"):
            batch_dir = tmp_path / name
            spec = session_job(job_spec, inferred, batch_dir, infer_params, cpus=2)
            log = through_executor(executor, spec, warm=True)
            assert f"(pid {started.pid}) on cpu" in log, log
            launch = json.loads((spec.job_dir / "launch.json").read_text())
            assert launch["warm"] is True
            result = json.loads((spec.job_dir / "result.json").read_text())
            assert result["summary"]["inference"]["resident"]["pid"] == started.pid
            same_as_the_sessions(inferred, batch_dir)
        # the warm start behind the last job, its imports done, holds no torch
        (spare,) = [s for s in executor.spares.waiting() if s.module == Pipeline.INFER.module]
        ready_by = time.monotonic() + 120
        while not spare.says_ready():
            assert time.monotonic() < ready_by, "the spare never said its imports were done"
            time.sleep(0.05)
        maps = Path(f"/proc/{spare.pid}/maps").read_text()
        assert "_nd_image" in maps and "libtorch" not in maps  # the workers' code, no net
    finally:
        executor.close()
    assert not os.path.exists(folder)
    with pytest.raises(ProcessLookupError):
        os.kill(started.pid, 0)


def test_where_gpus_are_handed_out_a_job_given_none_runs_its_own_net_and_starts_no_resident(
    inferred: InferredBatch,
    tmp_path: Path,
    job_spec: Callable[..., Any],
    infer_params: dict[str, Any],
) -> None:
    """``gpus = 1`` and inference on the CPU (``inference_gpus = 0``): no resident device is
    started for the batch, the job is named none and runs its own net, and its warm start
    imports torch as ever (its kind of warm start is not the one of jobs with a resident
    device)."""
    limits = LocalExecutorSection(resident_device=True, gpus=1, max_gpus=1)
    executor = LocalExecutor(max_parallel=1, limits=limits,
                             env={**os.environ, "WANDB_MODE": "offline"})  # fmt: skip
    try:
        executor.expect(Pipeline.INFER, Resources(cpus=1))
        assert executor.residents is not None and executor.residents.running == {}
        (spare,) = executor.spares.waiting()
        assert RESIDENT_DEVICES_ENV not in spare.env
        batch_dir = tmp_path / "cpu"
        spec = session_job(job_spec, inferred, batch_dir, infer_params)
        log = through_executor(executor, spec, warm=True)
        assert "resident device" not in log and "inference on cpu" in log, log
        assert executor.residents.running == {}
        same_as_the_sessions(inferred, batch_dir)
    finally:
        executor.close()
