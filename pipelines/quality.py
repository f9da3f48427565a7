"""Object-level quality: the objects found matched to the true ones, and what that scores. Pure.

A found object matches a true one when their IoU (pixels in both over pixels in either) is
above 0.5: above a half, no object can match two, so the matching needs no choosing. Scored:

- objects: the true ones (T) and the found ones (P);
- matched (M): the pairs above IoU 0.5;
- F1 at IoU 0.5: 2M / (T + P), the harmonic mean of the share of true objects found and the
  share of found objects that are true (1 where there is none of either);
- mean matched IoU: over the matched pairs (no value where none matched): how well the
  outlines of the objects found agree;
- count error: P − T for one image; for many, Σ|P − T| / ΣT (misses in one image and extras in
  another do not cancel).

Truth comes as a mask (:func:`truth_objects`): where its pixels take one value besides 0 it is
binary and its objects are its 8-connected components (as the jobs count theirs); where they
take several, it is a label image and each value is one object, so that two objects in contact
can be told apart (``scripts/synth.py --labels`` writes such masks; napari, QuPath and Fiji
export them).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import ndimage

from pipelines.instances import EIGHT, neighbours

MATCH_IOU = 0.5


@dataclass(frozen=True)
class ObjectScore:
    """Counts over one image or many (added with ``+``)."""

    true: int = 0
    found: int = 0
    matched: int = 0
    iou_sum: float = 0.0  # of the matched pairs
    miscounted: int = 0  # Σ|P − T| over the images
    images: int = 0

    def __add__(self, other: ObjectScore) -> ObjectScore:
        return ObjectScore(
            self.true + other.true,
            self.found + other.found,
            self.matched + other.matched,
            self.iou_sum + other.iou_sum,
            self.miscounted + other.miscounted,
            self.images + other.images,
        )

    @property
    def f1(self) -> float:
        total = self.true + self.found
        return 1.0 if total == 0 else 2 * self.matched / total

    @property
    def mean_iou(self) -> float | None:
        return self.iou_sum / self.matched if self.matched else None

    @property
    def count_error(self) -> float | None:
        """Σ|P − T| / ΣT (0 where both are 0; no value where only T is)."""
        if self.true == 0:
            return 0.0 if self.miscounted == 0 else None
        return self.miscounted / self.true

    def figures(self) -> dict[str, Any]:
        """The scores as a summary shows them (rounded)."""
        iou, error = self.mean_iou, self.count_error
        return {
            "images": self.images,
            "objects_true": self.true,
            "objects_found": self.found,
            "matched": self.matched,
            "f1_50": round(self.f1, 4),
            "mean_matched_iou": None if iou is None else round(iou, 4),
            "count_error": None if error is None else round(error, 4),
        }


def total(scores: Iterable[ObjectScore]) -> ObjectScore:
    return sum(scores, ObjectScore())


def dice(prediction: np.ndarray, truth: np.ndarray) -> float:
    total_pixels = int(prediction.sum()) + int(truth.sum())
    return 1.0 if total_pixels == 0 else 2 * int((prediction & truth).sum()) / total_pixels


def score_row(score: ObjectScore, dice_value: float) -> dict[str, Any]:
    """One image's cells of :data:`pipelines.layout.OBJECT_SCORE_COLUMNS`."""
    iou = score.mean_iou
    return {"objects_true": score.true, "objects_found": score.found, "matched": score.matched,
            "f1_50": round(score.f1, 4), "mean_matched_iou": None if iou is None else round(iou, 4),
            "count_error": score.found - score.true, "dice": round(dice_value, 4)}  # fmt: skip


def truth_objects(mask: np.ndarray) -> np.ndarray:
    """The true objects' ids (int32, 1…T, 0 outside) of a ground-truth mask as decoded (any
    numbers, 0 outside): see the module's text."""
    values = np.unique(mask[mask > 0])
    if len(values) <= 1:
        labels, _ = ndimage.label(mask > 0, structure=EIGHT)
        return labels.astype(np.int32)
    ids = np.searchsorted(values, mask).astype(np.int32) + 1
    return np.where(mask > 0, ids, 0).astype(np.int32)


def matches(truth: np.ndarray, found: np.ndarray) -> dict[int, tuple[int, float]]:
    """{true id: (found id, IoU)} of the pairs above IoU 0.5; ids are those of the two label
    images (same shape, 0 outside)."""
    both = (truth > 0) & (found > 0)
    if not both.any():
        return {}
    stride = np.int64(found.max()) + 1
    keys, shared = np.unique(truth[both].astype(np.int64) * stride + found[both],
                             return_counts=True)  # fmt: skip
    true_ids, found_ids = keys // stride, keys % stride
    true_area = np.bincount(truth.ravel().astype(np.int64))
    found_area = np.bincount(found.ravel().astype(np.int64))
    iou = shared / (true_area[true_ids] + found_area[found_ids] - shared)
    good = iou > MATCH_IOU
    found_pairs = zip(true_ids[good], found_ids[good], iou[good], strict=True)
    return {int(t): (int(f), float(v)) for t, f, v in found_pairs}


def score_objects(truth: np.ndarray, found: np.ndarray) -> ObjectScore:
    """One image's score: ``truth`` and ``found`` label images (ids 1…N, 0 outside)."""
    true_count = len(np.unique(truth[truth > 0]))
    found_count = len(np.unique(found[found > 0]))
    matched = matches(truth, found)
    return ObjectScore(true_count, found_count, len(matched),
                       sum(iou for _, iou in matched.values()),
                       abs(found_count - true_count), 1)  # fmt: skip


def touching_pairs(truth: np.ndarray) -> set[tuple[int, int]]:
    """Pairs (lower id, higher id) of true objects in contact (8-neighbours)."""
    pairs: set[tuple[int, int]] = set()
    for here_at, there_at in neighbours(truth.shape):
        here, there = truth[here_at], truth[there_at]
        contact = (here != there) & (here > 0) & (there > 0)
        low = np.minimum(here[contact], there[contact])
        high = np.maximum(here[contact], there[contact])
        pairs.update(zip(low.tolist(), high.tolist(), strict=True))
    return pairs


def pairs_apart(truth: np.ndarray, found: np.ndarray) -> tuple[int, int]:
    """(pairs of true objects in contact, those of them found as two objects: each of the two
    matched, above IoU 0.5, by an object of its own)."""
    pairs = touching_pairs(truth)
    matched = matches(truth, found)
    apart = sum(1 for a, b in pairs if a in matched and b in matched)
    return len(pairs), apart
