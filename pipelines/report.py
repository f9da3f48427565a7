"""Report job: merge the shard tables, summarise the run, write a self-contained HTML report.

``python -m pipelines.report JOB_DIR`` runs after every compute job of a batch succeeded. In
``run_dir`` it writes:

- ``table.csv`` (inference): the rows of ``parts/table-*.csv``, sorted by path; every image
  input of the spec must have exactly one row, otherwise the job fails (INTERNAL: a shard's
  output is missing, which is not the data owner's doing);
- ``summary.json``: counts, area statistics, model, manifest hash, per-job timings, and for
  training the registered model and its metrics, for a sweep its trials and the winner;
- ``report.html``: one file, no network references, pictures inlined as base64 PNG.

What to report is decided by what the run left: shard tables (inference),
``training/model.json`` (training, or a sweep's registered winner) and ``sweep/sweep.json``.
Overlays show the most and least confident images and random others; an image segmented window
by window is shown as its label image's overview with the objects drawn over it (the first
SLIDES of them). Training previews the best, the worst and a random validation image by Dice.
"""

from __future__ import annotations

import csv
import json
import statistics
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from daemon.contract.heldfolder import HeldFolder
from daemon.contract.jobspec import JOBS_DIR, RESULT_FILE, JobResult, JobSpec, Pipeline, Role
from daemon.contract.safeopen import RefusedInput, open_input
from daemon.contract.version import code_version
from pipelines import figures
from pipelines.images import UnreadableImage, decode
from pipelines.job import log, run_folder, run_job
from pipelines.layout import (
    CURVE_COLUMNS,
    MASKS_DIR,
    METRICS_FILE,
    MODEL_FILE,
    PARTS_DIR,
    PREVIEW_INDEX,
    PREVIEWS_DIR,
    REPORT_FILE,
    SUMMARY_FILE,
    SWEEP_DIR,
    SWEEP_FILE,
    TABLE_COLUMNS,
    TABLE_FILE,
    TRAINING_DIR,
    TRIALS_DIR,
    TRIALS_TABLE,
    label_image_name,
    mask_name,
    table_csv,
)
from pipelines.omezarr import overview_and_labels
from pipelines.page import render

OVERLAYS = 6
SLIDES = 4  # overviews of images segmented window by window, at most


def merge_tables(run_dir: Path) -> list[dict[str, str]]:
    """All rows of the shard tables, sorted by path; a path listed twice is an error."""
    rows: dict[str, dict[str, str]] = {}
    for part in sorted((run_dir / PARTS_DIR).glob("table-*.csv")):
        with open(part, newline="", encoding="utf-8") as handle:
            reader = csv.DictReader(handle)
            if tuple(reader.fieldnames or ()) != TABLE_COLUMNS:
                raise ValueError(
                    f"{part.name} has columns {reader.fieldnames}, not {TABLE_COLUMNS}"
                )
            for row in reader:
                if row["path"] in rows:
                    raise ValueError(f"{row['path']!r} appears in more than one shard table")
                rows[row["path"]] = row
    return [rows[path] for path in sorted(rows)]


def check_complete(spec: JobSpec, rows: list[dict[str, str]]) -> None:
    expected = {item.path for item in spec.inputs if item.role is Role.IMAGE}
    missing = sorted(expected - {row["path"] for row in rows})
    if missing:
        examples = ", ".join(repr(path) for path in missing[:5])
        raise RuntimeError(f"no table row for {len(missing)} of {len(expected)} images: {examples}")


def job_timings(run_dir: Path, own: str) -> list[dict[str, Any]]:
    """What each finished job of this run reported (the report job itself excluded)."""
    jobs = []
    for path in sorted((run_dir / JOBS_DIR).glob(f"*/{RESULT_FILE}")):
        if path.parent.name == own:
            continue
        result = JobResult.from_json(path.read_text(encoding="utf-8"))
        summary = result.summary
        jobs.append(
            {
                "job": path.parent.name,
                "pipeline": result.pipeline,
                "ok": result.ok,
                "elapsed_s": summary.get("elapsed_s"),
                "host": summary.get("host"),
                "finished_at": result.finished_at,
            }
        )
    return jobs


def _area_stats(rows: list[dict[str, str]]) -> dict[str, float | None]:
    areas = [int(row["area_px"]) for row in rows if int(row["objects"])]
    if not areas:
        return {"mean": None, "median": None, "min": None, "max": None}
    return {
        "mean": round(statistics.fmean(areas), 2),
        "median": float(statistics.median(areas)),
        "min": min(areas),
        "max": max(areas),
    }


def _tiled(rows: list[dict[str, str]]) -> list[dict[str, str]]:
    return [row for row in rows if row.get("tiled") == "1"]


def windows_of(row: dict[str, str]) -> tuple[int, int] | None:
    """(windows run, windows skipped as glass) of an image segmented window by window; None
    for a row without them (a table written before they were counted)."""
    run, glass = row.get("windows_run"), row.get("windows_glass")
    if not run and not glass:
        return None
    return int(run or 0), int(glass or 0)


def inference_summary(rows: list[dict[str, str]]) -> dict[str, Any]:
    first = rows[0] if rows else {}
    summary: dict[str, Any] = {
        "images": len(rows),
        "images_with_objects": sum(1 for row in rows if int(row["objects"])),
        "objects": sum(int(row["objects"]) for row in rows),
        "area_px_of_images_with_objects": _area_stats(rows),
        "model": {
            "name": first.get("model_name"),
            "version": int(first["model_version"]) if first else None,
            "sha256": first.get("model_sha256"),
        },
        "table": TABLE_FILE,
    }
    counted = [found for found in map(windows_of, _tiled(rows)) if found is not None]
    if counted:
        summary["windows"] = {"run": sum(w[0] for w in counted),
                              "glass": sum(w[1] for w in counted)}  # fmt: skip
    return summary


def overlay_picks(rows: list[dict[str, str]], seed: int = 0) -> list[tuple[str, dict[str, str]]]:
    """(label, row) of the most and least confident images and random others (at most OVERLAYS
    in all); images segmented window by window are too large to draw and are left out."""
    small = [r for r in rows if r.get("tiled") in (None, "", "0") and r.get("confidence")]
    order = sorted(small, key=lambda r: (float(r["confidence"]), r["path"]))
    if not order:
        return []
    picks = [("most confident", order[-1])]
    if len(order) > 1:
        picks.append(("least confident", order[0]))
    rest = order[1:-1]
    chosen = np.random.default_rng(seed).permutation(len(rest))[: OVERLAYS - len(picks)]
    return picks + [("random", rest[i]) for i in sorted(chosen)]


def sample_overlays(
    spec: JobSpec, rows: list[dict[str, str]], batch: HeldFolder
) -> list[tuple[str, str]]:
    """(caption, data URI) for the images :func:`overlay_picks` chose, read (with their masks)
    through the held batch folder."""
    masks = Path(spec.run_dir).relative_to(spec.batch_dir) / MASKS_DIR
    pictures = []
    for label, row in overlay_picks(rows):
        try:
            with open_input(batch, row["path"]) as handle:
                image = decode(handle.read(), name=row["path"])
            with open_input(batch, f"{masks}/{mask_name(row['path'])}") as handle:
                mask = decode(handle.read())
        except (OSError, RefusedInput, UnreadableImage) as exc:
            log.warning("no overlay for %s: %s", row["path"], exc)
            continue
        caption = (
            f"{label}: {row['path']}: {row['objects']} object(s), {row['area_px']} px, "
            f"confidence {float(row['confidence']):.3f}"
        )
        pictures.append((caption, figures.data_uri(figures.overlay(image, mask > 0.5))))
    return pictures


def _slide_caption(row: dict[str, str]) -> str:
    def count(text: str) -> str:
        return f"{int(text):,}" if text.isdigit() else text

    caption = (f"{row['path']}: {count(row['objects'])} object(s), "
               f"{count(row['width'])} × {count(row['height'])} px")  # fmt: skip
    windows = windows_of(row)
    if windows is not None:
        caption += f", {windows[0]:,} windows run, {windows[1]:,} skipped as glass"
    return caption


def slide_overviews(rows: list[dict[str, str]], run: HeldFolder) -> list[tuple[str, str]]:
    """(caption, data URI) for the first SLIDES images segmented window by window: the overview
    their label image holds, objects drawn over it, read through the held run folder. A label
    image missing, or not as its writer leaves it, is warned about and left out."""
    pictures = []
    for row in _tiled(rows)[:SLIDES]:
        try:
            with run.folder(f"{MASKS_DIR}/{label_image_name(row['path'])}") as held:
                grey, ids = overview_and_labels(held)
        # the owner may have altered or replaced it; zarr and its codecs raise all these on
        # a damaged one, and a picture is not worth a failed report
        except (OSError, ValueError, LookupError, TypeError, RuntimeError) as exc:
            log.warning("no slide overview for %s: %s", row["path"], exc)
            continue
        picture = figures.label_overlay(grey, ids)
        pictures.append((_slide_caption(row), figures.data_uri(picture)))
    return pictures


def read_curves(path: Path) -> list[dict[str, float]]:
    with open(path, newline="", encoding="utf-8") as handle:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(handle)]


def training_charts(curves: list[dict[str, float]]) -> list[tuple[str, str]]:
    def series(*keys: str) -> dict[str, list[tuple[float, float]]]:
        return {key: [(row["epoch"], row[key]) for row in curves] for key in keys}

    loss = figures.line_chart("loss (BCE + Dice)", series("train_loss", "val_loss"))
    quality = figures.line_chart("validation", series("val_dice", "val_iou"))
    return [("loss per epoch", figures.png_uri(loss)), ("Dice and IoU", figures.png_uri(quality))]


def _previews(folder: Path) -> list[tuple[str, str]]:
    """(caption, data URI) of the training previews, captioned from their index."""
    try:
        index = json.loads((folder / PREVIEW_INDEX).read_text(encoding="utf-8"))["previews"]
    except (OSError, ValueError, KeyError):
        index = [{"file": p.name} for p in sorted(folder.glob("*.png"))]
    previews = []
    for entry in index:
        caption = Path(entry["file"]).stem
        if "pick" in entry:
            caption = f"{entry['pick']}: {caption} (Dice {entry['dice']:.3f})"
        previews.append((caption, figures.png_uri((folder / entry["file"]).read_bytes())))
    return previews


def _training(run_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(summary part, page part) for a training run (and a sweep's winner)."""
    training_dir = run_dir / TRAINING_DIR
    model = json.loads((training_dir / MODEL_FILE).read_text(encoding="utf-8"))
    curves = read_curves(training_dir / METRICS_FILE)
    summary = {
        "model": model,
        "epochs_run": len(curves),
        "curves": f"{TRAINING_DIR}/{METRICS_FILE}",
    }
    page = {
        "model": model,
        "curves": curves,
        "columns": CURVE_COLUMNS,
        "charts": training_charts(curves),
        "previews": _previews(training_dir / PREVIEWS_DIR),
    }
    return summary, page


def _number(text: str) -> str | float:
    """A CSV cell as a float when it is a fraction (shown rounded), else as written."""
    try:
        return float(text) if "." in text or "e" in text else text
    except ValueError:
        return text


def _sweep(run_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(summary part, page part) for a sweep: every trial ranked, their validation curves."""
    record = json.loads((run_dir / SWEEP_DIR / SWEEP_FILE).read_text(encoding="utf-8"))
    with open(run_dir / SWEEP_DIR / TRIALS_TABLE, newline="", encoding="utf-8") as handle:
        trials = list(csv.DictReader(handle))
    metric = record.get("metric", "val_dice")
    series = {}
    for trial in trials:
        curves = read_curves(run_dir / TRIALS_DIR / trial["job"] / METRICS_FILE)
        series[f"trial {trial['trial']}"] = [(row["epoch"], row[metric]) for row in curves]
    chart = figures.line_chart(f"{metric} per epoch, every trial", series)
    summary = {"method": record.get("method"), "metric": metric, "trials": len(trials),
               "winner": record.get("winner"), "table": f"{SWEEP_DIR}/{TRIALS_TABLE}",
               "wandb_sweep_id": record.get("wandb_sweep_id")}  # fmt: skip
    shown = [{k: _number(v) for k, v in trial.items()} for trial in trials]
    page = {"summary": summary, "trials": shown, "chart": figures.png_uri(chart),
            "space": record.get("space", {})}  # fmt: skip
    return summary, page


def _inference(
    spec: JobSpec, run: HeldFolder, run_dir: Path, batch: HeldFolder
) -> tuple[dict[str, Any], dict[str, Any]]:
    rows = merge_tables(run_dir)
    check_complete(spec, rows)
    run.write_text(TABLE_FILE, table_csv(rows))
    summary = inference_summary(rows)
    sizes = [int(row["area_px"]) / int(row["objects"]) for row in rows if int(row["objects"])]
    histogram = figures.histogram("object size (mean per image)", sizes, "area (pixels)")
    page = {
        "summary": summary,
        "rows": rows,
        "overlays": sample_overlays(spec, rows, batch),
        "slides": slide_overviews(rows, run),
        "histogram": figures.png_uri(histogram),
    }
    return summary, page


def report(spec: JobSpec, job_dir: Path, batch: HeldFolder) -> dict[str, Any]:
    """The report job."""
    with run_folder(spec, batch) as run:
        return _report(spec, job_dir, run, batch)


def _report(spec: JobSpec, job_dir: Path, run: HeldFolder, batch: HeldFolder) -> dict[str, Any]:
    """The report job, reading inputs through the held batch folder and writing under the held
    run folder ``run``."""
    run_dir = Path(spec.run_dir)
    # Every other job of the batch has ended: what a killed one was writing is garbage.
    strays = run.remove_strays()
    if strays:
        log.info("removed %d temporary file(s) left by interrupted writes, e.g. %s",
                 len(strays), strays[0])  # fmt: skip
    summary: dict[str, Any] = {
        "batch": {
            "id": spec.batch_id,
            "revision": spec.batch_revision,
            "kind": spec.batch_kind,
            "title": spec.title,
            "dir": spec.batch_dir,
        },
        "manifest_sha256": spec.manifest_sha256,
        "params": dict(spec.params),
        "generated_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "code_version": code_version(),
        "jobs": job_timings(run_dir, own=job_dir.name),
    }
    summary["compute_s"] = round(sum(job["elapsed_s"] or 0 for job in summary["jobs"]), 3)
    pages: dict[str, Any] = {}
    if (run_dir / PARTS_DIR).is_dir():
        summary["inference"], pages["inference"] = _inference(spec, run, run_dir, batch)
    if (run_dir / SWEEP_DIR / SWEEP_FILE).is_file():
        summary["sweep"], pages["sweep"] = _sweep(run_dir)
    if (run_dir / TRAINING_DIR / MODEL_FILE).is_file():
        summary["training"], pages["training"] = _training(run_dir)
    if not pages:
        raise RuntimeError(f"nothing to report in {run_dir}: no shard tables, no trained model")
    run.write_text(SUMMARY_FILE, json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
    run.write_text(REPORT_FILE, render(summary, pages))
    log.info("report written: %s", run_dir / REPORT_FILE)
    return {"report": REPORT_FILE, "summary": SUMMARY_FILE, "sections": sorted(pages)}


if __name__ == "__main__":
    raise SystemExit(run_job(Pipeline.REPORT, report))
