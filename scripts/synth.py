"""Synthetic Droplet Microarray (DMA) images with ground-truth spheroid masks.

Each image is one droplet seen from above: a circular droplet on a textured background, its
edge a bright reflective rim (brighter than anything else in the image, so a global Otsu
threshold picks the rim, not the spheroid), and inside it zero, one or two darker irregular
spheroids of varied size, shape and contrast; then vignetting, blur and noise. The mask marks
the spheroids.

Image ``i`` of seed ``s`` depends only on ``(s, i, size)``: a batch of 10 is the first 10
images of a batch of 100.

Usage::

    python scripts/synth.py OUT --kind training --count 64 --size 128 --seed 0 \
        [--format png|tif|ome-tif|slide|svs|ndpi|ome-zarr] [--bits 8|16] [--truth DIR] \
        [--tissue 0.1] [--labels] [--illumination A] [--noise N] [--contrast C] [--touching T]

Another microscope (``--illumination``, ``--noise``, ``--contrast``: uneven light, sensor noise,
another camera curve) and spheroids in contact (``--touching``: the share of images whose
spheroids are two that touch) are knobs of :mod:`microscope`, 0 by default: at 0 the images are
the same, byte for byte, and a knob draws from a stream of its own (image ``i`` is the same
scene under another look). ``--labels`` writes each spheroid's id (1, 2, …) in the masks instead
of 255, so that two in contact are two objects of the ground truth.

``ome-tif`` writes each image as a three-channel OME-TIFF, as a fluorescence microscope does:
``DAPI`` and ``RFP`` planes beside the ``GFP`` plane that holds the droplet (segment it with
``[params] channel = "GFP"``); masks stay single-channel.

``slide`` (inference only) writes each image as a whole-slide image of ``--size``² pixels: a
grid of droplets of 128² (image ``i`` of the slide's seed in row-major order), an 8-bit tiled
(256²), deflate-compressed TIFF with reduced levels in SubIFDs down to about 1024 pixels across,
as scanners and QuPath write pyramids; written tile by tile, so any size fits in memory.
``--tissue 0.1`` keeps a tenth of the droplets, in islands, the rest bare glass. ``svs``
writes the same slide as an Aperio scanner does (RGB, JPEG tiles, a thumbnail, levels reduced
by four in pages of their own; needs imagecodecs). ``ndpi`` writes it in the layout of a
Hamamatsu NDPI (:func:`write_ndpi`), ``ome-zarr`` as an OME-Zarr image (:func:`write_ome_zarr`:
the TIFF's levels, pixel for pixel, as a store of chunks in a folder ``*.ome.zarr``). Larger
than ``max_whole_pixels``, it is segmented window by window into an OME-Zarr label image.

Training batches get ``OUT/images/`` and ``OUT/masks/``; inference batches ``OUT/images/``
(and the masks in ``--truth DIR`` if given, for evaluation).
"""

from __future__ import annotations

import argparse
import io
import math
import struct
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tifffile
from PIL import Image
from scipy import ndimage

sys.path.insert(0, str(Path(__file__).resolve().parent))
from microscope import DEFAULT, Look, shifted

KINDS = ("training", "inference")
FORMATS = {"png": ".png", "tif": ".tif", "ome-tif": ".ome.tif", "slide": ".tif", "svs": ".svs",
           "ndpi": ".ndpi", "ome-zarr": ".ome.zarr"}  # fmt: skip
SLIDES = ("slide", "svs", "ndpi", "ome-zarr")  # the formats of whole-slide images
CHANNELS = ("DAPI", "GFP", "RFP")  # ome-tif: the droplet is the GFP plane
CELL = 128  # slide: one droplet
SLIDE_TILE = 256  # slide: its TIFF tiles
GLASS = 0.92  # slide: the grey of bare glass (bright field)
SPHEROID_COUNTS = (0, 1, 2)
SPHEROID_ODDS = (0.12, 0.73, 0.15)


@dataclass(frozen=True)
class Sample:
    """One synthetic image (float32 grey in [0, 1]), its spheroid mask and the spheroids' ids
    (``labels``: 0 outside, 1, 2, … each spheroid: two in contact are told apart)."""

    image: np.ndarray
    mask: np.ndarray
    spheroids: int
    labels: np.ndarray


def _smooth_noise(rng: np.random.Generator, size: int, sigma: float) -> np.ndarray:
    """Gaussian-filtered white noise scaled to unit standard deviation."""
    field = ndimage.gaussian_filter(rng.standard_normal((size, size), dtype=np.float32), sigma)
    return field / (field.std() + 1e-6)


def _blob(
    rng: np.random.Generator,
    yy: np.ndarray,
    xx: np.ndarray,
    centre: tuple[float, float],
    radius: float,
) -> np.ndarray:
    """Mask of an irregular blob: a circle whose radius wobbles with a few harmonics."""
    dy, dx = yy - centre[0], xx - centre[1]
    angle = np.arctan2(dy, dx)
    wobble = np.ones_like(angle)
    for harmonic in range(2, 6):
        wobble += rng.uniform(0, 0.2 / harmonic) * np.cos(harmonic * angle + rng.uniform(0, 7))
    return np.hypot(dy, dx) < radius * wobble


def _place_spheroids(
    rng: np.random.Generator, yy: np.ndarray, xx: np.ndarray, droplet: np.ndarray, radius: float
) -> np.ndarray:
    """Ids (uint8, 0 outside) of 0–2 spheroids placed inside the droplet without touching."""
    count = int(rng.choice(SPHEROID_COUNTS, p=SPHEROID_ODDS))
    labels = np.zeros(yy.shape, dtype=np.uint8)
    placed: list[tuple[float, float, float]] = []
    for _ in range(count):
        size = rng.uniform(0.15, 0.45) * radius * (0.7 if count == 2 else 1.0)
        for _attempt in range(20):
            reach = max(radius - 1.35 * size, 0.0)
            offset, angle = rng.uniform(0, reach), rng.uniform(0, 2 * np.pi)
            cy, cx = droplet[0] + offset * np.sin(angle), droplet[1] + offset * np.cos(angle)
            if all(np.hypot(cy - y, cx - x) > 1.3 * (size + r) for y, x, r in placed):
                placed.append((cy, cx, size))
                blob = _blob(rng, yy, xx, (cy, cx), size)
                labels[blob & (labels == 0)] = len(placed)
                break
    return labels


def touching_pair(
    rng: np.random.Generator, yy: np.ndarray, xx: np.ndarray, droplet: np.ndarray, radius: float
) -> np.ndarray:
    """Ids (uint8) of two spheroids in contact near the droplet's centre: their centres as far
    apart as their radii's sum or up to 15 % closer, closer still until their outlines meet
    (wobbly outlines may part); a pixel of both goes to the one it is deeper inside (by
    distance over radius)."""
    sizes = rng.uniform(0.2, 0.45, 2) * radius * 0.7
    angle = rng.uniform(0, 2 * np.pi)
    direction = np.array([np.sin(angle), np.cos(angle)])
    shift = rng.uniform(-0.1, 0.1, 2) * radius
    shapes = rng.integers(2**32, size=2)  # each outline's wobble, the same at every try
    closeness = rng.uniform(0.85, 1.0)
    while closeness > 0:
        gap = closeness * sizes.sum()
        centres = [droplet + shift + direction * gap * (s / sizes.sum()) * sign
                   for s, sign in zip(sizes[::-1], (-1, 1), strict=True)]  # fmt: skip
        blobs = [_blob(np.random.default_rng(shape), yy, xx, (c[0], c[1]), s)
                 for shape, c, s in zip(shapes, centres, sizes, strict=True)]  # fmt: skip
        if (ndimage.binary_dilation(blobs[0], np.ones((3, 3))) & blobs[1]).any():
            break
        closeness -= 0.03
    depth = [np.hypot(yy - c[0], xx - c[1]) / s for c, s in zip(centres, sizes, strict=True)]
    labels = np.zeros(yy.shape, dtype=np.uint8)
    labels[blobs[0]] = 1
    labels[blobs[1] & (~blobs[0] | (depth[1] < depth[0]))] = 2
    return labels


def synth_sample(
    rng: np.random.Generator,
    size: int,
    look: Look = DEFAULT,
    other: np.random.Generator | None = None,
) -> Sample:
    """Draw one DMA-like image of ``size``×``size`` pixels and its spheroid mask; ``look``'s
    knobs (:mod:`microscope`) draw from ``other``, so the default draws stay as they are."""
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    background = rng.uniform(0.22, 0.38)
    image = background + 0.03 * _smooth_noise(rng, size, size / 12)
    image += 0.015 * _smooth_noise(rng, size, 1.0)
    droplet = size / 2 + rng.uniform(-0.05, 0.05, 2) * size
    radius = rng.uniform(0.34, 0.43) * size
    distance = np.hypot(yy - droplet[0], xx - droplet[1])
    inside = ndimage.gaussian_filter((distance < radius).astype(np.float32), 1.0)
    image += inside * rng.uniform(0.1, 0.2)
    labels = _place_spheroids(rng, yy, xx, droplet, radius)
    if look.touching and other is not None and other.random() < look.touching:
        labels = touching_pair(other, yy, xx, droplet, radius)
    mask = labels > 0
    if mask.any():
        texture = 1 + 0.12 * _smooth_noise(rng, size, 1.5)
        contrast = rng.uniform(0.1, 0.3)
        soft = ndimage.gaussian_filter(mask.astype(np.float32), rng.uniform(0.6, 1.4))
        image -= contrast * soft * texture
    # The reflective rim: a thin ring, brightest on the side facing the light.
    angle = np.arctan2(yy - droplet[0], xx - droplet[1])
    glare = 0.75 + 0.25 * np.cos(angle - rng.uniform(0, 2 * np.pi))
    ring = np.exp(-(((distance - radius) / (rng.uniform(0.012, 0.025) * size)) ** 2))
    image = np.maximum(image, rng.uniform(0.88, 0.98) * glare * ring + image * (1 - ring))
    vignette = 1 - rng.uniform(0, 0.25) * (np.hypot(yy - size / 2, xx - size / 2) / size) ** 2
    image = ndimage.gaussian_filter(image * vignette, rng.uniform(0.5, 1.0))
    image += rng.normal(0, rng.uniform(0.004, 0.02), image.shape)
    pixels = np.clip(image, 0, 1).astype(np.float32)
    if look.shifts and other is not None:
        pixels = shifted(other, pixels, look)
    return Sample(image=pixels, mask=mask, spheroids=int(labels.max()), labels=labels)


def sample(seed: int, index: int, size: int = 128, look: Look = DEFAULT) -> Sample:
    """Image ``index`` of the stream for ``seed``, as ``look`` shows it."""
    other = None if look == DEFAULT else np.random.default_rng([seed, index, 1])
    return synth_sample(np.random.default_rng([seed, index]), size, look, other)


def to_integer(image: np.ndarray, bits: int) -> np.ndarray:
    """Quantise a [0, 1] float image to uint8 or uint16."""
    dtype = {8: np.uint8, 16: np.uint16}[bits]
    return np.round(image * np.iinfo(dtype).max).astype(dtype)


def write_image(path: Path, pixels: np.ndarray, channels: bool = False) -> None:
    """Write an integer (H, W) array as PNG or TIFF, chosen by the file suffix; ``channels``:
    an ``.ome.tif`` holds it as the GFP plane of :data:`CHANNELS`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".png":
        Image.fromarray(pixels).save(path, format="PNG")
    elif channels and path.name.endswith(".ome.tif"):
        top = np.iinfo(pixels.dtype).max
        planes = np.stack([pixels // 3, pixels, top - pixels])  # DAPI, GFP, RFP
        metadata = {"axes": "CYX", "Channel": {"Name": list(CHANNELS)}}
        tifffile.imwrite(path, planes, ome=True, metadata=metadata, photometric="minisblack")
    else:
        tifffile.imwrite(path, pixels, photometric="minisblack")


def tissue_cells(size: int, seed: int, tissue: float) -> np.ndarray:
    """Which droplet cells of a slide hold tissue (the others are glass): all for ``tissue``
    1, else islands of about that share of the cells (a smooth random field's highest)."""
    across = -(-size // CELL)
    if tissue >= 1:
        return np.ones((across, across), dtype=bool)
    field = _smooth_noise(np.random.default_rng([seed, across]), across, max(across / 12, 1.0))
    return field > np.quantile(field, 1 - tissue)


def _glass(seed: int) -> np.ndarray:
    """A cell of bare glass: bright, with a little sensor noise."""
    noise = np.random.default_rng([seed, 1]).normal(0, 0.01, (CELL, CELL))
    return to_integer(np.clip(GLASS + noise, 0, 1).astype(np.float32), 8)


def slide_tiles(
    size: int, seed: int, step: int = 1, tissue: float = 1.0, rows: tuple[int, int] | None = None
) -> Iterator[np.ndarray]:
    """The slide's 256² tiles at 1/``step`` of its resolution, row-major (the last ones
    cropped), each drawn from the droplets it covers (glass where :func:`tissue_cells` has
    none); ``rows`` (first, count): only that strip of the slide's rows."""
    present, glass = tissue_cells(size, seed, tissue), _glass(seed)
    across, span = -(-size // CELL), SLIDE_TILE * step
    first, count = rows or (0, size)
    end = first + count
    for top in range(first, end, span):
        for left in range(0, size, span):
            height, width = min(span, end - top), min(span, size - left)
            region = np.zeros((span, span), dtype=np.uint8)
            for dy in range(0, height, CELL):
                for dx in range(0, width, CELL):
                    row, col = (top + dy) // CELL, (left + dx) // CELL
                    drawn = (to_integer(sample(seed, row * across + col, CELL).image, 8)
                             if present[row, col] else glass)  # fmt: skip
                    region[dy : dy + CELL, dx : dx + CELL] = drawn
            yield region[:height:step, :width:step]


def densest_rows(size: int, seed: int, tissue: float, count: int) -> int:
    """The first of the ``count`` rows of the size² slide that hold the most tissue (a
    multiple of the droplet cell): the strip where a job's bands are fullest."""
    cells = max(1, count // CELL)
    per_row = tissue_cells(size, seed, tissue).sum(axis=1)
    return int(np.argmax(np.convolve(per_row, np.ones(cells), "valid"))) * CELL


def write_slide(
    path: Path, size: int, seed: int, levels: int | None = None, tissue: float = 1.0,
    rows: tuple[int, int] | None = None,
) -> None:  # fmt: skip
    """A ``size``² slide (:func:`slide_tiles`, ``tissue`` its share of droplets) as a tiled
    TIFF with ``levels`` reduced levels in SubIFDs (by default down to about 1024 pixels
    across; 0: none); as an Aperio SVS where ``path`` ends in ``.svs``, a Hamamatsu NDPI
    where it ends in ``.ndpi``, an OME-Zarr image where it ends in ``.zarr``. ``rows``
    (first, count; a multiple of the droplet cell first): only that strip of it, ``size``
    wide."""
    if levels is None:
        levels = max(0, math.ceil(math.log2(size / 1024)))
    path.parent.mkdir(parents=True, exist_ok=True)
    vendor = {".svs": _write_svs, ".ndpi": write_ndpi, ".zarr": write_ome_zarr}.get(path.suffix)
    if vendor is not None:
        if rows is not None:
            raise ValueError(f"a strip of a slide is written as a TIFF, not as {path.suffix}")
        vendor(path, size, seed, levels, tissue)
        return
    if rows is not None and rows[0] % CELL:
        raise ValueError(f"a strip starts at a multiple of {CELL} rows, not {rows[0]}")
    height = size if rows is None else rows[1]
    options = {"dtype": np.uint8, "tile": (SLIDE_TILE, SLIDE_TILE), "compression": "zlib",
               "photometric": "minisblack"}  # fmt: skip
    # The droplets are drawn once: the reduced levels (every 2^k-th pixel of level 0, as
    # slide_tiles draws them) are filled from level 0's tiles as they pass, in arrays on disk
    # beside the slide (a 100,000² slide's are 3.3 GB), and written after it.
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".levels-") as scratch:
        reduced = [
            np.lib.format.open_memmap(Path(scratch) / f"{level}.npy", "w+", np.uint8,
                                      (-(-height // 2**level), -(-size // 2**level)))
            for level in range(1, levels + 1)
        ]  # fmt: skip
        across = -(-size // SLIDE_TILE)

        def level_zero() -> Iterator[np.ndarray]:
            for number, tile in enumerate(slide_tiles(size, seed, 1, tissue, rows)):
                top, left = (SLIDE_TILE * n for n in divmod(number, across))
                for level, pixels in enumerate(reduced, start=1):
                    step = 2**level
                    row, col = -(-top // step), -(-left // step)  # its first pixel here
                    part = tile[row * step - top :: step, col * step - left :: step]
                    pixels[row : row + part.shape[0], col : col + part.shape[1]] = part
                yield tile

        with tifffile.TiffWriter(path, bigtiff=height * size > 2**31) as tif:
            tif.write(level_zero(), shape=(height, size), subifds=levels, **options)
            for pixels in reduced:
                tif.write(pixels, subfiletype=1, **options)


def _write_svs(path: Path, size: int, seed: int, levels: int, tissue: float) -> None:
    """The slide as a scanner's Aperio SVS: RGB (the grey in each colour), JPEG tiles, the
    reduced levels (by four, as Aperio scans) as pages after a thumbnail, each described the
    way Aperio's library does."""
    header = "Aperio Image Library v12.0.15 \r\n"
    options = {"tile": (SLIDE_TILE, SLIDE_TILE), "compression": "jpeg", "photometric": "rgb",
               "compressionargs": {"level": 90}}  # fmt: skip

    def rgb(tiles: Iterator[np.ndarray]) -> Iterator[np.ndarray]:
        return (np.repeat(tile[..., None], 3, axis=2) for tile in tiles)

    steps = [4**k for k in range(1, levels) if size // 4**k >= SLIDE_TILE]
    thumb = max(1, size // 768)
    with tifffile.TiffWriter(path, bigtiff=3 * size * size > 2**31) as tif:
        tif.write(rgb(slide_tiles(size, seed, 1, tissue)), shape=(size, size, 3), dtype=np.uint8,
                  description=f"{header}{size}x{size} [0,0 {size}x{size}] (256x256) JPEG/RGB "
                  "Q=90|AppMag = 20|MPP = 0.5", **options)  # fmt: skip
        small = _whole_level(size, seed, thumb, tissue)
        thumbnail = f"{header}{size}x{size} -> {small.shape[1]}x{small.shape[0]}"
        tif.write(np.repeat(small[..., None], 3, axis=2), photometric="rgb", compression="jpeg",
                  description=thumbnail)  # fmt: skip
        for step in steps:
            side = -(-size // step)
            tif.write(rgb(slide_tiles(size, seed, step, tissue)), shape=(side, side, 3),
                      dtype=np.uint8, subfiletype=1, description=f"{header}{size}x{size} -> "
                      f"{side}x{side} - |AppMag = 20|MPP = {0.5 * step}", **options)  # fmt: skip


def write_ndpi(path: Path, size: int, seed: int, levels: int, tissue: float) -> None:
    """The slide in the layout of a Hamamatsu NDPI, as tifffile and OpenSlide read one: a TIFF
    with 64-bit offsets (an IFD's 4-byte entries, then the next IFD's offset in 8 bytes, then
    the high 4 bytes of each entry's value), RGB; each level one JPEG (4:2:0, YCbCr) in one
    strip with restart markers, their starts in the McuStarts tag (65426), so that a reader
    decodes one restart interval of one row of MCUs at a time; the levels reduced by four, as
    Hamamatsu scans, then a macro image of the slide (magnification -1). Made here, not by a
    scanner: Hamamatsu's private tags beyond those are left out. Each level is encoded whole
    in memory (JPEG: at most 65,535 pixels across), so this is for test slides."""
    if size > 65535:
        raise ValueError(f"an NDPI level is one JPEG, at most 65,535 pixels across, not {size}")
    steps = [1] + [4**k for k in range(1, levels) if size // 4**k >= SLIDE_TILE]
    whole = [_whole_level(size, seed, step, tissue) for step in steps]
    label = np.full((whole[-1].shape[0], whole[-1].shape[0] // 2), 40, np.uint8)
    macro = np.concatenate([label, whole[-1]], axis=1)  # the slide's label beside it
    pages = [(level, 20.0) for level in whole] + [(macro, -1.0)]
    out = bytearray(b"II*\0" + bytes(8))  # the first IFD's offset: 8 bytes
    next_at = 4
    for grey, magnification in pages:
        data, starts = _restart_jpeg(np.repeat(grey[..., None], 3, axis=2))
        strip = len(out)
        out += data + bytes(len(data) % 2)
        height, width = grey.shape
        entries = [
            (254, 4, [0]), (256, 4, [width]), (257, 4, [height]), (258, 3, [8, 8, 8]),
            (259, 3, [7]), (262, 3, [6]), (271, 2, b"Hamamatsu\0"),
            (272, 2, b"synthetic\0"), (273, 4, [strip]), (277, 3, [3]),
            (278, 4, [height]), (279, 4, [len(data)]), (305, 2, b"watchd scripts/synth.py\0"),
            (65420, 4, [1]),
            (65421, 11, [magnification]), (65426, 4, starts),
        ]  # fmt: skip
        struct.pack_into("<Q", out, next_at, len(out))
        next_at = len(out) + 2 + 12 * len(entries)
        out += _ndpi_ifd(len(out), entries)
    if len(out) >= 2**32:
        raise ValueError("an NDPI of 4 GB or more needs the offsets' high bytes")
    path.write_bytes(bytes(out))


def write_ome_zarr(path: Path, size: int, seed: int, levels: int, tissue: float) -> None:
    """The slide as an OME-Zarr image (NGFF 0.4, Zarr v2, as bioformats2raw writes one): a
    folder with a multiscales group of five axes (t, c, z, y, x; one time point, one channel
    named "Brightfield", one slice), level 0 and ``levels`` levels halved (every 2^k-th pixel,
    as the TIFF's), chunks of 256² compressed with Blosc-zstd, written a row of chunks at a
    time; built under a hidden name and renamed into place whole."""
    import numcodecs
    import zarr

    building = path.with_name(f".{path.name}.partial")
    group = zarr.open_group(str(building), mode="w", zarr_format=2)
    compressor = numcodecs.Blosc(cname="zstd", clevel=5, shuffle=numcodecs.Blosc.BITSHUFFLE)
    datasets = []
    for level in range(levels + 1):
        step = 2**level
        side = -(-size // step)
        array = group.create_array(
            str(level), shape=(1, 1, 1, side, side), chunks=(1, 1, 1, SLIDE_TILE, SLIDE_TILE),
            dtype=np.uint8, compressors=compressor,
            chunk_key_encoding={"name": "v2", "separator": "/"},
        )  # fmt: skip
        for number, row in enumerate(_tile_rows(slide_tiles(size, seed, step, tissue), size, step)):
            band = np.concatenate(list(row), axis=1)
            array[0, 0, 0, number * SLIDE_TILE : number * SLIDE_TILE + len(band)] = band
        scale = {"type": "scale", "scale": [1.0, 1.0, 1.0, float(step), float(step)]}
        datasets.append({"path": str(level), "coordinateTransformations": [scale]})
    axes = [{"name": "t", "type": "time"}, {"name": "c", "type": "channel"},
            *({"name": a, "type": "space", "unit": "micrometer"} for a in "zyx")]  # fmt: skip
    group.attrs.update({
        "multiscales": [{"version": "0.4", "name": path.name, "axes": axes, "datasets": datasets}],
        "omero": {"channels": [{"label": "Brightfield", "color": "FFFFFF", "active": True,
                                "window": {"start": 0, "end": 255, "min": 0, "max": 255}}]},
    })  # fmt: skip
    building.rename(path)


def _whole_level(size: int, seed: int, step: int, tissue: float) -> np.ndarray:
    """The slide at 1/``step`` in one array."""
    rows = _tile_rows(slide_tiles(size, seed, step, tissue), size, step)
    return np.concatenate([np.concatenate(list(row), axis=1) for row in rows])


def _restart_jpeg(rgb: np.ndarray) -> tuple[bytes, list[int]]:
    """``rgb`` as a baseline JPEG (4:2:0) with a restart marker every so many MCUs (a whole
    number of them across a row, at most 512 pixels), and where each interval's entropy-coded
    data starts (the first right after the scan's header)."""
    across = -(-rgb.shape[1] // 16)  # MCUs of 16² in a row
    interval = max(d for d in range(1, 33) if across % d == 0)
    buffer = io.BytesIO()
    Image.fromarray(rgb).save(buffer, "JPEG", quality=90, subsampling=2,
                              restart_marker_blocks=interval)  # fmt: skip
    data = buffer.getvalue()
    at = 2  # after SOI: marker segments up to the start of scan
    while data[at : at + 2] != b"\xff\xda":
        at += 2 + struct.unpack(">H", data[at + 2 : at + 4])[0]
    starts = [at + 2 + struct.unpack(">H", data[at + 2 : at + 4])[0]]
    at = starts[0]
    while (at := data.find(b"\xff", at)) >= 0 and at + 1 < len(data):
        if 0xD0 <= data[at + 1] <= 0xD7:  # RSTn: the next interval starts after it
            starts.append(at + 2)
        at += 2 if data[at + 1] != 0xFF else 1  # FF00 is a stuffed data byte, FFFF fill
    return data, starts


def _ndpi_ifd(offset: int, entries: list[tuple[int, int, Any]]) -> bytes:
    """An NDPI IFD at ``offset``: the count, the 12-byte entries (tag, type, count, value or
    its offset), 8 bytes for the next IFD's offset (0: patched by the caller), the entries'
    high 4 bytes (0: under 4 GB), then the values that did not fit in 4 bytes."""
    codes = {3: "H", 4: "I", 11: "f"}  # SHORT, LONG, FLOAT; 2: ASCII as given
    block = 2 + 16 * len(entries) + 8
    head, values = bytearray(struct.pack("<H", len(entries))), bytearray()
    for tag, kind, value in entries:
        raw = value if kind == 2 else struct.pack(f"<{len(value)}{codes[kind]}", *value)
        if len(raw) <= 4:
            head += struct.pack("<HHI", tag, kind, len(value)) + raw.ljust(4, b"\0")
        else:
            head += struct.pack("<HHII", tag, kind, len(value), offset + block + len(values))
            values += raw + bytes(len(raw) % 2)
    return bytes(head + bytes(8) + bytes(4 * len(entries)) + values)


def _tile_rows(tiles: Iterator[np.ndarray], size: int, step: int) -> Iterator[Iterator[np.ndarray]]:
    """:func:`slide_tiles`' tiles (at 1/``step``) grouped in rows."""
    across = -(-size // (SLIDE_TILE * step))
    row: list[np.ndarray] = []
    for tile in tiles:
        row.append(tile)
        if len(row) == across:
            yield iter(row)
            row = []


def make_batch(
    folder: Path,
    kind: str,
    count: int,
    size: int = 128,
    seed: int = 0,
    fmt: str = "png",
    bits: int = 8,
    truth_dir: Path | None = None,
    tissue: float = 1.0,
    look: Look = DEFAULT,
    labels: bool = False,
) -> list[Path]:
    """Write ``count`` images (and masks) for a ``kind`` batch; return the files in ``folder``.

    Images go to ``folder/images/img_0000.<fmt>``; training masks (uint8 0/255, same name and
    format; ``labels``: each spheroid's id, 1, 2, …, so that two in contact stay two) to
    ``folder/masks/``; inference masks only to ``truth_dir`` when given (those are not in the
    returned list). ``look``: another microscope's picture (:mod:`microscope`).
    """
    if kind not in KINDS or fmt not in FORMATS or bits not in (8, 16):
        raise ValueError(f"unsupported kind/format/bits: {kind!r}, {fmt!r}, {bits!r}")
    if fmt in SLIDES:
        if kind != "inference" or bits != 8 or truth_dir is not None or look != DEFAULT:
            raise ValueError("slides are 8-bit inference images, without ground truth or looks")
        paths = [folder / "images" / f"slide_{index:04d}{FORMATS[fmt]}" for index in range(count)]
        for index, path in enumerate(paths):
            write_slide(path, size, seed + index, tissue=tissue)
        return paths
    folder = Path(folder)
    mask_dir = folder / "masks" if kind == "training" else truth_dir
    written: list[Path] = []
    for index in range(count):
        name = f"img_{index:04d}{FORMATS[fmt]}"
        drawn = sample(seed, index, size, look)
        write_image(folder / "images" / name, to_integer(drawn.image, bits), channels=True)
        written.append(folder / "images" / name)
        if mask_dir is not None:
            truth = drawn.labels if labels else to_integer(drawn.mask.astype(np.float32), 8)
            write_image(Path(mask_dir) / name, truth)
            if kind == "training":
                written.append(Path(mask_dir) / name)
    return sorted(written)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="batch folder to write into")
    parser.add_argument("--kind", choices=KINDS, default="training")
    parser.add_argument("--count", type=int, default=16)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--format", choices=sorted(FORMATS), default="png")
    parser.add_argument("--bits", type=int, choices=(8, 16), default=8)
    parser.add_argument("--truth", type=Path, help="inference only: write ground truth here")
    parser.add_argument(
        "--tissue", type=float, default=1.0, help="slide: the share of droplets; the rest glass"
    )
    parser.add_argument("--labels", action="store_true",
                        help="masks hold each spheroid's id (1, 2, …), not 255")  # fmt: skip
    knobs = parser.add_argument_group("another microscope (0–1 each; see scripts/microscope.py)")
    meanings = {"illumination": "uneven light: a gain ramp and a vignette",
                "noise": "extra sensor noise (its standard deviation)",
                "contrast": "another camera curve: gamma e^±c, squeezed contrast",
                "touching": "the share of images with two spheroids in contact"}  # fmt: skip
    for knob, meaning in meanings.items():
        knobs.add_argument(f"--{knob}", type=float, default=0.0, help=meaning)
    args = parser.parse_args(argv)
    if not 0 < args.tissue <= 1:
        parser.error("--tissue must be in (0, 1]")
    try:
        look = Look(args.illumination, args.noise, args.contrast, args.touching)
    except ValueError as exc:
        parser.error(str(exc))
    files = make_batch(args.out, args.kind, args.count, args.size, args.seed, args.format,
                       args.bits, args.truth, args.tissue, look, args.labels)  # fmt: skip
    print(f"wrote {len(files)} files to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
