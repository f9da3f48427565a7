"""Pure rules of inference: thresholding, small-object removal, statistics, output paths."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from PIL import Image
from scipy import ndimage

from pipelines.images import encode_mask
from pipelines.inference.finish import measure
from pipelines.instances import components

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
    labels = components(probabilities > threshold, min_area)
    mask, objects = labels > 0, int(labels.max())
    assert not (mask & ~(probabilities > threshold)).any()
    labels, count = ndimage.label(mask, structure=EIGHT)
    assert count == objects
    assert all(area >= min_area for area in np.bincount(labels.ravel())[1:])
    removed, _ = ndimage.label((probabilities > threshold) & ~mask, structure=EIGHT)
    assert all(area < max(min_area, 1) for area in np.bincount(removed.ravel())[1:])


def test_diagonal_pixels_form_one_object() -> None:
    probabilities = np.eye(4, dtype=np.float32)
    assert components(probabilities > 0.5, 4).max() == 1
    assert components(probabilities > 0.5, 5).max() == 0


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


@settings(max_examples=60, deadline=None)
@given(
    mask=arrays(np.bool_, (14, 11)),
    min_area=st.integers(0, 6),
)
def test_objects_are_numbered_in_raster_order_and_the_small_ones_left_out(
    mask: np.ndarray, min_area: int
) -> None:
    """A mask's components of at least ``min_area`` pixels, numbered 1 … count by their first
    pixel, as ndimage numbers the components it keeps."""
    labels = components(mask, min_area)
    again, number = ndimage.label(labels > 0, structure=EIGHT)
    assert labels.max() == number and np.array_equal(labels, again)
    left_out, _ = ndimage.label(mask & (labels == 0), structure=EIGHT)
    assert all(area < max(min_area, 1) for area in np.bincount(left_out.ravel())[1:])


def test_a_mask_png_is_read_back_by_pillow_as_uint8_0_and_255_at_any_size() -> None:
    rng = np.random.default_rng(3)
    for shape in ((1, 1), (1, 300), (300, 1), (257, 129)):
        mask = rng.random(shape) > 0.5
        with Image.open(io.BytesIO(encode_mask(mask, ".png"))) as opened:
            assert opened.mode == "L"
            raw = np.asarray(opened)
        assert raw.dtype == np.uint8 and np.array_equal(raw, np.where(mask, 255, 0))
