"""A real training job: ``python -m pipelines.train JOB_DIR`` on a tiny synthetic batch."""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import json
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
from scipy import ndimage

from daemon.contract.jobspec import SPEC_FILE, ErrorKind, InputFile, ModelRef, Pipeline, Resources
from models import registry
from pipelines.images import decode

if TYPE_CHECKING:
    from collections.abc import Callable

    from conftest import JobRun, TrainedModel


def test_training_registers_a_version_with_metadata_and_aliases(
    trained: TrainedModel, train_params: dict[str, Any]
) -> None:
    job = trained.run
    assert job.result is not None and job.result.ok, job.log
    version_dir = trained.registry / trained.name / "v0001"
    weights = (version_dir / "weights.pt").read_bytes()
    metadata = json.loads((version_dir / "metadata.json").read_text())
    assert metadata["sha256"] == hashlib.sha256(weights).hexdigest()
    assert metadata["version"] == 1 and metadata["name"] == trained.name
    assert metadata["architecture"] == {"depth": 2, "width": 8, "in_channels": 1}
    assert metadata["params"] == train_params
    assert metadata["manifest_sha256"] == job.spec.manifest_sha256
    assert metadata["training"]["epochs_run"] == 2 and metadata["training"]["wall_time_s"] > 0
    for key in ("created_at", "code_version", "torch_version", "lightning_version", "hardware"):
        assert metadata[key], key
    assert set(metadata["metrics"]) == {
        "epoch", "train_loss", "val_loss", "val_dice", "val_iou", "val_object_f1",
        "val_matched_iou", "val_count_error", "val_objects", "val_objects_found",
        "val_objects_matched",
    }  # fmt: skip
    aliases = json.loads((trained.registry / trained.name / "aliases.json").read_text())
    assert aliases == {"latest": 1, "best": 1}


def test_training_writes_curves_model_card_and_previews_into_its_work_folder(
    trained: TrainedModel,
) -> None:
    """Into the run's work folder in the spool (the report copies the model card and the curves
    for the owner): a training job writes nothing into the batch folder."""
    job = trained.run
    training = job.work_dir / "training"
    with open(training / "metrics.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [row["epoch"] for row in rows] == ["1", "2"]
    assert set(rows[0]) == {"epoch", "train_loss", "val_loss", "val_dice", "val_iou"}
    card = json.loads((training / "model.json").read_text())
    assert (card["name"], card["version"]) == (trained.name, 1)
    assert job.result is not None and job.result.summary["model"]["version"] == 1
    assert len(list((training / "previews").glob("*.png"))) == 3
    # Lightning writes nothing of its own; W&B only under wandb/ (both reached by descriptor)
    assert sorted(p.name for p in training.iterdir()) == [
        "metrics.csv",
        "model.json",
        "previews",
        "validation.csv",
        "wandb",
    ]
    batch_dir = Path(job.spec.batch_dir)
    assert {p.name for p in batch_dir.iterdir()} <= {"images", "masks", "results"}  # (report's)
    exchanged = {"jobs", "ledger", "parts", "trials", "sweep", "regions"}
    assert not exchanged & {p.name for p in (batch_dir / "results").glob("*")}
    assert {"jobs", "training"} <= {p.name for p in job.work_dir.iterdir()}
    stray = [
        p
        for p in (*batch_dir.rglob("*"), *job.work_dir.rglob("*"))
        if p.name.startswith(".tmp-") or p.suffix == ".ckpt" or p.name == "lightning_logs"
    ]
    assert stray == []


def test_the_objects_of_each_validation_image_are_scored_and_registered_pooled(
    trained: TrainedModel,
) -> None:
    """validation.csv has a row per validation image (its true objects those of its mask);
    the version's metrics are the rows pooled: objects summed, F1 from the sums."""
    training = trained.run.work_dir / "training"
    with open(training / "validation.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    batch_dir = Path(trained.run.spec.batch_dir)
    assert len(rows) == 4 and all(row["image"].startswith("images/") for row in rows)
    for row in rows:
        mask = decode((batch_dir / row["image"].replace("images/", "masks/")).read_bytes())
        assert int(row["objects_true"]) == int(ndimage.label(mask > 0, np.ones((3, 3)))[1])
        assert int(row["count_error"]) == int(row["objects_found"]) - int(row["objects_true"])
    metrics = json.loads((training / "model.json").read_text())["metrics"]
    true, found, matched = (sum(int(r[k]) for r in rows)
                            for k in ("objects_true", "objects_found", "matched"))  # fmt: skip
    assert (metrics["val_objects"], metrics["val_objects_found"]) == (true, found)
    assert metrics["val_objects_matched"] == matched
    assert metrics["val_object_f1"] == (round(2 * matched / (true + found), 4) if true + found else 1)
    miscounted = sum(abs(int(r["count_error"])) for r in rows)
    assert metrics["val_count_error"] == (round(miscounted / true, 4) if true else None)


def test_a_retried_training_job_does_not_publish_twice(
    trained: TrainedModel, run: Callable[..., JobRun]
) -> None:
    """Attempt 2 of a job whose attempt 1 published (then died) reuses that version."""
    retry = dataclasses.replace(trained.run.spec, attempt=2)
    (retry.job_dir / SPEC_FILE).write_text(retry.to_json(), encoding="utf-8")
    job = run(retry)
    assert job.returncode == 0, job.log
    assert "version 1 was published by an earlier attempt: not training again" in job.log
    assert registry.list_versions(trained.registry, trained.name) == [1]
    assert job.result is not None and job.result.summary["model"]["version"] == 1


def test_training_log_is_plain_and_quiet(trained: TrainedModel) -> None:
    log = trained.run.log
    assert "epoch 2/2: train_loss" in log and "registered spheroids version 1" in log
    assert "Warning" not in log and "Traceback" not in log
    assert [line for line in log.splitlines() if line.strip() and not line[:4].isdigit()] == []


def test_bad_training_inputs_fail_with_every_problem(
    synth: ModuleType,
    tmp_path: Path,
    manifest_inputs: Callable[..., Any],
    job_spec: Callable[..., Any],
    run: Callable[..., JobRun],
    train_params: dict[str, Any],
) -> None:
    """A missing mask and a checksum mismatch: one INPUT error naming both, nothing registered."""
    batch_dir = tmp_path / "training batch"
    files = synth.make_batch(batch_dir, "training", count=4, size=32, seed=0)
    inputs = list(manifest_inputs(batch_dir, files, checksums=True))
    inputs = [i for i in inputs if i.path != "masks/img_0003.png"]
    inputs[0] = InputFile(inputs[0].path, inputs[0].size, "9b1c" + "0" * 60, inputs[0].role)
    spec = job_spec(
        batch_dir,
        Pipeline.TRAIN,
        tuple(inputs),
        registry=tmp_path / "registry",
        model=ModelRef("spheroids"),
        params=train_params,
        batch_kind="training",
    )
    job = run(spec)
    assert job.returncode == 2, job.log
    assert job.result is not None and not job.result.ok and job.result.error is not None
    assert job.result.error.kind is ErrorKind.INPUT
    rendered = [p.render() for p in job.result.error.problems]
    assert rendered == [
        "input 'images/img_0003.png': no mask named 'img_0003'.* for this image — every "
        "training image needs a mask with the same file name stem",
        "input 'images/img_0000.png': sha256 is "
        + hashlib.sha256(files[0].read_bytes()).hexdigest()[:12]
        + "…, expected 9b1c00000000… — the file changed or was damaged while copying; "
        "copy it again",
    ]
    assert not (tmp_path / "registry").exists()


def test_training_with_two_tasks_runs_cpu_ddp_and_only_rank_zero_publishes(
    synth: ModuleType,
    tmp_path: Path,
    manifest_inputs: Callable[..., Any],
    job_spec: Callable[..., Any],
    run: Callable[..., JobRun],
    train_params: dict[str, Any],
) -> None:
    """resources.tasks = 2: Lightning starts a second rank (gloo on CPU); one version, one
    result."""
    batch_dir = tmp_path / "ddp batch"
    files = synth.make_batch(batch_dir, "training", count=8, size=32, seed=4)
    spec = job_spec(
        batch_dir,
        Pipeline.TRAIN,
        manifest_inputs(batch_dir, files),
        registry=tmp_path / "registry",
        model=ModelRef("ddp"),
        params=train_params,
        batch_kind="training",
        resources=Resources(cpus=1, tasks=2),
    )
    job = run(spec)
    assert job.returncode == 0 and job.result is not None and job.result.ok, job.log
    assert registry.list_versions(tmp_path / "registry", "ddp") == [1]
    published = registry.resolve(tmp_path / "registry", "ddp", "latest")
    assert published.metadata["training"]["processes"] == 2
    assert job.log.count("rank 1 finished: rank 0 writes the result") == 1
    assert job.log.count("registered ddp version 1") == 1
    assert job.log.count("epoch 2/2: train_loss") == 1


def test_the_trainer_layout_follows_tasks_locally_and_slurm_under_srun() -> None:
    """Locally Lightning spawns the ranks; inside ``srun --ntasks`` Slurm's variables decide
    (and Lightning's Slurm environment, not ours, reads them)."""
    from lightning.pytorch.plugins.environments import LightningEnvironment

    from pipelines.fitting import layout

    alone = layout(1, 0, {})
    assert (alone["devices"], alone["num_nodes"], alone["strategy"]) == (1, 1, "auto")
    assert isinstance(alone["plugins"][0], LightningEnvironment)
    local = layout(2, 0, {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1", "SLURM_PROCID": "0"})
    assert (local["devices"], local["strategy"]) == (2, "ddp")
    assert isinstance(local["plugins"][0], LightningEnvironment)
    srun = layout(4, 0, {"SLURM_NTASKS": "4", "SLURM_NNODES": "2", "SLURM_PROCID": "3"})
    assert (srun["accelerator"], srun["devices"], srun["num_nodes"]) == ("cpu", 2, 2)
    assert srun["strategy"] == "ddp" and srun["plugins"] == []


def test_a_link_planted_where_the_wandb_folder_was_is_neither_followed_nor_written(
    synth: ModuleType,
    tmp_path: Path,
    manifest_inputs: Callable[..., Any],
    job_spec: Callable[..., Any],
    run: Callable[..., JobRun],
    train_params: dict[str, Any],
) -> None:
    """W&B writes by path: its folder is the held training folder's in the spool, given to W&B
    by that held folder's own path. A link the owner plants where it was under results/ is
    left alone: training succeeds and writes nothing through it."""
    batch_dir = tmp_path / "training batch"
    files = synth.make_batch(batch_dir, "training", count=4, size=32, seed=0)
    spec = job_spec(batch_dir, Pipeline.TRAIN, manifest_inputs(batch_dir, files),
                    registry=tmp_path / "registry", model=ModelRef("spheroids"),
                    params=train_params, batch_kind="training")  # fmt: skip
    outside = tmp_path / "outside"
    outside.mkdir()
    (batch_dir / "results" / "training").mkdir(parents=True)
    (batch_dir / "results" / "training" / "wandb").symlink_to(outside)
    job = run(spec)
    assert job.returncode == 0, job.log
    assert list(outside.iterdir()) == []
    assert [p.name for p in (job.work_dir / "training" / "wandb").iterdir()]
