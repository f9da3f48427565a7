"""The HTML of the batch report: one self-contained file, styles inline, pictures as data URIs.

The markup is a Jinja2 template (``templates/report.html.j2``) rendered with autoescaping: every
value that comes from the batch (titles, file names, parameters) is escaped by Jinja, none by
hand. This module picks what the page shows from the summary and the prepared page parts; the
page references nothing outside itself except the relative link to ``table.csv`` next to it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jinja2

from pipelines.layout import QUALITY_COLUMNS, TABLE_COLUMNS, VALIDATION_COLUMNS

MAX_ROWS = 500
TABLE_VIEW = TABLE_COLUMNS[: TABLE_COLUMNS.index("tiled") + 1]  # the measured columns
JOB_COLUMNS = ("job", "pipeline", "ok", "elapsed_s", "host", "finished_at")

_TEMPLATES = jinja2.Environment(
    loader=jinja2.PackageLoader("pipelines", "templates"),
    autoescape=True,
    undefined=jinja2.StrictUndefined,  # a part the page asks for and nobody gave is a bug
)


def shown(value: Any) -> str:
    """A value as a cell shows it: a dash for nothing, floats to four significant digits."""
    if value is None or value == "":
        return "–"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def numeric(value: Any) -> bool:
    """Whether a cell holds a number (a CSV's text too): it is right-aligned."""
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return not isinstance(value, bool)


_TEMPLATES.filters["shown"] = shown
_TEMPLATES.tests["numeric"] = numeric
# compiled as this module is imported (~12 ms): a report forked from a warm start
# (daemon/executors/spares.py) finds it made
_PAGE = _TEMPLATES.get_template("report.html.j2")


def _inference(part: Mapping[str, Any]) -> dict[str, Any]:
    summary, rows = part["summary"], part["rows"]
    area = summary["area_px_of_images_with_objects"]
    model = summary["model"]
    facts = {
        "images": summary["images"],
        "images with objects": summary["images_with_objects"],
        "objects": summary["objects"],
        "mean area (px, images with objects)": area["mean"],
        "median area (px)": area["median"],
        "model": f"{model['name']} version {model['version']}",
        "model sha256": model["sha256"],
    }
    if "precision" in summary:
        made_in = summary["precision"].items()
        facts["net precision"] = ", ".join(f"{name}: {count:,} image(s)" for name, count in made_in)
    checked = [_checked(job) for job in summary.get("precision_checks", []) if job["checks"]]
    if checked:
        facts["precision checks (first batch against fp32)"] = "; ".join(checked)
    if "windows" in summary:  # tables written before windows were counted have none
        windows = summary["windows"]
        facts["window by window"] = (f"{windows['run']:,} windows run, {windows['glass']:,} "
                                     "skipped as glass (no tissue)")  # fmt: skip
    first = rows[:MAX_ROWS]
    return {
        "facts": facts,
        "truth": _truth(summary.get("ground_truth"), part.get("truth", [])),
        "histogram": part["histogram"],
        "overlays": part["overlays"],
        "slides": part["slides"],
        "tiled": sum(1 for row in rows if row.get("tiled") == "1"),
        "shown": len(first),
        "total": len(rows),
        "headers": TABLE_VIEW,
        "rows": [[row[c] for c in TABLE_VIEW] for row in first],
    }


def percent(share: float | None) -> str | None:
    return None if share is None else f"{100 * share:.1f} %"


def object_facts(scores: Mapping[str, Any]) -> dict[str, Any]:
    """The object scores of a set of images (:meth:`pipelines.quality.ObjectScore.figures`),
    as the page names them."""
    return {
        "true objects": scores["objects_true"],
        "objects found": scores["objects_found"],
        "matched (IoU above 0.5)": scores["matched"],
        "F1 at IoU 0.5": scores["f1_50"],
        "mean matched IoU": scores["mean_matched_iou"],
        "count error (Σ |found − true| ÷ true)": percent(scores["count_error"]),
    }


def worst_first(rows: Sequence[Mapping[str, str]], columns: Sequence[str]) -> list[list[str]]:
    """Rows of object scores, the lowest F1 (then Dice) first, at most MAX_ROWS."""
    ranked = sorted(rows, key=lambda r: (float(r["f1_50"]), float(r["dice"])))
    return [[row[c] for c in columns] for row in ranked[:MAX_ROWS]]


def _truth(scores: Mapping[str, Any] | None, rows: Sequence[Mapping[str, str]]) -> Any:
    """The ground truth's part of the inference section (None for a batch without masks)."""
    if scores is None:
        return None
    facts = {"images scored (with a true mask)": scores["images"], **object_facts(scores),
             "Dice (pixels of every image scored)": scores["dice"]}  # fmt: skip
    return {"facts": facts, "notes": scores["not_scored"], "headers": QUALITY_COLUMNS,
            "rows": worst_first(rows, QUALITY_COLUMNS), "total": len(rows)}  # fmt: skip


def _counts(check: Mapping[str, Any]) -> str:
    """How one precision check's object counts compared (a job of an older code said only
    whether every image's was the same)."""
    if check["counts_equal"]:
        return "same object counts"
    if "counted_alike" in check:
        return f"same object counts in {check['counted_alike']} of {check['images']} images"
    return "other object counts"


def _checked(job: Mapping[str, Any]) -> str:
    """One job's precision checks, in a line: which were tried, how they agreed, what stayed."""
    tried = [
        f"{c['precision']} {c['agreement']:.5f} of pixels, {_counts(c)} "
        f"({'kept' if c['kept'] else 'not kept'})"
        for c in job["checks"]
    ]
    said = f"{job['job']} on {job['device']}: {', '.join(tried)} → {job['precision']}"
    resident = job.get("resident", {})  # a resident device's (pipelines/inference/resident.py)
    if resident.get("decided_by"):
        said += f" (as {resident['decided_by']} decided on the resident device)"
    if resident.get("ended_during_the_job"):
        said += " (its resident device ended during the job: the rest on its own net)"
    compiled = [  # gpu_compile's first full batch of each size against fp32's eager masks
        f"{c['shape']} " + (f"{c['agreement']:.5f}" if "agreement" in c else "failed")
        + f" ({'compiled' if c['kept'] else 'eager'})"
        for c in job.get("compile_checks", [])
    ]  # fmt: skip
    return said + (f"; gpu_compile {job['compile']}: {', '.join(compiled)}" if compiled else "")


def _training(part: Mapping[str, Any]) -> dict[str, Any]:
    model = part["model"]
    metrics = model.get("metrics", {})
    facts = {
        "registered as": f"{model['name']} version {model['version']}",
        "aliases": ", ".join(sorted(model.get("aliases", {}))) or None,
        "sha256": model["sha256"],
        "best epoch": metrics.get("epoch"),
        "validation loss": metrics.get("val_loss"),
        "validation Dice": metrics.get("val_dice"),
        "validation IoU": metrics.get("val_iou"),
        "epochs run": len(part["curves"]),
    }
    if "val_object_f1" in metrics:  # versions trained before objects were scored have none
        objects = {
            "objects_true": metrics.get("val_objects"),
            "objects_found": metrics.get("val_objects_found"),
            "matched": metrics.get("val_objects_matched"),
            "f1_50": metrics.get("val_object_f1"),
            "mean_matched_iou": metrics.get("val_matched_iou"),
            "count_error": metrics.get("val_count_error"),
        }
        facts.update({f"validation: {k}": v for k, v in object_facts(objects).items()})
    columns = part["columns"]
    epochs = [[int(row["epoch"]), *(row[c] for c in columns[1:])] for row in part["curves"]]
    validation = part.get("validation", [])
    checked = {"headers": VALIDATION_COLUMNS, "total": len(validation),
               "rows": worst_first(validation, VALIDATION_COLUMNS)}  # fmt: skip
    return {
        "facts": facts,
        "charts": part["charts"],
        "previews": part["previews"],
        "headers": columns,
        "rows": epochs,
        "validation": checked,
    }


def _sweep(part: Mapping[str, Any]) -> dict[str, Any]:
    summary, trials = part["summary"], part["trials"]
    facts = {
        "method": summary["method"],
        "trials": summary["trials"],
        "compared by": f"{summary['metric']} (higher is better)",
        "winner (registered)": summary["winner"],
        "W&B sweep": summary.get("wandb_sweep_id"),
    }
    headers = list(trials[0]) if trials else []
    return {
        "facts": facts,
        "space": {f"space: {k}": str(v) for k, v in part["space"].items()},
        "chart": part["chart"],
        "headers": headers,
        "rows": [[row[h] for h in headers] for row in trials],
    }


def _jobs(jobs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    return {"headers": JOB_COLUMNS, "rows": [[job.get(h) for h in JOB_COLUMNS] for job in jobs]}


def render(summary: Mapping[str, Any], pages: Mapping[str, Any]) -> str:
    """The whole report page."""
    batch = summary["batch"]
    meta = (
        f"batch {batch['id']} revision {batch['revision']} · {batch['kind']} · "
        f"generated {summary['generated_at']} · watchd {summary['code_version']}"
    )
    parts = {"inference": _inference, "sweep": _sweep, "training": _training}
    return (
        _PAGE.render(
            title=str(batch.get("title") or batch["dir"]),
            meta=meta,
            batch_facts={"folder": batch["dir"], "manifest sha256": summary["manifest_sha256"]},
            params=summary.get("params", {}),
            jobs=_jobs(summary.get("jobs", [])),
            **{name: make(pages[name]) if name in pages else None for name, make in parts.items()},
        )
        + "\n"
    )
