"""The reader: images read ahead by real DataLoader worker processes come back in order, whole,
as an in-process read gives them, across chunk boundaries and with bad inputs among them."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import tifffile
from PIL import Image

from daemon.contract.jobspec import InputFile
from pipelines.images import read_image_hashed
from pipelines.reader import CHUNK, read_ahead

MAX_PIXELS = 100 * 100


def _folder(batch_dir: Path) -> list[InputFile]:
    """Nine inputs (two chunks and one more): two sizes of grey PNG, a 16-bit RGB TIFF, a cut
    PNG, an unsupported suffix, a TIFF and a PNG too large to decode whole."""
    rng = np.random.default_rng(5)
    images = batch_dir / "images"
    images.mkdir(parents=True)
    for name, shape in (("a.png", (40, 60)), ("b.png", (40, 60)), ("c.png", (72, 48))):
        Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(images / name)
    tifffile.imwrite(images / "d.tif", rng.integers(0, 65536, (50, 30, 3), dtype=np.uint16))
    (images / "cut.png").write_bytes((images / "a.png").read_bytes()[:200])
    (images / "e.jpg").write_bytes(b"\xff\xd8\xff")
    tifffile.imwrite(images / "big.tif", rng.integers(0, 256, (128, 128), dtype=np.uint8))
    Image.fromarray(rng.integers(0, 256, (128, 128), dtype=np.uint8)).save(images / "big.png")
    Image.fromarray(rng.integers(0, 256, (33, 33), dtype=np.uint8)).save(images / "f.png")
    names = ["a.png", "cut.png", "b.png", "d.tif", "e.jpg", "big.tif", "c.png", "big.png", "f.png"]
    return [
        InputFile(f"images/{n}", hashlib.sha256((images / n).read_bytes()).hexdigest())
        for n in names
    ]


@pytest.mark.parametrize("cpus", [1, 3], ids=["in-process", "two-workers"])
def test_read_ahead_gives_every_input_in_order_as_read_in_process(
    tmp_path: Path, cpus: int
) -> None:
    batch_dir = tmp_path / "batch"
    items = _folder(batch_dir)
    assert len(items) > 2 * CHUNK
    loaded = list(read_ahead(batch_dir, items, MAX_PIXELS, cpus))
    assert [each.item for each in loaded] == items
    by_name = {Path(each.item.path).name: each for each in loaded}
    for name in ("a.png", "b.png", "c.png", "d.tif", "f.png"):
        expected, digest = read_image_hashed(batch_dir, by_name[name].item)
        got = by_name[name]
        assert got.pixels is not None and got.pixels.dtype == np.float32
        np.testing.assert_array_equal(got.pixels, expected)
        assert got.sha256 == digest and not got.problems and not got.tiled
    assert "cannot be decoded as PNG" in by_name["cut.png"].problems[0].message
    assert "is a '.jpg' file; watchd reads PNG and TIFF" in by_name["e.jpg"].problems[0].message
    assert by_name["big.tif"].tiled and by_name["big.tif"].pixels is None
    assert "more than params.max_whole_pixels = 10 000" in by_name["big.png"].problems[0].message
    assert all(by_name[n].pixels is None for n in ("cut.png", "e.jpg", "big.png"))
