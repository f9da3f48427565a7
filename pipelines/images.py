"""Read input images and write masks.

Inputs are PNG or TIFF, 8- or 16-bit, grey or RGB(A) (converted to grey with the ITU-R 601
luma weights), returned as float32 in [0, 1] scaled by the integer range (255 or 65535). The
format is recognised from the file's content, not its name. Each file is read once: the
sha256 named in the manifest is checked on those same bytes. Files are opened only by the rule
of :mod:`daemon.safeopen`: an input swapped for a link out of the batch folder, or for a FIFO,
after the batch was accepted is refused, never read. Whatever is wrong with a file becomes an
:class:`InputError` with one :class:`Problem` naming it, never a traceback; only an I/O error
other than "file not found" (the share failing) escapes, so the job is retried.

Masks are written in the format of the input's file name (PNG or TIFF), uint8 0/255,
atomically.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np
import tifffile
from PIL import Image

from daemon.atomicfile import write_bytes
from daemon.jobspec import InputFile, Problem
from daemon.safeopen import Folder, Presence, RefusedInput, open_input
from pipelines.job import InputError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TIFF_MAGICS = (b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+")
MASK_FORMATS = {".png": "PNG", ".tif": "TIFF", ".tiff": "TIFF"}
_LUMA = np.array([0.299, 0.587, 0.114], dtype=np.float32)
_PNG_ERRORS = (OSError, SyntaxError, ValueError, EOFError, zlib.error, Image.DecompressionBombError)
_TIFF_ERRORS = (
    tifffile.TiffFileError,
    ValueError,
    KeyError,
    IndexError,
    OSError,
    EOFError,
    struct.error,
    zlib.error,
)


class UnreadableImage(Exception):
    """The bytes are not an image we can use; ``hint`` tells the owner what to do."""

    def __init__(self, message: str, hint: str) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


def where(item: InputFile) -> str:
    """How a problem names an input: its path in the batch folder."""
    return f"input '{item.path}'"


def _short(digest: str) -> str:
    return digest[:12] + "…"


_REFUSED_HINTS = {
    Presence.OUTSIDE: "it was replaced by a link after the batch was accepted; "
    "copy the file itself into the batch folder",
    Presence.SPECIAL: "it was replaced after the batch was accepted; put the image file back",
}


def open_item(batch_dir: Folder, item: InputFile) -> BinaryIO:
    """Open ``item`` by the batch folder's rule (:mod:`daemon.safeopen`): a regular file inside
    the folder, checked as it is opened. A missing or refused input is an :class:`InputError`."""
    try:
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


def read_input(batch_dir: Folder, item: InputFile) -> bytes:
    """The bytes of ``item``, checked against its sha256 when the manifest gives one."""
    with open_item(batch_dir, item) as handle:
        data = handle.read()
    problem = checksum_problem(item, hashlib.sha256(data).hexdigest()) if item.sha256 else None
    if problem is not None:
        raise InputError("checksum mismatch", [problem])
    return data


def read_image(batch_dir: Folder, item: InputFile) -> np.ndarray:
    """Read, verify and decode ``item`` to a float32 (H, W) array in [0, 1]."""
    return read_image_hashed(batch_dir, item)[0]


def read_image_hashed(batch_dir: Folder, item: InputFile) -> tuple[np.ndarray, str]:
    """:func:`read_image`, and the sha256 of the bytes it decoded (from one read)."""
    data = read_input(batch_dir, item)
    try:
        pixels = decode(data)
    except UnreadableImage as exc:
        raise InputError("unreadable image", [Problem(where(item), exc.message, exc.hint)]) from exc
    return pixels, item.sha256.lower() if item.sha256 else hashlib.sha256(data).hexdigest()


def peek_size(batch_dir: Folder, item: InputFile) -> tuple[int, int] | None:
    """(height, width) from a PNG's or TIFF's header without decoding pixels; None if unknown
    (also when the file cannot be opened: reading it whole then says why)."""
    try:
        with open_input(batch_dir, item.path) as handle:
            head = handle.read(32)
            if head.startswith(PNG_MAGIC) and len(head) >= 24:
                width, height = struct.unpack(">II", head[16:24])
                return height, width
            if head[:4] in TIFF_MAGICS:
                handle.seek(0)
                with tifffile.TiffFile(handle, name=Path(item.path).name) as tif:
                    page = tif.pages[0]
                    if isinstance(page, tifffile.TiffPage):
                        return page.imagelength, page.imagewidth
    except (OSError, RefusedInput, *_TIFF_ERRORS):
        return None
    return None


def decode(data: bytes) -> np.ndarray:
    """Decode PNG or TIFF bytes to float32 grey in [0, 1]; raise UnreadableImage otherwise."""
    if not data:
        raise UnreadableImage("the file is empty (0 bytes)", "copy it again")
    if data.startswith(PNG_MAGIC):
        pixels = _decode_png(data)
    elif data[:4] in TIFF_MAGICS:
        pixels = _decode_tiff(data)
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


def _decode_tiff(data: bytes) -> np.ndarray:
    try:
        with tifffile.TiffFile(io.BytesIO(data)) as tif:
            if not tif.pages:
                raise UnreadableImage(
                    "cannot be decoded as TIFF (it holds no image)",
                    "the file is damaged or incomplete; copy or export it again",
                )
            if len(tif.pages) != 1:
                raise UnreadableImage(
                    f"has {len(tif.pages)} pages; expected a single 2-D image",
                    "save one image per file",
                )
            page = tif.pages[0]
            if not isinstance(page, tifffile.TiffPage):
                raise UnreadableImage("has no readable first page", "export it again")
            pixels = page.asarray()
            if page.planarconfig == tifffile.PLANARCONFIG.SEPARATE and pixels.ndim == 3:
                pixels = np.moveaxis(pixels, 0, -1)
            inverted = page.photometric == tifffile.PHOTOMETRIC.MINISWHITE
    except _TIFF_ERRORS as exc:
        raise UnreadableImage(
            f"cannot be decoded as TIFF ({type(exc).__name__}: {exc})",
            "the file is damaged, incomplete or uses an unsupported compression; "
            "export it again as uncompressed or deflate TIFF",
        ) from exc
    if pixels.dtype not in (np.uint8, np.uint16):
        raise UnreadableImage(
            f"has {pixels.dtype.itemsize * 8}-bit {pixels.dtype.kind!r}-type samples "
            f"({pixels.dtype}); only 8- and 16-bit unsigned integer images are supported",
            "export it as an 8- or 16-bit TIFF",
        )
    return np.iinfo(pixels.dtype).max - pixels if inverted else pixels


def _to_unit_grey(pixels: np.ndarray) -> np.ndarray:
    scale = np.float32(np.iinfo(pixels.dtype).max)
    if pixels.ndim == 3 and pixels.shape[-1] in (3, 4):
        grey = pixels[..., :3].astype(np.float32) @ _LUMA
    elif pixels.ndim == 3 and pixels.shape[-1] == 2:
        grey = pixels[..., 0].astype(np.float32)  # grey + alpha
    elif pixels.ndim == 2:
        grey = pixels.astype(np.float32)
    else:
        raise UnreadableImage(
            f"has shape {pixels.shape}; expected a grey or RGB image",
            "export a single grey or RGB image per file",
        )
    if min(grey.shape) < 1:
        raise UnreadableImage(f"has no pixels (shape {pixels.shape})", "export it again")
    return np.clip(grey / scale, 0.0, 1.0)


def check_suffix(item: InputFile) -> Problem | None:
    """A problem if no mask can be written in this input's format (PNG or TIFF by name)."""
    if Path(item.path).suffix.lower() in MASK_FORMATS:
        return None
    return Problem(
        where(item),
        f"'{Path(item.path).suffix}' files are not supported",
        "save the image as .png or .tif",
    )


def encode_mask(mask: np.ndarray, suffix: str) -> bytes:
    """A boolean (H, W) mask as uint8 0/255 PNG or TIFF bytes."""
    pixels = np.where(mask, np.uint8(255), np.uint8(0))
    buffer = io.BytesIO()
    if MASK_FORMATS[suffix.lower()] == "PNG":
        Image.fromarray(pixels).save(buffer, format="PNG")
    else:
        tifffile.imwrite(buffer, pixels, photometric="minisblack", compression="zlib")
    return buffer.getvalue()


def write_mask(path: Path, mask: np.ndarray) -> None:
    """Write ``mask`` atomically to ``path`` in the format its suffix names."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes(path, encode_mask(mask, path.suffix))
