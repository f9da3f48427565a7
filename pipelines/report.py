"""Report job: merge the shard tables, summarise the run, write a self-contained HTML report.

``python -m pipelines.report JOB_DIR`` runs after every compute job of a batch succeeded. It
reads what the run's jobs left in the run's work folder in the spool (the service's own: shard
tables, job results, training's model card, curves and previews, the sweep's record), never
what lies in the owner's batch folder but the inputs and the masks it shows, and those through
the held batch folder. In ``run_dir`` (the owner's results folder) it writes:

- ``table.csv`` (inference): the rows of ``parts/table-*.csv``, sorted by path; every image
  input of the spec must have exactly one row, otherwise the job fails (INTERNAL: a shard's
  output is missing, which is not the data owner's doing);
- ``quality.csv`` (inference with ground truth, masks beside the images): each image's objects
  against its true ones (:mod:`pipelines.truth`);
- ``summary.json``: counts, area statistics, model, manifest hash, per-job timings, and for
  training the registered model and its metrics, for a sweep its trials and the winner;
- ``report.html``: one file, no network references, pictures inlined as base64 PNG;
- copies for the owner of ``training/model.json`` and ``training/metrics.csv`` (training) and
  ``sweep/trials.csv`` (a sweep).

What to report is decided by what the run left: shard tables (inference),
``training/model.json`` (training, or a sweep's registered winner) and ``sweep/sweep.json``.
Every file is read through the held work folder, at most MAX_READ_BYTES of it, and a name read
from one (a preview's) must be one name in its folder.
Overlays show the most and least confident images and random others; an image segmented window
by window is shown as its label image's overview with the objects drawn over it (the first
SLIDES of them). Training previews the best, the worst and a random validation image by Dice,
and shows each validation image's objects against the true ones (``training/validation.csv``).
"""

from __future__ import annotations

import csv
import io
import json
import statistics
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from daemon.contract.heldfolder import HeldFolder, parts_of
from daemon.contract.jobspec import (
    JOBS_DIR,
    RESULT_FILE,
    InputFile,
    JobResult,
    JobSpec,
    Pipeline,
    Role,
)
from daemon.contract.names import inference_params
from daemon.contract.safeopen import RefusedInput
from daemon.contract.version import code_version
from pipelines import figures, truth
from pipelines.images import UnreadableImage, read_bounded
from pipelines.job import InputError, log, main, run_folder, work_folder
from pipelines.layout import (
    CURVE_COLUMNS,
    MASKS_DIR,
    METRICS_FILE,
    MODEL_FILE,
    PARTS_DIR,
    PREVIEW_INDEX,
    PREVIEWS_DIR,
    QUALITY_FILE,
    REPORT_FILE,
    SUMMARY_FILE,
    SWEEP_DIR,
    SWEEP_FILE,
    TABLE_COLUMNS,
    TABLE_FILE,
    TRAINING_DIR,
    TRIALS_DIR,
    TRIALS_TABLE,
    VALIDATION_FILE,
    label_image_name,
    table_csv,
)
from pipelines.page import render

OVERLAYS = 6
SLIDES = 4  # overviews of images segmented window by window, at most
MAX_READ_BYTES = 512 << 20  # one file the jobs left (a table of 55,000 rows is some 10 MB)


def merge_tables(work: HeldFolder) -> list[dict[str, str]]:
    """All rows of the shard tables (``parts/table-*.csv`` of the work folder), sorted by path;
    a path listed twice is an error."""
    rows: dict[str, dict[str, str]] = {}
    for name in _names(work, PARTS_DIR, lambda n: n.startswith("table-") and n.endswith(".csv")):
        reader = csv.DictReader(io.StringIO(_read_text(work, f"{PARTS_DIR}/{name}"), newline=""))
        if tuple(reader.fieldnames or ()) != TABLE_COLUMNS:
            raise ValueError(f"{name} has columns {reader.fieldnames}, not {TABLE_COLUMNS}")
        for row in reader:
            if row["path"] in rows:
                raise ValueError(f"{row['path']!r} appears in more than one shard table")
            rows[row["path"]] = row
    return [rows[path] for path in sorted(rows)]


def _names(folder: HeldFolder, relative: str, wanted: Callable[[str], bool]) -> list[str]:
    """The regular files of a folder below ``folder`` whose names are ``wanted``, sorted; none
    if the folder is not there."""
    try:
        with folder.folder(relative) as inner:
            entries = inner.entries()
    except FileNotFoundError:
        return []
    return sorted(e.name for e in entries if e.is_file(follow_symlinks=False) and wanted(e.name))


def _read_text(folder: HeldFolder, relative: str) -> str:
    """A text file below ``folder``, at most MAX_READ_BYTES of it (a longer one is refused)."""
    with folder.open_read(relative) as handle:
        data = handle.read(MAX_READ_BYTES + 1)
    if len(data) > MAX_READ_BYTES:
        raise ValueError(f"{relative} is larger than {MAX_READ_BYTES:,} bytes")
    return data.decode("utf-8")


def check_complete(spec: JobSpec, rows: list[dict[str, str]]) -> None:
    expected = {item.path for item in spec.inputs if item.role is Role.IMAGE}
    missing = sorted(expected - {row["path"] for row in rows})
    if missing:
        examples = ", ".join(repr(path) for path in missing[:5])
        raise RuntimeError(f"no table row for {len(missing)} of {len(expected)} images: {examples}")


def job_timings(work: HeldFolder, own: str) -> list[dict[str, Any]]:
    """What each finished job of this run reported (the report job itself excluded)."""
    jobs = []
    with work.folder(JOBS_DIR) as folder:
        names = sorted(e.name for e in folder.entries() if e.is_dir(follow_symlinks=False))
    for name in names:
        if name == own:
            continue
        try:
            result = JobResult.from_json(_read_text(work, f"{JOBS_DIR}/{name}/{RESULT_FILE}"))
        except FileNotFoundError:
            continue  # a folder of launch files, or a job that left no result
        summary = result.summary
        job = {
            "job": name,
            "pipeline": result.pipeline,
            "ok": result.ok,
            "elapsed_s": summary.get("elapsed_s"),
            "host": summary.get("host"),
            "finished_at": result.finished_at,
        }
        if "inference" in summary:  # where its net ran, in what precision, and why
            job["inference"] = summary["inference"]
        jobs.append(job)
    return jobs


def precision_checks(jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each inference job's device and precision, with the checks of its first batch."""
    return [{"job": job["job"], **job["inference"]} for job in jobs if "inference" in job]


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
    made_in = Counter(row["precision"] for row in rows if row.get("precision"))
    if made_in:  # (tables written before it was recorded have no precision)
        summary["precision"] = dict(sorted(made_in.items()))
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
    spec: JobSpec, rows: list[dict[str, str]], batch: HeldFolder, run: HeldFolder
) -> list[tuple[str, str]]:
    """(caption, data URI) for the images :func:`overlay_picks` chose, read through the held
    batch folder, bounded by what its header declares (the owner may have replaced it:
    :func:`pipelines.images.read_bounded`), with their masks as :func:`pipelines.truth.written_mask`
    reads them: through the held run folder, bounded, and never one with another hard link."""
    params = inference_params(spec.params)
    most = int(params["max_whole_pixels"])
    pictures = []
    for label, row in overlay_picks(rows):
        try:
            image = read_bounded(batch, InputFile(row["path"]), most, params["channel"])
            mask = truth.written_mask(run, row)
        except (OSError, RefusedInput, InputError, UnreadableImage) as exc:
            log.warning("no overlay for %s: %s", row["path"], exc)
            continue
        if image is None:
            continue
        caption = (
            f"{label}: {row['path']}: {row['objects']} object(s), {row['area_px']} px, "
            f"confidence {float(row['confidence']):.3f}"
        )
        overlay = figures.overlay(image[0], mask > 0.5)
        pictures.append((caption, figures.data_uri(overlay)))
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
    slides = _tiled(rows)[:SLIDES]
    if not slides:
        return []
    from pipelines.omezarr import overview_and_labels  # zarr: for slides only (1 s of imports)

    pictures = []
    for row in slides:
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


def read_curves(text: str) -> list[dict[str, float]]:
    """A training's curves (``metrics.csv``) from its text."""
    reader = csv.DictReader(io.StringIO(text, newline=""))
    return [{k: float(v) for k, v in row.items()} for row in reader]


def training_charts(curves: list[dict[str, float]]) -> list[tuple[str, str]]:
    def series(*keys: str) -> dict[str, list[tuple[float, float]]]:
        return {key: [(row["epoch"], row[key]) for row in curves] for key in keys}

    loss = figures.line_chart("loss (BCE + Dice)", series("train_loss", "val_loss"))
    quality = figures.line_chart("validation", series("val_dice", "val_iou"))
    return [("loss per epoch", figures.png_uri(loss)), ("Dice and IoU", figures.png_uri(quality))]


def _previews(training: HeldFolder) -> list[tuple[str, str]]:
    """(caption, data URI) of the training previews, captioned from their index; an entry of
    the index is one file name in the previews folder, nothing else."""
    try:
        index = json.loads(_read_text(training, f"{PREVIEWS_DIR}/{PREVIEW_INDEX}"))["previews"]
    except (OSError, ValueError, KeyError):
        index = [{"file": n} for n in _names(training, PREVIEWS_DIR, lambda n: n.endswith(".png"))]
    previews = []
    for entry in index:
        name = str(entry["file"])
        if parts_of(name) != (name,):
            raise ValueError(f"the previews' index names {name!r}, not a file of the folder")
        caption = Path(name).stem
        if "pick" in entry:
            caption = f"{entry['pick']}: {caption} (Dice {entry['dice']:.3f}"
            if "objects_true" in entry:
                caption += f"; {entry['objects_found']} objects found, {entry['objects_true']} true"
            caption += ")"
        with training.open_read(f"{PREVIEWS_DIR}/{name}") as handle:
            previews.append((caption, figures.png_uri(handle.read(MAX_READ_BYTES))))
    return previews


def _validation_text(training: HeldFolder) -> str | None:
    """training/validation.csv (None for a training from before it was written)."""
    try:
        return _read_text(training, VALIDATION_FILE)
    except FileNotFoundError:
        return None


def _training(work: HeldFolder, run: HeldFolder) -> tuple[dict[str, Any], dict[str, Any]]:
    """(summary part, page part) for a training run (and a sweep's winner); the model card, the
    curves and the validation images' scores are copied for the owner into ``training/`` of the
    results folder."""
    with work.folder(TRAINING_DIR) as training:
        card, curves_text = _read_text(training, MODEL_FILE), _read_text(training, METRICS_FILE)
        validation_text = _validation_text(training)
        previews = _previews(training)
    model, curves = json.loads(card), read_curves(curves_text)
    run.write_text(f"{TRAINING_DIR}/{MODEL_FILE}", card)
    run.write_text(f"{TRAINING_DIR}/{METRICS_FILE}", curves_text)
    validation = []
    if validation_text is not None:
        run.write_text(f"{TRAINING_DIR}/{VALIDATION_FILE}", validation_text)
        validation = list(csv.DictReader(io.StringIO(validation_text, newline="")))
    summary = {
        "model": model,
        "epochs_run": len(curves),
        "curves": f"{TRAINING_DIR}/{METRICS_FILE}",
    }
    if validation:
        summary["validation"] = f"{TRAINING_DIR}/{VALIDATION_FILE}"
    page = {
        "model": model,
        "curves": curves,
        "columns": CURVE_COLUMNS,
        "charts": training_charts(curves),
        "previews": previews,
        "validation": validation,
    }
    return summary, page


def _number(text: str) -> str | float:
    """A CSV cell as a float when it is a fraction (shown rounded), else as written."""
    try:
        return float(text) if "." in text or "e" in text else text
    except ValueError:
        return text


def _sweep(work: HeldFolder, run: HeldFolder) -> tuple[dict[str, Any], dict[str, Any]]:
    """(summary part, page part) for a sweep: every trial ranked, their validation curves; the
    trials' table is copied for the owner into ``sweep/`` of the results folder."""
    record = json.loads(_read_text(work, f"{SWEEP_DIR}/{SWEEP_FILE}"))
    table = _read_text(work, f"{SWEEP_DIR}/{TRIALS_TABLE}")
    trials = list(csv.DictReader(io.StringIO(table, newline="")))
    metric = record.get("metric", "val_dice")
    series = {}
    for trial in trials:
        job = str(trial["job"])
        if parts_of(job) != (job,):
            raise ValueError(f"the trials' table names {job!r}, not a trial's folder")
        curves = read_curves(_read_text(work, f"{TRIALS_DIR}/{job}/{METRICS_FILE}"))
        series[f"trial {trial['trial']}"] = [(row["epoch"], row[metric]) for row in curves]
    run.write_text(f"{SWEEP_DIR}/{TRIALS_TABLE}", table)
    chart = figures.line_chart(f"{metric} per epoch, every trial", series)
    summary = {"method": record.get("method"), "metric": metric, "trials": len(trials),
               "winner": record.get("winner"), "table": f"{SWEEP_DIR}/{TRIALS_TABLE}",
               "wandb_sweep_id": record.get("wandb_sweep_id")}  # fmt: skip
    shown = [{k: _number(v) for k, v in trial.items()} for trial in trials]
    page = {"summary": summary, "trials": shown, "chart": figures.png_uri(chart),
            "space": record.get("space", {})}  # fmt: skip
    return summary, page


def _inference(
    spec: JobSpec,
    run: HeldFolder,
    work: HeldFolder,
    batch: HeldFolder,
    jobs: list[dict[str, Any]],
) -> tuple[dict[str, Any], dict[str, Any]]:
    rows = merge_tables(work)
    check_complete(spec, rows)
    run.write_text(TABLE_FILE, table_csv(rows))
    summary = inference_summary(rows)
    scored = truth.score_batch(spec.inputs, rows, batch, run)
    if scored is not None:
        run.write_text(QUALITY_FILE, scored.csv())
        summary["ground_truth"] = scored.summary()
    summary["precision_checks"] = precision_checks(jobs)
    sizes = [int(row["area_px"]) / int(row["objects"]) for row in rows if int(row["objects"])]
    histogram = figures.histogram("object size (mean per image)", sizes, "area (pixels)")
    page = {
        "summary": summary,
        "rows": rows,
        "overlays": sample_overlays(spec, rows, batch, run),
        "slides": slide_overviews(rows, run),
        "histogram": figures.svg_uri(histogram),
        "truth": [] if scored is None else scored.rows,
    }
    return summary, page


def report(spec: JobSpec, job_dir: Path, batch: HeldFolder) -> dict[str, Any]:
    """The report job."""
    with run_folder(spec, batch) as run, work_folder(spec) as work:
        return _report(spec, job_dir, run, work, batch)


def _report(
    spec: JobSpec, job_dir: Path, run: HeldFolder, work: HeldFolder, batch: HeldFolder
) -> dict[str, Any]:
    """The report job, reading what the jobs left in the held work folder ``work`` and inputs
    through the held batch folder, writing under the held run folder ``run``."""
    run_dir = Path(spec.run_dir)
    # Every other job of the batch has ended: what a killed one was writing is garbage.
    strays = run.remove_strays() + work.remove_strays()
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
        "jobs": job_timings(work, own=job_dir.name),
    }
    summary["compute_s"] = round(sum(job["elapsed_s"] or 0 for job in summary["jobs"]), 3)
    pages: dict[str, Any] = {}
    if work.exists(PARTS_DIR):
        summary["inference"], pages["inference"] = _inference(
            spec, run, work, batch, summary["jobs"]
        )
    if work.exists(f"{SWEEP_DIR}/{SWEEP_FILE}"):
        summary["sweep"], pages["sweep"] = _sweep(work, run)
    if work.exists(f"{TRAINING_DIR}/{MODEL_FILE}"):
        summary["training"], pages["training"] = _training(work, run)
    if not pages:
        raise RuntimeError(f"nothing to report in {spec.work_dir}: no shard tables, no model")
    run.write_text(SUMMARY_FILE, json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
    run.write_text(REPORT_FILE, render(summary, pages))
    log.info("report written: %s", run_dir / REPORT_FILE)
    return {"report": REPORT_FILE, "summary": SUMMARY_FILE, "sections": sorted(pages)}


if __name__ == "__main__":
    main(Pipeline.REPORT, report)
