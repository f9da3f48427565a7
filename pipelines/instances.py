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

The image is measured at once, as far as that gives each object's values alone (its filled
shape's distances, summits, the merge; the parts' solidity counted exactly, all parts together,
by :mod:`pipelines.solidity`); the watershed goes object by object, since its result depends on
the order in which its summits leave the flood's queue.

Whole images only: an image segmented window by window is labelled band by band and joined
across bands (:mod:`pipelines.tiles`); a cut would need each object whole, so its objects are
its connected components.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

import numpy as np
from scipy import ndimage
from skimage.segmentation import watershed

from pipelines.solidity import run_starts, solidity

EIGHT = np.ones((3, 3), dtype=bool)
ROUND = 0.9  # a part a cut leaves is kept apart only if at least this solid (area / hull)
# the four directions that reach every 8-neighbour pair once: right, down, down-right, down-left
_HALF_NEIGHBOURHOOD = ((0, 1), (1, 0), (1, 1), (1, -1))


def components(mask: np.ndarray, min_area: int) -> np.ndarray:
    """The 8-connected components of ``mask`` (int32 ids 1…N in raster order), those smaller
    than ``min_area`` pixels dropped."""
    labels, count = ndimage.label(mask, structure=EIGHT)
    if count == 0 or min_area <= 1:
        return labels
    # sizes counted over the foreground alone and ids given by np.take: for a 256² image of the
    # demo's, 0.07 + 0.14 ms where a count over every pixel and fancy indexing took 0.20 + 0.26
    keep = np.bincount(labels[np.asarray(mask, dtype=bool)], minlength=count + 1) >= min_area
    keep[0] = False
    if keep[1:].all():
        return labels
    ids = np.zeros(len(keep), dtype=labels.dtype)
    ids[keep] = np.arange(1, int(keep.sum()) + 1, dtype=labels.dtype)
    return np.take(ids, labels)


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
    if split_neck <= 0 or not labels.any():
        return labels
    gaps = cut_lines(labels, split_neck)
    if gaps is None:
        return labels
    return components((labels > 0) & ~gaps, min_area)


def cut_lines(labels: np.ndarray, split_neck: float) -> np.ndarray | None:
    """The pixels that become background so that the parts of each object of ``labels``
    (:func:`components`' ids) with narrow necks between them are apart; None where no object
    is cut.

    Each object is measured alone, its holes filled, the image's edge as background: as if it
    were cut out with a margin of background. Done for the whole image at once, this gives the
    same distances, summits and parts, since two objects' filled shapes never touch, and the
    background between them is nearer than the other object is. But an object inside
    another's hole is in that one's filled shape: those go alone, each."""
    rows, cols = np.flatnonzero(labels.any(axis=1)), np.flatnonzero(labels.any(axis=0))
    if not len(rows):
        return None
    around = slice(rows[0], rows[-1] + 1), slice(cols[0], cols[-1] + 1)
    padded = np.zeros((around[0].stop - around[0].start + 2, around[1].stop - around[1].start + 2),
                      dtype=labels.dtype)  # fmt: skip
    padded[1:-1, 1:-1] = labels[around]  # beyond the objects' box: background, as the edge
    background, pieces = ndimage.label(padded == 0)  # 4-connected, as binary_fill_holes fills
    inside = padded > 0
    if pieces == 1:  # no holes: each filled shape is its object, with the object's id
        filled, count = padded, int(labels.max())
    else:
        filled = (background != background[0, 0]).view(np.int8)
        count = 1 if labels.max() == 1 else 0  # one object: its filled shape is the one shape
        if not count:
            filled, count = ndimage.label(filled, structure=EIGHT)
    shape_of = np.zeros(int(labels.max()) + 1, dtype=np.int64)
    shape_of[padded[inside]] = filled[inside]
    crowded = np.flatnonzero(np.bincount(shape_of[1:], minlength=count + 1) > 1)
    if len(crowded):  # a filled shape with an object in its hole: not measured here
        filled[np.isin(filled, crowded)] = 0
    gaps = np.zeros(labels.shape, dtype=bool)
    found = _cut_filled(filled, count, split_neck)
    if found is not None:
        gaps[around] = found[1:-1, 1:-1] & inside[1:-1, 1:-1]
    if len(crowded):  # the boxes cost a pass over the image: only for those that need them
        boxes = ndimage.find_objects(labels)
        for index in np.flatnonzero(np.isin(shape_of, crowded)):
            alone = cut_lines((labels[boxes[index - 1]] == index).astype(labels.dtype),
                              split_neck)  # fmt: skip
            if alone is not None:
                gaps[boxes[index - 1]] |= alone
    return gaps if gaps.any() else None


def _cut_filled(filled: np.ndarray, count: int, split_neck: float) -> np.ndarray | None:
    """Where each filled shape (``filled``'s ids 1…``count``, apart, a margin of 0 around)
    is cut: its pixels 8-next to a part of higher id, for each shape whose parts stay more
    than one and are all round enough; None where none is."""
    distance = _distances(filled > 0)
    summits = (filled > 0) & (distance == ndimage.maximum_filter(distance, size=3))
    markers, peaks = ndimage.label(summits, structure=EIGHT)
    shape_of = np.zeros(peaks + 1, dtype=np.int64)
    shape_of[markers[summits]] = filled[summits]
    several = np.flatnonzero(np.bincount(shape_of[1:], minlength=count + 1) > 1)
    if not len(several):
        return None
    parts = _watersheds(filled, distance, markers, several)
    group = _merge(parts, distance, peaks, split_neck)
    heads = np.flatnonzero(group == np.arange(peaks + 1))[1:]  # the parts that name a group
    groups_of = np.bincount(shape_of[heads], minlength=count + 1)
    candidates = heads[groups_of[shape_of[heads]] > 1]  # in shapes of two groups or more
    if not len(candidates):
        return None
    number = np.zeros(peaks + 1, dtype=np.int32)  # groups renumbered 1…, in the parts' order
    number[candidates] = np.arange(1, len(candidates) + 1, dtype=np.int32)
    groups = number[group][parts]
    round_enough = solidity(groups, len(candidates)) >= ROUND
    failed = np.bincount(shape_of[candidates], weights=~round_enough, minlength=count + 1)
    cut = np.flatnonzero(groups_of > 1)
    cut = cut[failed[cut] == 0]
    if not len(cut):
        return None
    keep = np.zeros(len(candidates) + 1, dtype=bool)
    keep[1:] = np.isin(shape_of[candidates], cut)
    groups = np.where(keep[groups], groups, 0)
    return (groups > 0) & (_apart(groups) == 0)


def _distances(shapes: np.ndarray) -> np.ndarray:
    """``distance_transform_edt(shapes).astype(np.float32)``, the same values, computed only
    where ``shapes`` is (the transform's own distances cost more than its search)."""
    nearest = ndimage.distance_transform_edt(shapes, return_distances=False, return_indices=True)
    rows, cols = np.nonzero(shapes)
    across = (nearest[0][rows, cols] - rows).astype(np.float64) ** 2
    across += (nearest[1][rows, cols] - cols).astype(np.float64) ** 2
    distance = np.zeros(shapes.shape, dtype=np.float32)
    distance[rows, cols] = np.sqrt(across)
    return distance


def _watersheds(
    filled: np.ndarray, distance: np.ndarray, markers: np.ndarray, shapes: np.ndarray
) -> np.ndarray:
    """Each of ``shapes`` (ids of ``filled``) split into the basins of its summits
    (``markers``' ids), one watershed each: its result depends on the order in which the
    summits leave the flood's queue, which other shapes' summits would change."""
    parts = np.zeros(filled.shape, dtype=np.int32)
    boxes = ndimage.find_objects(filled)
    for index in shapes:
        rows, cols = boxes[index - 1]
        box = slice(rows.start - 1, rows.stop + 1), slice(cols.start - 1, cols.stop + 1)
        shape = filled[box] == index
        basins = watershed(-distance[box], np.where(shape, markers[box], 0), mask=shape,
                           connectivity=2)  # fmt: skip
        parts[box][shape] = basins[shape]
    return parts


def _merge(parts: np.ndarray, distance: np.ndarray, count: int, split_neck: float) -> np.ndarray:
    """The parts (ids 1…``count``, a margin of 0 around) joined where their neck is wide: for
    each, the lowest id of its group (0 for 0). Parts that do not touch never join: the parts
    of several objects are joined as each object's alone would be, in the same order.

    Greedy, widest neck (relative to the thinner side) first, and each join judged again with
    the joined part's summit: a lump that joins one spheroid no longer looks like a wide neck
    to the other one it also touches. A join weighs again only the necks whose ratio it
    changed (those the part took over, and all of its own only when its summit rose): an
    object the net drew ragged, cut into thousands of parts, costs about its parts, not their
    square."""
    summit = _summits(parts, distance, count).tolist()
    first, second, width = (side.tolist() for side in _borders(parts, distance))
    necks: list[dict[int, float]] = [{} for _ in range(count + 1)]
    for a, b, neck in zip(first, second, width, strict=True):
        necks[a][b] = necks[b][a] = neck
    ratios = {(a, b): neck / min(summit[a], summit[b])  # (lower, higher): its ratio now
              for a, b, neck in zip(first, second, width, strict=True)}  # fmt: skip
    heap = [(-ratio, a, b) for (a, b), ratio in ratios.items()]
    heapq.heapify(heap)
    head = list(range(count + 1))  # a part joined to a lower one points to it
    while heap:
        negative, a, b = heapq.heappop(heap)
        if -negative < split_neck:
            break
        if head[a] != a or head[b] != b or ratios.get((a, b)) != -negative:
            continue  # a part already joined, or a neck judged before a join
        head[b] = a
        del ratios[(a, b)]
        rose = summit[b] > summit[a]
        summit[a] = max(summit[a], summit[b])
        gone, necks[b] = necks[b], {}
        changed = set()
        for c, neck in gone.items():
            del necks[c][b]
            ratios.pop((min(b, c), max(b, c)), None)
            if c != a:
                necks[a][c] = necks[c][a] = max(necks[a].get(c, 0.0), neck)
                changed.add(c)
        for c in necks[a] if rose else changed:
            low, high = min(a, c), max(a, c)
            ratio = necks[a][c] / min(summit[a], summit[c])
            if ratios.get((low, high)) != ratio:
                ratios[(low, high)] = ratio
                heapq.heappush(heap, (-ratio, low, high))
    for part in range(count + 1):  # each part names its group's lowest id
        head[part] = head[head[part]]
    return np.array(head)


def _summits(parts: np.ndarray, distance: np.ndarray, count: int) -> np.ndarray:
    """The highest distance in each part (float64; 0 for a part without pixels)."""
    inside = parts > 0
    ids, values = parts[inside], distance[inside]
    order = np.argsort(ids, kind="stable")
    ids, values = ids[order], values[order]
    starts = run_starts(ids)
    summit = np.zeros(count + 1)
    if len(ids):
        summit[ids[starts]] = np.maximum.reduceat(values, starts)
    return summit


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
    neck the highest distance on their shared border (of the lower of each pair of pixels);
    ``parts`` has a margin of 0 around."""
    ids, heights = parts.ravel(), distance.ravel()  # a margin of 0: no neighbour off the array
    (here,) = np.nonzero(ids)
    row = parts.shape[1]
    keys, necks = [], []
    stride = np.int64(parts.max()) + 1
    for step in (1, row, row + 1, row - 1):  # right, below, below right, below left
        there = here + step
        mine, theirs = ids[here], ids[there]
        border = (mine != theirs) & (theirs > 0)
        a, b = mine[border].astype(np.int64), theirs[border].astype(np.int64)
        keys.append(np.minimum(a, b) * stride + np.maximum(a, b))
        necks.append(np.minimum(heights[here[border]], heights[there[border]]))
    if not sum(len(key) for key in keys):
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, np.zeros(0, dtype=np.float32)
    key, neck = np.concatenate(keys), np.concatenate(necks)
    order = np.argsort(key, kind="stable")
    key, neck = key[order], neck[order]
    starts = run_starts(key)
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
