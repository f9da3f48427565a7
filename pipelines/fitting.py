"""Fitting a U-Net with Lightning: data sets, the per-epoch recorder, the device layout, W&B.

One process or several: with ``tasks`` > 1 the Trainer runs DDP. Started by hand or by the
local executor, Lightning launches the other ranks itself (each re-runs
``python -m pipelines.train JOB_DIR``); under Slurm the job is started with ``srun`` (one task
per rank) and Lightning's Slurm environment takes the ranks from Slurm's variables. On CPUs the
process group uses gloo, on GPUs NCCL. Only rank 0 writes files; metrics are reduced across
ranks (``sync_dist``, torchmetrics' own sync), so every rank sees the same validation numbers
and early stopping stops them together.

Weights & Biases: a :class:`WandbLogger` whose run folder is inside the run's results, offline
unless ``WANDB_MODE=online`` (the executor sets it from the config's ``jobs.wandb_mode``);
``disabled`` turns it off. ``wandb sync`` uploads an offline run later.
"""

from __future__ import annotations

import csv
import io
import math
import os
import time
from collections.abc import Mapping
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback, EarlyStopping
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.plugins.environments import LightningEnvironment
from torch.utils.data import DataLoader
from torch.utils.data import Dataset as TorchDataset

from daemon.contract.heldfolder import HeldFolder
from models.segmenter import UNetModule
from pipelines.augment import Augmentations
from pipelines.job import log, process_rank
from pipelines.layout import CURVE_COLUMNS, METRICS_FILE, WANDB_DIR
from pipelines.pairs import TrainingData, split

PROGRESS_SECONDS = 300.0  # within an epoch, a line in the log at most this often


class PairSet(TorchDataset[tuple[torch.Tensor, torch.Tensor]]):
    """(image, mask) tensors of shape (1, H, W); random crops to ``patch``, then ``augment``."""

    def __init__(
        self,
        data: TrainingData,
        indices: list[int],
        patch: tuple[int, int] | None,
        augment: Augmentations,
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
        image, mask = self.augment(image, mask)
        return image[None].contiguous(), mask[None].contiguous()


def curves_csv(rows: list[dict[str, float]]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(CURVE_COLUMNS)
    for row in rows:
        writer.writerow([int(row["epoch"])] + [f"{row[k]:.6g}" for k in CURVE_COLUMNS[1:]])
    return buffer.getvalue()


class EpochRecorder(Callback):
    """After each epoch: log a line, rewrite metrics.csv (in the held ``folder``), keep the
    weights if val_loss is best. Within a long epoch, a line at most every PROGRESS_SECONDS:
    the log shows the job is working (the local executor ends a job whose log stands still
    for ``stall_minutes``).

    Every rank keeps the best weights (they are identical under DDP); only rank 0 writes.
    """

    def __init__(self, folder: HeldFolder, epochs: int) -> None:
        self.folder, self.epochs = folder, epochs
        self.rows: list[dict[str, float]] = []
        self.best: dict[str, float] | None = None
        self.best_state: dict[str, torch.Tensor] | None = None
        self.said_at = time.monotonic()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
        batch_idx: int,
    ) -> None:  # fmt: skip
        now = time.monotonic()
        if trainer.is_global_zero and now - self.said_at >= PROGRESS_SECONDS:
            self.said_at = now
            log.info("epoch %d/%d: batch %d/%s", trainer.current_epoch + 1, self.epochs,
                     batch_idx + 1, trainer.num_training_batches)  # fmt: skip

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        metrics = trainer.callback_metrics
        row = {"epoch": float(trainer.current_epoch + 1)}
        row.update({key: float(metrics.get(key, math.nan)) for key in CURVE_COLUMNS[1:]})
        self.rows.append(row)
        if trainer.is_global_zero:
            self.said_at = time.monotonic()
            self.folder.write_text(METRICS_FILE, curves_csv(self.rows))
            figures = " ".join(f"{k} {row[k]:.4f}" for k in CURVE_COLUMNS[1:])
            log.info("epoch %d/%d: %s", row["epoch"], self.epochs, figures)
        improved = self.best is None or row["val_loss"] < self.best["val_loss"]
        if math.isfinite(row["val_loss"]) and improved:
            self.best = row
            assert isinstance(pl_module, UNetModule)
            state = pl_module.net.state_dict()
            self.best_state = {k: v.detach().clone() for k, v in state.items()}


def loaders(
    data: TrainingData, params: Mapping[str, Any]
) -> tuple[DataLoader[Any], DataLoader[Any]]:
    """Training (cropped to the smallest image if sizes differ, varied as the params say:
    :mod:`pipelines.augment`) and validation loaders.

    ``num_workers=0``: every image is decoded up front, a batch costs a crop and its variations,
    and worker processes would only compete with the torch threads for the job's cores.
    """
    train_idx, val_idx = split(len(data.images), float(params["val_fraction"]), int(params["seed"]))
    shapes = {image.shape for image in data.images}
    uniform = len(shapes) == 1
    patch = None if uniform else (min(s[0] for s in shapes), min(s[1] for s in shapes))
    batch_size = int(params["batch_size"])
    train = DataLoader(
        PairSet(data, train_idx, patch, Augmentations.of(params)),
        batch_size=batch_size,
        shuffle=True,
    )
    # Images of different sizes cannot share a batch: validate them one by one, uncropped.
    val = DataLoader(PairSet(data, val_idx, None, Augmentations()), batch_size if uniform else 1)
    return train, val


def layout(tasks: int, gpus: int, environ: Mapping[str, str]) -> dict[str, Any]:
    """Trainer arguments for ``tasks`` processes (ranks) on CPUs or on ``gpus`` GPUs.

    Under an ``srun`` with several tasks, Slurm started the ranks: Lightning's Slurm environment
    reads them (its default detection). Otherwise the plain Lightning environment, which never
    takes over the variables or signals of a Slurm job the job happens to run in, and spawns
    the other local ranks itself.
    """
    slurm_tasks = int(environ.get("SLURM_NTASKS", "1") or 1)
    under_srun = slurm_tasks > 1 and "SLURM_PROCID" in environ
    use_gpu = gpus > 0 and torch.cuda.is_available()
    ranks = slurm_tasks if under_srun else max(1, tasks)
    nodes = int(environ.get("SLURM_NNODES", "1") or 1) if under_srun else 1
    per_node = max(1, ranks // nodes)
    return {
        "accelerator": "gpu" if use_gpu else "cpu",
        "devices": per_node,
        "num_nodes": nodes,
        "strategy": "ddp" if ranks > 1 else "auto",
        "plugins": [] if under_srun else [LightningEnvironment()],
    }


def wandb_logger(
    save_dir: HeldFolder, name: str, group: str, params: Mapping[str, Any],
    environ: Mapping[str, str],
) -> WandbLogger | None:  # fmt: skip
    """The W&B logger for this run (its folder: ``save_dir/wandb``), or None when disabled.

    The run is started here, on rank 0 only (other ranks log nothing; their metrics reach rank
    0 through the DDP reductions), and handed to Lightning's logger. W&B writes only by path:
    it gets the held folder's own path (:meth:`HeldFolder.proc_path`), so no link planted
    above reaches it, and its ``wandb/`` is made (or found a real folder) through it first.
    """
    mode = environ.get("WANDB_MODE", "offline")
    if mode == "disabled" or process_rank(environ) != 0:
        return None
    import wandb

    save_dir.folder(WANDB_DIR, create=True).close()
    run = wandb.init(
        dir=save_dir.proc_path(),
        mode="online" if mode == "online" else "offline",
        project=environ.get("WANDB_PROJECT", "watchd"),
        name=name,
        group=group,
        config=dict(params),
        settings=wandb.Settings(console="off", silent=True),
    )
    return WandbLogger(experiment=run)


def fit(
    data: TrainingData,
    params: Mapping[str, Any],
    out: HeldFolder,
    logger: WandbLogger | None,
    tasks: int = 1,
    gpus: int = 0,
) -> tuple[UNetModule, EpochRecorder, L.Trainer]:
    """Train with early stopping on val_loss, writing the curves into ``out``; the module holds
    the best weights at the end. Lightning writes no file of its own (no checkpoints, no
    logger but W&B's); its root folder is ``out`` itself, reached through its descriptor."""
    L.seed_everything(int(params["seed"]), workers=True, verbose=False)
    train, val = loaders(data, params)
    module = UNetModule(int(params["depth"]), int(params["width"]), float(params["learning_rate"]))
    recorder = EpochRecorder(out, int(params["epochs"]))
    trainer = L.Trainer(
        max_epochs=int(params["epochs"]),
        default_root_dir=out.proc_path(),
        logger=logger if logger is not None else False,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[recorder, EarlyStopping("val_loss", patience=int(params["patience"]))],
        **layout(tasks, gpus, os.environ),
    )
    trainer.fit(module, train, val)
    if recorder.best_state is None:
        raise RuntimeError("training produced no finite validation loss (diverged?)")
    module.net.load_state_dict(recorder.best_state)
    return module, recorder, trainer
