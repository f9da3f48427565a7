"""Training job: fit a U-Net on a batch's image/mask pairs and register the best weights.

``python -m pipelines.train JOB_DIR``. Writes, inside ``run_dir/training/``:

- ``metrics.csv``: epoch, train_loss, val_loss, val_dice, val_iou; rewritten (atomically)
  after every epoch, so it can be watched while the job runs;
- ``model.json``: the registered name, version, sha256 and validation metrics;
- ``previews/<stem>.png``: a few validation images with predicted (orange) and true (cyan)
  outlines, for the report.

Lightning runs on the CPU with its own checkpointing and loggers off: every file above is
written atomically by us, the best weights (lowest val_loss) are kept in memory, and the
registry publishes them. All images are decoded up front (that is how every input problem is
found before training starts), so a batch costs a crop and a flip: DataLoader workers would
only compete with the torch threads for the job's cores, hence ``num_workers=0``.

Nothing is published twice: the version's metadata records the job it came from
(:func:`origin`), and a retried job whose earlier attempt got as far as publishing (then died,
say, writing the previews) takes that version instead of training again.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import platform
import time
import warnings
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback, EarlyStopping
from lightning.pytorch.plugins.environments import LightningEnvironment
from torch.utils.data import DataLoader
from torch.utils.data import Dataset as TorchDataset

from daemon.atomicfile import write_bytes, write_text
from daemon.jobspec import JobSpec, Pipeline
from models import registry
from models.segmenter import UNetModule
from models.unet import UNet
from pipelines import figures
from pipelines.job import code_version, log, run_job
from pipelines.layout import (
    CURVE_COLUMNS,
    METRICS_FILE,
    MODEL_FILE,
    PREVIEWS_DIR,
    TRAINING_DIR,
)
from pipelines.pairs import TrainingData, load_dataset, split

PREVIEWS = 4
# Harmless in a batch job: few workers is deliberate (see the module docstring).
# Lightning 2.6 on torch 2.13 also warns about its own use of a deprecated torch API.
QUIET_WARNINGS = (
    r".*does not have many workers.*",
    r".*`srun` command is available.*",
    r".*isinstance\(treespec, LeafSpec\)`? is deprecated.*",
)


class PairSet(TorchDataset[tuple[torch.Tensor, torch.Tensor]]):
    """(image, mask) tensors of shape (1, H, W); random crops to ``patch`` and flips if asked."""

    def __init__(
        self, data: TrainingData, indices: list[int], patch: tuple[int, int] | None, augment: bool
    ) -> None:
        self.images = [torch.from_numpy(data.images[i]) for i in indices]
        self.masks = [torch.from_numpy(data.masks[i].astype(np.float32)) for i in indices]
        self.patch = patch
        self.augment = augment

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image, mask = self.images[index], self.masks[index]
        if self.patch is not None:
            top = int(torch.randint(image.shape[0] - self.patch[0] + 1, ()))
            left = int(torch.randint(image.shape[1] - self.patch[1] + 1, ()))
            rows, cols = slice(top, top + self.patch[0]), slice(left, left + self.patch[1])
            image, mask = image[rows, cols], mask[rows, cols]
        if self.augment:
            for dim in (0, 1):
                if torch.rand(()) < 0.5:
                    image, mask = image.flip(dim), mask.flip(dim)
        return image[None].contiguous(), mask[None].contiguous()


class EpochRecorder(Callback):
    """After each epoch: log a line, rewrite metrics.csv, keep the weights if val_loss is best."""

    def __init__(self, path: Path, epochs: int) -> None:
        self.path, self.epochs = path, epochs
        self.rows: list[dict[str, float]] = []
        self.best: dict[str, float] | None = None
        self.best_state: dict[str, torch.Tensor] | None = None

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        metrics = trainer.callback_metrics
        row = {"epoch": float(trainer.current_epoch + 1)}
        row.update({key: float(metrics.get(key, math.nan)) for key in CURVE_COLUMNS[1:]})
        self.rows.append(row)
        write_text(self.path, curves_csv(self.rows))
        log.info(
            "epoch %d/%d: %s",
            row["epoch"],
            self.epochs,
            " ".join(f"{k} {row[k]:.4f}" for k in CURVE_COLUMNS[1:]),
        )
        improved = self.best is None or row["val_loss"] < self.best["val_loss"]
        if math.isfinite(row["val_loss"]) and improved:
            self.best = row
            assert isinstance(pl_module, UNetModule)
            state = pl_module.net.state_dict()
            self.best_state = {k: v.detach().clone() for k, v in state.items()}


def curves_csv(rows: list[dict[str, float]]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(CURVE_COLUMNS)
    for row in rows:
        writer.writerow([int(row["epoch"])] + [f"{row[k]:.6g}" for k in CURVE_COLUMNS[1:]])
    return buffer.getvalue()


def _loaders(data: TrainingData, params: dict[str, Any]) -> tuple[DataLoader[Any], DataLoader[Any]]:
    train_idx, val_idx = split(len(data.images), float(params["val_fraction"]), int(params["seed"]))
    shapes = {image.shape for image in data.images}
    uniform = len(shapes) == 1
    patch = None if uniform else (min(s[0] for s in shapes), min(s[1] for s in shapes))
    batch_size = int(params["batch_size"])
    train = DataLoader(
        PairSet(data, train_idx, patch, augment=True), batch_size=batch_size, shuffle=True
    )
    # Images of different sizes cannot share a batch: validate them one by one, uncropped.
    val = DataLoader(PairSet(data, val_idx, None, augment=False), batch_size if uniform else 1)
    return train, val


def fit(
    data: TrainingData, params: dict[str, Any], training_dir: Path
) -> tuple[UNetModule, EpochRecorder]:
    """Train with early stopping on val_loss; the module holds the best weights at the end."""
    L.seed_everything(int(params["seed"]), workers=True, verbose=False)
    train, val = _loaders(data, params)
    module = UNetModule(int(params["depth"]), int(params["width"]), float(params["learning_rate"]))
    recorder = EpochRecorder(training_dir / METRICS_FILE, int(params["epochs"]))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=int(params["epochs"]),
        default_root_dir=training_dir / "lightning",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        # One process: never let Lightning take over Slurm's task variables or signals.
        plugins=[LightningEnvironment()],
        callbacks=[recorder, EarlyStopping("val_loss", patience=int(params["patience"]))],
    )
    trainer.fit(module, train, val)
    if recorder.best_state is None:
        raise RuntimeError("training produced no finite validation loss (diverged?)")
    module.net.load_state_dict(recorder.best_state)
    return module, recorder


def _hardware() -> dict[str, Any]:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": gpu,
    }


def best_metrics(recorder: EpochRecorder) -> dict[str, float | int | None]:
    """Metrics of the epoch whose weights were kept (epoch as an int, 1-based)."""
    best = recorder.best or {}
    metrics: dict[str, float | int | None] = {k: best.get(k) for k in CURVE_COLUMNS}
    metrics["epoch"] = int(best["epoch"]) if "epoch" in best else None
    return metrics


def origin(spec: JobSpec) -> dict[str, Any]:
    """What identifies the training job in the metadata of the version it publishes."""
    return {"batch_id": spec.batch_id, "batch_revision": spec.batch_revision, "job_id": spec.job_id}


def _metadata(
    spec: JobSpec, net: UNet, recorder: EpochRecorder, wall_time: float
) -> dict[str, Any]:
    return {
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "origin": origin(spec),
        "architecture": net.architecture(),
        "metrics": best_metrics(recorder),
        "manifest_sha256": spec.manifest_sha256,
        "params": dict(spec.params),
        "training": {
            "batch_dir": spec.batch_dir,
            "job_name": spec.job_name,
            "attempt": spec.attempt,
            "epochs_run": len(recorder.rows),
            "wall_time_s": round(wall_time, 3),
        },
        "code_version": code_version(),
        "torch_version": torch.__version__,
        "lightning_version": L.__version__,
        "python_version": platform.python_version(),
        "hardware": _hardware(),
    }


def train_and_publish(
    spec: JobSpec, data: TrainingData, training_dir: Path
) -> tuple[registry.ModelVersion, UNet]:
    started = time.monotonic()
    module, recorder = fit(data, dict(spec.params), training_dir)
    metadata = _metadata(spec, module.net, recorder, time.monotonic() - started)
    best = recorder.best or {}
    published = registry.register(
        Path(spec.registry_dir),
        spec.model.name,
        module.net.state_dict(),
        metadata,
        val_dice=best.get("val_dice"),
    )
    log.info("registered %s version %d", published.name, published.version)
    return published, module.net


def rebuild(published: registry.ModelVersion) -> UNet:
    """The net of a published version (for a retried job whose model is already out)."""
    net = UNet(**published.architecture)
    net.load_state_dict(registry.load(published))
    return net


@torch.inference_mode()
def write_previews(net: UNet, data: TrainingData, indices: list[int], folder: Path) -> None:
    """Overlays of prediction and ground truth for the first few validation images."""
    folder.mkdir(parents=True, exist_ok=True)
    net.eval()
    for index in indices[:PREVIEWS]:
        image, truth = data.images[index], data.masks[index]
        logits = net(torch.from_numpy(image)[None, None])[0, 0]
        picture = figures.overlay(image, (torch.sigmoid(logits) > 0.5).numpy(), truth)
        write_bytes(folder / f"{data.pairs[index].stem}.png", figures.png_bytes(picture))


def describe(spec: JobSpec, published: registry.ModelVersion) -> dict[str, Any]:
    """The model card written to training/model.json and returned in the summary."""
    aliases = registry.read_aliases(Path(spec.registry_dir), published.name)
    return {
        "name": published.name,
        "version": published.version,
        "sha256": published.sha256,
        "path": str(published.path),
        "aliases": {k: v for k, v in aliases.items() if v == published.version},
        "metrics": published.metadata.get("metrics", {}),
    }


def train(spec: JobSpec, job_dir: Path) -> dict[str, Any]:
    """The training job: load and check the pairs, fit, publish, describe."""
    for pattern in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    registry.check_name(spec.model.name)
    training_dir = Path(spec.run_dir) / TRAINING_DIR
    training_dir.mkdir(parents=True, exist_ok=True)
    data = load_dataset(Path(spec.batch_dir), spec.inputs)
    log.info("loaded %d image/mask pairs", len(data.images))
    published = registry.find(Path(spec.registry_dir), spec.model.name, origin(spec))
    if published is None:
        published, net = train_and_publish(spec, data, training_dir)
    else:
        log.info(
            "version %d was published by an earlier attempt: not training again", published.version
        )
        net = rebuild(published)
    description = describe(spec, published)
    write_text(training_dir / MODEL_FILE, _json(description))
    params = spec.params
    val_idx = split(len(data.images), float(params["val_fraction"]), int(params["seed"]))[1]
    write_previews(net, data, val_idx, training_dir / PREVIEWS_DIR)
    return {
        "model": description,
        "pairs": len(data.images),
        "validation_pairs": len(val_idx),
        **published.metadata.get("training", {}),
    }


def _json(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    raise SystemExit(run_job(Pipeline.TRAIN, train))
