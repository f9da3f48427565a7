"""Read input images and write masks.

Inputs are PNG or TIFF, 8- or 16-bit, grey or RGB(A) (converted to grey with the ITU-R 601
luma weights), returned as float32 in [0, 1] scaled by the integer range (255 or 65535). The
format is recognised from the file's content, not its name. Each file is read once: the
sha256 named in the manifest is checked on those same bytes. Files are opened only by the rule
of :mod:`daemon.contract.safeopen`: an input swapped for a link out of the batch folder, or for a
FIFO, after the batch was accepted is refused, never read. Whatever is wrong with a file becomes an
:class:`InputError` with one :class:`Problem` naming it, never a traceback, including an error
reading it (permission denied, an I/O error on that file); only an error that says the share
itself is gone escapes, so the job is retried (:func:`reading`). What is read is bounded by the
image's header and by the file (:func:`read_bounded`): a sparse file is refused unread.

Masks are written in the format of the input's file name (PNG or TIFF), uint8 0/255,
atomically, into a folder held by the rule of :mod:`daemon.contract.heldfolder`.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import os
import struct
import zlib
from collections.abc import Iterator
from pathlib import PurePosixPath
from typing import Any, BinaryIO

import imagecodecs
import numpy as np
import tifffile
from PIL import Image

from daemon.contract.heldfolder import HeldFolder
from daemon.contract.jobspec import InputFile, Problem
from daemon.contract.names import VENDOR_FORMATS, input_format_problem, is_store
from daemon.contract.safeopen import Folder, Presence, RefusedInput, open_input
from pipelines.bounds import (
    PNG_MAGIC,
    TIFF_ERRORS,
    TIFF_MAGICS,
    check_windowable,
    declared_size,
    oversized,
    stored,
    where,
)
from pipelines.channels import ChannelProblem, plane_page
from pipelines.job import InputError
from pipelines.vendor import read_vendor

MASK_FORMATS = {".png": "PNG", ".tif": "TIFF", ".tiff": "TIFF"}  # (pipelines.layout.mask_name)
_UNRECOGNISED_BYTES = 64 * 2**10  # read of a file that is no PNG or TIFF, to say what it is
_LUMA = np.array([0.299, 0.587, 0.114], dtype=np.float32)
_PNG_ERRORS = (OSError, SyntaxError, ValueError, EOFError, zlib.error, Image.DecompressionBombError)


class UnreadableImage(Exception):
    """The bytes are not an image we can use; ``hint`` tells the owner what to do."""

    def __init__(self, message: str, hint: str) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


def _short(digest: str) -> str:
    return digest[:12] + "…"


_REFUSED_HINTS = {
    Presence.OUTSIDE: "it was replaced by a link after the batch was accepted; "
    "copy the file itself into the batch folder",
    Presence.SPECIAL: "it was replaced after the batch was accepted; put the image file back",
}


# The share itself failing, not one file: the job is worth running again later.
_SHARE_ERRNOS = frozenset(
    {errno.ESTALE, errno.ENOTCONN, errno.ETIMEDOUT, errno.EHOSTDOWN, errno.EHOSTUNREACH,
     errno.ENETDOWN, errno.ENETUNREACH, errno.ECONNRESET, errno.ECONNABORTED, errno.ENOMEDIUM}
)  # fmt: skip


@contextlib.contextmanager
def reading(item: InputFile) -> Iterator[None]:
    """Turn an error reading ``item`` (permission denied, an I/O error on this one file) into
    an :class:`InputError` naming it; an error that says the share is gone escapes (the job is
    then retried), and so does any error of a write inside the block."""
    try:
        yield
    except OSError as exc:
        if isinstance(exc, FileNotFoundError) or exc.errno in _SHARE_ERRNOS:
            raise
        reason = exc.strerror or type(exc).__name__
        hint = (
            "make it readable for the account watchd runs as (e.g. chmod a+r)"
            if exc.errno in (errno.EACCES, errno.EPERM)
            else "the storage could not deliver this file; copy it again"
        )
        problem = Problem(where(item), f"cannot be read ({reason})", hint)
        raise InputError("input unreadable", [problem]) from None


def open_item(batch_dir: Folder, item: InputFile) -> BinaryIO:
    """Open ``item`` by the batch folder's rule (:mod:`daemon.contract.safeopen`): a regular file
    inside the folder, checked as it is opened. A missing, refused or unreadable input is an
    :class:`InputError` (see :func:`reading`)."""
    try:
        with reading(item):
            return open_input(batch_dir, item.path)
    except FileNotFoundError:
        hint = "it was moved or deleted after the batch was accepted; put it back"
        raise InputError(
            "input missing", [Problem(where(item), "the file is gone", hint)]
        ) from None
    except RefusedInput as exc:
        hint = _REFUSED_HINTS.get(exc.located.presence, "")
        raise InputError(
            "input refused", [Problem(where(item), f"now {exc.reason}", hint)]
        ) from None


@contextlib.contextmanager
def held_still(handle: BinaryIO, item: InputFile) -> Iterator[None]:
    """Raise InputError if the open input ``handle`` changed (size or modification time)
    while the block ran: what was read at its start and at its end are then not one file."""
    before = os.fstat(handle.fileno())
    yield
    after = os.fstat(handle.fileno())
    if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
        hint = "it was written to while being read; let the copy finish, then retry the batch"
        raise InputError(
            "input changed", [Problem(where(item), "changed while it was being segmented", hint)]
        )


def checksum_problem(item: InputFile, actual: str) -> Problem | None:
    """A problem if the manifest gives ``item`` a sha256 and ``actual`` is not it."""
    if item.sha256 is None or actual == item.sha256.lower():
        return None
    message = f"sha256 is {_short(actual)}, expected {_short(item.sha256.lower())}"
    hint = "the file changed or was damaged while copying; copy it again"
    return Problem(where(item), message, hint)


def read_image(batch_dir: Folder, item: InputFile, channel: Any = None) -> np.ndarray:
    """Read, verify and decode ``item`` to a float32 (H, W) array in [0, 1]."""
    return read_image_hashed(batch_dir, item, channel)[0]


def read_image_hashed(
    batch_dir: Folder, item: InputFile, channel: Any = None
) -> tuple[np.ndarray, str]:
    """:func:`read_image`, and the sha256 of the bytes it decoded (from one read)."""
    found = read_bounded(batch_dir, item, max_pixels=None, channel=channel)
    assert found is not None  # only an image over max_pixels is left to the windowed path
    return found


def read_bounded(
    batch_dir: Folder, item: InputFile, max_pixels: int | None, channel: Any = None
) -> tuple[np.ndarray, str] | None:
    """The pixels of ``item`` and the sha256 of its bytes, read in memory bounded by what its
    header declares and by what the file really holds; None for a TIFF of more than
    ``max_pixels`` pixels that the window-by-window reader can take (segment it so).

    Refused, each as an :class:`InputError` naming the file: a sparse file (:func:`stored`),
    a file far larger than its declared image, an image over ``max_pixels`` that cannot be
    read window by window, a checksum mismatch, bytes that are not an image we decode.
    """
    if is_store(item.path):  # a folder of chunks (pipelines.ngff): window by window
        return None
    with open_item(batch_dir, item) as handle, reading(item):
        size = stored(handle, item)
        if PurePosixPath(item.path).suffix.lower() in VENDOR_FORMATS:
            with held_still(handle, item):
                pixels, digest = read_vendor(handle, item, max_pixels, channel)
            problem = checksum_problem(item, digest)
            if problem is not None:
                raise InputError("checksum mismatch", [problem])
            try:
                return _to_unit_grey(_unsigned(pixels, "OME-TIFF")), digest
            except UnreadableImage as exc:
                problem = Problem(where(item), exc.message, exc.hint)
                raise InputError("unreadable image", [problem]) from exc
        declared = declared_size(handle, item)
        if declared is not None and max_pixels is not None and declared.pixels > max_pixels:
            check_windowable(item, declared, max_pixels)
            return None
        limit = _UNRECOGNISED_BYTES if declared is None else declared.max_file_bytes
        if declared is not None and size > limit:
            raise InputError("input too large", [oversized(item, declared, size)])
        handle.seek(0)
        data = handle.read(limit + 1)
    if declared is None:  # not an image: decoding its first bytes says why
        raise _unreadable(item, data)
    if len(data) != size:
        hint = "it was written to while being read; let the copy finish, then retry the batch"
        raise InputError("input changed", [Problem(where(item), "changed while read", hint)])
    digest = hashlib.sha256(data).hexdigest()
    problem = checksum_problem(item, digest)
    if problem is not None:
        raise InputError("checksum mismatch", [problem])
    try:
        return decode(data, channel, item.path), digest
    except UnreadableImage as exc:
        raise InputError("unreadable image", [Problem(where(item), exc.message, exc.hint)]) from exc


def _unreadable(item: InputFile, head: bytes) -> InputError:
    try:
        decode(head, name=item.path)
    except UnreadableImage as exc:
        return InputError("unreadable image", [Problem(where(item), exc.message, exc.hint)])
    hint = "the file is damaged or incomplete; copy or export it again"
    return InputError("unreadable image", [Problem(where(item), "has no readable header", hint)])


def decode(data: bytes, channel: Any = None, name: str = "") -> np.ndarray:
    """Decode PNG or TIFF bytes to float32 grey in [0, 1]; raise UnreadableImage otherwise.
    ``channel``: the plane of a multi-channel TIFF (:mod:`pipelines.channels`). ``name``: the
    file's name, which tells an NDPI from a TIFF (its offsets are 64 bits: the same as a
    TIFF's under 4 GB, not over)."""
    if not data:
        raise UnreadableImage("the file is empty (0 bytes)", "copy it again")
    if data.startswith(PNG_MAGIC):
        pixels = _decode_png(data)
    elif data[:4] in TIFF_MAGICS:
        pixels = _decode_tiff(data, channel, PurePosixPath(name).name)
    else:
        raise UnreadableImage(
            f"is not a PNG or TIFF image (it starts with {data[:8]!r})",
            "save the image as PNG or TIFF (8 or 16 bit)",
        )
    return _to_unit_grey(pixels)


def _decode_png(data: bytes) -> np.ndarray:
    bit_depth = data[24] if len(data) > 25 else 0
    if bit_depth not in (8, 16):
        raise UnreadableImage(
            f"is a {bit_depth}-bit PNG; only 8- and 16-bit images are supported",
            "export it as an 8- or 16-bit PNG",
        )
    fast = _decode_png_libpng(data, bit_depth)
    if fast is not None:
        return fast
    try:
        with Image.open(io.BytesIO(data), formats=["PNG"]) as opened:
            opened.load()
            image = opened.convert("RGB") if opened.mode in ("P", "PA") else opened
            pixels = np.array(image)
    except _PNG_ERRORS as exc:
        raise UnreadableImage(
            f"cannot be decoded as PNG ({exc})",
            "the file is damaged or incomplete; copy or export it again",
        ) from exc
    if pixels.dtype.kind in "iu" and pixels.dtype.itemsize > 1:
        pixels = pixels.astype(np.uint16)  # Pillow's "I" and big-endian "I;16B" modes
    return pixels


# (colour type, bit depth) → the samples per pixel libpng gives where Pillow gives the same
# values: grey and grey + alpha at 8 and 16 bits, RGB(A) at 8 (Pillow keeps only the high byte of
# a 16-bit RGB sample; a palette it expands itself)
_LIBPNG_SAMPLES = {(0, 8): 1, (0, 16): 1, (4, 8): 2, (4, 16): 2, (2, 8): 3, (6, 8): 4}


def _decode_png_libpng(data: bytes, bit_depth: int) -> np.ndarray | None:
    """The pixels of a PNG as Pillow gives them, decoded by libpng (imagecodecs) in one call:
    0.65 against 1.0–1.2 ms for a 256² grey image, the decode being a worker's largest cost
    per image. None where Pillow must decode it: another kind of PNG (see
    :data:`_LIBPNG_SAMPLES`), an interlaced one, or one libpng refuses, so that Pillow says
    why."""
    samples = _LIBPNG_SAMPLES.get((data[25], bit_depth)) if len(data) > 28 else None
    if samples is None or data[28] != 0 or data[12:16] != b"IHDR":
        return None
    width, height = struct.unpack(">II", data[16:24])
    try:
        pixels = imagecodecs.png_decode(data)
    except Exception:  # Pillow decodes it again and names what is wrong
        return None
    dtype = np.uint8 if bit_depth == 8 else np.uint16
    shape = (height, width) if samples == 1 else (height, width, samples)
    return pixels if pixels.dtype == dtype and pixels.shape == shape else None


def _decode_tiff(data: bytes, channel: Any, name: str) -> np.ndarray:
    try:
        with tifffile.TiffFile(io.BytesIO(data), name=name or "image.tif") as tif:
            if not tif.pages:
                raise UnreadableImage(
                    "cannot be decoded as TIFF (it holds no image)",
                    "the file is damaged or incomplete; copy or export it again",
                )
            try:
                page = plane_page(tif, channel)
            except ChannelProblem as exc:
                raise UnreadableImage(exc.message, exc.hint) from exc
            if not isinstance(page, tifffile.TiffPage):
                raise UnreadableImage("has no readable first page", "export it again")
            pixels = page.asarray()
            if page.planarconfig == tifffile.PLANARCONFIG.SEPARATE and pixels.ndim == 3:
                pixels = np.moveaxis(pixels, 0, -1)
            inverted = page.photometric == tifffile.PHOTOMETRIC.MINISWHITE
    except TIFF_ERRORS as exc:
        raise UnreadableImage(
            f"cannot be decoded as TIFF ({type(exc).__name__}: {exc})",
            "the file is damaged, incomplete or uses an unsupported compression; "
            "export it again as uncompressed or deflate TIFF",
        ) from exc
    pixels = _unsigned(pixels, "TIFF")
    return np.iinfo(pixels.dtype).max - pixels if inverted else pixels


def _unsigned(pixels: np.ndarray, export: str) -> np.ndarray:
    """``pixels`` if 8- or 16-bit unsigned, else UnreadableImage (hint: export as ``export``)."""
    if pixels.dtype not in (np.uint8, np.uint16):
        raise UnreadableImage(
            f"has {pixels.dtype.itemsize * 8}-bit {pixels.dtype.kind!r}-type samples "
            f"({pixels.dtype}); only 8- and 16-bit unsigned integer images are supported",
            f"export it as an 8- or 16-bit {export}",
        )
    return pixels


def _to_unit_grey(pixels: np.ndarray) -> np.ndarray:
    scale = np.float32(np.iinfo(pixels.dtype).max)
    if pixels.ndim == 3 and pixels.shape[-1] in (3, 4):
        plane = None
    elif pixels.ndim == 3 and pixels.shape[-1] == 2:
        plane = pixels[..., 0]  # grey + alpha
    elif pixels.ndim == 2:
        plane = pixels
    else:
        raise UnreadableImage(
            f"has shape {pixels.shape}; expected a grey or RGB image",
            "export a single grey or RGB image per file",
        )
    if min(pixels.shape[:2]) < 1:
        raise UnreadableImage(f"has no pixels (shape {pixels.shape})", "export it again")
    if plane is not None:  # in one pass: an unsigned sample over its largest value is in [0, 1]
        return np.divide(plane, scale, dtype=np.float32)
    return np.clip((pixels[..., :3].astype(np.float32) @ _LUMA) / scale, 0.0, 1.0)


def check_suffix(item: InputFile) -> Problem | None:
    """A problem if this input is in a format the jobs do not read (the daemon's intake says
    the same, :func:`daemon.contract.names.input_format_problem`)."""
    found = input_format_problem(item.path)
    return None if found is None else Problem(where(item), *found)


def encode_mask(mask: np.ndarray, suffix: str) -> bytes:
    """A boolean (H, W) mask as uint8 0/255 PNG or TIFF bytes."""
    if MASK_FORMATS[suffix.lower()] == "PNG":
        return _mask_png(mask)
    pixels = np.where(mask, np.uint8(255), np.uint8(0))
    buffer = io.BytesIO()
    tifffile.imwrite(buffer, pixels, photometric="minisblack", compression="zlib")
    return buffer.getvalue()


def _mask_png(mask: np.ndarray) -> bytes:
    """An 8-bit grey PNG of a mask, every row unfiltered, deflated with run-length matches
    only (zlib's Z_RLE): what a mask of long runs of 0 and 255 needs. 0.2 ms for a 256² mask
    where Pillow's encoder, trying every filter on every row, took 2.9 ms, and the files are
    smaller (1.6 kB against 2.4 kB for the synthetic spheroids); any PNG reader reads it."""
    height, width = mask.shape
    rows = np.empty((height, width + 1), dtype=np.uint8)
    rows[:, 0] = 0  # filter type None
    np.multiply(mask, np.uint8(255), out=rows[:, 1:], casting="unsafe")
    deflate = zlib.compressobj(1, zlib.DEFLATED, 15, 9, zlib.Z_RLE)
    data = deflate.compress(rows.data) + deflate.flush()
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit grey, no interlace
    return (
        PNG_MAGIC
        + _png_chunk(b"IHDR", header)
        + _png_chunk(b"IDAT", data)
        + _png_chunk(b"IEND", b"")
    )


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def write_mask(folder: HeldFolder, name: str, mask: np.ndarray, *, fsync: bool = True) -> None:
    """Write ``mask`` atomically as ``name`` in ``folder``, in the format its suffix names;
    ``fsync=False`` leaves making it durable to the caller (:mod:`pipelines.inference.durable`)."""
    folder.write_bytes(name, encode_mask(mask, PurePosixPath(name).suffix), fsync=fsync)
