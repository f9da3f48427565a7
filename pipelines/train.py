"""Training job: fit a U-Net on a batch's image/mask pairs and register the best weights.

``python -m pipelines.train JOB_DIR``. Writes, inside ``work_dir/training/`` (the run's work
folder in the spool: the report job copies the model card and the curves into the owner's
results folder):

- ``metrics.csv``: epoch, train_loss, val_loss, val_dice, val_iou; rewritten (atomically)
  after every epoch, so it can be watched while the job runs;
- ``model.json``: the registered name, version, sha256 and validation metrics;
- ``validation.csv`` and ``previews/``: the kept weights on each validation image, as the
  inference job would segment it: its objects against the true ones and the Dice of their
  mask; pictures of the best, the worst and a random one (:mod:`pipelines.validation`); the
  pooled object scores are registered with the version's metrics;
- ``wandb/``: the Weights & Biases run (see :mod:`pipelines.fitting`).

Every file is written through the held work folder (:func:`pipelines.job.work_folder`); W&B,
which writes only by path, is given the held training folder's own path
(:meth:`daemon.contract.heldfolder.HeldFolder.proc_path`).

Lightning's own checkpointing is off: the best weights (lowest val_loss) are kept in memory
and the registry publishes them. With ``tasks`` > 1 the fit runs as DDP; only rank 0 publishes
and writes files (and :func:`pipelines.job.run_job` writes result.json on rank 0 only).

A **sweep trial** (a training job of a ``sweep`` batch) registers nothing: it writes its
curves and a candidate (weights + metadata) into ``work_dir/trials/<job name>/``, and the sweep
job registers only the winner (:mod:`pipelines.sweep`), so trials never compete for ``best``.

Nothing is published twice: the version's metadata records the job it came from
(:func:`origin`), and a retried job whose earlier attempt got as far as publishing (then died,
say, writing the previews) takes that version instead of training again.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
import warnings
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from daemon.contract.heldfolder import HeldFolder
from daemon.contract.jobspec import JobSpec, Pipeline
from daemon.contract.version import code_version
from models import registry
from models.registry import BestRule
from models.unet import UNet
from pipelines import fitting, validation
from pipelines.job import log, run_job, work_folder
from pipelines.layout import (
    CANDIDATE_FILE,
    CANDIDATE_WEIGHTS,
    CURVE_COLUMNS,
    MODEL_FILE,
    TRAINING_DIR,
    TRIALS_DIR,
)
from pipelines.pairs import TrainingData, load_dataset, split

SWEEP_KIND = "sweep"
# Harmless in a batch job: few workers is deliberate (see pipelines.fitting.loaders).
# Lightning 2.6 on torch 2.13 also warns about its own use of a deprecated torch API.
QUIET_WARNINGS = (
    r".*does not have many workers.*",
    r".*`srun` command is available.*",
    r".*isinstance\(treespec, LeafSpec\)`? is deprecated.*",
    r".*smaller than the logging interval.*",
)


def _hardware() -> dict[str, Any]:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": gpu,
    }


def best_metrics(recorder: fitting.EpochRecorder) -> dict[str, float | int | None]:
    """Metrics of the epoch whose weights were kept (epoch as an int, 1-based)."""
    best = recorder.best or {}
    metrics: dict[str, float | int | None] = {k: best.get(k) for k in CURVE_COLUMNS}
    metrics["epoch"] = int(best["epoch"]) if "epoch" in best else None
    return metrics


def origin(spec: JobSpec) -> dict[str, Any]:
    """What identifies the training job in the metadata of the version it publishes.

    Ids alone are not enough: another daemon (or a fresh database) numbers its batches from 1
    again; the run folder (time and manifest hash) and the job name make it unique.
    """
    return {"batch_id": spec.batch_id, "batch_revision": spec.batch_revision,
            "job_id": spec.job_id, "job_name": spec.job_name, "run_dir": spec.run_dir}  # fmt: skip


def metadata(
    spec: JobSpec, net: UNet, recorder: fitting.EpochRecorder, wall_time: float, ranks: int
) -> dict[str, Any]:
    """What the registry keeps with the weights: metrics, provenance, versions, hardware."""
    import lightning
    import torchmetrics

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
            "processes": ranks,
        },
        "code_version": code_version(),
        "torch_version": torch.__version__,
        "lightning_version": lightning.__version__,
        "torchmetrics_version": torchmetrics.__version__,
        "numpy_version": np.__version__,
        "python_version": platform.python_version(),
        "hardware": _hardware(),
    }


def best_rule(params: dict[str, Any]) -> BestRule:
    return BestRule(str(params.get("best_metric", "val_dice")), float(params.get("best_margin", 0)))


def _fit(
    spec: JobSpec, data: TrainingData, out: HeldFolder
) -> tuple[UNet, dict[str, Any], list[validation.Checked] | None]:
    """Fit, writing into the held folder ``out``; (best net, registry metadata, its scores on
    the validation images: None on ranks > 0, which score nothing)."""
    started = time.monotonic()
    params = dict(spec.params)
    group = f"batch-{spec.batch_id}-r{spec.batch_revision}"
    logger = fitting.wandb_logger(out, spec.job_name, group, params, os.environ)
    tasks = spec.resources.tasks
    module, recorder, trainer = fitting.fit(data, params, out, logger, tasks, spec.resources.gpus)
    meta = metadata(spec, module.net, recorder, time.monotonic() - started, trainer.world_size)
    if not trainer.is_global_zero:
        return module.net, meta, None
    checked = validation.evaluate(module.net, data, validation_indices(data, params))
    meta["metrics"].update(validation.metrics(checked))
    if logger is not None:
        logger.experiment.summary.update({k: v for k, v in meta["metrics"].items() if v})
        logger.experiment.finish()
    return module.net, meta, checked


def validation_indices(data: TrainingData, params: Mapping[str, Any]) -> list[int]:
    """The validation images of the fit (its seeded split)."""
    return split(len(data.images), float(params["val_fraction"]), int(params["seed"]))[1]


def rebuild(published: registry.ModelVersion) -> UNet:
    """The net of a published version (for a retried job whose model is already out)."""
    net = UNet(**published.architecture)
    net.load_state_dict(registry.load(published))
    return net


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


def publish_training(spec: JobSpec, data: TrainingData, work: HeldFolder) -> dict[str, Any] | None:
    """Fit and register (or find what an earlier attempt registered); None on ranks > 0."""
    with work.folder(TRAINING_DIR, create=True) as training:
        return _publish_training(spec, data, training)


def _publish_training(
    spec: JobSpec, data: TrainingData, training: HeldFolder
) -> dict[str, Any] | None:
    published = registry.find(Path(spec.registry_dir), spec.model.name, origin(spec))
    if published is None:
        net, meta, checked = _fit(spec, data, training)
        if checked is None:
            return None
        best = meta["metrics"]
        published = registry.register(
            Path(spec.registry_dir), spec.model.name, net.state_dict(), meta,
            val_dice=best.get("val_dice"), rule=best_rule(dict(spec.params)),
        )  # fmt: skip
        log.info("registered %s version %d", published.name, published.version)
    else:
        log.info("version %d was published by an earlier attempt: not training again",
                 published.version)  # fmt: skip
        checked = validation.evaluate(rebuild(published), data,
                                      validation_indices(data, spec.params))  # fmt: skip
    description = describe(spec, published)
    training.write_text(MODEL_FILE, _json(description))
    validation.write(data, checked, training, int(spec.params["seed"]))
    return {"model": description, **published.metadata.get("training", {})}


def train_trial(spec: JobSpec, data: TrainingData, work: HeldFolder) -> dict[str, Any] | None:
    """A sweep trial: fit and leave a candidate for the sweep job; None on ranks > 0."""
    with work.folder(f"{TRIALS_DIR}/{spec.job_name}", create=True) as trial:
        net, meta, checked = _fit(spec, data, trial)
        if checked is None:
            return None
        weights = registry.state_bytes(net.state_dict())
        trial.write_bytes(CANDIDATE_WEIGHTS, weights)
        meta["sha256"] = hashlib.sha256(weights).hexdigest()
        trial.write_text(CANDIDATE_FILE, _json(meta))
    log.info("trial %s: %s", spec.params.get("trial"), json.dumps(meta["metrics"]))
    return {"trial": spec.params.get("trial"), "candidate": meta, **meta["training"]}


def train(spec: JobSpec, job_dir: Path, batch: HeldFolder) -> dict[str, Any] | None:
    """The training job: load and check the pairs, fit, publish (or leave a candidate)."""
    for pattern in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    os.environ.setdefault("WANDB_SILENT", "true")  # W&B's chatter would break the plain log
    registry.check_name(spec.model.name)
    data = load_dataset(batch, spec.inputs, spec.params.get("channel"))
    log.info("loaded %d image/mask pairs", len(data.images))
    with work_folder(spec) as work:
        trial = spec.batch_kind == SWEEP_KIND
        summary = train_trial(spec, data, work) if trial else publish_training(spec, data, work)
    if summary is None:
        return None
    val_count = len(split(len(data.images), float(spec.params["val_fraction"]), 0)[1])
    return {**summary, "pairs": len(data.images), "validation_pairs": val_count}


def _json(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    raise SystemExit(run_job(Pipeline.TRAIN, train))
