"""Replay scenarios of the model life cycle: a training drop registers a model, an inference
drop naming ``latest`` uses it, a sweep drop registers its best trial, all through the real
daemon loop and the real local executor."""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from pathlib import Path

import synth
from conftest import MODEL, TINY_TRAINING
from replay import Replay, copy_slowly, manifest_text
from zarr.core.sync import cleanup_resources

from daemon.contract.spool import work_dir
from daemon.core.manifest_schema import Kind
from daemon.core.states import BatchState, JobState
from daemon.site.config import Config
from daemon.store import Store


def batches_and_jobs(config: Config) -> dict[str, tuple[object, list]]:
    store = Store(config.daemon.database)
    try:
        return {b.folder: (b, store.jobs([b.id])) for b in store.batches()}
    finally:
        store.close()


def staged_training(tmp_path: Path, kind: Kind = Kind.TRAINING, **options: object) -> Path:
    folder = tmp_path / "staging" / kind.value
    synth.make_batch(folder, "training", count=8, size=48, seed=11)
    (folder / "manifest.toml").write_bytes(
        manifest_text(folder, kind, model=MODEL, params=TINY_TRAINING, **options)
    )
    return folder


def test_a_training_drop_registers_a_model_that_an_inference_drop_naming_latest_uses(
    config_for: Callable[..., Config],
    staged: Callable[..., Path],
    drop_root: Path,
    registry: Path,
    tmp_path: Path,
) -> None:
    config = config_for()
    before = json.loads((registry / MODEL / "aliases.json").read_text())["latest"]
    with Replay(config) as replay:
        replay.run(copy_slowly(staged_training(tmp_path), drop_root / "annotated", 0.0, 0.01),
                   timeout=240)  # fmt: skip
        replay.run(copy_slowly(staged(count=3), drop_root / "plate", 0.0, 0.01), timeout=240)
    found = batches_and_jobs(config)
    training, _ = found["annotated"]
    assert training.state is BatchState.DONE, training.reason
    aliases = json.loads((registry / MODEL / "aliases.json").read_text())
    assert aliases["latest"] == before + 1
    version_dir = registry / MODEL / f"v{before + 1:04d}"
    metadata = json.loads((version_dir / "metadata.json").read_text())
    assert metadata["manifest_sha256"] == training.manifest_sha256
    assert metadata["origin"]["batch_id"] == training.id
    card = json.loads((Path(training.run_dir) / "training" / "model.json").read_text())
    assert card["version"] == before + 1
    inference, _ = found["plate"]
    assert inference.state is BatchState.DONE, inference.reason
    with open(Path(inference.run_dir) / "table.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 3
    assert {(r["model_name"], r["model_version"], r["model_sha256"]) for r in rows} == {
        (MODEL, str(before + 1), metadata["sha256"])
    }
    summary = json.loads((Path(inference.run_dir) / "summary.json").read_text())
    assert summary["inference"]["model"]["version"] == before + 1


def test_a_sweep_drop_runs_its_trials_together_and_ends_with_the_best_trial_registered(
    config_for: Callable[..., Config], drop_root: Path, registry: Path, tmp_path: Path
) -> None:
    config = config_for()
    sweep = {"method": "grid", "space": {"learning_rate": [0.02, 0.0002]}}
    before = json.loads((registry / MODEL / "aliases.json").read_text())["latest"]
    folder = staged_training(tmp_path, Kind.SWEEP, sweep=sweep)
    with Replay(config) as replay:
        replay.run(copy_slowly(folder, drop_root / "sweep", 0.0, 0.01), timeout=300)
    batch, jobs = batches_and_jobs(config)["sweep"]
    assert batch.state is BatchState.DONE, batch.reason
    assert [(j.name.split("-", 1)[1], j.state) for j in jobs] == [
        ("trial-0000", JobState.SUCCEEDED),
        ("trial-0001", JobState.SUCCEEDED),
        ("sweep", JobState.SUCCEEDED),
        ("report", JobState.SUCCEEDED),
    ]
    assert [dict(j.params) for j in jobs[:2]] == [
        {"learning_rate": 0.02, "trial": 0},
        {"learning_rate": 0.0002, "trial": 1},
    ]
    assert json.loads((registry / MODEL / "aliases.json").read_text())["latest"] == before + 1
    run_dir = Path(batch.run_dir)
    work = work_dir(config.daemon.spool_dir, batch.id, batch.run_dir)
    candidates = {
        path.parent.name: json.loads(path.read_text())
        for path in (work / "trials").glob("*/candidate.json")
    }
    winner = max(candidates, key=lambda job: candidates[job]["metrics"]["val_dice"])
    metadata = json.loads((registry / MODEL / f"v{before + 1:04d}" / "metadata.json").read_text())
    assert metadata["sweep"]["winner"] == winner
    assert metadata["sha256"] == candidates[winner]["sha256"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["sweep"]["winner"] == winner and summary["sweep"]["trials"] == 2
    assert summary["training"]["model"]["version"] == before + 1
    assert "<h2>Sweep</h2>" in (run_dir / "report.html").read_text()


def test_a_slide_larger_than_region_bytes_is_segmented_by_region_jobs_assembled_and_reported(
    tmp_path: Path, config_for: Callable[..., Config], registry: Path, drop_root: Path
) -> None:
    """A drop of small images and one pyramidal slide: the slide's file is larger than
    ``[planner] region_bytes``, so three jobs segment a region of it each, beside the small
    images' shard; the assembly job makes its label image and object table; the report
    lists every image; the batch is done and no work folder is left."""
    staging = tmp_path / "staging" / "slides"
    synth.make_batch(staging, "inference", count=3, size=64, seed=5)
    synth.write_slide(staging / "images" / "scan.tif", 1300, seed=6, levels=1)
    slide_bytes = (staging / "images" / "scan.tif").stat().st_size
    params = {"max_whole_pixels": 500_000, "tile_size": 256, "tile_overlap": 32}
    (staging / "manifest.toml").write_bytes(
        manifest_text(staging, Kind.INFERENCE, model=MODEL, version="latest", params=params)
    )
    config = config_for(planner={"region_bytes": slide_bytes // 3 + 1})
    with Replay(config) as replay:
        replay.run(copy_slowly(staging, drop_root / "slides", 0.0, 0.01), timeout=240)
    ((batch, jobs),) = batches_and_jobs(config).values()
    assert batch.state is BatchState.DONE, batch.reason
    assert [(j.name.split("-", 1)[1], j.state) for j in jobs] == [
        ("infer-0000", JobState.SUCCEEDED),
        ("infer-0001", JobState.SUCCEEDED),
        ("infer-0002", JobState.SUCCEEDED),
        ("infer-0003", JobState.SUCCEEDED),
        ("assemble", JobState.SUCCEEDED),
        ("report", JobState.SUCCEEDED),
    ]
    assert [j.params.get("region", {}).get("index") for j in jobs[:4]] == [None, 0, 1, 2]
    assert sum(j.images for j in jobs) == 4
    run = Path(batch.run_dir)
    assert (run / "masks" / "images" / "scan.tif.ome.zarr" / "labels" / "segmentation").is_dir()
    with open(run / "table.csv", newline="") as handle:
        rows = {row["path"]: row for row in csv.DictReader(handle)}
    assert sorted(rows) == ["images/img_0000.png", "images/img_0001.png", "images/img_0002.png",
                            "images/scan.tif"]  # fmt: skip
    objects = (run / "objects" / "images" / "scan.tif.csv").read_text().splitlines()
    assert rows["images/scan.tif"]["tiled"] == "1"
    assert len(objects) - 1 == int(rows["images/scan.tif"]["objects"])
    assert not (run / "regions" / "images" / "scan.tif.zarr").exists()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["inference"]["images"] == 4


def test_an_ome_zarr_store_dropped_chunk_by_chunk_is_split_by_its_bytes_and_segmented(
    tmp_path: Path, config_for: Callable[..., Config], registry: Path, drop_root: Path
) -> None:
    """An OME-Zarr image (a folder of chunk files) copied into the drop folder a file at a
    time, the manifest (which lists the store by its name, no size) last: taken in once the
    store stops changing, split into three region jobs by its files' bytes, assembled into a
    label image and an object table, reported; the batch is done."""
    staging = tmp_path / "staging" / "zarr"
    synth.write_slide(staging / "scan.ome.zarr", 1300, seed=6, levels=1, tissue=0.5)
    cleanup_resources()  # zarr's threads, which wrote it here
    store_bytes = sum(
        p.stat().st_size for p in (staging / "scan.ome.zarr").rglob("*") if p.is_file()
    )
    params = {"max_whole_pixels": 500_000, "tile_size": 256, "tile_overlap": 32}
    manifest = manifest_text(staging, Kind.INFERENCE, model=MODEL, version="latest", params=params)
    assert b'{ path = "scan.ome.zarr" }' in manifest  # no size, no checksum
    (staging / "manifest.toml").write_bytes(manifest)
    config = config_for(planner={"region_bytes": store_bytes // 3 + 1})
    with Replay(config) as replay:
        replay.run(copy_slowly(staging, drop_root / "zarr", 0.0, 0.005), timeout=240)
    ((batch, jobs),) = batches_and_jobs(config).values()
    assert batch.state is BatchState.DONE, batch.reason
    assert [(j.name.split("-", 1)[1], j.state) for j in jobs] == [
        ("infer-0000", JobState.SUCCEEDED),
        ("infer-0001", JobState.SUCCEEDED),
        ("infer-0002", JobState.SUCCEEDED),
        ("assemble", JobState.SUCCEEDED),
        ("report", JobState.SUCCEEDED),
    ]
    run = Path(batch.run_dir)
    assert (run / "masks" / "scan.ome.zarr.ome.zarr" / "labels" / "segmentation").is_dir()
    with open(run / "table.csv", newline="") as handle:
        (row,) = list(csv.DictReader(handle))
    objects = (run / "objects" / "scan.ome.zarr.csv").read_text().splitlines()
    assert row["path"] == "scan.ome.zarr" and row["tiled"] == "1"
    assert int(row["objects"]) > 10 and len(objects) - 1 == int(row["objects"])
    assert "scan.ome.zarr" in (run / "report.html").read_text()
