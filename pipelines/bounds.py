"""How much of an input image may be read and decoded: what its header declares, and what
the file really stores.

A job decodes an image whole only when its header declares at most ``max_whole_pixels``
pixels, and reads at most what those pixels can take encoded (:attr:`Declared.max_file_bytes`);
a larger TIFF goes window by window only if its strips or tiles are small enough to be decoded
one at a time (uncompressed strips are read by rows, whatever their size). A sparse file is
refused for what it is before anything is read (:func:`stored`). Each refusal is an
:class:`InputError` with a problem naming the file, the figures and the parameter that decides.
"""

from __future__ import annotations

import errno
import os
import struct
import zlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import BinaryIO

import tifffile

from daemon.contract.jobspec import InputFile, Problem
from daemon.contract.names import TIFF_SUFFIXES
from pipelines.channels import Planes
from pipelines.job import InputError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TIFF_MAGICS = (b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+")
TIFF_ERRORS = (
    tifffile.TiffFileError,
    ValueError,
    KeyError,
    IndexError,
    OSError,
    EOFError,
    struct.error,
    zlib.error,
)
_PNG_SAMPLES = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # by colour type
_METADATA_BYTES = 16 * 2**20  # allowed beside the pixels (profiles, text, OME-XML …)


def where(item: InputFile) -> str:
    """How a problem names an input: its path in the batch folder."""
    return f"input '{item.path}'"


@dataclass(frozen=True)
class Declared:
    """What an image's header says it holds, read before any pixel is decoded."""

    kind: str  # "PNG" or "TIFF"
    height: int
    width: int
    pixel_bytes: int  # bytes of one pixel as stored, all samples
    segment: tuple[int, int] = (0, 0)  # TIFF: (rows, columns) of a strip or tile
    pieces: str = ""  # TIFF: what those are, as the owner reads it ("compressed strips")
    whole_pieces: bool = False  # TIFF: each must be decoded whole (uncompressed strips: by rows)
    unsupported: str = ""  # TIFF: why the window-by-window reader cannot take it
    planes: int = 1  # TIFF: planes of this size in the file (channels, slices)

    @property
    def pixels(self) -> int:
        return self.height * self.width

    @property
    def max_file_bytes(self) -> int:
        """The most bytes a file holding this image can need: its pixels uncompressed, twice
        (no compression a PNG or TIFF uses grows data that much), and room for metadata."""
        return 2 * self.pixels * self.pixel_bytes * self.planes + _METADATA_BYTES


def stored(handle: BinaryIO, item: InputFile) -> int:
    """The size of the open input (left at its start); an :class:`InputError` if it is a
    sparse file.

    A file whose length is mostly holes (never written, e.g. made by ``truncate`` or a copy cut
    short) is not an image, and reading it would cost its whole length in zeros. Only when the
    file has fewer blocks stored than its length (holes, or a filesystem that compresses) are
    its holes looked for (SEEK_DATA/SEEK_HOLE). Compressing filesystems (ZFS) store runs of
    zeros as holes too, so a few holes are allowed: more than half the file is refused.
    """
    status = os.fstat(handle.fileno())
    if status.st_blocks * 512 >= status.st_size:
        return status.st_size
    holes = _hole_bytes(handle.fileno(), status.st_size)
    handle.seek(0)  # the walk moved the descriptor's offset under the buffered handle
    if 2 * holes > status.st_size:
        message = (
            f"is a sparse file: {spaced(holes)} of its {spaced(status.st_size)} bytes are "
            "holes, never written"
        )
        hint = (
            "it is not a whole image (made by truncate, or a copy cut short); copy the image again"
        )
        raise InputError("sparse input", [Problem(where(item), message, hint)])
    return status.st_size


def _hole_bytes(fd: int, size: int, extents: int = 1024) -> int:
    """Bytes in holes among the first ``extents`` holes of the file open as ``fd``; 0 where
    the filesystem cannot tell."""
    holes = offset = 0
    for _ in range(extents):
        try:
            data = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno != errno.ENXIO:  # ENXIO: no data after offset, the rest is a hole
                return 0
            data = size
        holes += min(data, size) - offset
        if data >= size:
            break
        offset = os.lseek(fd, data, os.SEEK_HOLE)
    return holes


def declared_size(handle: BinaryIO, item: InputFile) -> Declared | None:
    """What the PNG's or TIFF's header in ``handle`` declares, without decoding pixels; None if
    it is neither or its header cannot be read (decoding it then says why)."""
    handle.seek(0)
    head = handle.read(32)
    if head.startswith(PNG_MAGIC) and len(head) >= 26:
        width, height, depth, colour = struct.unpack(">IIBB", head[16:26])
        samples = _PNG_SAMPLES.get(colour, 4)
        return Declared("PNG", height, width, samples * max(1, depth // 8))
    if head[:4] not in TIFF_MAGICS:
        return None
    handle.seek(0)
    try:
        with tifffile.TiffFile(handle, name=Path(item.path).name) as tif:
            page = tif.pages[0]
            if not isinstance(page, tifffile.TiffPage):
                return None
            return replace(_tiff_declared(page), planes=max(1, Planes.of(tif).count))
    except TIFF_ERRORS:
        return None


def _tiff_declared(page: tifffile.TiffPage) -> Declared:
    height, width = page.imagelength, page.imagewidth
    segment = (
        (page.tilelength, page.tilewidth)
        if page.is_tiled
        else (min(page.rowsperstrip, height), width)
    )
    whole_pieces = page.is_tiled or page.compression != 1 or page.predictor != 1
    pieces = ("compressed " if page.compression != 1 else "") + (
        "tiles" if page.is_tiled else "strips"
    )
    unsupported = ""
    if page.dtype is None or page.dtype.char not in "BH":
        unsupported = f"has {page.bitspersample}-bit samples of type {page.sampleformat}"
    elif page.planarconfig == tifffile.PLANARCONFIG.SEPARATE and page.samplesperpixel > 1:
        unsupported = "stores its colours in separate planes"
    pixel_bytes = page.samplesperpixel * max(1, page.bitspersample // 8)
    return Declared("TIFF", height, width, pixel_bytes, segment, pieces, whole_pieces, unsupported)


def check_windowable(item: InputFile, declared: Declared, max_pixels: int) -> None:
    """Raise InputError unless the window-by-window reader can take this image (over
    ``max_pixels``): a TIFF, by name and content, whose strips or tiles are not larger."""
    over = (
        f"is {declared.width}×{declared.height} pixels ({spaced(declared.pixels)}), more "
        f"than params.max_whole_pixels = {spaced(max_pixels)} allows to segment as a whole"
    )
    if declared.kind != "TIFF" or Path(item.path).suffix.lower() not in TIFF_SUFFIXES:
        hint = (
            "raise params.max_whole_pixels in the manifest (a 2048×2048 image needs about "
            "2 GB), or save it as a TIFF: those are segmented window by window"
        )
        raise InputError("image too large", [Problem(where(item), over, hint)])
    rows, columns = declared.segment
    if declared.unsupported:
        message = f"{over}, and {declared.unsupported}, which cannot be read window by window"
        hint = "export it as an 8- or 16-bit grey or RGB TIFF, tiled (e.g. 512×512 tiles)"
        raise InputError("image too large", [Problem(where(item), message, hint)])
    if declared.whole_pieces and rows * columns > max_pixels:
        message = (
            f"{over}, and stores them in {declared.pieces} of {columns}×{rows} pixels, each "
            "of which must be decoded at once"
        )
        hint = (
            "save it as a tiled TIFF (e.g. 512×512 tiles), or uncompressed, or with fewer "
            "rows per strip; or raise params.max_whole_pixels if the job has the memory"
        )
        raise InputError("image too large", [Problem(where(item), message, hint)])


def oversized(item: InputFile, declared: Declared, size: int) -> Problem:
    message = (
        f"is {spaced(size)} bytes, more than a {declared.width}×{declared.height} "
        f"{declared.kind} can hold (at most {spaced(declared.max_file_bytes)} bytes)"
    )
    return Problem(where(item), message, "it holds more than the image; export it again")


def spaced(n: int) -> str:
    return f"{n:,}".replace(",", " ")
