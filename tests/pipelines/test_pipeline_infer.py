"""Real inference jobs: ``python -m pipelines.infer JOB_DIR`` on shards of a synthetic batch."""

from __future__ import annotations

import csv
import json
import os
import shutil
import time
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import tifffile
from inferjobs import MAIN_IMPORTS, read_mask, through_executor
from jobrun import work_dir_for
from labelimages import zarr_levels
from PIL import Image
from scipy import ndimage

from daemon.contract.jobspec import (
    PROGRESS_FILE,
    ErrorKind,
    InputFile,
    JobSpec,
    ModelRef,
    Pipeline,
    Resources,
    Role,
    Shard,
)
from daemon.executors.local import LocalExecutor
from pipelines.images import decode

if TYPE_CHECKING:
    from collections.abc import Callable

    from conftest import InferredBatch, JobRun

TABLE_HEADER = [
    "path",
    "width",
    "height",
    "area_px",
    "equivalent_diameter_px",
    "objects",
    "mean_intensity",
    "confidence",
    "tiled",
    "windows_run",
    "windows_glass",
    "precision",
    "model_name",
    "model_version",
    "model_sha256",
    "manifest_sha256",
    "code_version",
]


def same_slide_outputs(results: Path, expected: Path, image: str) -> list[np.ndarray]:
    """Assert that two results folders hold the same label image of ``image`` (every level,
    pixel for pixel) and the same object table; the levels."""
    label = f"masks/images/{image}.ome.zarr"
    levels = zarr_levels(results / label, "labels/segmentation")
    wanted = zarr_levels(expected / label, "labels/segmentation")
    for got, want in zip(levels, wanted, strict=True):
        np.testing.assert_array_equal(got, want)
    objects = f"objects/images/{image}.csv"
    assert (results / objects).read_text() == (expected / objects).read_text()
    return levels


def in_regions(
    run: Callable[..., JobRun], job_spec: Callable[..., JobSpec], batch_dir: Path,
    inputs: tuple[InputFile, ...], image: str, order: tuple[int, ...], params: dict[str, Any],
    **common: Any,
) -> None:  # fmt: skip
    """Segment ``image`` as the daemon plans a large one: a job per region (run in
    ``order``), then the assembly job; each must succeed."""
    count = len(order)
    for index in order:
        region = {"region": {"index": index, "count": count, "image": image}}
        job = run(job_spec(batch_dir, Pipeline.INFER, inputs, params={**params, **region},
                           shard=Shard(index, count), **common))  # fmt: skip
        assert job.returncode == 0, job.log
        assert f"{image}: region {index + 1} of {count}" in job.log
    assembly = run(job_spec(batch_dir, Pipeline.ASSEMBLE, inputs,
                            params={**params, "regional": [image]}, **common))  # fmt: skip
    assert assembly.returncode == 0, assembly.log


def test_each_shard_leaves_its_progress_for_the_daemon_all_images_done(
    inferred: InferredBatch,
) -> None:
    for job in inferred.shards:
        progress = json.loads((job.spec.job_dir / PROGRESS_FILE).read_text())
        images = [i for i in job.spec.inputs if i.role is Role.IMAGE]
        due_at = progress.pop("due_at")  # when it expected to end: by then, it had
        assert isinstance(due_at, float) and due_at <= time.time()
        assert progress == {"done": len(images), "total": len(images)}


def test_each_shard_writes_masks_at_the_inputs_paths_in_their_format(
    inferred: InferredBatch,
) -> None:
    run_dir = inferred.batch_dir / "results"
    for job in inferred.shards:
        assert job.returncode == 0 and job.result is not None and job.result.ok, job.log
    for item in inferred.inputs:
        mask_path = run_dir / "masks" / item.path
        assert mask_path.suffix == Path(item.path).suffix
        header = mask_path.read_bytes()[:4]
        assert header == (b"\x89PNG" if item.path.endswith(".png") else b"II*\x00")
        mask = read_mask(mask_path)
        assert mask.dtype == np.uint8 and set(np.unique(mask)) <= {0, 255}
        assert mask.shape == decode((inferred.batch_dir / item.path).read_bytes()).shape


def test_each_shard_writes_its_table_with_the_model_version(inferred: InferredBatch) -> None:
    run_dir = inferred.batch_dir / "results"
    parts = work_dir_for(inferred.batch_dir) / "parts"
    assert sorted(p.name for p in parts.iterdir()) == [
        "table-0000.csv",
        "table-0001.csv",
    ]
    metadata = json.loads(
        (inferred.model.registry / inferred.model.name / "v0001" / "metadata.json").read_text()
    )
    rows = []
    for part in sorted(parts.iterdir()):
        with open(part, newline="", encoding="utf-8") as handle:
            reader = csv.DictReader(handle)
            assert reader.fieldnames == TABLE_HEADER
            rows += list(reader)
    assert sorted(row["path"] for row in rows) == sorted(item.path for item in inferred.inputs)
    for row in rows:
        assert (row["model_name"], row["model_version"]) == (inferred.model.name, "1")
        assert row["model_sha256"] == metadata["sha256"]
        assert row["manifest_sha256"] == inferred.shards[0].spec.manifest_sha256
        assert row["code_version"]
        assert int(row["area_px"]) >= 0 and int(row["objects"]) >= 0
        mask = read_mask(run_dir / "masks" / row["path"])
        assert int(row["area_px"]) == int((mask > 0).sum())
        # touching objects are cut apart by background: the mask's components are the objects
        assert int(row["objects"]) == ndimage.label(mask > 0, np.ones((3, 3)))[1]
    summary = inferred.shards[1].result.summary  # type: ignore[union-attr]
    assert (
        summary["model"]["model_version"] == 1 and summary["model"]["requested_version"] == "latest"
    )
    assert summary["table"] == "parts/table-0001.csv"


def test_running_a_shard_again_replaces_its_outputs(
    inferred: InferredBatch, run: Callable[..., JobRun]
) -> None:
    first = inferred.shards[0]
    table = work_dir_for(inferred.batch_dir) / "parts" / "table-0000.csv"
    before = table.read_text(encoding="utf-8")
    again = run(first.spec)
    assert again.returncode == 0, again.log
    assert table.read_text(encoding="utf-8") == before
    leftovers = [p for p in (inferred.batch_dir / "results").rglob(".tmp-*")]
    assert leftovers == []


def test_a_shard_on_three_cpus_makes_the_masks_and_rows_of_one_cpu_in_as_many_workers(
    inferred: InferredBatch,
    tmp_path: Path,
    job_spec: Callable[..., Any],
    run: Callable[..., JobRun],
    infer_params: dict[str, Any],
) -> None:
    """Every input of both shards in one job of three CPUs: three workers read and finish, a
    chunk at a time, in any order; the masks are those of the one-CPU shards bit for bit, the
    rows the same, the ledger one line per image; the summary says how the job ran. The job's
    main process imports torch, and none of the libraries of its workers' stages (Pillow,
    tifffile, scipy, scikit-image): not even to read their replies."""
    batch_dir = tmp_path / "three"
    for folder in ("images", "plate 2 ü"):
        shutil.copytree(inferred.batch_dir / folder, batch_dir / folder)
    spec = job_spec(batch_dir, Pipeline.INFER, inferred.inputs, registry=inferred.model.registry,
                    model=ModelRef(inferred.model.name, "latest"), params=infer_params,
                    resources=Resources(cpus=3))  # fmt: skip
    job = run(spec, MAIN_IMPORTS)
    assert job.returncode == 0 and job.result is not None, job.log
    assert "3 worker(s)" in job.log
    imported = [line for line in job.log.splitlines() if line.startswith("the main process")]
    assert imported == ["the main process imports torch"], job.log
    inference = job.result.summary["inference"]
    assert inference == {"device": "cpu", "precision": "fp32", "checks": [], "compile": "off",
                         "compile_checks": [], "workers": 3, "masks_durable": "syncfs"}  # fmt: skip
    for item in inferred.inputs:
        mine = read_mask(batch_dir / "results" / "masks" / item.path)
        theirs = read_mask(inferred.batch_dir / "results" / "masks" / item.path)
        assert np.array_equal(mine, theirs), item.path
    with open(work_dir_for(batch_dir) / "parts" / "table-0000.csv", newline="") as handle:
        rows = {row["path"]: row for row in csv.DictReader(handle)}
    for part in ("table-0000.csv", "table-0001.csv"):
        with open(work_dir_for(inferred.batch_dir) / "parts" / part, newline="") as handle:
            for row in csv.DictReader(handle):
                assert rows[row["path"]] == row
                assert row["precision"] == "fp32"
    ledger = (work_dir_for(batch_dir) / "ledger" / "shard-0000.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["path"] for line in ledger) == sorted(rows)


def test_a_shard_handed_to_a_warm_start_makes_the_masks_and_rows_of_one_started_cold(
    inferred: InferredBatch,
    tmp_path: Path,
    job_spec: Callable[..., Any],
    infer_params: dict[str, Any],
) -> None:
    """The local executor's way with inference jobs (``executor.local.warm_starts``): the first
    starts cold, the next is forked from a launcher started behind it, torch and the workers'
    code imported before the job came. Both on two CPUs, their masks are those of the session's
    shards bit for bit, their rows the same."""
    executor = LocalExecutor(max_parallel=1, env={**os.environ, "WANDB_MODE": "offline"})
    specs = {}
    try:
        for name in ("cold", "warm"):
            batch_dir = tmp_path / name
            for folder in ("images", "plate 2 ü"):
                shutil.copytree(inferred.batch_dir / folder, batch_dir / folder)
            spec = job_spec(batch_dir, Pipeline.INFER, inferred.inputs,
                            registry=inferred.model.registry, params=infer_params,
                            model=ModelRef(inferred.model.name, "latest"),
                            resources=Resources(cpus=2))  # fmt: skip
            # the spare started behind the cold job may still import once that job ended
            through_executor(executor, spec, warm=name == "warm")
            specs[name] = spec
    finally:
        executor.close()
    logs = {name: (spec.job_dir / "log.txt").read_text() for name, spec in specs.items()}
    for name, warm in (("cold", False), ("warm", True)):
        assert json.loads((specs[name].job_dir / "launch.json").read_text())["warm"] is warm
        assert "RuntimeWarning" not in logs[name], logs[name]
    # forked: no cold start said, no imports of its own to freeze (the spare froze its)
    assert "watchd: the job starts cold" not in logs["warm"], logs["warm"]
    assert "objects frozen" in logs["cold"] and "objects frozen" not in logs["warm"]
    theirs = {}
    for part in ("table-0000.csv", "table-0001.csv"):
        with open(work_dir_for(inferred.batch_dir) / "parts" / part, newline="") as handle:
            theirs.update({row["path"]: row for row in csv.DictReader(handle)})
    for name in ("cold", "warm"):
        batch_dir = tmp_path / name
        for item in inferred.inputs:
            mine = read_mask(batch_dir / "results" / "masks" / item.path)
            expected = read_mask(inferred.batch_dir / "results" / "masks" / item.path)
            assert np.array_equal(mine, expected), (name, item.path)
        with open(work_dir_for(batch_dir) / "parts" / "table-0000.csv", newline="") as handle:
            rows = {row["path"]: row for row in csv.DictReader(handle)}
        assert rows == theirs, name


def _shard_spec(
    batch_dir: Path,
    inputs: tuple[InputFile, ...],
    job_spec: Callable[..., Any],
    registry: Path,
    model: ModelRef,
    params: dict[str, Any],
) -> Any:
    return job_spec(
        batch_dir,
        Pipeline.INFER,
        inputs,
        registry=registry,
        model=model,
        params=params,
        shard=Shard(2, 3),
    )


def test_bad_images_fail_the_shard_with_one_problem_each(
    inferred: InferredBatch,
    tmp_path: Path,
    job_spec: Callable[..., Any],
    manifest_inputs: Callable[..., Any],
    run: Callable[..., JobRun],
    infer_params: dict[str, Any],
) -> None:
    """Truncated, empty, not-an-image and changed files are all named; no table is written."""
    batch_dir = tmp_path / "batch"
    shutil.copytree(inferred.batch_dir / "images", batch_dir / "images")
    good = sorted((batch_dir / "images").iterdir())
    inputs = list(manifest_inputs(batch_dir, good, checksums=True))
    (batch_dir / "images" / "cut.png").write_bytes(good[1].read_bytes()[:300])
    (batch_dir / "images" / "empty.png").write_bytes(b"")
    (batch_dir / "images" / "notes.tif").write_text("not an image\n")
    inputs += [InputFile(f"images/{n}") for n in ("cut.png", "empty.png", "notes.tif")]
    good[2].write_bytes(good[2].read_bytes() + b"\x00")  # changed after its sha256 was taken
    spec = _shard_spec(
        batch_dir,
        tuple(inputs),
        job_spec,
        inferred.model.registry,
        ModelRef(inferred.model.name, "1"),
        infer_params,
    )
    job = run(spec)
    assert job.returncode == 2, job.log
    error = job.result.error  # type: ignore[union-attr]
    assert error is not None and error.kind is ErrorKind.INPUT
    by_file = {p.where: p for p in error.problems}
    assert set(by_file) == {
        f"input '{inputs[2].path}'",
        "input 'images/cut.png'",
        "input 'images/empty.png'",
        "input 'images/notes.tif'",
    }
    assert by_file[f"input '{inputs[2].path}'"].message.startswith("sha256 is ")
    assert "cannot be decoded as PNG" in by_file["input 'images/cut.png'"].message
    assert "empty" in by_file["input 'images/empty.png'"].message
    assert "not a PNG or TIFF" in by_file["input 'images/notes.tif'"].message
    assert all(p.hint for p in error.problems)
    assert not (work_dir_for(batch_dir) / "parts").exists()


def test_a_mask_that_cannot_be_written_fails_the_job_after_the_masks_written_before_it(
    inferred: InferredBatch,
    tmp_path: Path,
    job_spec: Callable[..., Any],
    manifest_inputs: Callable[..., Any],
    run: Callable[..., JobRun],
    infer_params: dict[str, Any],
) -> None:
    """Masks are written by the finisher thread: its error still fails the job, the ledger holds
    exactly the masks written before it, and a re-run does only the rest. A file planted where
    a folder of masks goes is the owner's doing: an INPUT problem naming it."""
    batch_dir = tmp_path / "blocked"
    for folder in ("images", "plate 2 ü"):
        shutil.copytree(inferred.batch_dir / folder, batch_dir / folder)
    files = sorted((batch_dir / "images").iterdir()) + sorted(
        (batch_dir / "plate 2 ü").rglob("*.tif")
    )
    spec = _shard_spec(batch_dir, manifest_inputs(batch_dir, files), job_spec,
                       inferred.model.registry, ModelRef(inferred.model.name, "latest"),
                       infer_params)  # fmt: skip
    blocker = batch_dir / "results" / "masks" / "plate 2 ü"
    blocker.parent.mkdir(parents=True)
    blocker.write_text("a file where the masks' folder goes\n")
    job = run(spec)
    assert job.returncode == 2, job.log
    error = job.result.error  # type: ignore[union-attr]
    assert error is not None and error.kind is ErrorKind.INPUT
    assert [p.where for p in error.problems] == ["'results/masks/plate 2 ü'"]
    ledger = work_dir_for(batch_dir) / "ledger" / "shard-0002.jsonl"
    done = [json.loads(line)["path"] for line in ledger.read_text().splitlines()]
    assert done == [f"images/{f.name}" for f in files[:3]]
    assert not (work_dir_for(batch_dir) / "parts").exists()
    blocker.unlink()
    again = run(spec)
    assert again.result is not None and again.result.summary["resumed"] == 3, again.log
    assert again.result.summary["segmented"] == 2


def test_an_unknown_model_is_a_model_error_listing_what_exists(
    inferred: InferredBatch,
    tmp_path: Path,
    job_spec: Callable[..., Any],
    run: Callable[..., JobRun],
    infer_params: dict[str, Any],
) -> None:
    spec = _shard_spec(
        tmp_path, (), job_spec, inferred.model.registry, ModelRef("nuclei", "latest"), infer_params
    )
    job = run(spec)
    assert job.returncode == 2, job.log
    error = job.result.error  # type: ignore[union-attr]
    assert error is not None and error.kind is ErrorKind.MODEL
    assert "no model named 'nuclei'" in error.message and "spheroids" in error.message


def test_tampered_weights_are_a_model_error_naming_the_expected_hash(
    inferred: InferredBatch,
    tmp_path: Path,
    job_spec: Callable[..., Any],
    run: Callable[..., JobRun],
    infer_params: dict[str, Any],
) -> None:
    registry = tmp_path / "registry"
    shutil.copytree(inferred.model.registry, registry)
    weights = registry / inferred.model.name / "v0001" / "weights.pt"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0x01
    weights.write_bytes(bytes(data))
    expected = json.loads((weights.parent / "metadata.json").read_text())["sha256"]
    batch_dir = tmp_path / "batch"
    shutil.copytree(inferred.batch_dir / "images", batch_dir / "images")
    inputs = tuple(i for i in inferred.inputs if i.path.startswith("images/"))
    spec = _shard_spec(
        batch_dir, inputs, job_spec, registry, ModelRef(inferred.model.name, "best"), infer_params
    )
    job = run(spec)
    assert job.returncode == 2, job.log
    error = job.result.error  # type: ignore[union-attr]
    assert error is not None and error.kind is ErrorKind.MODEL
    assert f"recorded {expected}" in error.message
    assert not (batch_dir / "results" / "masks").exists()


def _grid(synth: Any, cells: int, size: int, seed: int) -> np.ndarray:
    """A slide of cells×cells synthetic droplets, float in [0, 1]."""
    rows = [
        np.hstack([synth.sample(seed, r * cells + c, size).image for c in range(cells)])
        for r in range(cells)
    ]
    return np.vstack(rows)


def test_a_rerun_skips_images_already_done_with_the_same_bytes_and_model(
    inferred: InferredBatch,
    tmp_path: Path,
    job_spec: Callable[..., Any],
    manifest_inputs: Callable[..., Any],
    run: Callable[..., JobRun],
    infer_params: dict[str, Any],
) -> None:
    batch_dir = tmp_path / "resumable"
    shutil.copytree(inferred.batch_dir / "images", batch_dir / "images")
    files = sorted((batch_dir / "images").iterdir())
    inputs = manifest_inputs(batch_dir, files)  # no sha256: the ledger hashes the files
    spec = _shard_spec(batch_dir, inputs, job_spec, inferred.model.registry,
                       ModelRef(inferred.model.name, "latest"), infer_params)  # fmt: skip
    first = run(spec)
    assert first.returncode == 0 and first.result is not None, first.log
    assert (first.result.summary["segmented"], first.result.summary["resumed"]) == (3, 0)
    ledger = work_dir_for(batch_dir) / "ledger" / "shard-0002.jsonl"
    assert len(ledger.read_text().splitlines()) == 3
    table = (work_dir_for(batch_dir) / "parts" / "table-0002.csv").read_text()
    again = run(spec)
    assert again.result is not None and again.result.summary["resumed"] == 3, again.log
    assert "3 of 3 images already done (ledger): skipped" in again.log
    assert (work_dir_for(batch_dir) / "parts" / "table-0002.csv").read_text() == table
    image = Image.open(files[1])
    Image.fromarray(255 - np.asarray(image)).save(files[1])  # new bytes at the same path
    changed = run(spec)
    assert changed.result is not None and changed.result.summary["segmented"] == 1, changed.log
    assert changed.result.summary["resumed"] == 2


@pytest.mark.parametrize("scanned", ["slide.svs", "slide.ndpi"])
def test_a_scanners_slide_is_read_by_its_pyramid_like_the_same_slide_as_a_tiff(
    scanned: str,
    inferred: InferredBatch,
    synth: ModuleType,
    tmp_path: Path,
    job_spec: Callable[..., Any],
    manifest_inputs: Callable[..., Any],
    run: Callable[..., JobRun],
    infer_params: dict[str, Any],
) -> None:
    """A scanner's slide, RGB in JPEG, its levels reduced by four: an Aperio SVS (tiles, its
    levels in pages after a thumbnail) or a Hamamatsu NDPI (64-bit offsets, each level one
    JPEG read a restart interval at a time, a macro image after them): segmented window by
    window, its glass found on its smallest level (not the thumbnail or the macro), its label
    image that of the same slide written as a grey TIFF but for what JPEG changed."""
    batch_dir = tmp_path / "scanned"
    for name in (scanned, "slide.tif"):
        synth.write_slide(batch_dir / "images" / name, 1100, seed=4, levels=2, tissue=0.3)
    registry_dir, model = inferred.model.registry, ModelRef(inferred.model.name, "1")
    params = {**infer_params, "max_whole_pixels": 100_000, "tile_size": 256, "tile_overlap": 32}
    images = [batch_dir / "images" / name for name in (scanned, "slide.tif")]
    job = run(job_spec(batch_dir, Pipeline.INFER, manifest_inputs(batch_dir, images),
                       registry=registry_dir, model=model, params=params))  # fmt: skip
    assert job.returncode == 0, job.log
    assert f"images/{scanned}: tiled inference" in job.log
    assert "tissue mask from the 275x275 level" in job.log
    with open(work_dir_for(batch_dir) / "parts" / "table-0000.csv", newline="") as handle:
        mine, tif = list(csv.DictReader(handle))
    assert mine["path"] == f"images/{scanned}" and int(mine["windows_glass"]) > 0
    assert [mine[key] for key in ("windows_run", "windows_glass")] == [
        tif[key] for key in ("windows_run", "windows_glass")
    ]
    masks = batch_dir / "results" / "masks" / "images"
    got = zarr_levels(masks / f"{scanned}.ome.zarr", "labels/segmentation")[0] > 0
    want = zarr_levels(masks / "slide.tif.ome.zarr", "labels/segmentation")[0] > 0
    assert want.sum() > 1000 and (got == want).mean() > 0.99


def test_an_ome_zarr_store_is_segmented_like_the_same_slide_as_a_tiff_in_one_task_or_regions(
    inferred: InferredBatch,
    synth: ModuleType,
    tmp_path: Path,
    job_spec: Callable[..., Any],
    manifest_inputs: Callable[..., Any],
    run: Callable[..., JobRun],
    infer_params: dict[str, Any],
) -> None:
    """An OME-Zarr image (a folder of chunks; t, c, z, y, x) holding the pixels of a slide's
    TIFF, level for level: read a chunk at a time, its glass found on its smallest level, its
    label image, object table and row those of the TIFF; then split into three region jobs
    and assembled, the same again (the store walked by each job: its state the same)."""
    one_dir, regions_dir = tmp_path / "one", tmp_path / "regions"
    for name in ("slide.ome.zarr", "slide.tif"):
        synth.write_slide(one_dir / "images" / name, 1100, seed=4, levels=2, tissue=0.3)
    shutil.copytree(
        one_dir / "images" / "slide.ome.zarr", regions_dir / "images" / "slide.ome.zarr"
    )
    registry_dir, model = inferred.model.registry, ModelRef(inferred.model.name, "1")
    params = {**infer_params, "max_whole_pixels": 100_000, "tile_size": 256, "tile_overlap": 32}
    images = [one_dir / "images" / name for name in ("slide.ome.zarr", "slide.tif")]
    inputs = manifest_inputs(one_dir, images)
    assert inputs[0].size is None and inputs[0].sha256 is None  # a folder: neither
    spec = job_spec(one_dir, Pipeline.INFER, inputs, registry=registry_dir, model=model,
                    params=params)  # fmt: skip
    job = run(spec)
    assert job.returncode == 0, job.log
    assert "images/slide.ome.zarr: tiled inference" in job.log
    assert job.log.count("tissue mask from the 275x275 level") == 2
    with open(work_dir_for(one_dir) / "parts" / "table-0000.csv", newline="") as handle:
        store_row, tif_row = list(csv.DictReader(handle))
    assert {k: v for k, v in store_row.items() if k != "path"} == {
        k: v for k, v in tif_row.items() if k != "path"
    }
    assert int(store_row["objects"]) > 10 and int(store_row["windows_glass"]) > 0
    one = one_dir / "results"
    for got, want in zip(zarr_levels(one / "masks/images/slide.ome.zarr.ome.zarr", "labels/segmentation"),
                         zarr_levels(one / "masks/images/slide.tif.ome.zarr", "labels/segmentation"),
                         strict=True):  # fmt: skip
        np.testing.assert_array_equal(got, want)
    objects = (one / "objects/images/slide.ome.zarr.csv").read_text()
    assert objects == (one / "objects/images/slide.tif.csv").read_text()
    again = run(spec)  # the ledger knows the store by its state: not segmented again
    assert again.result is not None and again.result.summary["resumed"] == 2, again.log
    chunk = next(p for p in (one_dir / "images" / "slide.ome.zarr" / "0").rglob("*") if p.is_file())
    os.utime(chunk, ns=(1, 1))  # a chunk of it written again
    changed = run(spec)
    assert changed.result is not None and changed.result.summary["segmented"] == 1, changed.log
    inputs = manifest_inputs(regions_dir, [regions_dir / "images" / "slide.ome.zarr"])
    in_regions(run, job_spec, regions_dir, inputs, "images/slide.ome.zarr", (1, 0, 2), params,
               registry=registry_dir, model=model)  # fmt: skip
    same_slide_outputs(regions_dir / "results", one, "slide.ome.zarr")
    with open(work_dir_for(regions_dir) / "parts" / "table-regions.csv", newline="") as handle:
        (row,) = list(csv.DictReader(handle))
    assert row == store_row


def test_a_large_rgb_16_bit_tiff_is_segmented_window_by_window_like_the_whole_image(
    inferred: InferredBatch,
    synth: ModuleType,
    tmp_path: Path,
    job_spec: Callable[..., Any],
    manifest_inputs: Callable[..., Any],
    run: Callable[..., JobRun],
    infer_params: dict[str, Any],
) -> None:
    """Tiled and whole masks of the same RGB 16-bit slide agree; the tiled one is an OME-Zarr
    label image with its object table; a PNG too large to decode whole is refused with a hint."""
    grey = _grid(synth, 5, 64, seed=9)
    rgb = np.round(np.repeat(grey[..., None], 3, axis=2) * 65535).astype(np.uint16)
    batch_dir = tmp_path / "slides"
    (batch_dir / "images").mkdir(parents=True)
    tifffile.imwrite(batch_dir / "images" / "slide.tif", rgb, tile=(64, 64), compression="zlib")
    Image.fromarray((grey * 255).astype(np.uint8)).save(batch_dir / "images" / "huge.png")
    registry_dir, model = inferred.model.registry, ModelRef(inferred.model.name, "1")
    slide = manifest_inputs(batch_dir, [batch_dir / "images" / "slide.tif"], checksums=True)
    whole = run(job_spec(batch_dir, Pipeline.INFER, slide, registry=registry_dir, model=model,
                         params=infer_params, job_name="whole"))  # fmt: skip
    assert whole.returncode == 0, whole.log
    whole_mask = read_mask(batch_dir / "results" / "masks" / "images" / "slide.tif") > 0
    shutil.rmtree(work_dir_for(batch_dir) / "ledger")
    params = {**infer_params, "max_whole_pixels": 100_000, "tile_size": 128, "tile_overlap": 32}
    tiled = run(job_spec(batch_dir, Pipeline.INFER, slide, registry=registry_dir, model=model,
                         params=params, job_name="tiled"))  # fmt: skip
    assert tiled.returncode == 0, tiled.log
    assert "images/slide.tif: tiled inference" in tiled.log
    results = batch_dir / "results"
    level0 = zarr_levels(
        results / "masks" / "images" / "slide.tif.ome.zarr", "labels/segmentation"
    )[0]
    assert level0.shape == (320, 320)
    tiled_mask = level0 > 0
    # The session's model trained 2 epochs: many pixels sit near the threshold, where each
    # window's own standardisation tips them. scripts/bench_tiled.py measures a trained model.
    assert (tiled_mask == whole_mask).mean() > 0.9
    with open(work_dir_for(batch_dir) / "parts" / "table-0000.csv", newline="") as handle:
        (row,) = list(csv.DictReader(handle))
    assert row["tiled"] == "1" and int(row["area_px"]) == int(tiled_mask.sum())
    with open(results / "objects" / "images" / "slide.tif.csv", newline="") as handle:
        objects = list(csv.DictReader(handle))
    assert len(objects) == int(row["objects"]) == int(level0.max())
    assert sum(int(o["area_px"]) for o in objects) == int(row["area_px"])
    huge = manifest_inputs(batch_dir, [batch_dir / "images" / "huge.png"])
    refused = run(job_spec(batch_dir, Pipeline.INFER, huge, registry=registry_dir, model=model,
                           params=params, job_name="huge"))  # fmt: skip
    assert refused.returncode == 2 and refused.result is not None
    (problem,) = refused.result.error.problems  # type: ignore[union-attr]
    assert problem.render() == (
        "input 'images/huge.png': is 320×320 pixels (102 400), more than "
        "params.max_whole_pixels = 100 000 allows to segment as a whole — raise "
        "params.max_whole_pixels in the manifest (a 2048×2048 image needs about 2 GB), or save "
        "it as a TIFF: those are segmented window by window"
    )


# Root reads any file whatever its mode: the job runs without the capabilities that allow it.
UNPRIVILEGED = (
    ("setpriv", "--inh-caps=-dac_override,-dac_read_search",
     "--bounding-set=-dac_override,-dac_read_search")
    if os.geteuid() == 0 else ()
)  # fmt: skip


def test_an_unreadable_image_is_a_problem_of_that_image_and_the_others_are_segmented(
    inferred: InferredBatch,
    tmp_path: Path,
    job_spec: Callable[..., Any],
    manifest_inputs: Callable[..., Any],
    run: Callable[..., JobRun],
    infer_params: dict[str, Any],
) -> None:
    """Permission denied on one input: kind INPUT (not retried), that file named with what to
    do, every other image's mask written as for any bad image."""
    batch_dir = tmp_path / "batch"
    shutil.copytree(inferred.batch_dir / "images", batch_dir / "images")
    files = sorted((batch_dir / "images").iterdir())
    inputs = manifest_inputs(batch_dir, files, checksums=True)
    files[1].chmod(0)
    spec = _shard_spec(batch_dir, inputs, job_spec, inferred.model.registry,
                       ModelRef(inferred.model.name, "1"), infer_params)  # fmt: skip
    job = run(spec, UNPRIVILEGED)
    assert job.returncode == 2, job.log
    error = job.result.error  # type: ignore[union-attr]
    assert error is not None and error.kind is ErrorKind.INPUT and not error.kind.retryable
    (problem,) = error.problems
    assert problem.render() == (
        f"input '{inputs[1].path}': cannot be read (Permission denied) — make it readable for "
        "the account watchd runs as (e.g. chmod a+r)"
    )
    masks = batch_dir / "results" / "masks"
    assert sorted(p.name for p in (masks / "images").iterdir()) == sorted(
        f.name for f in files if f != files[1]
    )


ODD_NAMES = ("a\rb.png", "c\nd.png", 'e "quoted", f.png', "g\r\n,h'.png", "ü ñ 名.png")


def test_any_legal_file_name_round_trips_through_the_shard_table_and_the_report(
    inferred: InferredBatch,
    tmp_path: Path,
    job_spec: Callable[..., Any],
    manifest_inputs: Callable[..., Any],
    run: Callable[..., JobRun],
    infer_params: dict[str, Any],
) -> None:
    """Carriage returns, line feeds, quotes, commas and non-ASCII in names: every mask made,
    the shard table and the report's table.csv list each name exactly."""
    batch_dir = tmp_path / "batch"
    (batch_dir / "images").mkdir(parents=True)
    source = sorted((inferred.batch_dir / "images").iterdir())[0]
    files = [batch_dir / "images" / name for name in ODD_NAMES]
    for path in files:
        shutil.copyfile(source, path)
    inputs = manifest_inputs(batch_dir, files, checksums=True)
    model = ModelRef(inferred.model.name, "1")
    shard = run(_shard_spec(batch_dir, inputs, job_spec, inferred.model.registry, model,
                            infer_params))  # fmt: skip
    assert shard.returncode == 0, shard.log
    report = run(job_spec(batch_dir, Pipeline.REPORT, inputs, registry=inferred.model.registry,
                          model=model, params=infer_params, job_name="report"))  # fmt: skip
    assert report.returncode == 0, report.log
    expected = sorted(f"images/{name}" for name in ODD_NAMES)
    tables = (work_dir_for(batch_dir) / "parts/table-0002.csv", batch_dir / "results/table.csv")
    for table in tables:
        with open(table, newline="", encoding="utf-8") as handle:
            assert sorted(row["path"] for row in csv.DictReader(handle)) == expected, table
    assert all((batch_dir / "results" / "masks" / "images" / name).is_file() for name in ODD_NAMES)


def test_slides_segmented_by_the_jobs_workers_side_by_side_are_the_one_process_label_images(
    tmp_path: Path,
    synth: ModuleType,
    inferred: InferredBatch,
    job_spec: Callable[..., JobSpec],
    manifest_inputs: Callable[..., Any],
    run: Callable[..., JobRun],
    infer_params: dict[str, Any],
) -> None:
    """A job of 3 CPUs segments each slide of its shard (a TIFF, an OME-Zarr store) in 3
    regions at once, its workers each opening it, reading and labelling their region while
    the net runs in the job's main process, then relabelling and halving the label image's
    chunks: every level, the object tables and the table rows equal those of a job of 1 CPU
    (which segments them alone), with the trained model; no temporary folder is left beside
    the label images."""
    params = {**infer_params, "max_whole_pixels": 100_000, "tile_size": 96, "tile_overlap": 16}
    registry_dir, model = inferred.model.registry, ModelRef(inferred.model.name, "1")
    names = ("slide.ome.zarr", "slide.tif")
    outputs = {}
    for cpus in (1, 3):
        batch_dir = tmp_path / f"cpus-{cpus}"
        for name in names:
            synth.write_slide(batch_dir / "images" / name, 1100, seed=4, tissue=0.3)
        images = [batch_dir / "images" / name for name in names]
        inputs = manifest_inputs(batch_dir, images, checksums=True)
        job = run(job_spec(batch_dir, Pipeline.INFER, inputs, registry=registry_dir, model=model,
                           params=params, resources=Resources(cpus=cpus)))  # fmt: skip
        assert job.returncode == 0, job.log
        assert job.log.count("3 regions side by side") == (2 if cpus == 3 else 0), job.log
        outputs[cpus] = batch_dir
    one, three = (outputs[cpus] / "results" for cpus in (1, 3))
    for name in names:
        levels = same_slide_outputs(three, one, name)
        assert len(levels) == 3 and int(levels[0].max()) > 10  # objects: a comparison of them
    rows = []
    for cpus in (1, 3):
        with open(work_dir_for(outputs[cpus]) / "parts" / "table-0000.csv", newline="") as handle:
            rows.append(list(csv.DictReader(handle)))
    assert rows[0] == rows[1] and len(rows[0]) == 2
    assert sorted(p.name for p in (three / "masks" / "images").iterdir()) == sorted(
        f"{name}.ome.zarr" for name in names
    )


def test_a_slide_split_across_region_jobs_assembles_into_the_one_job_label_image(
    tmp_path: Path,
    synth: ModuleType,
    inferred: InferredBatch,
    job_spec: Callable[..., JobSpec],
    manifest_inputs: Callable[..., Any],
    run: Callable[..., JobRun],
    infer_params: dict[str, Any],
) -> None:
    """Three inference jobs, each one region of a slide (as the daemon plans a large file),
    then the assembly job: the label image, the object table and the table row equal those
    of one job segmenting the whole slide with the trained model, the windows skipped as glass
    counted once; the work folder is gone."""
    slides = {}
    for name in ("one", "regions"):
        batch_dir = tmp_path / name
        synth.write_slide(batch_dir / "images" / "slide.tif", 1100, seed=4, tissue=0.3)
        slides[name] = (
            batch_dir,
            manifest_inputs(batch_dir, [batch_dir / "images" / "slide.tif"], checksums=True),
        )
    registry_dir, model = inferred.model.registry, ModelRef(inferred.model.name, "1")
    params = {**infer_params, "max_whole_pixels": 100_000, "tile_size": 256, "tile_overlap": 32}
    one_dir, inputs = slides["one"]
    one = run(
        job_spec(one_dir, Pipeline.INFER, inputs, registry=registry_dir, model=model, params=params)
    )
    assert one.returncode == 0, one.log
    batch_dir, inputs = slides["regions"]
    in_regions(run, job_spec, batch_dir, inputs, "images/slide.tif", (2, 0, 1), params,
               registry=registry_dir, model=model)  # fmt: skip
    same_slide_outputs(batch_dir / "results", one_dir / "results", "slide.tif")
    with open(work_dir_for(batch_dir) / "parts" / "table-regions.csv", newline="") as handle:
        (row,) = list(csv.DictReader(handle))
    with open(work_dir_for(one_dir) / "parts" / "table-0000.csv", newline="") as handle:
        (wanted,) = list(csv.DictReader(handle))
    assert row == wanted
    assert int(row["windows_glass"]) > 0 and int(row["windows_run"]) > 0
    assert not (work_dir_for(batch_dir) / "regions").exists()
    assert int(row["objects"]) > 10  # droplets found, so the comparison means something
