"""Skipping the glass: a slide's windows over no tissue are not run, and change no label."""

from __future__ import annotations

import logging
from itertools import pairwise
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import tifffile
from labelimages import zarr_levels
from zarr.core.sync import cleanup_resources

from daemon.contract.heldfolder import HeldFolder
from pipelines.omezarr import CHUNK, LABEL_NAME
from pipelines.tiles import RegionReader, TiledResult, region_rows, segment_tiled, starts
from pipelines.tissue import GROW

GLASS = 235
WINDOW, OVERLAP = 256, 32


def _pyramid(path: Path, pixels: np.ndarray, levels: int) -> None:
    """A tiled TIFF of ``pixels`` with ``levels`` halved levels in SubIFDs."""
    with tifffile.TiffWriter(path) as tif:
        tif.write(pixels, tile=(128, 128), subifds=levels, photometric="minisblack")
        for level in range(1, levels + 1):
            tif.write(pixels[:: 2**level, :: 2**level], tile=(128, 128), subfiletype=1,
                      photometric="minisblack")  # fmt: skip


def test_the_tissue_mask_is_what_differs_from_the_glass_on_the_smallest_level(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The glass is the smallest level's most common grey; a window touching a level pixel of
    tissue (grown by GROW) runs, one farther off does not; without a reduced level, or with
    a tolerance of 0, every window runs."""
    pixels = np.full((2048, 2048), GLASS, dtype=np.uint8)
    pixels[1000:1100, 600:700] = 90  # tissue: level 2's rows 250:275, columns 150:175
    _pyramid(tmp_path / "slide.tif", pixels, 2)
    with caplog.at_level(logging.INFO, logger="pipelines"):
        reader = RegionReader(tmp_path / "slide.tif", glass_tolerance=0.05)
    assert reader.tissue is not None and reader.tissue.tissue.shape == (512, 512)
    assert reader.tissue.glass == pytest.approx(GLASS / 255, abs=1 / 256)
    assert "tissue 0.3 % of the slide" in caplog.text  # (25 + 2·GROW)² of 512²
    reach = 4 * GROW  # full-resolution pixels the growth adds around the tissue
    assert reader.has_tissue(1100 + reach - 1, 1400, 0, 2048)
    assert not reader.has_tissue(1100 + reach, 1400, 0, 2048)
    assert reader.has_tissue(0, 1001, 600 - reach, 600 - reach + 1)  # one pixel of it
    assert not reader.has_tissue(0, 2048, 0, 600 - reach)
    reader.close()
    plain = RegionReader(tmp_path / "slide.tif", glass_tolerance=0.0)
    assert plain.tissue is None and plain.has_tissue(0, 1, 0, 1)
    plain.close()
    tifffile.imwrite(tmp_path / "flat.tif", pixels, tile=(128, 128))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pipelines"):
        flat = RegionReader(tmp_path / "flat.tif", glass_tolerance=0.05)
    assert flat.tissue is None and "no reduced level" in caplog.text
    flat.close()


def _run(
    source: Path, folder: HeldFolder, target: str, tolerance: float
) -> tuple[TiledResult, int]:
    """Segment with a net that sees each pixel alone; the result and the windows it saw."""
    seen = []

    def net(tiles: np.ndarray) -> np.ndarray:
        seen.append(len(tiles))
        return np.where(tiles < 0.45, 0.9, 0.1).astype(np.float32)

    try:
        result = segment_tiled(source, folder, target, net, 0.5, 20, WINDOW, OVERLAP, batch=3,
                               glass_tolerance=tolerance)  # fmt: skip
    finally:
        cleanup_resources()
    return result, sum(seen)


def test_windows_over_glass_are_not_run_and_the_label_image_is_the_same(
    tmp_path: Path, synth: ModuleType
) -> None:
    """A synthetic slide of a tenth tissue: most windows are skipped, counted as glass, never
    given to the net; the label image (every level) and the object table equal those of the
    run through every window."""
    (source,) = synth.make_batch(tmp_path / "b", "inference", 1, size=2600, seed=5,
                                 fmt="slide", tissue=0.1)  # fmt: skip
    masks = tmp_path / "masks"
    masks.mkdir()
    with HeldFolder.open(masks) as folder:
        every, every_seen = _run(source, folder, "every.ome.zarr", 0.0)
        skipping, skipping_seen = _run(source, folder, "skip.ome.zarr", 0.05)
    windows = len(starts(2600, WINDOW, WINDOW - OVERLAP)) ** 2
    assert (every.windows_run, every.windows_glass, every_seen) == (windows, 0, windows)
    assert skipping.windows_run == skipping_seen < windows // 3
    assert skipping.windows_run + skipping.windows_glass == windows
    assert skipping.objects > 10 and skipping.table == every.table
    for mine, theirs in zip(zarr_levels(masks / "skip.ome.zarr", f"labels/{LABEL_NAME}"),
                            zarr_levels(masks / "every.ome.zarr", f"labels/{LABEL_NAME}"),
                            strict=True):  # fmt: skip
        np.testing.assert_array_equal(mine, theirs)


def test_a_synthetic_slide_keeps_the_share_of_droplets_asked_in_islands(synth: ModuleType) -> None:
    """``--tissue 0.1``: about a tenth of the cells are droplets, the rest bare glass."""
    cells = synth.tissue_cells(20_000, 3, 0.1)
    assert cells.shape == (157, 157)
    assert cells.mean() == pytest.approx(0.1, abs=0.01)
    from scipy import ndimage

    _, islands = ndimage.label(cells)
    assert islands < 40  # islands, not scattered cells
    assert synth.tissue_cells(300, 3, 1.0).all()


@pytest.mark.parametrize("count", [2, 3, 7, 40])
def test_regions_share_the_windows_to_run_not_the_rows(count: int) -> None:
    """With a tissue mask, a slide's regions are cut where the windows the net will run are
    shared evenly (glass rows cost nothing): whole chunk rows, in order, covering the image,
    each region's work within one chunk row's of an even share."""
    work = np.array([0, 0, 12, 30, 3, 0, 0, 0, 0, 9, 14, 0, 0, 1])
    height = len(work) * CHUNK - 100
    spans = [region_rows(height, i, count, work) for i in range(count)]
    assert spans[0][0] == 0 and spans[-1][1] == height
    assert all(a[1] == b[0] for a, b in pairwise(spans))
    assert all(first % CHUNK == 0 and first <= end for first, end in spans)
    shares = [int(work[first // CHUNK : -(-end // CHUNK)].sum()) for first, end in spans]
    assert sum(shares) == work.sum()
    assert max(shares) <= work.sum() / count + work.max()
    even = [region_rows(height, i, count) for i in range(count)]
    assert even == [region_rows(height, i, count, np.zeros_like(work)) for i in range(count)]
