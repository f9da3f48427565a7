"""Large images' label images: OME-Zarr that the viewers' reader opens, equal across seams."""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from pathlib import Path

import numpy as np
import pytest
import tifffile
import zarr
from labelimages import zarr_levels
from ome_zarr.io import parse_url
from ome_zarr.reader import Label, Multiscales, Reader
from ome_zarr_models.v04.image import Image
from ome_zarr_models.v04.image_label import ImageLabel
from scipy import ndimage
from zarr.core.sync import cleanup_resources

from daemon.contract.heldfolder import HeldFolder, is_temporary
from pipelines.layout import OBJECT_COLUMNS, objects_csv
from pipelines.omezarr import CHUNK, LABEL_NAME, work_array
from pipelines.tiles import (
    TILE,
    RegionReader,
    RegionRecord,
    TiledResult,
    assemble,
    region_rows,
    segment_region,
    segment_tiled,
    window_cache_rows,
)

MIN_AREA = 30
THRESHOLD = 0.5


def _slide(height: int = 1300, width: int = 1100) -> np.ndarray:
    """Discs everywhere (many on band, chunk and window borders), a diagonal line through
    every band, a U whose arms join only bands below their tops, and specks smaller than
    MIN_AREA; grey values differ per object (the table's mean intensity)."""
    rng = np.random.default_rng(7)
    pixels = np.zeros((height, width), dtype=np.uint8)
    rows, cols = np.ogrid[:height, :width]
    for _ in range(90):
        y, x, r = rng.integers(0, height), rng.integers(0, width), rng.integers(2, 30)
        pixels[(rows - y) ** 2 + (cols - x) ** 2 < r * r] = rng.integers(140, 255)
    for k in range(min(height, width) - 40):
        pixels[20 + k, 20 + k : 23 + k] = 200
    for border in (TILE, CHUNK, 2 * TILE + CHUNK):  # arms cross the border, join below it
        arms = (
            (slice(border - 60, border + 40), slice(700, 706)),
            (slice(border - 60, border + 40), slice(760, 766)),
        )
        for arm in arms:
            pixels[arm] = 180
        pixels[border + 34 : border + 40, 700:766] = 180
    return pixels


def _thresholded(tiles: np.ndarray) -> np.ndarray:
    """A net that sees each pixel alone: the windows' blend is the whole image's answer, so
    any difference from the whole image is the tiling's (seams, band joins, chunk writes)."""
    return np.where(tiles > 0.5, 0.95, 0.05).astype(np.float32)


def _expected(pixels: np.ndarray) -> tuple[np.ndarray, list[dict[str, object]]]:
    """The whole image's labels (small ones removed, ids in raster order) and object rows."""
    labels, _ = ndimage.label(pixels > 127, structure=np.ones((3, 3), dtype=bool))
    areas = np.bincount(labels.ravel())
    kept = areas >= MIN_AREA
    kept[0] = False
    final = np.cumsum(kept) * kept
    grey = pixels / np.float32(255)
    rows = []
    for old, box in enumerate(ndimage.find_objects(labels), start=1):
        if not kept[old]:
            continue
        y, x = (float(c) for c in ndimage.center_of_mass(labels == old))
        rows.append({
            "id": int(final[old]), "area_px": int(areas[old]), "centroid_y": round(y, 2),
            "centroid_x": round(x, 2), "bbox_top": box[0].start, "bbox_left": box[1].start,
            "bbox_bottom": box[0].stop, "bbox_right": box[1].stop,
            "mean_intensity": round(float(grey[labels == old].mean(dtype=np.float64)), 6),
        })  # fmt: skip
    return final[labels].astype(np.uint32), rows


def _segment(folder: HeldFolder, source: Path | io.BytesIO, target: str) -> TiledResult:
    """Segment as a job does (a job's process ends after; here zarr's threads are stopped)."""
    try:
        return segment_tiled(source, folder, target, _thresholded, THRESHOLD, MIN_AREA,
                             window=300, overlap=40, batch=4)  # fmt: skip
    finally:
        cleanup_resources()


@pytest.fixture(scope="module")
def slide(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray, TiledResult]:
    pixels = _slide()
    out = tmp_path_factory.mktemp("slide")
    tifffile.imwrite(out / "slide.tif", pixels, tile=(128, 128), compression="zlib")
    with HeldFolder.open(out) as folder:
        result = _segment(folder, out / "slide.tif", "slide.tif.ome.zarr")
    return out / "slide.tif.ome.zarr", pixels, result


def test_the_label_image_equals_the_whole_images_labels_across_every_seam(
    slide: tuple[Path, np.ndarray, TiledResult],
) -> None:
    """Windows, bands of TILE rows and chunks of CHUNK² cut objects; each object still has one
    id, the whole image's, and a U whose arms meet only further down is one object."""
    path, pixels, result = slide
    expected, rows = _expected(pixels)
    level0 = zarr_levels(path, f"labels/{LABEL_NAME}")[0]
    assert level0.dtype == np.uint32
    np.testing.assert_array_equal(level0, expected)
    assert result.objects == len(rows) == int(expected.max())
    assert result.area == int((expected > 0).sum())


def test_tiles_read_ahead_and_ids_written_behind_on_threads_give_the_same_label_image(
    slide: tuple[Path, np.ndarray, TiledResult], tmp_path: Path
) -> None:
    """Three threads decode the next row of windows' tiles and write chunk rows behind
    the labelling (as the job does): every level, every object row, the same, bit for bit."""
    path, _, result = slide
    with (
        ThreadPoolExecutor(3) as pool,
        HeldFolder.open(tmp_path) as folder,
        closing(
            RegionReader(path.parent / "slide.tif", window_cache_rows({"tile_size": 300}))
        ) as reader,
    ):
        reader.pool = pool
        try:
            threaded = segment_tiled(reader, folder, "t.ome.zarr", _thresholded, THRESHOLD,
                                     MIN_AREA, window=300, overlap=40, batch=4)  # fmt: skip
        finally:
            cleanup_resources()
    assert threaded == result
    mine = zarr_levels(tmp_path / "t.ome.zarr", f"labels/{LABEL_NAME}")
    theirs = zarr_levels(path, f"labels/{LABEL_NAME}")
    assert len(mine) == len(theirs)
    for got, want in zip(mine, theirs, strict=True):
        np.testing.assert_array_equal(got, want)


def test_the_object_table_counts_an_object_crossing_borders_once(
    slide: tuple[Path, np.ndarray, TiledResult],
) -> None:
    _, pixels, result = slide
    _, expected_rows = _expected(pixels)
    assert result.table == [{**row, "mean_intensity": pytest.approx(row["mean_intensity"], abs=2e-6)}
                            for row in expected_rows]  # fmt: skip
    line = next(r for r in result.table if r["bbox_bottom"] - r["bbox_top"] > 1000)
    assert line["bbox_top"] == 20 and line["bbox_left"] == 20  # the diagonal: one object
    text = objects_csv(result.table)
    assert next(csv.reader(io.StringIO(text))) == list(OBJECT_COLUMNS)
    assert len(text.splitlines()) == len(result.table) + 1


def test_ome_zarr_py_reads_an_image_with_its_label_pyramid_valid_ngff_0_4(
    slide: tuple[Path, np.ndarray, TiledResult],
) -> None:
    """What napari's plugin uses finds the overview image and the label image under labels/;
    the NGFF models validate both; each level halves the one above (nearest)."""
    path, pixels, _ = slide
    nodes = list(Reader(parse_url(str(path)))())
    image = next(n for n in nodes if n.load(Multiscales) and not n.load(Label))
    label = next(n for n in nodes if n.load(Label))
    assert image.data[0].shape == pixels.shape  # small enough: the overview is full size
    assert [tuple(level.shape) for level in label.data] == [(1300, 1100), (650, 550), (325, 275)]
    # the values through zarr (the reader's dask arrays would start dask's thread pool)
    assert np.array_equal(zarr_levels(path)[0], pixels)
    levels = zarr_levels(path, f"labels/{LABEL_NAME}")
    for number, level in enumerate(levels[1:], start=1):
        np.testing.assert_array_equal(level, levels[0][:: 2**number, :: 2**number])
    try:
        group = zarr.open_group(str(path), mode="r")
        Image.from_zarr(group)
        validated = ImageLabel.from_zarr(group[f"labels/{LABEL_NAME}"])
        assert validated.attributes.image_label.source.image == "../../"  # type: ignore[union-attr]
        assert dict(group["labels"].attrs) == {"labels": [LABEL_NAME]}
        assert group[f"labels/{LABEL_NAME}/0"].chunks == (CHUNK, CHUNK)
    finally:
        cleanup_resources()


def test_background_chunks_are_not_stored(tmp_path: Path) -> None:
    """Glass costs no file: a slide with one object stores one chunk per level."""
    pixels = np.zeros((2000, 1800), dtype=np.uint8)
    pixels[1100:1140, 1300:1340] = 220
    tifffile.imwrite(tmp_path / "s.tif", pixels, tile=(256, 256), compression="zlib")
    with HeldFolder.open(tmp_path) as folder:
        result = _segment(folder, tmp_path / "s.tif", "s.tif.ome.zarr")
    assert result.objects == 1 and result.table[0]["area_px"] == 1600
    level0 = tmp_path / "s.tif.ome.zarr" / "labels" / LABEL_NAME / "0"
    chunks = [p.relative_to(level0).as_posix() for p in level0.rglob("*") if p.is_file()
              and not p.name.startswith(".")]  # fmt: skip
    assert chunks == ["2/2"]


def test_an_earlier_output_or_a_planted_link_at_the_name_is_replaced_never_followed(
    tmp_path: Path,
) -> None:
    """A run again replaces the label image whole; a link the owner planted at its name is
    removed, not followed (what it points to stays as it was); no temporary is left."""
    pixels = _slide(600, 500)
    tifffile.imwrite(tmp_path / "s.tif", pixels, tile=(128, 128))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("mine")
    masks = tmp_path / "masks"
    masks.mkdir()
    os.symlink(elsewhere, masks / "s.tif.ome.zarr")
    run: Callable[[], TiledResult]
    with HeldFolder.open(masks) as folder:
        run = lambda: _segment(folder, tmp_path / "s.tif", "s.tif.ome.zarr")  # noqa: E731
        first = run()
        assert not (masks / "s.tif.ome.zarr").is_symlink()
        second = run()
    assert (elsewhere / "keep.txt").read_text() == "mine" and len(list(elsewhere.iterdir())) == 1
    assert first.table == second.table
    assert [p.name for p in masks.iterdir() if is_temporary(p.name)] == []
    assert sorted(p.name for p in masks.iterdir()) == ["s.tif.ome.zarr"]


@pytest.mark.parametrize("count", [3, 5], ids=["a-chunk-row-each", "more-regions-than-rows"])
def test_regions_segmented_apart_assemble_into_the_one_task_label_image(
    tmp_path: Path, slide: tuple[Path, np.ndarray, TiledResult], count: int
) -> None:
    """One slide across ``count`` tasks, run in reverse order, each with its own reader and
    its own handle on the shared ids (as separate processes have), records kept as bytes: the
    assembly equals the one-task label image pixel for pixel, and its object table, the
    U-shaped objects whose arms meet below a region border included (seams are the test)."""
    one_task, pixels, single = slide
    source = one_task.parent / "slide.tif"
    records = {}
    try:
        with HeldFolder.open(tmp_path) as folder:
            folder.mkdir("work")
            for index in reversed(range(count)):
                reader = RegionReader(source)
                with folder.folder("work") as work:
                    store, ids = work_array(work, *pixels.shape)
                    try:
                        record = segment_region(reader, _thresholded, THRESHOLD, ids, index,
                                                count, window=300, overlap=40, batch=4)  # fmt: skip
                    finally:
                        store.close()
                        reader.close()
                records[index] = RegionRecord.from_bytes(record.to_bytes())
            with folder.folder("work") as work:
                store, ids = work_array(work, *pixels.shape)
                try:
                    ordered = [records[i] for i in range(count)]
                    result = assemble(ordered, ids, folder, "s.ome.zarr", MIN_AREA, *pixels.shape)
                finally:
                    store.close()
    finally:
        cleanup_resources()
    assert [region_rows(1300, i, count) for i in range(count)][-1][1] == 1300
    labels = zarr_levels(tmp_path / "s.ome.zarr", f"labels/{LABEL_NAME}")
    expected = zarr_levels(one_task, f"labels/{LABEL_NAME}")
    for level, wanted in zip(labels, expected, strict=True):
        np.testing.assert_array_equal(level, wanted)
    assert result.table == single.table
    assert (result.objects, result.area) == (single.objects, single.area)
    assert result.confidence == pytest.approx(single.confidence)
    np.testing.assert_array_equal(zarr_levels(tmp_path / "s.ome.zarr")[0], pixels)
