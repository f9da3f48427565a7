"""Pure rules of inference: thresholding, small-object removal, statistics, output paths."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from scipy import ndimage

from pipelines.infer import clean_mask, measure

EIGHT = np.ones((3, 3), dtype=bool)


@settings(max_examples=60, deadline=None)
@given(
    probabilities=arrays(np.float32, (12, 15), elements=st.floats(0, 1, width=32)),
    threshold=st.floats(0.05, 0.95),
    min_area=st.integers(0, 20),
)
def test_kept_objects_are_above_threshold_and_large_enough(
    probabilities: np.ndarray, threshold: float, min_area: int
) -> None:
    mask, objects = clean_mask(probabilities, threshold, min_area)
    assert not (mask & ~(probabilities > threshold)).any()
    labels, count = ndimage.label(mask, structure=EIGHT)
    assert count == objects
    assert all(area >= min_area for area in np.bincount(labels.ravel())[1:])
    removed, _ = ndimage.label((probabilities > threshold) & ~mask, structure=EIGHT)
    assert all(area < max(min_area, 1) for area in np.bincount(removed.ravel())[1:])


def test_diagonal_pixels_form_one_object() -> None:
    probabilities = np.eye(4, dtype=np.float32)
    assert clean_mask(probabilities, 0.5, 4)[1] == 1
    assert clean_mask(probabilities, 0.5, 5)[1] == 0


def test_statistics_of_a_square_object() -> None:
    image = np.full((10, 20), 0.25, dtype=np.float32)
    image[2:6, 3:7] = 0.75
    mask = np.zeros_like(image, dtype=bool)
    mask[2:6, 3:7] = True
    stats = measure(image, mask, 1)
    assert stats["width"] == 20 and stats["height"] == 10 and stats["area_px"] == 16
    assert stats["equivalent_diameter_px"] == pytest.approx(math.sqrt(64 / math.pi), abs=1e-3)
    assert stats["mean_intensity"] == pytest.approx(0.75)
    assert measure(image, np.zeros_like(mask), 0)["mean_intensity"] == ""
