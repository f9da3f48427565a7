"""Reading inputs (PNG/TIFF, 8/16-bit, grey/RGB, checksums) and writing masks."""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import imagecodecs
import numpy as np
import pytest
import tifffile
from PIL import Image, PngImagePlugin

from daemon.contract.heldfolder import HeldFolder
from daemon.contract.jobspec import InputFile
from pipelines import images
from pipelines.images import (
    UnreadableImage,
    decode,
    encode_mask,
    held_still,
    open_item,
    read_bounded,
    read_image,
    write_mask,
)
from pipelines.job import InputError
from pipelines.layout import mask_name

RAMP8 = np.arange(48 * 32, dtype=np.uint32).reshape(32, 48).astype(np.uint8)
RAMP16 = (np.arange(48 * 32, dtype=np.uint32).reshape(32, 48) * 40).astype(np.uint16)
NOISE = np.random.default_rng(0).integers(0, 256, (64, 64), dtype=np.uint8)


def png(pixels: np.ndarray, mode: str | None = None, bits: int | None = None) -> bytes:
    buffer = io.BytesIO()
    image = Image.fromarray(pixels)
    image = image.convert(mode) if mode else image
    image.save(buffer, format="PNG", **({"bits": bits} if bits else {}))
    return buffer.getvalue()


def grey_palette_png(pixels: np.ndarray) -> bytes:
    image = Image.frombytes("P", (pixels.shape[1], pixels.shape[0]), pixels.tobytes())
    image.putpalette([value for level in range(256) for value in (level, level, level)])
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def tiff(pixels: np.ndarray, **options: object) -> bytes:
    buffer = io.BytesIO()
    tifffile.imwrite(buffer, pixels, **options)  # type: ignore[arg-type]
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (png(RAMP8), RAMP8 / 255),
        (png(RAMP16), RAMP16 / 65535),
        (tiff(RAMP8), RAMP8 / 255),
        (tiff(RAMP16), RAMP16 / 65535),
        (tiff(255 - RAMP8, photometric="miniswhite"), RAMP8 / 255),
    ],
    ids=["png8", "png16", "tif8", "tif16", "tif-miniswhite"],
)
def test_grey_images_are_scaled_by_their_integer_range(data: bytes, expected: np.ndarray) -> None:
    pixels = decode(data)
    assert pixels.dtype == np.float32 and pixels.shape == (32, 48)
    np.testing.assert_allclose(pixels, expected, atol=1e-6)


@pytest.mark.parametrize(
    "data",
    [
        png(np.stack([RAMP8] * 3, axis=-1)),
        png(np.stack([RAMP8] * 3, axis=-1), mode="RGBA"),
        png(RAMP8, mode="LA"),
        grey_palette_png(RAMP8),
        tiff(np.stack([RAMP8] * 3, axis=-1), photometric="rgb"),
        tiff(np.stack([RAMP8] * 3), photometric="rgb", planarconfig="separate"),
    ],
    ids=["png-rgb", "png-rgba", "png-la", "png-palette", "tif-rgb", "tif-rgb-planar"],
)
def test_colour_images_become_grey(data: bytes) -> None:
    """A grey picture stored as RGB/RGBA/palette reads back as the same grey values."""
    np.testing.assert_allclose(decode(data), RAMP8 / 255, atol=2 / 255)


def png_with(pixels: np.ndarray, mode: str, chunks: dict[bytes, bytes], **options: object) -> bytes:
    info = PngImagePlugin.PngInfo()
    for kind, body in chunks.items():
        info.add(kind, body)
    buffer = io.BytesIO()
    image = Image.fromarray(pixels).convert(mode)
    image.save(buffer, format="PNG", pnginfo=info, **options)
    return buffer.getvalue()


GAMMA = {b"gAMA": (45455).to_bytes(4, "big"), b"sBIT": bytes([5])}
SPOTS = np.random.default_rng(3).integers(0, 256, (37, 53), dtype=np.uint8)


@pytest.mark.parametrize(
    ("data", "libpng"),
    [
        (png(SPOTS), True),
        (png(RAMP16), True),
        (png(SPOTS, mode="LA"), True),
        (png(np.stack([SPOTS, 255 - SPOTS, SPOTS // 2], axis=-1)), True),
        (png(np.stack([SPOTS, 255 - SPOTS, SPOTS // 2], axis=-1), mode="RGBA"), True),
        (png_with(SPOTS, "L", GAMMA), True),
        (png_with(SPOTS, "L", {}, transparency=7), False),  # libpng adds an alpha channel
        (png_with(SPOTS, "L", {}, optimize=True), True),
        (imagecodecs.png_encode(np.stack([RAMP16, RAMP16 // 3, RAMP16 // 7], axis=-1)), False),
        (grey_palette_png(SPOTS), False),
    ],
    ids=[
        "grey8",
        "grey16",
        "grey-alpha",
        "rgb8",
        "rgba8",
        "gamma-sbit",
        "trns",
        "optimized",
        "rgb16",
        "palette",
    ],
)
def test_pngs_decode_to_the_pixels_pillow_gives(data: bytes, libpng: bool) -> None:
    """The PNGs libpng decodes (one call: a worker's largest cost per image) come out as
    Pillow's pixels, value for value; the others are left to Pillow."""
    assert (images._decode_png_libpng(data, data[24]) is not None) is libpng
    with Image.open(io.BytesIO(data)) as opened:
        opened.load()
        expected = np.array(opened.convert("RGB") if opened.mode == "P" else opened)
    if expected.dtype.itemsize > 1:
        expected = expected.astype(np.uint16)
    found = images._decode_png(data)
    assert found.dtype == expected.dtype and found.shape == expected.shape
    assert np.array_equal(found, expected)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "empty"),
        (b"name,area\nimg_1,42\n", "not a PNG or TIFF"),
        (png(NOISE)[:2000], "cannot be decoded as PNG"),
        (png(RAMP8 > 100), "1-bit PNG"),
        (tiff(NOISE)[:2000], "cannot be decoded as TIFF"),
        (tiff(RAMP8.astype(np.float32)), "32-bit"),
        (tiff(np.stack([RAMP8, RAMP8])), "2 pages"),
        (
            tiff(np.zeros((32, 48, 5), np.uint8), photometric="minisblack", planarconfig="contig"),
            "shape",
        ),
    ],
    ids=[
        "empty",
        "text",
        "truncated-png",
        "1bit-png",
        "truncated-tif",
        "float-tif",
        "stack",
        "5ch",
    ],
)
def test_unusable_files_raise_a_readable_reason(data: bytes, message: str) -> None:
    with pytest.raises(UnreadableImage) as caught:
        decode(data)
    assert message in caught.value.message
    assert caught.value.hint


def test_read_image_names_the_file_and_checks_the_sha256(tmp_path: Path) -> None:
    data = png(RAMP8)
    (tmp_path / "plate 1").mkdir()
    (tmp_path / "plate 1" / "ä b.png").write_bytes(data)
    good = InputFile("plate 1/ä b.png", len(data), hashlib.sha256(data).hexdigest())
    assert read_image(tmp_path, good).shape == (32, 48)
    wrong = InputFile("plate 1/ä b.png", len(data), "9b1c" + "0" * 60)
    with pytest.raises(InputError) as caught:
        read_image(tmp_path, wrong)
    (problem,) = caught.value.problems
    assert problem.where == "input 'plate 1/ä b.png'"
    assert problem.message.startswith("sha256 is ") and "expected 9b1c" in problem.message
    assert "copy it again" in problem.hint


def test_a_small_ndpi_is_read_whole_by_its_name_and_its_mask_is_a_tiff(
    tmp_path: Path, synth: ModuleType
) -> None:
    """An NDPI under max_whole_pixels is decoded whole (its largest level, not its macro
    image); its mask is named after it with .tif added."""
    synth.write_slide(tmp_path / "s.ndpi", 600, seed=2, levels=1)
    synth.write_slide(tmp_path / "s.tif", 600, seed=2, levels=0)
    data = (tmp_path / "s.ndpi").read_bytes()
    item = InputFile("s.ndpi", len(data), hashlib.sha256(data).hexdigest())
    pixels = read_image(tmp_path, item)
    assert pixels.shape == (600, 600)
    assert np.abs(pixels - decode((tmp_path / "s.tif").read_bytes())).mean() < 0.01
    assert mask_name("plate/s.ndpi") == "plate/s.ndpi.tif"


def test_corrupt_input_becomes_an_input_problem_not_a_traceback(tmp_path: Path) -> None:
    (tmp_path / "broken.tif").write_bytes(b"II*\x00garbage")
    with pytest.raises(InputError) as caught:
        read_image(tmp_path, InputFile("broken.tif"))
    assert caught.value.problems[0].where == "input 'broken.tif'"
    assert "TIFF" in caught.value.problems[0].message


def test_an_input_written_to_while_read_in_parts_is_an_input_problem(tmp_path: Path) -> None:
    """A large TIFF is hashed, then read window by window: a write in between is caught."""
    (tmp_path / "slide.tif").write_bytes(tiff(RAMP8))
    item = InputFile("slide.tif")
    with open_item(tmp_path, item) as handle, held_still(handle, item):
        assert handle.read(4) == b"II*\x00"  # unchanged: no problem
    with (
        pytest.raises(InputError) as caught,
        open_item(tmp_path, item) as handle,
        held_still(handle, item),
    ):
        handle.read(4)
        with open(tmp_path / "slide.tif", "ab") as writer:
            writer.write(b"more")
    (problem,) = caught.value.problems
    assert problem.render() == (
        "input 'slide.tif': changed while it was being segmented — it was written to while "
        "being read; let the copy finish, then retry the batch"
    )


@pytest.mark.parametrize("name", ["a.png", "a.tif", "a.TIFF"])
def test_masks_are_written_atomically_as_uint8_0_255_in_the_input_format(
    tmp_path: Path, name: str
) -> None:
    mask = np.zeros((20, 30), dtype=bool)
    mask[5:9, 3:17] = True
    path = tmp_path / "masks" / "deep" / name
    with HeldFolder.open(tmp_path) as held, held.folder("masks/deep", create=True) as folder:
        write_mask(folder, name, mask)
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG" if name.endswith(".png") else b"II*\x00")
    if name.endswith(".png"):
        with Image.open(path) as opened:
            raw = np.asarray(opened)
    else:
        raw = tifffile.imread(path)
    assert raw.dtype == np.uint8 and set(np.unique(raw)) == {0, 255}
    assert np.array_equal(raw > 0, mask)
    assert [p.name for p in path.parent.iterdir()] == [name]  # no temporary file left


def test_unknown_mask_format_is_refused() -> None:
    with pytest.raises(KeyError):
        encode_mask(np.zeros((2, 2), bool), ".jpg")


GIB = 2**30


def _peak_rss_mb(batch_dir: Path, relative: str, max_pixels: int) -> tuple[float, str]:
    """How much the peak RSS (MB) of a fresh process grows while it reads ``relative`` as a
    job does (its imports measured first, in the same process), and what the read said (the
    problem, or "read")."""
    code = (
        "import resource, sys\n"
        "from daemon.contract.jobspec import InputFile\n"
        "from pipelines.images import read_bounded\n"
        "from pipelines.job import InputError\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "try:\n"
        f"    read_bounded(sys.argv[1], InputFile(sys.argv[2]), {max_pixels})\n"
        "    said = 'read'\n"
        "except InputError as exc:\n"
        "    said = exc.problems[0].render()\n"
        "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)\n"
        "print(said)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(batch_dir), relative],
        capture_output=True, text=True, check=True, cwd=Path(__file__).parents[2],
    )  # fmt: skip
    peak, said = done.stdout.split("\n", 1)
    return float(peak), said.strip()


def test_a_sparse_file_passed_as_an_image_is_refused_for_what_it_is_without_reading_it(
    tmp_path: Path,
) -> None:
    """4 GiB of holes behind a valid PNG header: refused as sparse, in a few dozen MB."""
    with open(tmp_path / "sparse.png", "wb") as handle:
        handle.write(png(RAMP8))
        handle.truncate(4 * GIB)
    peak, said = _peak_rss_mb(tmp_path, "sparse.png", 2048 * 2048)
    assert said.startswith("input 'sparse.png': is a sparse file: 4 294 ") and "holes" in said
    assert "copy the image again" in said
    assert peak < 64, f"peak RSS grew by {peak:.0f} MB while reading"


def test_a_file_far_larger_than_its_declared_image_is_refused_unread(tmp_path: Path) -> None:
    with open(tmp_path / "padded.png", "wb") as handle:
        handle.write(png(RAMP8))
        handle.write(os.urandom(17 * 2**20))  # written, not sparse
    with pytest.raises(InputError) as caught:
        read_bounded(tmp_path, InputFile("padded.png"), None)
    (problem,) = caught.value.problems
    assert (
        problem.message.startswith("is 17 ") and "more than a 48×32 PNG can hold" in problem.message
    )


def test_an_image_over_max_whole_pixels_names_the_parameter_and_its_value(tmp_path: Path) -> None:
    (tmp_path / "a.png").write_bytes(png(RAMP8))
    with pytest.raises(InputError) as caught:
        read_bounded(tmp_path, InputFile("a.png"), 1)
    (problem,) = caught.value.problems
    assert problem.message == (
        "is 48×32 pixels (1 536), more than params.max_whole_pixels = 1 allows to segment as a whole"
    )
    assert "raise params.max_whole_pixels in the manifest" in problem.hint


def test_a_compressed_tiff_in_strips_larger_than_max_whole_pixels_is_refused_naming_it(
    tmp_path: Path,
) -> None:
    """A single deflate strip must be decoded whole: refused before any pixel is decoded,
    while the same pixels uncompressed (read by rows) or tiled go window by window."""
    pixels = np.zeros((1000, 800), np.uint8)
    tifffile.imwrite(tmp_path / "strip.tif", pixels, compression="zlib", rowsperstrip=1000)
    tifffile.imwrite(tmp_path / "plain.tif", pixels, rowsperstrip=1000)
    tifffile.imwrite(tmp_path / "tiled.tif", pixels, compression="zlib", tile=(256, 256))
    with pytest.raises(InputError) as caught:
        read_bounded(tmp_path, InputFile("strip.tif"), 100_000)
    (problem,) = caught.value.problems
    assert problem.message == (
        "is 800×1000 pixels (800 000), more than params.max_whole_pixels = 100 000 allows to "
        "segment as a whole, and stores them in compressed strips of 800×1000 pixels, each of "
        "which must be decoded at once"
    )
    assert "tiled TIFF" in problem.hint and "params.max_whole_pixels" in problem.hint
    assert read_bounded(tmp_path, InputFile("plain.tif"), 100_000) is None
    assert read_bounded(tmp_path, InputFile("tiled.tif"), 100_000) is None
