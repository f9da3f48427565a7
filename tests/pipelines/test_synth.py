"""The synthetic DMA generator: deterministic, realistic enough to fool Otsu, readable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import tifffile
from PIL import Image
from scipy import ndimage
from skimage.filters import threshold_otsu

from pipelines.images import decode

ROOT = Path(__file__).resolve().parents[2]


def test_same_seed_and_index_give_the_same_image(synth: ModuleType) -> None:
    first, again = synth.sample(7, 3, 64), synth.sample(7, 3, 64)
    assert np.array_equal(first.image, again.image)
    assert np.array_equal(first.mask, again.mask)
    assert not np.array_equal(first.image, synth.sample(8, 3, 64).image)


def test_batches_are_byte_identical_per_seed_and_prefix_stable(
    synth: ModuleType, tmp_path: Path
) -> None:
    """A batch of 3 is the first 3 files of a batch of 5 with the same seed."""
    small = synth.make_batch(tmp_path / "a", "training", count=3, size=48, seed=4)
    large = synth.make_batch(tmp_path / "b", "training", count=5, size=48, seed=4)
    by_name = {p.relative_to(tmp_path / "b"): p.read_bytes() for p in large}
    assert len(small) == 6 and len(large) == 10
    for path in small:
        assert path.read_bytes() == by_name[path.relative_to(tmp_path / "a")]


def test_masks_mark_the_spheroids_and_some_images_have_none_or_two(synth: ModuleType) -> None:
    samples = [synth.sample(0, i, 96) for i in range(64)]
    counts = [s.spheroids for s in samples]
    assert {0, 1, 2} <= set(counts)
    for drawn in samples:
        assert drawn.mask.any() == (drawn.spheroids > 0)
        assert drawn.image.dtype == np.float32 and 0 <= drawn.image.min() <= drawn.image.max() <= 1
        if drawn.spheroids:
            ring = drawn.image.max()
            assert drawn.image[drawn.mask].mean() < 0.7 * ring  # darker than the rim


def test_a_global_otsu_threshold_does_not_find_the_spheroids(synth: ModuleType) -> None:
    """The bright rim and the background pull Otsu away from the spheroid: IoU stays low."""
    ious = []
    for index in range(16):
        drawn = synth.sample(1, index, 128)
        if not drawn.spheroids:
            continue
        dark = drawn.image < threshold_otsu(drawn.image)
        ious.append((dark & drawn.mask).sum() / (dark | drawn.mask).sum())
    assert np.median(ious) < 0.5


@pytest.mark.parametrize(("fmt", "bits"), [("png", 8), ("png", 16), ("tif", 8), ("tif", 16)])
def test_formats_and_bit_depths_are_written_and_read_back(
    synth: ModuleType, tmp_path: Path, fmt: str, bits: int
) -> None:
    files = synth.make_batch(tmp_path, "training", count=2, size=40, seed=2, fmt=fmt, bits=bits)
    image_path = tmp_path / "images" / f"img_0001.{fmt}"
    mask_path = tmp_path / "masks" / f"img_0001.{fmt}"
    assert image_path in files and mask_path in files
    if fmt == "png":
        with Image.open(image_path) as opened:
            raw = np.asarray(opened)
    else:
        raw = tifffile.imread(image_path)
    assert raw.dtype == (np.uint8 if bits == 8 else np.uint16) and raw.shape == (40, 40)
    expected = synth.sample(2, 1, 40)
    assert np.abs(decode(image_path.read_bytes()) - expected.image).max() <= 1 / 255
    assert np.array_equal(decode(mask_path.read_bytes()) > 0, expected.mask)


def test_inference_batches_have_no_masks_unless_truth_is_asked_for(
    synth: ModuleType, tmp_path: Path
) -> None:
    files = synth.make_batch(tmp_path / "batch", "inference", 3, 32, truth_dir=tmp_path / "truth")
    assert [p.relative_to(tmp_path / "batch").as_posix() for p in files] == [
        "images/img_0000.png",
        "images/img_0001.png",
        "images/img_0002.png",
    ]
    assert not (tmp_path / "batch" / "masks").exists()
    assert sorted(p.name for p in (tmp_path / "truth").iterdir()) == [p.name for p in files]


def test_command_line_writes_a_batch(tmp_path: Path) -> None:
    out = tmp_path / "drop folder"
    completed = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "synth.py"),
            str(out),
            "--kind",
            "training",
            "--count",
            "2",
            "--size",
            "32",
            "--format",
            "tif",
            "--bits",
            "16",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    assert "wrote 4 files" in completed.stdout
    assert tifffile.imread(out / "images" / "img_0001.tif").dtype == np.uint16


def test_a_slide_is_a_pyramidal_tiled_tiff_of_droplets(tmp_path: Path, synth: ModuleType) -> None:
    """``--format slide``: a tiled TIFF with reduced levels in SubIFDs, each level the one
    above halved, level 0 the droplets of the seed in row-major order."""
    (path,) = synth.make_batch(tmp_path, "inference", 1, size=700, seed=3, fmt="slide")
    assert path.name == "slide_0000.tif"
    with tifffile.TiffFile(path) as tif:
        assert tif.pages[0].is_tiled
        levels = [level.asarray() for level in tif.series[0].levels]
    assert [level.shape for level in levels] == [(700, 700)]  # 700 < 1024: no reduced level
    synth.write_slide(path, 700, seed=3, levels=2)
    with tifffile.TiffFile(path) as tif:
        levels = [level.asarray() for level in tif.series[0].levels]
    assert [level.shape for level in levels] == [(700, 700), (350, 350), (175, 175)]
    for number, level in enumerate(levels[1:], start=1):
        assert np.array_equal(level, levels[0][:: 2**number, :: 2**number])
    across = 6  # droplets of 128 across 700 pixels
    second_row = synth.to_integer(synth.sample(3, across, 128).image, 8)
    assert np.array_equal(levels[0][128:256, :128], second_row)


def test_an_ndpi_slide_is_a_hamamatsu_pyramid_read_a_restart_interval_at_a_time(
    tmp_path: Path, synth: ModuleType
) -> None:
    """``--format ndpi``: tifffile knows it as an NDPI (64-bit offsets, Hamamatsu's tags), its
    levels reduced by four, then the macro image; each level one JPEG whose restart intervals
    are its tiles, each decoded alone as it is in the whole; the droplets those of the grey
    slide but for what JPEG changed."""
    (path,) = synth.make_batch(tmp_path, "inference", 1, size=600, seed=4, fmt="ndpi")
    assert path.name == "slide_0000.ndpi"
    synth.write_slide(path, 1100, seed=4, levels=2, tissue=0.3)
    synth.write_slide(tmp_path / "slide.tif", 1100, seed=4, levels=0, tissue=0.3)
    with tifffile.TiffFile(path) as tif:
        assert tif.is_ndpi and tif.pages[0].ndpi_tags["Magnification"] == 20.0
        pyramid, macro = tif.series
        assert [level.shape for level in pyramid.levels] == [(1100, 1100, 3), (275, 275, 3)]
        assert macro.name == "Macro" and macro.shape == (275, 412, 3)
        page = pyramid.levels[0].pages[0]
        assert (page.tilelength, page.tilewidth, len(page.dataoffsets)) == (16, 368, 69 * 3)
        whole = page.asarray()
        handle = tif.filehandle
        for index in (0, 100, 206):  # the first tile, one inside, the last (cut at the edge)
            handle.seek(page.dataoffsets[index])
            data = handle.read(page.databytecounts[index])
            tile = page.decode(data, index, jpegheader=page.jpegheader)[0][0]
            row, col = divmod(index, 3)
            part = whole[16 * row : 16 * row + 16, 368 * col : 368 * col + 368]
            assert np.array_equal(tile[: part.shape[0], : part.shape[1]], part)
    grey = tifffile.imread(tmp_path / "slide.tif").astype(int)
    assert np.abs(whole[..., 0].astype(int) - grey).mean() < 3
    with pytest.raises(ValueError, match="65,535"):
        synth.write_slide(tmp_path / "big.ndpi", 70_000, seed=4, levels=1)


def test_a_strip_of_a_slide_is_its_rows_with_their_own_levels(
    tmp_path: Path, synth: ModuleType
) -> None:
    """``rows``: that strip of the size² slide, as wide as the slide, its own reduced levels;
    densest_rows finds the strip with the most tissue."""
    whole, strip = tmp_path / "whole.tif", tmp_path / "strip.tif"
    synth.write_slide(whole, 1100, seed=4, levels=2, tissue=0.3)
    first = synth.densest_rows(1100, 4, 0.3, 384)
    assert first % 128 == 0 and 0 <= first <= 1100 - 384
    synth.write_slide(strip, 1100, seed=4, levels=2, tissue=0.3, rows=(first, 384))
    with tifffile.TiffFile(whole) as tif:
        full = tif.series[0].levels[0].asarray()
    with tifffile.TiffFile(strip) as tif:
        levels = [level.asarray() for level in tif.series[0].levels]
    assert [level.shape for level in levels] == [(384, 1100), (192, 550), (96, 275)]
    assert np.array_equal(levels[0], full[first : first + 384])
    assert np.array_equal(levels[2], levels[0][::4, ::4])
    with pytest.raises(ValueError, match="multiple of 128"):
        synth.write_slide(strip, 1100, seed=4, rows=(100, 384))


def test_an_ome_zarr_slide_holds_the_tiffs_levels_and_ome_zarr_py_reads_it(
    tmp_path: Path, synth: ModuleType
) -> None:
    """``--format ome-zarr``: a folder that ome-zarr-py's reader takes for an image (NGFF 0.4:
    t, c, z, y, x; its channel named), its levels the TIFF slide's levels pixel for pixel."""
    import zarr
    from ome_zarr.io import parse_url
    from ome_zarr.reader import Multiscales, Reader
    from zarr.core.sync import cleanup_resources

    (path,) = synth.make_batch(tmp_path, "inference", 1, size=600, seed=4, fmt="ome-zarr")
    assert path.name == "slide_0000.ome.zarr" and path.is_dir()
    synth.write_slide(tmp_path / "slide.tif", 600, seed=4)
    try:
        (node,) = list(Reader(parse_url(str(path)))())
        assert node.load(Multiscales) is not None
        assert [a["name"] for a in node.metadata["axes"]] == ["t", "c", "z", "y", "x"]
        assert node.metadata["channel_names"] == ["Brightfield"]
        with tifffile.TiffFile(tmp_path / "slide.tif") as tif:
            levels = [level.asarray() for level in tif.series[0].levels]  # (its SubIFDs)
        assert [d.shape[-2:] for d in node.data] == [level.shape for level in levels]
        group = zarr.open_group(str(path), mode="r")  # (the pixels without dask's threads)
        for number, level in enumerate(levels):
            assert np.array_equal(group[str(number)][0, 0, 0], level)
    finally:
        cleanup_resources()
    assert not list(tmp_path.glob("images/.*"))  # built under a hidden name, renamed whole


def test_another_microscope_shows_the_same_scene_and_the_defaults_stay_as_they_were(
    synth: ModuleType,
) -> None:
    """Light, noise and contrast knobs change the picture, not the spheroids; a knob at 0 draws
    nothing (the image of before, byte for byte)."""
    for index in range(6):
        plain = synth.sample(5, index, 64)
        assert np.array_equal(synth.sample(5, index, 64, synth.Look()).image, plain.image)
        for look in (synth.Look(illumination=0.4), synth.Look(noise=0.05),
                     synth.Look(contrast=0.6)):  # fmt: skip
            shifted = synth.sample(5, index, 64, look)
            assert np.array_equal(shifted.mask, plain.mask)
            assert not np.array_equal(shifted.image, plain.image)
            assert 0 <= shifted.image.min() <= shifted.image.max() <= 1
    with pytest.raises(ValueError, match="noise must be within 0 and 1"):
        synth.Look(noise=2)


def test_touching_spheroids_are_two_ids_in_contact_and_label_masks_keep_them(
    synth: ModuleType, tmp_path: Path
) -> None:
    eight = np.ones((3, 3), dtype=bool)
    for index in range(10):
        drawn = synth.sample(4, index, 96, synth.Look(touching=1.0))
        assert drawn.spheroids == 2 and set(np.unique(drawn.labels)) == {0, 1, 2}
        assert np.array_equal(drawn.mask, drawn.labels > 0)
        assert ndimage.label(drawn.mask, eight)[1] == 1  # in contact: one blob of pixels
    synth.make_batch(tmp_path, "training", 3, 96, seed=4, look=synth.Look(touching=1.0),
                     labels=True)  # fmt: skip
    with Image.open(tmp_path / "masks" / "img_0001.png") as opened:
        assert set(np.unique(np.asarray(opened))) == {0, 1, 2}


def test_the_command_line_takes_the_knobs_and_refuses_a_strength_out_of_range(
    tmp_path: Path,
) -> None:
    script = str(ROOT / "scripts" / "synth.py")
    made = subprocess.run([sys.executable, script, str(tmp_path / "a"), "--count", "2", "--size",
                           "48", "--touching", "1", "--noise", "0.05", "--labels"],
                          capture_output=True, text=True, check=False)  # fmt: skip
    assert made.returncode == 0, made.stderr
    with Image.open(tmp_path / "a" / "masks" / "img_0000.png") as opened:
        assert np.asarray(opened).max() == 2
    refused = subprocess.run([sys.executable, script, str(tmp_path / "b"), "--contrast", "3"],
                             capture_output=True, text=True, check=False)  # fmt: skip
    assert refused.returncode == 2 and "contrast must be within 0 and 1, not 3.0" in refused.stderr
