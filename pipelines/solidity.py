"""Solidity (area over convex hull area) of many labelled regions at once, exactly as skimage's
``regionprops(labels)[i].solidity`` gives it, at a small part of its cost. Pure.

skimage's hull of a region is the convex hull of its pixels' edge midpoints (a pixel (r, c)
has four: (r ± ½, c) and (r, c ± ½)), and its area the number of pixel centres inside that
hull or on its outline (``convex_hull_image``). Here, in doubled coordinates (centres at even
rows and columns, the midpoints at integers), the hull's left outline is the greatest convex
function of the row below each half-row's leftmost midpoint, its right outline the least
concave one above the rightmost; the centres between them are counted row by row, in integer
arithmetic: the same count as skimage's, whose point-in-polygon test is exact on these
coordinates. All regions go through each step together (one sort, a few passes), where skimage
builds one hull per region.
"""

from __future__ import annotations

import numpy as np

Chain = tuple[np.ndarray, np.ndarray, np.ndarray]  # region, doubled row, doubled column


def solidity(labels: np.ndarray, count: int) -> np.ndarray:
    """Area over convex hull area (float64) of each region 1…``count`` of ``labels`` (2-D,
    0 background, every id present)."""
    rows, cols = np.nonzero(labels)
    ids = labels[rows, cols].astype(np.int64)
    order = np.argsort(ids, kind="stable")  # by region, each in raster order
    ids, rows, cols = ids[order], rows[order].astype(np.int64), cols[order].astype(np.int64)
    area = np.bincount(ids, minlength=count + 1)[1:]
    left, right = _half_rows(ids, rows, cols, -1), _half_rows(ids, rows, cols, 1)
    return area / _centres_between(_outline(*left, -1), _outline(*right, 1), count)


def run_starts(*keys: np.ndarray) -> np.ndarray:
    """Where each run of equal values begins in ``keys`` (arrays of one length, taken together
    as one key per position), the first position included."""
    changed = np.zeros(len(keys[0]), dtype=bool)
    changed[:1] = True
    for key in keys:
        changed[1:] |= key[1:] != key[:-1]
    return np.flatnonzero(changed)


def _half_rows(ids: np.ndarray, rows: np.ndarray, cols: np.ndarray, side: int) -> Chain:
    """The outermost edge midpoint of each region on each half-row, on the ``side`` -1 (left)
    or 1 (right), sorted by region and row: of a row's end pixel (r, c), (2r, 2c + side) and
    (2r ± 1, 2c); a half-row between two rows takes the outer of theirs."""
    starts = run_starts(ids, rows)
    ends = np.append(starts[1:], len(ids)) - 1
    region, row = ids[starts], rows[starts]
    end = cols[starts] if side < 0 else cols[ends]
    level = np.stack([2 * row - 1, 2 * row, 2 * row + 1], axis=1).ravel()
    column = np.stack([2 * end, 2 * end + side, 2 * end], axis=1).ravel()
    region = np.repeat(region, 3)
    same = (region[1:] == region[:-1]) & (level[1:] == level[:-1])  # two rows' shared half-row
    outer = np.maximum if side > 0 else np.minimum
    column[:-1][same] = outer(column[:-1][same], column[1:][same])
    keep = np.insert(~same, 0, True)
    return region[keep], level[keep], column[keep]


def _outline(region: np.ndarray, row: np.ndarray, col: np.ndarray, side: int) -> Chain:
    """The vertices of each region's outline through its chain of points: ``side`` -1, the
    greatest convex function of the row below them (a hull's left side); 1, the least concave
    one above (its right side). A point on or inside the line between its neighbours is no
    vertex; all such go at once, until none is left (each one gone is inside the hull of the
    points kept, so the outline stays the same)."""
    while len(region) > 2:
        before, here, after = slice(0, -2), slice(1, -1), slice(2, None)
        inner = (region[before] == region[here]) & (region[here] == region[after])
        span = row[after] - row[before]
        line = col[before] * (row[after] - row[here]) + col[after] * (row[here] - row[before])
        drop = inner & (side * (col[here] * span - line) <= 0)
        if not drop.any():
            break
        keep = np.ones(len(region), dtype=bool)
        keep[1:-1] = ~drop
        region, row, col = region[keep], row[keep], col[keep]
    return region, row, col


def _centres_between(left: Chain, right: Chain, count: int) -> np.ndarray:
    """The number of pixel centres (even doubled rows and columns) between each region's left
    and right outlines, the outlines included (float64, exact)."""
    region, row, _ = left
    starts = run_starts(region)
    top, bottom = row[starts], row[np.append(starts[1:], len(region)) - 1]
    rows_in = (bottom - top) // 2  # the centres' rows: top + 1, top + 3, …, bottom - 1
    wanted = np.repeat(region[starts], rows_in)
    offset = np.arange(len(wanted)) - np.repeat(np.cumsum(rows_in) - rows_in, rows_in)
    at = np.repeat(top + 1, rows_in) + 2 * offset
    first = _column_at(*left, wanted, at, ceiling=True)
    last = _column_at(*right, wanted, at, ceiling=False)
    return np.bincount(wanted, weights=last - first + 1, minlength=count + 1)[1:]


def _column_at(
    region: np.ndarray, row: np.ndarray, col: np.ndarray, wanted: np.ndarray, at: np.ndarray,
    ceiling: bool,
) -> np.ndarray:  # fmt: skip
    """Where each region's outline (its vertices, by row) crosses the doubled row ``at`` of
    region ``wanted``: the first pixel column at or right of it (``ceiling``), else the last
    at or left of it."""
    stride = int(max(row.max(), at.max())) + 2
    keys, key = region * stride + row + 1, wanted * stride + at + 1
    after = np.searchsorted(keys, key)
    exact = keys[np.minimum(after, len(keys) - 1)] == key
    before = np.where(exact, after, after - 1)
    span = np.where(exact, 1, row[after] - row[before])
    across = np.where(
        exact, col[after], col[before] * (row[after] - at) + col[after] * (at - row[before])
    )  # the crossing's doubled column times span; a pixel column is half of one, rounded inward
    return -((-across) // (2 * span)) if ceiling else across // (2 * span)
