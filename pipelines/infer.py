"""Inference job: segment one shard's images with a registered model.

``python -m pipelines.infer JOB_DIR``. For every image input of the spec (the daemon gives each
shard only its own), inside ``run_dir``:

- ``masks/<input path>``: the mask, same relative path, name and format as the input;
- ``parts/table-<shard index, 4 digits>.csv``: one row per image (:data:`TABLE_COLUMNS`).

A pixel is foreground when the sigmoid probability exceeds ``threshold``; connected components
(8-connected) smaller than ``min_object_area`` pixels are removed and not counted. Per image:
``area_px`` is the total foreground area, ``equivalent_diameter_px`` the diameter of a circle
of that area, ``objects`` the number of components kept, ``mean_intensity`` the mean grey value
(0–1) under the mask (empty when there is no object).

Images with problems (unreadable, checksum mismatch) do not stop the others: every problem is
collected, and the job fails with all of them at the end without writing the shard table.
Every file is written atomically, so running a shard again simply replaces its outputs.
"""

from __future__ import annotations

import csv
import io
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy import ndimage
from torch.utils.data import DataLoader
from torch.utils.data import Dataset as TorchDataset

from daemon.atomicfile import write_text
from daemon.jobspec import InputFile, JobSpec, Pipeline, Problem
from models import registry
from models.registry import ModelError, ModelVersion
from models.unet import UNet
from pipelines.images import check_suffix, read_image, write_mask
from pipelines.job import InputError, code_version, log, run_job
from pipelines.layout import (
    MASKS_DIR,
    PARTS_DIR,
    TABLE_COLUMNS,
    output_path,
    table_name,
)

_EIGHT_CONNECTED = np.ones((3, 3), dtype=bool)
_PROGRESS_EVERY_S = 30.0


def clean_mask(
    probabilities: np.ndarray, threshold: float, min_area: int
) -> tuple[np.ndarray, int]:
    """Threshold, then drop components smaller than ``min_area``; return (mask, objects)."""
    labels, count = ndimage.label(probabilities > threshold, structure=_EIGHT_CONNECTED)
    if count == 0:
        return labels > 0, 0
    keep = np.bincount(labels.ravel()) >= min_area
    keep[0] = False
    return keep[labels], int(keep.sum())


def measure(image: np.ndarray, mask: np.ndarray, objects: int) -> dict[str, Any]:
    """The per-image statistics of the table (without path and provenance)."""
    area = int(mask.sum())
    return {
        "width": image.shape[1],
        "height": image.shape[0],
        "area_px": area,
        "equivalent_diameter_px": round(math.sqrt(4 * area / math.pi), 3),
        "objects": objects,
        "mean_intensity": round(float(image[mask].mean()), 6) if area else "",
    }


def load_model(spec: JobSpec) -> tuple[UNet, ModelVersion]:
    """Resolve, verify and build the spec's model, ready for inference."""
    version = registry.resolve(Path(spec.registry_dir), spec.model.name, spec.model.version)
    state = registry.load(version)
    try:
        net = UNet(**version.architecture)
        net.load_state_dict(state)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ModelError(
            f"model {version.name!r} version {version.version}: the weights do not fit the "
            f"architecture in its metadata {version.architecture} ({exc})"
        ) from exc
    net.eval()
    return net.to(memory_format=torch.channels_last), version


@dataclass(frozen=True)
class Loaded:
    """One input as read by a loader worker: pixels, or the problems that prevented it."""

    item: InputFile
    pixels: np.ndarray | None
    problems: tuple[Problem, ...]


class ShardImages(TorchDataset[Loaded]):
    """Reads and verifies the shard's images (in DataLoader workers, overlapping the net)."""

    def __init__(self, batch_dir: Path, items: list[InputFile]) -> None:
        self.batch_dir, self.items = batch_dir, items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> Loaded:
        item = self.items[index]
        problem = check_suffix(item)
        if problem is not None:
            return Loaded(item, None, (problem,))
        try:
            return Loaded(item, read_image(self.batch_dir, item), ())
        except InputError as exc:
            return Loaded(item, None, exc.problems)


def _as_is(loaded: Loaded) -> Loaded:
    return loaded


def _loaded(spec: JobSpec, items: list[InputFile]) -> Iterator[Loaded]:
    # One or two reader processes hide the share's latency; the rest of the cores run the net.
    workers = min(2, max(0, spec.resources.cpus - 1))
    loader = DataLoader(
        ShardImages(Path(spec.batch_dir), items),
        batch_size=None,
        num_workers=workers,
        collate_fn=_as_is,
        prefetch_factor=2 if workers else None,
    )
    yield from loader


@torch.inference_mode()
def predict(net: UNet, pixels: np.ndarray) -> np.ndarray:
    """Sigmoid probabilities (H, W) for one grey image."""
    tensor = torch.from_numpy(pixels)[None, None].contiguous(memory_format=torch.channels_last)
    return torch.sigmoid(net(tensor))[0, 0].numpy()


def _table_csv(rows: list[dict[str, Any]]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, TABLE_COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


class Progress:
    """Logs "done/total images" at most every 30 s, and at the end."""

    def __init__(self, total: int) -> None:
        self.total, self.started = total, time.monotonic()
        self.last = self.started

    def tick(self, done: int) -> None:
        now = time.monotonic()
        if now - self.last > _PROGRESS_EVERY_S or done == self.total:
            self.last = now
            log.info("%d/%d images (%.3f s/image)", done, self.total, (now - self.started) / done)


def segment(
    spec: JobSpec, net: UNet, items: list[InputFile], provenance: dict[str, Any]
) -> tuple[list[dict[str, Any]], list[Problem]]:
    """Segment every item, writing its mask; return the table rows and the input problems."""
    threshold, min_area = float(spec.params["threshold"]), int(spec.params["min_object_area"])
    masks_dir = Path(spec.run_dir) / MASKS_DIR
    rows: list[dict[str, Any]] = []
    problems: list[Problem] = []
    progress = Progress(len(items))
    for done, loaded in enumerate(_loaded(spec, items), start=1):
        problems += loaded.problems
        if loaded.pixels is not None:
            mask, objects = clean_mask(predict(net, loaded.pixels), threshold, min_area)
            write_mask(output_path(masks_dir, loaded.item.path), mask)
            row = {"path": loaded.item.path, **measure(loaded.pixels, mask, objects)}
            rows.append({**row, **provenance})
        progress.tick(done)
    return rows, problems


def infer(spec: JobSpec, job_dir: Path) -> dict[str, Any]:
    """The inference job for one shard."""
    net, version = load_model(spec)
    log.info("model %s version %d (sha256 %s…)", version.name, version.version, version.sha256[:12])
    provenance = {
        "model_name": version.name,
        "model_version": version.version,
        "model_sha256": version.sha256,
        "manifest_sha256": spec.manifest_sha256,
        "code_version": code_version(),
    }
    items = [item for item in spec.inputs if item.role == "image"]
    started = time.monotonic()
    rows, problems = segment(spec, net, items, provenance)
    if problems:
        raise InputError(f"{len(problems)} problem(s) with the images of this shard", problems)
    table = Path(spec.run_dir) / PARTS_DIR / table_name(spec.shard.index)
    table.parent.mkdir(parents=True, exist_ok=True)
    write_text(table, _table_csv(rows))
    return {
        "images": len(rows),
        "images_with_objects": sum(1 for row in rows if row["objects"]),
        "objects": sum(row["objects"] for row in rows),
        "table": f"{PARTS_DIR}/{table.name}",
        "model": {**provenance, "requested_version": spec.model.version},
        "shard": {"index": spec.shard.index, "count": spec.shard.count},
        "seconds_per_image": round((time.monotonic() - started) / max(len(rows), 1), 4),
    }


if __name__ == "__main__":
    raise SystemExit(run_job(Pipeline.INFER, infer))
