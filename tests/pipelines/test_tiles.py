"""The window-by-window reader: regions of a TIFF read lazily, as the whole image reads."""

from __future__ import annotations

import io

import numpy as np
import pytest
import tifffile

from pipelines.images import decode
from pipelines.tiles import TILE, RegionReader


@pytest.mark.parametrize("byteorder", ["<", ">"])
@pytest.mark.parametrize(
    ("shape", "rows_per_strip"),
    [((700, 300), 700), ((700, 300, 3), 37), ((513, 77), 513)],
    ids=["one-strip", "rgb-strips", "short"],
)
def test_uncompressed_strips_are_read_a_band_of_rows_at_a_time_as_the_whole_image_reads(
    shape: tuple[int, ...], rows_per_strip: int, byteorder: str
) -> None:
    """A single huge strip (as ImageJ writes) is never decoded whole: regions read by rows
    equal the same region of the whole image, across strip borders, in either byte order."""
    pixels = np.random.default_rng(0).integers(0, 65536, shape, dtype=np.uint16)
    buffer = io.BytesIO()
    photometric = "rgb" if len(shape) == 3 else "minisblack"
    tifffile.imwrite(buffer, pixels, rowsperstrip=rows_per_strip, byteorder=byteorder,
                     photometric=photometric)  # fmt: skip
    whole = decode(buffer.getvalue())
    buffer.seek(0)
    reader = RegionReader(buffer)
    try:
        assert reader.by_rows and reader.seg_h <= TILE
        region = reader.region(10, shape[0] - 3, 5, 70)
    finally:
        reader.close()
    np.testing.assert_allclose(region, whole[10 : shape[0] - 3, 5:70], rtol=1e-6)


def test_a_pyramidal_tiff_is_read_at_its_full_resolution() -> None:
    """A whole-slide pyramid (reduced levels in SubIFDs, as OME-TIFF and QuPath write them)
    is read from its first level, whatever levels follow."""
    pixels = np.random.default_rng(0).integers(0, 255, (600, 900), dtype=np.uint8)
    buffer = io.BytesIO()
    with tifffile.TiffWriter(buffer, ome=True) as tif:
        tif.write(pixels, subifds=2, tile=(256, 256), compression="zlib", metadata={"axes": "YX"})
        for step in (2, 4):
            tif.write(pixels[::step, ::step], subfiletype=1, tile=(256, 256), compression="zlib")
    reader = RegionReader(io.BytesIO(buffer.getvalue()))
    try:
        assert (reader.height, reader.width) == pixels.shape
        assert np.allclose(reader.region(0, 600, 0, 900), pixels / 255.0)
    finally:
        reader.close()


def test_bands_are_regrouped_into_tile_rows_through_one_buffer() -> None:
    """rebanded copies each band it is given before asking for the next, so a producer may
    reuse its array (as probability_bands does): the rows come out in order, TILE at a time."""
    from pipelines.tiles import rebanded

    rows = np.arange(1000 * 3, dtype=np.float32).reshape(1000, 3)
    reused = np.empty((448, 3), dtype=np.float32)

    def produced():
        for top in range(0, 1000, 448):
            band = reused[: min(448, 1000 - top)]
            band[:] = rows[top : top + len(band)]
            yield top, band
            band[:] = -1  # overwritten once the next band is asked for

    out = [band.copy() for band in rebanded(produced())]
    assert [len(band) for band in out] == [TILE, TILE, TILE, 1000 - 3 * TILE]
    assert np.array_equal(np.concatenate(out), rows)
