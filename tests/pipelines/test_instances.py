"""The object step after the net: touching objects cut apart where they narrow."""

from __future__ import annotations

from types import ModuleType

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from scipy import ndimage

from daemon.contract.names import INFERENCE
from pipelines.instances import EIGHT, components, label_objects, mask_objects
from pipelines.quality import matches


def discs(shape: tuple[int, int], *circles: tuple[float, float, float]) -> np.ndarray:
    """Ids 1, 2, … of discs (row, column, radius); a pixel of two goes to the first."""
    yy, xx = np.mgrid[0 : shape[0], 0 : shape[1]]
    ids = np.zeros(shape, dtype=np.int32)
    for number, (row, col, radius) in enumerate(circles, start=1):
        ids[(np.hypot(yy - row, xx - col) <= radius) & (ids == 0)] = number
    return ids


def test_two_discs_in_contact_are_two_objects_and_their_mask_keeps_them_apart() -> None:
    truth = discs((60, 80), (30, 24, 12), (30, 47, 11.5))  # centres 23 apart, radii 23.5
    assert ndimage.label(truth > 0, EIGHT)[1] == 1  # one blob to the eye of a threshold
    found = label_objects((truth > 0).astype(np.float32), 0.5, 0, INFERENCE.split_neck)
    assert found.max() == 2
    assert sorted(matches(truth, found)) == [1, 2]
    assert ndimage.label(found > 0, EIGHT)[1] == 2  # the written mask's own objects
    assert label_objects((truth > 0).astype(np.float32), 0.5, 0, 0.0).max() == 1


def test_a_lumpy_or_elongated_object_stays_one() -> None:
    """Lumps joined by a waist nearly as wide as they are, an ellipse, a disc."""
    lumpy = discs((60, 80), (30, 30, 12), (30, 39, 10))  # centres 9 apart: a wide waist
    yy, xx = np.mgrid[0:60, 0:80]
    ellipse = ((yy - 30) / 10.0) ** 2 + ((xx - 40) / 25.0) ** 2 <= 1
    for mask in (lumpy > 0, ellipse, discs((40, 40), (20, 20, 15)) > 0):
        assert label_objects(mask.astype(np.float32), 0.5, 0, INFERENCE.split_neck).max() == 1


def test_a_chain_of_three_in_contact_is_three() -> None:
    truth = discs((50, 110), (25, 20, 11), (25, 42, 11), (25, 64, 11))
    found = label_objects((truth > 0).astype(np.float32), 0.5, 0, INFERENCE.split_neck)
    assert found.max() == 3 and sorted(matches(truth, found)) == [1, 2, 3]


def test_most_touching_pairs_of_the_generator_are_cut_and_no_single_spheroid_is(
    synth: ModuleType,
) -> None:
    """On the generator's true masks: ≥ 90 % of its touching pairs are two objects matched to
    theirs; none of its lone spheroids (default images) is cut."""
    look = synth.Look(touching=1.0)
    pairs = [synth.sample(11, i, 96, look) for i in range(40)]
    apart = 0
    for drawn in pairs:
        found = label_objects(drawn.mask.astype(np.float32), 0.5, 0, INFERENCE.split_neck)
        apart += sorted(matches(drawn.labels, found)) == [1, 2]
    assert apart >= 36
    for index in range(60):
        drawn = synth.sample(12, index, 96)
        found = label_objects(drawn.mask.astype(np.float32), 0.5, 0, INFERENCE.split_neck)
        assert found.max() == drawn.spheroids


@settings(max_examples=60, deadline=None)
@given(
    probabilities=arrays(np.float32, (14, 17), elements=st.floats(0, 1, width=32)),
    threshold=st.floats(0.05, 0.95),
    min_area=st.integers(0, 12),
    split_neck=st.sampled_from([0.0, 0.5, INFERENCE.split_neck, 0.99]),
)
def test_objects_are_the_components_of_their_mask_above_threshold_and_large_enough(
    probabilities: np.ndarray, threshold: float, min_area: int, split_neck: float
) -> None:
    """Whatever is cut: the returned ids are the 8-connected components of their own mask (so
    whoever labels a written mask finds the objects counted), inside the thresholded pixels,
    none smaller than ``min_area``; with nothing cut, the components of before."""
    found = label_objects(probabilities, threshold, min_area, split_neck)
    relabelled, count = ndimage.label(found > 0, EIGHT)
    assert count == found.max() and np.array_equal(relabelled, found)
    assert not ((found > 0) & ~(probabilities > threshold)).any()
    assert all(area >= min_area for area in np.bincount(found.ravel())[1:])
    plain = components(probabilities > threshold, min_area)
    if split_neck == 0:
        assert np.array_equal(found, plain)
    assert found.max() >= plain.max() or min_area > 0


# a 1-pixel object before a 3-pixel one: at min_area 2 the second is numbered 1
_SPECK_FIRST = np.array([[255, 0, 0, 0], [0, 0, 255, 255], [0, 0, 255, 0]], dtype=np.uint8)


@settings(max_examples=60, deadline=None)
@given(
    mask=arrays(
        np.uint8,
        st.tuples(st.integers(1, 40), st.integers(1, 40)),
        elements=st.sampled_from([0, 0, 255]),
        fill=st.nothing(),  # every pixel drawn: masks of many objects, large and small
    ),
    min_area=st.integers(0, 12),
    as_bool=st.booleans(),
)
@example(mask=_SPECK_FIRST, min_area=2, as_bool=False)
@example(mask=_SPECK_FIRST, min_area=2, as_bool=True)
def test_components_are_the_8_connected_ones_large_enough_numbered_in_raster_order(
    mask: np.ndarray, min_area: int, as_bool: bool
) -> None:
    """What the job's finish stage counts on (sizes counted over the foreground, ids by
    ``np.take``): the components of a boolean mask or of a 0/255 one alike, those smaller than
    ``min_area`` dropped, the others numbered 1…N in raster order of their first pixel."""
    given = mask.astype(bool) if as_bool else mask
    labels, count = ndimage.label(mask > 0, EIGHT)
    sizes = np.bincount(labels.ravel(), minlength=count + 1)
    expected = np.zeros_like(labels)
    for new, old in enumerate((i for i in range(1, count + 1) if sizes[i] >= min_area), 1):
        expected[labels == old] = new
    found = components(given, min_area)
    assert found.dtype == labels.dtype and np.array_equal(found, expected)
    firsts = [int(np.flatnonzero(found.ravel() == k)[0]) for k in range(1, int(found.max()) + 1)]
    assert firsts == sorted(firsts)  # raster order of each object's first pixel


def alone_and_together(mask: np.ndarray, min_area: int, split_neck: float) -> None:
    """The objects of ``mask`` are those of each of its components alone: no object's cut
    depends on another's (the step measures the image at once)."""
    found = mask_objects(mask, min_area, split_neck) > 0
    labels = components(mask, min_area)
    each = np.zeros(mask.shape, dtype=bool)
    for index in range(1, int(labels.max()) + 1):
        each |= mask_objects(labels == index, min_area, split_neck) > 0
    assert np.array_equal(found, each)


def test_objects_near_each_other_and_inside_a_hole_are_cut_as_alone(synth: ModuleType) -> None:
    """Touching pairs side by side, at the image's edge, and one inside a ring's hole: each is
    cut as it is alone, the ring (filled, one round shape) is not cut."""
    pairs = [synth.sample(11, i, 96, synth.Look(touching=1.0)).mask for i in range(4)]
    row = np.concatenate(pairs, axis=1)[10:-10]  # pairs close to each other and to the edge
    yy, xx = np.mgrid[0:130, 0:130]
    ring = (np.hypot(yy - 65, xx - 65) <= 62) & (np.hypot(yy - 65, xx - 65) > 52)
    nested = ring.copy()
    nested[17:113, 17:113] |= pairs[0]
    for mask in (row, nested, row[:, 30:-30]):
        alone_and_together(mask, 0, INFERENCE.split_neck)
    assert label_objects(nested.astype(np.float32), 0.5, 0, INFERENCE.split_neck).max() == 3
    assert label_objects(ring.astype(np.float32), 0.5, 0, INFERENCE.split_neck).max() == 1


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    smooth=st.floats(0.8, 3.0),
    split_neck=st.sampled_from([0.5, INFERENCE.split_neck, 0.99]),
)
def test_each_object_is_cut_as_it_would_be_alone(
    seed: int, smooth: float, split_neck: float
) -> None:
    """Random blobs, holes and specks among them, objects on the image's edge."""
    field = ndimage.gaussian_filter(np.random.default_rng(seed).standard_normal((48, 56)), smooth)
    alone_and_together(field > 0.2 * field.std(), 4, split_neck)
