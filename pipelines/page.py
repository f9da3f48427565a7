"""The HTML of the batch report: one self-contained file, styles inline, pictures as data URIs.

Pure: takes the summary and the prepared page parts, returns text. Every value that comes from
the batch (titles, file names) is escaped; the page references nothing outside itself except
the relative link to ``table.csv`` next to it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from html import escape
from typing import Any

from pipelines.layout import TABLE_COLUMNS

MAX_ROWS = 500
TABLE_VIEW = TABLE_COLUMNS[: TABLE_COLUMNS.index("tiled") + 1]  # the measured columns
STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1 { margin-bottom: 0.2em; } .meta { color: #666; margin-top: 0; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
th { background: #f3f3f3; } .kv th { width: 16em; }
.grid { display: flex; flex-wrap: wrap; gap: 12px; }
figure { margin: 0; } figcaption { font-size: 0.8em; color: #555; max-width: 256px; }
.note { color: #666; font-size: 0.9em; }
"""


def _text(value: Any) -> str:
    if value is None or value == "":
        return "–"
    if isinstance(value, float):
        return f"{value:.4g}"
    return escape(str(value))


def _is_number(value: Any) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return not isinstance(value, bool)


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr>"
        + "".join(
            f'<td class="num">{_text(v)}</td>' if _is_number(v) else f"<td>{_text(v)}</td>"
            for v in row
        )
        + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def key_values(pairs: Mapping[str, Any]) -> str:
    body = "".join(f"<tr><th>{escape(k)}</th><td>{_text(v)}</td></tr>" for k, v in pairs.items())
    return f'<table class="kv"><tbody>{body}</tbody></table>'


def figure(uri: str, caption: str) -> str:
    return (
        f'<figure><img src="{escape(uri)}" alt="{escape(caption)}">'
        f"<figcaption>{escape(caption)}</figcaption></figure>"
    )


def gallery(pictures: Sequence[tuple[str, str]]) -> str:
    if not pictures:
        return '<p class="note">No pictures.</p>'
    return '<div class="grid">' + "".join(figure(uri, cap) for cap, uri in pictures) + "</div>"


def _inference(part: Mapping[str, Any]) -> str:
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
    shown = rows[:MAX_ROWS]
    note = (
        f"Showing the first {len(shown)} of {len(rows)} images; "
        if len(shown) < len(rows)
        else f"All {len(rows)} images; "
    )
    return (
        "<h2>Segmentation</h2>"
        + key_values(facts)
        + gallery([("object size distribution", part["histogram"])])
        + "<h3>Examples</h3><p class=note>Predicted spheroids outlined and filled in orange: "
        + "the most and the least confident image, and random others.</p>"
        + gallery(part["overlays"])
        + "<h3>Per image</h3>"
        + f'<p class="note">{note}the full table is <a href="table.csv">table.csv</a>.</p>'
        + table(TABLE_VIEW, ([row[c] for c in TABLE_VIEW] for row in shown))
    )


def _training(part: Mapping[str, Any]) -> str:
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
    columns = part["columns"]
    epochs = ([int(row["epoch"]), *(row[c] for c in columns[1:])] for row in part["curves"])
    return (
        "<h2>Training</h2>"
        + key_values(facts)
        + gallery(part["charts"])
        + "<h3>Validation examples</h3>"
        + "<p class=note>Prediction in orange, ground truth outlined in cyan: the best, the "
        + "worst and a random validation image by Dice.</p>"
        + gallery(part["previews"])
        + "<h3>Per epoch</h3>"
        + table(columns, epochs)
    )


def _sweep(part: Mapping[str, Any]) -> str:
    summary, trials = part["summary"], part["trials"]
    facts = {
        "method": summary["method"],
        "trials": summary["trials"],
        "compared by": f"{summary['metric']} (higher is better)",
        "winner (registered)": summary["winner"],
        "W&B sweep": summary.get("wandb_sweep_id"),
    }
    headers = list(trials[0]) if trials else []
    return (
        "<h2>Sweep</h2>"
        + key_values(facts)
        + key_values({f"space: {k}": str(v) for k, v in part["space"].items()})
        + gallery([("validation curves of every trial", part["chart"])])
        + "<h3>Trials, best first</h3>"
        + table(headers, ([row[h] for h in headers] for row in trials))
    )


def _jobs(jobs: Sequence[Mapping[str, Any]]) -> str:
    headers = ("job", "pipeline", "ok", "elapsed_s", "host", "finished_at")
    return "<h2>Jobs</h2>" + table(headers, ([job.get(h) for h in headers] for job in jobs))


def render(summary: Mapping[str, Any], pages: Mapping[str, Any]) -> str:
    """The whole report page."""
    batch = summary["batch"]
    title = batch.get("title") or batch["dir"]
    meta = (
        f"batch {batch['id']} revision {batch['revision']} · {batch['kind']} · "
        f"generated {summary['generated_at']} · watchd {summary['code_version']}"
    )
    body = [
        f"<h1>{escape(str(title))}</h1><p class=meta>{escape(meta)}</p>",
        key_values({"folder": batch["dir"], "manifest sha256": summary["manifest_sha256"]}),
        key_values(summary.get("params", {})),
    ]
    if "inference" in pages:
        body.append(_inference(pages["inference"]))
    if "sweep" in pages:
        body.append(_sweep(pages["sweep"]))
    if "training" in pages:
        body.append(_training(pages["training"]))
    body.append(_jobs(summary.get("jobs", [])))
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{escape(str(title))} — watchd report</title><style>{STYLE}</style></head>"
        f"<body>{''.join(body)}</body></html>\n"
    )
