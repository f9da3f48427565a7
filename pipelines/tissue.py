"""Where a whole-slide image holds tissue: windows over glass only are not run through the net.

A slide is mostly glass. Its pyramid's smallest level (read whole: a few hundred to a few
thousand pixels across) gives a tissue mask: the glass's grey is the level's most common value,
a pixel farther from it than ``glass_tolerance`` (on the 0-1 grey scale) is tissue, and the
mask is grown by :data:`GROW` level pixels, so that the rim of an object whose low-resolution
pixel was averaged into the glass still counts. A window none of whose pixels lie under the
mask is not read and not run: its probabilities are 0 (background), which is what the net
gives for glass; a TIFF tile under no tissue is never decoded (the overview and the objects'
measures take it as the glass's grey). A window over any tissue pixel runs, so every pixel
of the mask gets the same probabilities as without it; only glass beside tissue can differ (a
skipped neighbour no longer adds its near-zero share to the blend). The windows run and
skipped are counted for the report.

A TIFF without reduced levels, or whose smallest level is larger than :data:`MAX_LEVEL_PIXELS`,
has no mask: every window runs (the log says so).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import ndimage

GROW = 2  # level pixels the tissue is grown by
MAX_LEVEL_PIXELS = 4096 * 4096  # a smallest level larger than this is not read whole
BINS = 256  # of the histogram whose fullest bin is the glass


@dataclass(frozen=True)
class TissueMask:
    """The grown tissue of a slide's smallest level, and how it lies over the full image."""

    tissue: np.ndarray  # bool, (level rows, level columns)
    height: int  # the full image's
    width: int
    glass: float  # the glass's grey, 0-1
    sums: np.ndarray  # the tissue's summed-area table, one row and column of zeros first

    @classmethod
    def of_level(cls, level: np.ndarray, height: int, width: int, tolerance: float) -> TissueMask:
        """The mask of ``level`` (float grey in [0, 1]) of an image of ``height × width``."""
        counts, _ = np.histogram(level, bins=BINS, range=(0.0, 1.0))
        glass = (int(np.argmax(counts)) + 0.5) / BINS
        tissue = np.abs(level - glass) > tolerance
        if tissue.any() and GROW:
            tissue = ndimage.binary_dilation(tissue, iterations=GROW)
        return cls(tissue, height, width, glass, summed(tissue))

    @property
    def fraction(self) -> float:
        """The share of the slide under the mask."""
        return float(self.tissue.mean()) if self.tissue.size else 0.0

    def any(self, top: int, bottom: int, left: int, right: int) -> bool:
        """Whether the full image's rows ``top:bottom``, columns ``left:right`` touch tissue
        (every level pixel they overlap, even in part, counts)."""
        rows, cols = self.tissue.shape
        return any_within(self.sums, _span(top, bottom, self.height, rows),
                          _span(left, right, self.width, cols))  # fmt: skip


def summed(mask: np.ndarray) -> np.ndarray:
    """The summed-area table of a 2-D ``mask``: one row and one column of zeros first."""
    sums = np.zeros((mask.shape[0] + 1, mask.shape[1] + 1), dtype=np.int64)
    sums[1:, 1:] = mask.cumsum(0).cumsum(1)
    return sums


def any_within(sums: np.ndarray, rows: tuple[int, int], columns: tuple[int, int]) -> bool:
    """Whether the mask whose :func:`summed` table is ``sums`` holds anything in its ``rows``
    (first, end) and ``columns``."""
    (y0, y1), (x0, x1) = rows, columns
    return bool(sums[y1, x1] - sums[y0, x1] - sums[y1, x0] + sums[y0, x0] > 0)


def _span(first: int, end: int, full: int, level: int) -> tuple[int, int]:
    """The level pixels (first, end) that full-resolution pixels ``first:end`` overlap."""
    scale = full / level
    return max(0, math.floor(first / scale)), min(level, math.ceil(end / scale))


@dataclass
class Windows:
    """Windows of a slide run through the net, and skipped as glass."""

    run: int = 0
    glass: int = 0
