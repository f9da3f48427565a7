"""A real sweep: two trial jobs (training jobs of a sweep batch) and the sweep job after them."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from jobrun import work_dir_for

from daemon.contract.jobspec import ModelRef, Pipeline, Shard
from models import registry

if TYPE_CHECKING:
    from collections.abc import Callable

    from conftest import JobRun

SPACE = {"method": "grid", "seed": 0, "metric": "val_dice", "trials": 2,
         "space": {"learning_rate": [0.05, 0.0001]}}  # fmt: skip


def test_trials_register_nothing_and_the_sweep_job_registers_only_the_best(
    synth: ModuleType,
    tmp_path: Path,
    manifest_inputs: Callable[..., Any],
    job_spec: Callable[..., Any],
    run: Callable[..., JobRun],
    train_params: dict[str, Any],
) -> None:
    batch_dir, root = tmp_path / "sweep batch", tmp_path / "registry"
    files = synth.make_batch(batch_dir, "training", count=8, size=32, seed=5)
    inputs = manifest_inputs(batch_dir, files)
    trials = []
    for index, rate in enumerate((0.05, 0.0001)):
        params = {**train_params, "learning_rate": rate, "trial": index}
        spec = job_spec(batch_dir, Pipeline.TRAIN, inputs, registry=root, model=ModelRef("swept"),
                        params=params, shard=Shard(index, 2), job_name=f"b1-trial-{index:04d}",
                        batch_kind="sweep")  # fmt: skip
        trials.append(run(spec))
        assert trials[-1].returncode == 0, trials[-1].log
    assert not root.exists(), "a trial registered a model"
    work = work_dir_for(batch_dir)
    candidates = [json.loads((work / "trials" / t.spec.job_name / "candidate.json").read_text())
                  for t in trials]  # fmt: skip
    best = max(range(2), key=lambda i: candidates[i]["metrics"]["val_dice"])
    worst = 1 - best
    # A winner planted beside them: in the owner's results/ (the red team's case), and even in
    # the work folder under a name the daemon did not record: neither counts.
    for planted in (batch_dir / "results" / "trials" / "b1-trial-9999", work / "trials" / "b1-x"):
        planted.mkdir(parents=True)
        source = work / "trials" / trials[worst].spec.job_name
        shutil.copyfile(source / "candidate.pt", planted / "candidate.pt")
        forged = {**candidates[worst], "metrics": {**candidates[worst]["metrics"], "val_dice": 1.0}}
        (planted / "candidate.json").write_text(json.dumps(forged))
    listed = [t.spec.job_name for t in trials]
    sweep_spec = job_spec(batch_dir, Pipeline.SWEEP, inputs, registry=root, model=ModelRef("swept"),
                          params={**train_params, "sweep": SPACE, "trial_jobs": listed},
                          job_name="b1-sweep", batch_kind="sweep")  # fmt: skip
    job = run(sweep_spec)
    assert job.returncode == 0 and job.result is not None and job.result.ok, job.log
    assert registry.list_versions(root, "swept") == [1]
    published = registry.resolve(root, "swept", "best")
    assert published.sha256 == candidates[best]["sha256"]
    assert published.metadata["sweep"]["winner"] == f"b1-trial-{best:04d}"
    assert published.metadata["params"]["learning_rate"] == (0.05, 0.0001)[best]
    with open(work / "sweep" / "trials.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [row["job"] for row in rows][0] == f"b1-trial-{best:04d}" and len(rows) == 2
    assert set(rows[0]) >= {"rank", "trial", "learning_rate", "val_dice", "val_loss"}
    record = json.loads((work / "sweep" / "sweep.json").read_text())
    assert record["wandb_sweep_config"]["parameters"] == {
        "learning_rate": {"values": [0.05, 0.0001]}
    }
    assert record["wandb_sweep_id"] is None  # offline: no W&B sweep is created
    card = json.loads((work / "training" / "model.json").read_text())
    assert (card["name"], card["version"]) == ("swept", 1)
    again = run(sweep_spec)  # a retried sweep job finds its version instead of adding one
    assert again.returncode == 0 and registry.list_versions(root, "swept") == [1]


def test_a_sweep_job_missing_trials_fails_as_internal(
    tmp_path: Path,
    job_spec: Callable[..., Any],
    run: Callable[..., JobRun],
    train_params: dict[str, Any],
) -> None:
    batch_dir = tmp_path / "empty sweep"
    batch_dir.mkdir()
    spec = job_spec(batch_dir, Pipeline.SWEEP, (), registry=tmp_path / "registry",
                    model=ModelRef("swept"), params={**train_params, "sweep": SPACE},
                    job_name="b1-sweep", batch_kind="sweep")  # fmt: skip
    job = run(spec)
    assert job.returncode == 1 and job.result is not None and job.result.error is not None
    assert "0 of 2 trials left a candidate in trials/" in job.result.error.message


def test_a_sweep_job_reads_only_the_trials_the_daemon_recorded(
    tmp_path: Path,
    job_spec: Callable[..., Any],
    run: Callable[..., JobRun],
    train_params: dict[str, Any],
) -> None:
    """Candidates lie in the work folder, but the sweep job counts only those its spec names:
    a trial the daemon did not record as succeeded is missing, whatever lies there."""
    batch_dir = tmp_path / "sweep"
    batch_dir.mkdir()
    stray = work_dir_for(batch_dir) / "trials" / "b1-trial-0000"
    stray.mkdir(parents=True)
    (stray / "candidate.json").write_text(json.dumps({"metrics": {"val_dice": 1.0}}))
    spec = job_spec(batch_dir, Pipeline.SWEEP, (), registry=tmp_path / "registry",
                    model=ModelRef("swept"),
                    params={**train_params, "sweep": SPACE, "trial_jobs": ["b1-trial-0001"]},
                    job_name="b1-sweep", batch_kind="sweep")  # fmt: skip
    job = run(spec)
    assert job.returncode == 1 and job.result is not None and job.result.error is not None
    assert "0 of 2 trials left a candidate in trials/" in job.result.error.message
