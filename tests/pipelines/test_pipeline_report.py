"""Real report jobs: merged table, summary.json and a self-contained report.html."""

from __future__ import annotations

import csv
import json
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from daemon.contract.jobspec import ErrorKind, InputFile, Pipeline
from pipelines.layout import TABLE_COLUMNS
from pipelines.page import render

if TYPE_CHECKING:
    from collections.abc import Callable

    from conftest import InferredBatch, JobRun, TrainedModel


def assert_self_contained(page: str) -> None:
    assert page.startswith("<!DOCTYPE html>")
    assert "http" not in page and 'src="//' not in page
    assert "<script" not in page and "<link" not in page
    assert re.findall(r'src="([^"]*)"', page)
    assert all(
        src.startswith("data:image/png;base64,") for src in re.findall(r'src="([^"]*)"', page)
    )


def report_spec(
    batch_dir: Path,
    kind: str,
    job: JobRun,
    job_spec: Callable[..., Any],
    inputs: tuple[InputFile, ...] | None = None,
) -> Any:
    """A report job for the batch ``job`` belongs to (``inputs``: all of the batch's)."""
    source = job.spec
    return job_spec(
        batch_dir,
        Pipeline.REPORT,
        inputs or source.inputs,
        registry=Path(source.registry_dir),
        model=source.model,
        params=source.params,
        job_name="report",
        batch_kind=kind,
    )


def test_inference_report_merges_tables_and_summarises(
    inferred: InferredBatch, job_spec: Callable[..., Any], run: Callable[..., JobRun]
) -> None:
    job = run(
        report_spec(inferred.batch_dir, "inference", inferred.shards[0], job_spec, inferred.inputs)
    )
    assert job.returncode == 0 and job.result is not None and job.result.ok, job.log
    run_dir = inferred.batch_dir / "results"
    with open(run_dir / "table.csv", newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    paths = [row["path"] for row in rows]
    assert paths == sorted(item.path for item in inferred.inputs)
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    assert summary["inference"]["images"] == len(inferred.inputs)
    assert summary["inference"]["objects"] == sum(int(row["objects"]) for row in rows)
    assert summary["inference"]["model"]["name"] == inferred.model.name
    assert summary["inference"]["model"]["version"] == 1
    assert summary["manifest_sha256"] == inferred.shards[0].spec.manifest_sha256
    assert sorted(j["job"] for j in summary["jobs"]) == ["infer-0000", "infer-0001"]
    page = (run_dir / "report.html").read_text(encoding="utf-8")
    assert_self_contained(page)
    assert page.count("data:image/png;base64,") >= 2
    assert "it&#39;s a &#34;test&#34;.png" in page and "plate 2 ü" in page  # escaped by Jinja


def test_training_report_shows_curves_and_the_registered_model(
    trained: TrainedModel, job_spec: Callable[..., Any], run: Callable[..., JobRun]
) -> None:
    batch_dir = Path(trained.run.spec.batch_dir)
    job = run(report_spec(batch_dir, "training", trained.run, job_spec))
    assert job.returncode == 0, job.log
    summary = json.loads((batch_dir / "results" / "summary.json").read_text(encoding="utf-8"))
    assert summary["training"]["model"]["version"] == 1
    assert summary["training"]["epochs_run"] == 2
    assert "inference" not in summary
    page = (batch_dir / "results" / "report.html").read_text(encoding="utf-8")
    assert_self_contained(page)
    assert page.count("data:image/png;base64,") == 2 + 3  # two charts, best/worst/random previews
    assert "best: " in page and "worst: " in page and "(Dice " in page
    assert "spheroids version 1" in page


def test_a_missing_shard_table_fails_the_report_as_internal(
    inferred: InferredBatch,
    tmp_path: Path,
    job_spec: Callable[..., Any],
    run: Callable[..., JobRun],
) -> None:
    batch_dir = tmp_path / "batch"
    shutil.copytree(inferred.batch_dir, batch_dir)
    for name in ("parts/table-0001.csv", "report.html", "summary.json", "table.csv"):
        (batch_dir / "results" / name).unlink(missing_ok=True)
    job = run(report_spec(batch_dir, "inference", inferred.shards[0], job_spec, inferred.inputs))
    assert job.returncode == 1, job.log
    error = job.result.error  # type: ignore[union-attr]
    assert error is not None and error.kind is ErrorKind.INTERNAL
    assert "no table row for 2 of 5 images" in error.message and error.traceback
    assert not (batch_dir / "results" / "report.html").exists()


def test_the_report_clears_away_what_killed_writes_left_and_nothing_else(
    inferred: InferredBatch,
    job_spec: Callable[..., Any],
    run: Callable[..., JobRun],
    tmp_path: Path,
) -> None:
    """A shard killed while writing a mask leaves a temporary (``.tmp-watchd-<16 hex>``); its
    retry writes the mask anew. The report, run once every shard has ended, removes the stray; a link of that name
    is neither followed nor removed, and the masks stay."""
    masks = inferred.batch_dir / "results" / "masks"
    stray = next(masks.rglob("*.png")).parent / ".tmp-watchd-0123456789abcdef"
    stray.write_bytes(b"half a mask")
    outside = tmp_path / "keep.png"
    outside.write_bytes(b"not the job's")
    link = masks / ".tmp-watchd-fedcba9876543210"
    link.symlink_to(outside)
    lookalike = masks / ".tmp-img.png.k1ll3d"  # an input's mask could be named so
    lookalike.write_bytes(b"a mask")
    before = sorted(masks.rglob("*.png"))
    try:
        job = run(
            report_spec(
                inferred.batch_dir, "inference", inferred.shards[0], job_spec, inferred.inputs
            )
        )
        assert job.returncode == 0, job.log
        assert not stray.exists()
        assert "removed 1 temporary file(s) left by interrupted writes" in job.log
        assert link.is_symlink() and outside.read_bytes() == b"not the job's"
        assert sorted(masks.rglob("*.png")) == before
        assert lookalike.read_bytes() == b"a mask"
    finally:
        link.unlink()
        lookalike.unlink()


HOSTILE = '<img src=x onerror="alert(1)">&'


def test_every_value_from_the_batch_is_escaped_by_the_template() -> None:
    """Title, folder, parameters, file names and captions come from the batch's owner: the
    template escapes each (autoescaping), so none becomes markup."""
    summary = {
        "batch": {"id": 1, "revision": 1, "kind": "inference", "title": HOSTILE, "dir": HOSTILE},
        "manifest_sha256": "0" * 64,
        "params": {HOSTILE: HOSTILE},
        "generated_at": "now",
        "code_version": "test",
        "jobs": [{"job": HOSTILE, "pipeline": "infer", "ok": True, "elapsed_s": 1.5}],
    }
    row = {column: "1" for column in TABLE_COLUMNS} | {"path": f"{HOSTILE}.png"}
    model = {"name": HOSTILE, "version": 1, "sha256": "0" * 64}
    inference = {
        "summary": {
            "images": 1, "images_with_objects": 1, "objects": 1, "model": model,
            "area_px_of_images_with_objects": {"mean": 1.0, "median": 1.0},
        },
        "rows": [row],
        "overlays": [(HOSTILE, "data:image/png;base64,AAAA")],
        "histogram": "data:image/png;base64,AAAA",
    }  # fmt: skip
    page = render(summary, {"inference": inference})
    assert "<img src=x" not in page and 'onerror="' not in page
    escaped = "&lt;img src=x onerror=&#34;alert(1)&#34;&gt;&amp;"
    assert page.count(escaped) >= 7  # title ×2, folder, parameter, path, caption, job, model
    assert '<td class="num">1</td>' in page and "<td>–</td>" in page  # a job's missing host
