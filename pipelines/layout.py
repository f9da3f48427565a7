"""Where pipelines put their outputs; the daemon and the report rely on it.

In ``run_dir``, the run's results folder in the owner's batch folder (only what is meant for
the owner; nothing here is read back but the masks the report shows and scores)::

    masks/<input path>              one mask per input image, same name and format …
    masks/<input path>.ome.zarr     … or, for an image segmented window by window, its label
                                    image in OME-Zarr (pipelines/omezarr.py)
    objects/<input path>.csv        one row per object of such an image (OBJECT_COLUMNS)
    table.csv                       all shards' rows, sorted by path (report)
    quality.csv                     inference with ground truth: objects against the true ones,
                                    per image (QUALITY_COLUMNS; report)
    summary.json, report.html       the report
    training/model.json, training/metrics.csv   the registered model and its curves (report)
    training/validation.csv         its validation images' objects scored (report)
    sweep/trials.csv                the sweep's trials, ranked (report)
    logs/<job name>.log             each ended job's log, its end (copied by the daemon)

In ``work_dir``, the run's work folder in the service's spool (what the jobs hand each other;
the owner can neither read nor write it, :mod:`daemon.contract.spool`)::

    jobs/<job name>/                spec.json, log.txt, result.json, progress.json (daemon/runner)
    parts/table-<shard:04d>.csv     per-image rows of one inference shard (TABLE_COLUMNS)
    ledger/shard-<index:04d>.jsonl  inference: one line per image done (resuming a shard)
    regions/<input path>.zarr/      an image segmented in regions by several jobs: their
                                    provisional ids and records, until the assembly job
    training/metrics.csv            per-epoch curves (CURVE_COLUMNS)
    training/model.json             the registered model: name, version, sha256, metrics
    training/previews/<stem>.png    validation overlays for the report (index.json: which, Dice)
    training/validation.csv         scores of the kept weights per validation image
                                    (VALIDATION_COLUMNS)
    training/wandb/                 the Weights & Biases run folder (offline unless configured)
    trials/<job name>/              a sweep trial: metrics.csv, candidate.pt, candidate.json
    sweep/trials.csv, sweep/sweep.json  the sweep's comparison of its trials, and its W&B config

A job writes the first through its run folder held from the batch folder down
(:func:`pipelines.job.run_folder`), never by path: the owner may plant anything under results/;
the second through the held work folder (:func:`pipelines.job.work_folder`).
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Iterable, Mapping
from typing import Any

MASKS_DIR = "masks"
PARTS_DIR = "parts"
TABLE_FILE = "table.csv"
SUMMARY_FILE = "summary.json"
REPORT_FILE = "report.html"
TRAINING_DIR = "training"
METRICS_FILE = "metrics.csv"
MODEL_FILE = "model.json"
PREVIEWS_DIR = "previews"
PREVIEW_INDEX = "index.json"
VALIDATION_FILE = "validation.csv"
QUALITY_FILE = "quality.csv"
WANDB_DIR = "wandb"
TRIALS_DIR = "trials"
CANDIDATE_WEIGHTS = "candidate.pt"
CANDIDATE_FILE = "candidate.json"
SWEEP_DIR = "sweep"
TRIALS_TABLE = "trials.csv"
SWEEP_FILE = "sweep.json"
LEDGER_DIR = "ledger"
OBJECTS_DIR = "objects"
REGIONS_DIR = "regions"
REGIONS_TABLE = "table-regions.csv"  # under parts/: the rows the assembly job adds
LABEL_IMAGE_SUFFIX = ".ome.zarr"
TABLE_COLUMNS = (
    "path",
    "width",
    "height",
    "area_px",
    "equivalent_diameter_px",
    "objects",
    "mean_intensity",
    "confidence",
    "tiled",
    "windows_run",  # of an image segmented window by window: windows the net ran on,
    "windows_glass",  # and windows over glass only, not run (pipelines.tissue)
    "precision",  # the net's: fp32; on a GPU what its first batch allowed (inference.placement)
    "model_name",
    "model_version",
    "model_sha256",
    "manifest_sha256",
    "code_version",
)
OBJECT_COLUMNS = ("id", "area_px", "centroid_y", "centroid_x", "bbox_top", "bbox_left",
                  "bbox_bottom", "bbox_right", "mean_intensity")  # fmt: skip
CURVE_COLUMNS = ("epoch", "train_loss", "val_loss", "val_dice", "val_iou")
# an image's objects against its true ones (pipelines/quality.py): count_error is found − true
OBJECT_SCORE_COLUMNS = ("objects_true", "objects_found", "matched", "f1_50", "mean_matched_iou",
                        "count_error", "dice")  # fmt: skip
VALIDATION_COLUMNS = ("image", *OBJECT_SCORE_COLUMNS)
QUALITY_COLUMNS = ("path", "mask", *OBJECT_SCORE_COLUMNS)


def table_name(shard_index: int) -> str:
    return f"table-{shard_index:04d}.csv"


def ledger_name(shard_index: int) -> str:
    return f"shard-{shard_index:04d}.jsonl"


def mask_name(input_path: str) -> str:
    """The mask of an input segmented whole (below ``masks/``): the input's path for a PNG or
    TIFF (the mask in its format), else the path with ``.tif`` added (a vendor's file, an SVS)."""
    keeps = input_path.lower().endswith((".png", ".tif", ".tiff"))
    return input_path if keeps else f"{input_path}.tif"


def label_image_name(input_path: str) -> str:
    """The label image of an input segmented window by window (below ``masks/``)."""
    return input_path + LABEL_IMAGE_SUFFIX


def work_folder_name(input_path: str) -> str:
    return f"{REGIONS_DIR}/{input_path}.zarr"


def image_stats(
    width: int, height: int, area: int, objects: int, intensity: float
) -> dict[str, Any]:
    """A table row's measures of one image (see pipelines/infer.py for what each means)."""
    return {
        "width": width,
        "height": height,
        "area_px": area,
        "equivalent_diameter_px": round(math.sqrt(4 * area / math.pi), 3),
        "objects": objects,
        "mean_intensity": round(intensity / area, 6) if area else "",
    }


def job_region(params: Mapping[str, Any]) -> tuple[int, int] | None:
    """(index, count) of the region a job segments of its one image (its ``region`` param,
    set by the daemon for a slide split across jobs: its ``regions/`` above), or None: whole
    images."""
    region = params.get("region")
    return None if region is None else (int(region["index"]), int(region["count"]))


def objects_table_name(input_path: str) -> str:
    return f"{OBJECTS_DIR}/{input_path}.csv"


def objects_csv(rows: Iterable[Mapping[str, Any]]) -> str:
    """A large image's object table (:data:`OBJECT_COLUMNS`) as CSV text."""
    return table_csv(rows, OBJECT_COLUMNS)


def table_csv(rows: Iterable[Mapping[str, Any]], columns: tuple[str, ...] = TABLE_COLUMNS) -> str:
    """The per-image table (:data:`TABLE_COLUMNS`) as CSV text. Every cell is quoted: a file
    name may hold a comma, a quote, a line feed or a carriage return, and ``csv`` leaves a
    carriage return unquoted when the line ends are plain line feeds."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, columns, lineterminator="\n", quoting=csv.QUOTE_ALL)
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()
