"""Sweep job: compare a sweep's trials and register the best one.

``python -m pipelines.sweep JOB_DIR`` runs after every trial of a ``sweep`` batch succeeded.
Each trial (a training job, see :mod:`pipelines.train`) left ``trials/<job>/`` in the run's work
folder in the spool with its curves and a candidate: weights and the metadata they would be
registered with. Only the trials the daemon lists in this job's spec (``trials``: the trial
jobs it recorded as succeeded) are read, each from the spool, its weights checked against the
sha256 its metadata records. Trials register nothing themselves, so they never race each other
for ``best``. This job:

- ranks the trials by the sweep's metric (higher is better; ties: lower val_loss, then the
  lower trial number) and writes ``sweep/trials.csv`` and ``sweep/sweep.json`` (work folder);
- registers the winner's weights (checked against their sha256, loaded ``weights_only``) as
  the next version of the batch's model, with the ``best`` rule of the manifest's params; a
  retried job finds the version an earlier attempt registered instead of registering again;
- writes ``training/`` as a training job would (model.json, the winner's metrics.csv,
  validation.csv, previews), so the report shows the registered model like any other
  training.

Weights & Biases: every trial is a W&B run of the batch's group. ``sweep.json`` holds the
search as a W&B sweep configuration; where ``WANDB_MODE=online`` the job also creates that W&B
sweep (``wandb.sweep``) so the W&B project shows it next to the trials' runs. The trials
themselves are chosen by the daemon (reproducibly, from the manifest), not by a W&B agent.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from pathlib import Path
from typing import Any

from daemon.contract.heldfolder import HeldFolder
from daemon.contract.jobspec import JobSpec, Pipeline
from models import registry
from pipelines import train, validation
from pipelines.job import log, run_job, work_folder
from pipelines.layout import (
    CANDIDATE_FILE,
    CANDIDATE_WEIGHTS,
    METRICS_FILE,
    MODEL_FILE,
    SWEEP_DIR,
    SWEEP_FILE,
    TRAINING_DIR,
    TRIALS_DIR,
    TRIALS_TABLE,
)
from pipelines.pairs import load_dataset

METRIC_COLUMNS = ("val_dice", "val_iou", "val_object_f1", "val_loss", "epoch")


MAX_CANDIDATE_BYTES = 16 << 20  # a candidate's metadata: metrics, params, provenance


def read_trials(work: HeldFolder, names: list[str]) -> list[dict[str, Any]]:
    """The candidate metadata of the trials ``names`` (the trial jobs the daemon recorded as
    succeeded), each with its folder and job name; a trial that left none is not there."""
    trials = []
    for name in sorted(names):
        try:
            with work.open_read(f"{TRIALS_DIR}/{name}/{CANDIDATE_FILE}") as handle:
                meta = json.loads(handle.read(MAX_CANDIDATE_BYTES))
        except FileNotFoundError:
            continue
        trials.append({**meta, "dir": str(work.path / TRIALS_DIR / name), "job": name})
    return trials


def _score(value: Any) -> float:
    return float(value) if value is not None and math.isfinite(float(value)) else -math.inf


def rank(trials: list[dict[str, Any]], metric: str) -> list[dict[str, Any]]:
    """Trials best first: ``metric`` high, then val_loss low, then the trial number."""

    def key(trial: dict[str, Any]) -> tuple[float, float, int]:
        metrics = trial["metrics"]
        loss = metrics.get("val_loss")
        return (
            -_score(metrics.get(metric)),
            math.inf if loss is None else float(loss),
            int(trial["params"].get("trial", 0)),
        )

    return sorted(trials, key=key)


def trials_csv(ranked: list[dict[str, Any]], space: list[str]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["rank", "trial", "job", *space, *METRIC_COLUMNS, "epochs_run", "wall_time_s"])
    for place, trial in enumerate(ranked, start=1):
        metrics, training = trial["metrics"], trial["training"]
        writer.writerow(
            [place, trial["params"].get("trial"), trial["job"]]
            + [trial["params"].get(name) for name in space]
            + [metrics.get(name) for name in METRIC_COLUMNS]
            + [training.get("epochs_run"), training.get("wall_time_s")]
        )
    return buffer.getvalue()


def wandb_config(sweep: dict[str, Any]) -> dict[str, Any]:
    """The sweep as a W&B sweep configuration (method, metric, parameters)."""
    parameters: dict[str, Any] = {}
    for name, axis in sweep.get("space", {}).items():
        if isinstance(axis, list):
            parameters[name] = {"values": axis}
        else:
            distribution = "log_uniform_values" if axis.get("log") else "uniform"
            parameters[name] = {"min": axis["min"], "max": axis["max"],
                                "distribution": distribution}  # fmt: skip
    metric = {"name": sweep.get("metric", "val_dice"), "goal": "maximize"}
    return {"method": sweep.get("method", "random"), "metric": metric, "parameters": parameters}


def _online_sweep(config: dict[str, Any]) -> str | None:
    """Create the W&B sweep when W&B is online (never in offline or disabled mode)."""
    if os.environ.get("WANDB_MODE") != "online":
        return None
    import wandb

    project = os.environ.get("WANDB_PROJECT", "watchd")
    return str(wandb.sweep(sweep=config, project=project))


def _register(spec: JobSpec, winner: dict[str, Any], sweep: dict[str, Any]) -> Any:
    """Register the winner (or find what an earlier attempt of this job registered)."""
    root = Path(spec.registry_dir)
    found = registry.find(root, spec.model.name, train.origin(spec))
    if found is not None:
        log.info("version %d was registered by an earlier attempt", found.version)
        return found
    where = f"trial {winner['job']}"
    state = registry.load_file(Path(winner["dir"]) / CANDIDATE_WEIGHTS, winner["sha256"], where)
    meta = {k: v for k, v in winner.items() if k not in ("dir", "job", "sha256")}
    meta["origin"] = train.origin(spec)
    meta["sweep"] = {**sweep, "winner": winner["job"], "trial": winner["params"].get("trial")}
    published = registry.register(
        root, spec.model.name, state, meta,
        val_dice=winner["metrics"].get("val_dice"), rule=train.best_rule(dict(spec.params)),
    )  # fmt: skip
    log.info("registered %s version %d (trial %s)", published.name, published.version,
             winner["job"])  # fmt: skip
    return published


def _describe_winner(
    spec: JobSpec,
    winner: dict[str, Any],
    published: Any,
    work: HeldFolder,
    training: HeldFolder,
    batch: HeldFolder,
) -> dict[str, Any]:
    """Write ``training/`` as a training job would (the winner's curves, the model card, the
    previews) through the held folders; the model card."""
    with work.open_read(f"{TRIALS_DIR}/{winner['job']}/{METRICS_FILE}") as curves:
        training.write_bytes(METRICS_FILE, curves.read())
    description = train.describe(spec, published)
    training.write_text(MODEL_FILE, json.dumps(description, indent=2) + "\n")
    data = load_dataset(batch, spec.inputs, spec.params.get("channel"))
    params = winner["params"]
    checked = validation.evaluate(train.rebuild(published), data,
                                  train.validation_indices(data, params))  # fmt: skip
    validation.write(data, checked, training, int(params["seed"]))
    return description


def sweep(spec: JobSpec, job_dir: Path, batch: HeldFolder) -> dict[str, Any]:
    """The sweep job: rank, register the best, describe it as a training would."""
    described = dict(spec.params.get("sweep") or {})
    metric = str(described.get("metric", "val_dice"))
    names = [str(name) for name in spec.params.get("trial_jobs", ())]
    with work_folder(spec) as work:
        trials = read_trials(work, names)
        expected = int(described.get("trials", len(names)))
        if len(trials) < expected or not trials:
            raise RuntimeError(
                f"{len(trials)} of {expected} trials left a candidate in {TRIALS_DIR}/"
            )
        ranked = rank(trials, metric)
        winner = ranked[0]
        space = list(described.get("space", {}))
        config = wandb_config(described)
        work.write_text(f"{SWEEP_DIR}/{TRIALS_TABLE}", trials_csv(ranked, space))
        published = _register(spec, winner, described)
        record = {**described, "winner": winner["job"], "wandb_sweep_config": config,
                  "wandb_sweep_id": _online_sweep(config)}  # fmt: skip
        work.write_text(f"{SWEEP_DIR}/{SWEEP_FILE}", json.dumps(record, indent=2) + "\n")
        with work.folder(TRAINING_DIR, create=True) as training:
            description = _describe_winner(spec, winner, published, work, training, batch)
    return {"model": description, "trials": len(ranked), "winner": winner["job"],
            "metric": metric, "table": f"{SWEEP_DIR}/{TRIALS_TABLE}"}  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(run_job(Pipeline.SWEEP, sweep))
