"""The finish stage: what becomes of an image's mask once the net has made it, in the job's
workers: its objects labelled (:func:`object_ids`), measured, the mask encoded and written.
The ledger line comes later, in the main process, once the mask is durable
(:mod:`pipelines.inference.durable`).

A pixel is foreground when the net's sigmoid probability exceeds ``threshold`` (decided on the
device, :mod:`pipelines.inference.device`); connected components (8-connected) smaller than
``min_object_area`` pixels are removed and not counted; touching objects are then cut apart
where they narrow (``split_neck``, :mod:`pipelines.instances`: one call, in
:func:`object_ids`), one pixel of background between them in the mask. Per image: ``area_px``
is the total foreground area, ``equivalent_diameter_px`` the diameter of a circle of that area,
``objects`` the number of objects kept, ``mean_intensity`` the mean grey value (0–1) under the
mask (empty when there is no object), ``confidence`` the mean of |2p − 1| over the image (1:
every pixel decided with certainty).

Only the workers import this module: the process that forks them, once, before it does
(:mod:`pipelines.inference.pool`). Its code needs Pillow, libpng, scipy and scikit-image, ~0.5 s
of imports that the main process never needs. What the main process needs of masks is in
:mod:`pipelines.inference.masks`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pipelines.images import write_mask
from pipelines.inference.masks import MaskFolders, Rules
from pipelines.instances import mask_objects
from pipelines.layout import image_stats, mask_name


def measure(image: np.ndarray, mask: np.ndarray, objects: int) -> dict[str, Any]:
    """The per-image statistics of the table (without confidence, path and provenance)."""
    area = int(np.count_nonzero(mask))  # (a boolean mask: 3 µs for 256², its sum 25)
    intensity = float(image[mask].sum()) if area else 0.0
    return image_stats(image.shape[1], image.shape[0], area, objects, intensity)


def object_ids(foreground: np.ndarray, rules: Rules) -> np.ndarray:
    """The object ids of a thresholded mask: where the mask becomes objects, touching ones cut
    apart (:func:`pipelines.instances.mask_objects`)."""
    return mask_objects(foreground.view(bool), rules.min_area, rules.split_neck)


def finish_image(
    masks: MaskFolders, path: str, pixels: np.ndarray, foreground: np.ndarray,
    confidence: float, rules: Rules,
) -> dict[str, Any]:  # fmt: skip
    """Label, measure and write the mask of the input ``path`` from its ``foreground`` (the
    thresholded mask, 0/1); its table row's measures."""
    labels = object_ids(foreground, rules)
    mask, objects = labels > 0, int(labels.max())
    folder, name = masks.of(path)
    write_mask(folder, mask_name(name), mask, fsync=rules.fsync_each)
    return {**measure(pixels, mask, objects), "confidence": round(confidence, 4), "tiled": 0}
