"""The finish stage: what becomes of an image's mask once the net has made it, in the job's
workers: its objects labelled (:meth:`Rules.objects`), measured, the mask encoded and written.
The ledger line comes later, in the main process, once the mask is durable
(:mod:`pipelines.inference.durable`).

A pixel is foreground when the net's sigmoid probability exceeds ``threshold`` (decided on the
device, :mod:`pipelines.inference.device`); connected components (8-connected) smaller than
``min_object_area`` pixels are removed and not counted; touching objects are then cut apart
where they narrow (``split_neck``, :mod:`pipelines.instances`: one call, in
:meth:`Rules.objects`), one pixel of background between them in the mask. Per image: ``area_px``
is the total foreground area, ``equivalent_diameter_px`` the diameter of a circle of that area,
``objects`` the number of objects kept, ``mean_intensity`` the mean grey value (0–1) under the
mask (empty when there is no object), ``confidence`` the mean of |2p − 1| over the image (1:
every pixel decided with certainty).
"""

from __future__ import annotations

import stat
from dataclasses import dataclass
from typing import Any

import numpy as np

from daemon.contract.heldfolder import HeldFolder, parts_of
from pipelines.images import write_mask
from pipelines.instances import mask_objects
from pipelines.layout import MASKS_DIR, image_stats, label_image_name, mask_name


def measure(image: np.ndarray, mask: np.ndarray, objects: int) -> dict[str, Any]:
    """The per-image statistics of the table (without confidence, path and provenance)."""
    area = int(mask.sum())
    intensity = float(image[mask].sum()) if area else 0.0
    return image_stats(image.shape[1], image.shape[0], area, objects, intensity)


@dataclass(frozen=True)
class Rules:
    """What the finish stage needs of the job's parameters."""

    min_area: int
    split_neck: float  # touching objects cut apart (pipelines.instances); 0: never
    fsync_each: bool  # the masks' filesystem needs an fsync per file (durable.each_file)

    def objects(self, foreground: np.ndarray) -> np.ndarray:
        """The object ids of a thresholded mask: where the mask becomes objects, touching ones
        cut apart (:func:`pipelines.instances.mask_objects`)."""
        return mask_objects(foreground.view(bool), self.min_area, self.split_neck)


def finish_image(
    masks: MaskFolders, path: str, pixels: np.ndarray, foreground: np.ndarray,
    confidence: float, rules: Rules,
) -> dict[str, Any]:  # fmt: skip
    """Label, measure and write the mask of the input ``path`` from its ``foreground`` (the
    thresholded mask, 0/1); its table row's measures."""
    labels = rules.objects(foreground)
    mask, objects = labels > 0, int(labels.max())
    folder, name = masks.of(path)
    write_mask(folder, mask_name(name), mask, fsync=rules.fsync_each)
    return {**measure(pixels, mask, objects), "confidence": round(confidence, 4), "tiled": 0}


class MaskFolders:
    """The folders of masks under ``masks/`` of the held run folder, each held once (made when
    first needed) and kept for the process's life: a mask write opens only its own file."""

    def __init__(self, run: HeldFolder) -> None:
        self.run = run
        self.held: dict[str, HeldFolder] = {}

    def of(self, input_path: str) -> tuple[HeldFolder, str]:
        """The held folder of the mask of ``input_path``, and the input's name (its mask's
        is :func:`mask_name` of it, its label image's :func:`label_image_name`)."""
        *above, name = parts_of(input_path)
        folder = "/".join((MASKS_DIR, *above))
        if folder not in self.held:
            self.held[folder] = self.run.folder(folder, create=True)
        return self.held[folder], name

    def present(self, input_path: str, tiled: bool) -> bool:
        """Whether the mask of ``input_path`` is there (nothing is made): a plain file, or the
        label image's folder for an image segmented window by window."""
        try:
            if tiled:
                label_image = f"{MASKS_DIR}/{label_image_name(input_path)}"
                return stat.S_ISDIR(self.run.lstat(label_image).st_mode)
            return stat.S_ISREG(self.run.lstat(f"{MASKS_DIR}/{mask_name(input_path)}").st_mode)
        except (OSError, ValueError):  # missing, or a planted entry on the way
            return False

    def close(self) -> None:
        for folder in self.held.values():
            folder.close()
        self.held.clear()
