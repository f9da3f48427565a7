"""Object-level scores: matching at IoU 0.5, F1, matched IoU, count error, touching pairs."""

from __future__ import annotations

import numpy as np
import pytest

from pipelines.quality import (
    ObjectScore,
    matches,
    pairs_apart,
    score_objects,
    total,
    touching_pairs,
    truth_objects,
)


def squares(shape: tuple[int, int], *boxes: tuple[int, int, int, int]) -> np.ndarray:
    """Ids 1, 2, … of boxes (top, left, bottom, right), later ones over earlier ones."""
    ids = np.zeros(shape, dtype=np.int32)
    for number, (top, left, bottom, right) in enumerate(boxes, start=1):
        ids[top:bottom, left:right] = number
    return ids


def test_an_object_matches_when_more_than_half_its_union_is_shared() -> None:
    truth = squares((20, 40), (0, 0, 10, 10), (0, 20, 10, 30))
    # the first found box shares 80 of 120 pixels (IoU 0.67); the second 50 of 150 (0.33)
    found = squares((20, 40), (0, 2, 10, 12), (0, 25, 10, 40))
    assert matches(truth, found) == {1: (1, pytest.approx(80 / 120))}
    score = score_objects(truth, found)
    assert (score.true, score.found, score.matched) == (2, 2, 1)
    assert score.f1 == 0.5 and score.mean_iou == pytest.approx(80 / 120)
    assert score.count_error == 0


def test_one_object_found_for_two_in_contact_scores_one_miss_at_most() -> None:
    truth = squares((10, 20), (0, 0, 10, 10), (0, 10, 10, 20))
    merged = (truth > 0).astype(np.int32)
    score = score_objects(truth, merged)
    assert (score.matched, score.f1, score.count_error) == (0, 0.0, 0.5)
    assert touching_pairs(truth) == {(1, 2)} and pairs_apart(truth, merged) == (1, 0)
    assert pairs_apart(truth, truth) == (1, 1)


def test_count_error_over_images_adds_misses_and_extras_without_cancelling() -> None:
    missed = ObjectScore(true=4, found=3, matched=3, iou_sum=2.7, miscounted=1, images=1)
    extra = ObjectScore(true=4, found=5, matched=4, iou_sum=3.6, miscounted=1, images=1)
    pooled = total([missed, extra])
    assert (pooled.true, pooled.found, pooled.miscounted) == (8, 8, 2)
    assert pooled.count_error == 0.25 and pooled.f1 == pytest.approx(14 / 16)
    assert pooled.figures()["mean_matched_iou"] == pytest.approx(0.9)
    assert ObjectScore().f1 == 1.0 and ObjectScore().count_error == 0.0
    assert ObjectScore(found=2, miscounted=2, images=1).count_error is None


def test_a_binary_truth_is_its_components_and_a_label_image_its_values() -> None:
    binary = np.zeros((8, 8), dtype=np.float32)
    binary[1:3, 1:3] = binary[5:7, 5:7] = binary[3, 3] = binary[4, 4] = 1.0  # diagonal: one
    assert truth_objects(binary).max() == 1
    binary[3, 3] = 0
    assert truth_objects(binary).max() == 2
    labelled = np.zeros((8, 8), dtype=np.float32)
    labelled[0:4, 0:4], labelled[0:4, 4:8] = 1 / 255, 2 / 255  # two in contact, as decoded
    ids = truth_objects(labelled)
    assert ids.max() == 2 and len(np.unique(ids[:4, :4])) == 1 and ids[0, 0] != ids[0, 7]
