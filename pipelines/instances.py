"""From a net's probabilities to objects: threshold, then cut touching objects apart. Pure.

The net draws one mask for all spheroids; two that touch are one connected component of it.
:func:`label_objects` (or :func:`mask_objects`, from a thresholded mask) cuts a component where
it narrows: on the distance to the background (the distance transform of the component, its
holes filled: a hole is no outline), each local summit is the centre of a part, a watershed from
the summits gives each pixel to one part, and two neighbouring parts stay one object unless the
neck between them (the highest distance on their shared border, half its width) is narrower than
``split_neck`` times the thinner part's own half-width (its summit). So two spheroids in
contact, whose outlines meet in a narrow waist, are two objects; a lumpy spheroid, whose lumps
are joined by a waist nearly as wide as they are, stays one. The cut is kept only where every
part it leaves is round enough for a spheroid (its area at least :data:`ROUND` of its convex
hull's): a mask the net broke into a crescent, around a spheroid it half missed, is not cut into
its horns. ``split_neck`` 0 never cuts: the objects are the connected components, as before this
step existed.

Objects that were cut apart are kept apart by one pixel of background (of the part with the
lower id, on their border), so that the 8-connected components of the returned mask are the
objects themselves: whoever labels a mask the jobs wrote finds the objects they counted. A
piece smaller than ``min_area`` pixels is dropped, a component before cutting as well as a
part after.

Whole images only: an image segmented window by window is labelled band by band and joined
across bands (:mod:`pipelines.tiles`); a cut would need each object whole, so its objects are
its connected components.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

import numpy as np
from scipy import ndimage
from skimage.measure import regionprops
from skimage.segmentation import watershed

EIGHT = np.ones((3, 3), dtype=bool)
ROUND = 0.9  # a part a cut leaves is kept apart only if at least this solid (area / hull)
# the four directions that reach every 8-neighbour pair once: right, down, down-right, down-left
_HALF_NEIGHBOURHOOD = ((0, 1), (1, 0), (1, 1), (1, -1))


def components(mask: np.ndarray, min_area: int) -> np.ndarray:
    """The 8-connected components of ``mask`` (int32 ids 1…N in raster order), those smaller
    than ``min_area`` pixels dropped."""
    labels, count = ndimage.label(mask, structure=EIGHT)
    if count == 0:
        return labels
    keep = np.bincount(labels.ravel()) >= min_area
    keep[0] = False
    if keep[1:].all():
        return labels
    ids = np.zeros(len(keep), dtype=labels.dtype)
    ids[keep] = np.arange(1, int(keep.sum()) + 1, dtype=labels.dtype)
    return ids[labels]


def label_objects(
    probabilities: np.ndarray, threshold: float, min_area: int, split_neck: float
) -> np.ndarray:
    """Object ids (int32, 0 background, 1…N in raster order of their first pixel) of the
    pixels whose probability exceeds ``threshold``: see the module's text."""
    return mask_objects(probabilities > threshold, min_area, split_neck)


def mask_objects(mask: np.ndarray, min_area: int, split_neck: float) -> np.ndarray:
    """Object ids, as :func:`label_objects` gives them, of a mask already thresholded (the
    inference job's device stage thresholds on the GPU)."""
    labels = components(mask, min_area)
    if split_neck <= 0:
        return labels
    kept, cut = labels > 0, False
    for index, box in enumerate(ndimage.find_objects(labels), start=1):
        if box is None:
            continue
        whole = labels[box] == index
        gaps = cut_lines(whole, split_neck)
        if gaps is not None:
            kept[box] &= ~gaps
            cut = True
    return components(kept, min_area) if cut else labels


def cut_lines(component: np.ndarray, split_neck: float) -> np.ndarray | None:
    """The pixels of ``component`` (one 8-connected object, a boolean array around it) that
    become background so that its parts with narrow necks between them are apart; None where
    it stays whole. Each is measured alone: the array's edge counts as background."""
    mask = np.zeros((component.shape[0] + 2, component.shape[1] + 2), dtype=bool)
    mask[1:-1, 1:-1] = component
    shape = ndimage.binary_fill_holes(mask)
    distance = ndimage.distance_transform_edt(shape).astype(np.float32)
    summits = shape & (distance == ndimage.maximum_filter(distance, size=3))
    markers, count = ndimage.label(summits, structure=EIGHT)
    if count <= 1:
        return None
    parts = watershed(-distance, markers, mask=shape, connectivity=2)
    groups = _merge(parts, distance, count, split_neck)
    if groups is None or min(part.solidity for part in regionprops(groups)) < ROUND:
        return None
    return (mask & (_apart(groups) == 0))[1:-1, 1:-1]


def _merge(
    parts: np.ndarray, distance: np.ndarray, count: int, split_neck: float
) -> np.ndarray | None:
    """The parts joined where their neck is wide (one id per group of parts); None where they
    all join into one.

    Greedy, widest neck (relative to the thinner side) first, and each join judged again with
    the joined part's summit: a lump that joins one spheroid no longer looks like a wide neck
    to the other one it also touches."""
    summit = np.asarray(ndimage.maximum(distance, parts, np.arange(count + 1)), dtype=np.float64)
    group = np.arange(count + 1)
    necks: dict[int, dict[int, float]] = {part: {} for part in range(1, count + 1)}
    for a, b, neck in zip(*_borders(parts, distance), strict=True):
        necks[int(a)][int(b)] = necks[int(b)][int(a)] = float(neck)
    version = dict.fromkeys(necks, 0)
    heap = [(-neck / min(summit[a], summit[b]), a, b, 0, 0)
            for a in necks for b, neck in necks[a].items() if a < b]  # fmt: skip
    heapq.heapify(heap)
    while heap:
        ratio, a, b, seen_a, seen_b = heapq.heappop(heap)
        if -ratio < split_neck:
            break
        if group[a] != a or group[b] != b or (version[a], version[b]) != (seen_a, seen_b):
            continue  # a part already joined, or a neck judged before a join
        group[group == b] = a
        summit[a] = max(summit[a], summit[b])
        for c, neck in necks.pop(b).items():
            del necks[c][b]
            if c != a:
                necks[a][c] = necks[c][a] = max(necks[a].get(c, 0.0), neck)
        version[a] += 1
        for c, neck in necks[a].items():
            low, high = min(a, c), max(a, c)
            ratio = neck / min(summit[a], summit[c])
            heapq.heappush(heap, (-ratio, low, high, version[low], version[high]))
    _, ids = np.unique(group, return_inverse=True)
    if ids.max() <= 1:
        return None
    return ids.astype(np.int32)[parts]


def neighbours(shape: tuple[int, ...]) -> Iterator[tuple[tuple[slice, slice], ...]]:
    """Pairs of views (rows, columns) of an array of ``shape``: the pixels, and their neighbour
    to the right, below, below right, below left: every pair of 8-neighbours once."""
    height, width = shape
    for dy, dx in _HALF_NEIGHBOURHOOD:
        if dx >= 0:
            left, right = slice(0, width - dx), slice(dx, width)
        else:
            left, right = slice(-dx, width), slice(0, width + dx)
        yield (slice(0, height - dy), left), (slice(dy, height), right)


def _borders(parts: np.ndarray, distance: np.ndarray) -> tuple[np.ndarray, ...]:
    """(first part, second part, neck) of every pair of parts that touch (8-neighbours), the
    neck the highest distance on their shared border (of the lower of each pair of pixels)."""
    keys, necks = [], []
    stride = np.int64(parts.max()) + 1
    for here_at, there_at in neighbours(parts.shape):
        here, there = parts[here_at], parts[there_at]
        border = (here != there) & (here > 0) & (there > 0)
        if not border.any():
            continue
        a, b = here[border].astype(np.int64), there[border].astype(np.int64)
        keys.append(np.minimum(a, b) * stride + np.maximum(a, b))
        necks.append(np.minimum(distance[here_at][border], distance[there_at][border]))
    if not keys:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, np.zeros(0, dtype=np.float32)
    key, neck = np.concatenate(keys), np.concatenate(necks)
    order = np.argsort(key, kind="stable")
    key, neck = key[order], neck[order]
    starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
    pairs = key[starts]
    return pairs // stride, pairs % stride, np.maximum.reduceat(neck, starts)


def _apart(ids: np.ndarray) -> np.ndarray:
    """``ids`` less the pixels 8-next to a higher id: no two objects touch any more."""
    height, width = ids.shape
    padded = np.pad(ids, 1)
    border = np.zeros(ids.shape, dtype=bool)
    for dy in (-1, 0, 1):
        for dx in (-1, 0, 1):
            if dy or dx:
                border |= padded[1 + dy : 1 + dy + height, 1 + dx : 1 + dx + width] > ids
    return np.where(border & (ids > 0), 0, ids)
