"""Solidity counted exactly, all regions at once: the values skimage's regionprops gives."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from scipy import ndimage
from skimage.measure import regionprops

from pipelines.instances import EIGHT
from pipelines.solidity import solidity


def consecutive(labels: np.ndarray) -> tuple[np.ndarray, int]:
    """``labels`` renumbered 1…N in the order of their ids, and N."""
    ids = np.unique(labels[labels > 0])
    return np.searchsorted(np.r_[0, ids], labels).astype(np.int32), len(ids)


def assert_as_regionprops(labels: np.ndarray) -> None:
    labels, count = consecutive(labels)
    if count:
        expected = [region.solidity for region in regionprops(labels)]
        assert solidity(labels, count).tolist() == expected  # to the last bit


@settings(max_examples=150, deadline=None)
@given(
    labels=arrays(np.int8, st.tuples(st.integers(1, 24), st.integers(1, 24)),
                  elements=st.integers(0, 4)),
)  # fmt: skip
def test_solidity_is_regionprops_on_any_labels(labels: np.ndarray) -> None:
    """Any labels, a region in several pieces included."""
    assert_as_regionprops(labels)


def test_solidity_is_regionprops_on_discs_blobs_lines_and_single_pixels() -> None:
    rng = np.random.default_rng(3)
    yy, xx = np.mgrid[0:90, 0:90]
    for radius in np.linspace(0.5, 40, 40):
        assert_as_regionprops((np.hypot(yy - 45.3, xx - 44.6) <= radius).astype(np.int32))
    for _ in range(30):
        field = ndimage.gaussian_filter(rng.standard_normal((70, 70)), rng.uniform(1, 5))
        assert_as_regionprops(ndimage.label(field > 0.3 * field.std(), EIGHT)[0])
    for labels in (np.eye(12, dtype=np.int32), np.eye(12, dtype=np.int32)[::-1],
                   np.ones((1, 1), np.int32), np.ones((3, 40), np.int32)):  # fmt: skip
        assert_as_regionprops(labels)
