"""How much of a Zarr store may be read and decoded: what its metadata declares, and what its
chunks really hold.

A store is a folder of files its owner wrote, any of which may be forged: a few bytes of
metadata can declare a chunk of gigabytes, and a chunk of a few kB can inflate to gigabytes.
So, as a TIFF's header is (:mod:`pipelines.bounds`), every file of a store is bounded before
it is read and every chunk before it is decoded, by a :class:`Guard` that
:class:`pipelines.omezarr.FolderStore` asks about each read:

- a metadata file (:data:`daemon.contract.stores.METADATA_NAMES`) is at most
  MAX_METADATA_BYTES and nested at most MAX_METADATA_DEPTH deep, checked before zarr parses it;
- an array is admitted once zarr has parsed its metadata and before any chunk of it is read
  (:func:`chunks_of`): its codecs must be ones whose output can be known before they run —
  blosc, zstd, lz4 (numcodecs' framing), gzip, zlib, bz2 or none, behind Zarr v3's ``bytes``
  and ``transpose`` and with a ``crc32c`` last — so its decoded chunk is what its shape and
  type hold;
- a chunk file is read only up to what its chunk can need encoded (twice its decoded bytes and
  a little: no codec here grows data that much), and its decoded size is known before the
  decoder allocates: from its frame's header (blosc's nbytes, zstd's frame content size, the
  lz4 size prefix), or, for gzip, zlib and bz2, which declare none, by inflating it into at
  most that many bytes first (so such a chunk is inflated twice). A zstd frame that does not
  declare its size is refused: numcodecs would decode it into a buffer that grows without end.

Sharding, lzma, filters and any other codec are refused naming it, saying how to write the
store instead; so is an array whose shape is not an image's, or whose chunks are larger than
the TIFF strips and tiles a job may decode (:func:`check_declared`). A refusal is a
:class:`Refused`, a ValueError with its message and hint: the reader of an input makes it a
problem naming the input (:mod:`pipelines.ngff`).
"""

from __future__ import annotations

import bz2
import math
import re
import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from daemon.contract.stores import MAX_METADATA_BYTES, METADATA_NAMES
from pipelines.bounds import spaced

MAX_METADATA_DEPTH = 32  # an NGFF document nests six or so deep
MAX_SIDE = 2**18  # rows or columns (a whole slide: some 100 000; a job's memory grows with them)
MAX_PLANE_PIXELS = 2**34  # pixels of one plane (a 131 072² slide)
MAX_AXIS = 2**16  # time points, channels or Z slices
MAX_PLANE_CHUNKS = 2**20  # chunks of one plane (a 131 072² plane in chunks of 128²)
PIXEL_BYTES = 8  # a decoded chunk's bytes per pixel of max_whole_pixels: a TIFF tile's most
SLACK_BYTES = 4096  # besides twice its decoded bytes, what a chunk may take encoded
COMPRESSORS = ("blosc", "zstd", "lz4", "gzip", "zlib", "bz2")
_WRITE = (
    "write the store with blosc (the default of bioformats2raw, ome-zarr-py and zarr), zstd, "
    "lz4 or gzip compression, or none, without filters or sharding"
)
_SIZED = "write the store with a Zarr library: its zstd frames declare their size"
_DAMAGED = "the chunk is damaged, or was not written by a Zarr library; copy the store again"
_FORGED = "it is not what a Zarr library writes (a few kB); write the store again"
_AGAIN = "no microscope or scanner makes such an image; write the store again from the original"
_AXIS_NAMES = {"y": "rows", "x": "columns", "t": "time points", "c": "channels", "z": "Z slices"}
_JSON_SPECIAL = re.compile(rb'["\\\[\]{}]')
_ZSTD_MAGIC = 0xFD2FB528


class Refused(ValueError):
    """What a store holds or declares that is not read: the problem and the next step."""

    def __init__(self, message: str, hint: str) -> None:
        super().__init__(message)
        self.message, self.hint = message, hint


@dataclass(frozen=True)
class Chunks:
    """How one array's chunks are stored: their shape and type, and their one compressor."""

    path: str  # the array's key in the store
    shape: tuple[int, ...]
    dtype: str
    compressor: str = ""  # one of COMPRESSORS, or "": none
    trailer: int = 0  # bytes after the compressed frame (a crc32c)

    @property
    def decoded(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    @property
    def max_stored(self) -> int:
        return 2 * self.decoded + SLACK_BYTES + self.trailer

    def __str__(self) -> str:
        return f"a chunk of {'×'.join(map(str, self.shape))} {self.dtype}"


def chunks_of(array: Any) -> Chunks:
    """How the zarr ``array``'s chunks are stored (from the metadata zarr parsed); Refused
    where its codecs are not ones whose output can be known before they run."""
    meta, path = array.metadata, array.path
    if meta.zarr_format == 2:
        if meta.filters:
            names = ", ".join(f.codec_id for f in meta.filters)
            raise Refused(f"filters array '{path}' with {names} before compressing it", _WRITE)
        compressor, trailer = ("" if meta.compressor is None else meta.compressor.codec_id), 0
    else:
        compressor, trailer = _v3_codecs([c.to_dict()["name"] for c in meta.codecs], path)
    if compressor and compressor not in COMPRESSORS:
        raise Refused(f"compresses array '{path}' with {compressor}, which watchd does not "
                      "decode: it cannot tell what a chunk inflates to before it does",
                      _WRITE)  # fmt: skip
    return Chunks(path, tuple(array.chunks), str(array.dtype), compressor, trailer)


def _v3_codecs(names: Sequence[str], path: str) -> tuple[str, int]:
    """(compressor, trailer bytes) of a Zarr v3 codec chain that is ``transpose``\\* ``bytes``
    [compressor] [``crc32c``]; Refused otherwise."""
    rest = list(names)
    while rest[:1] == ["transpose"]:
        rest.pop(0)
    if rest[:1] != ["bytes"]:
        if rest[:1] == ["sharding_indexed"]:
            raise Refused(f"stores array '{path}' in shards (sharding_indexed), which watchd "
                          "does not read", _WRITE)  # fmt: skip
        raise Refused(f"encodes array '{path}' with {', '.join(names)}, which watchd does not "
                      "decode", _WRITE)  # fmt: skip
    rest.pop(0)
    trailer = 4 if rest[-1:] == ["crc32c"] else 0
    compressors = [name.removeprefix("numcodecs.") for name in rest[: len(rest) - bool(trailer)]]
    if len(compressors) > 1:
        raise Refused(f"compresses array '{path}' with {', '.join(compressors)} one after the "
                      "other", _WRITE)  # fmt: skip
    return (compressors[0] if compressors else ""), trailer


def check_declared(array: Any, axes: Sequence[str], max_pixels: int) -> None:
    """Refused unless the zarr ``array`` (its dimensions named ``axes``, y and x last) declares
    a plausible image in chunks a job may decode one at a time: every dimension at least 1 and
    at most MAX_SIDE (y, x) or MAX_AXIS; a plane of at most MAX_PLANE_PIXELS, cut into at most
    MAX_PLANE_CHUNKS; a chunk of at most ``max_pixels`` pixels (as a TIFF's strip or tile,
    :func:`pipelines.bounds.check_windowable`) and, all its dimensions and the sample's bytes
    counted, at most ``max_pixels`` × PIXEL_BYTES bytes."""
    path, shape, chunks = array.path, tuple(array.shape), tuple(array.chunks)
    for axis, size in zip(axes, shape, strict=True):
        most = MAX_SIDE if axis in "yx" else MAX_AXIS
        if not 1 <= size <= most:
            said = "it holds no image" if size < 1 else f"more than the {spaced(most)} watchd reads"
            name = _AXIS_NAMES.get(axis, axis)
            raise Refused(f"declares array '{path}' with {spaced(size)} {name}: {said}", _AGAIN)
    height, width = shape[-2:]
    if height * width > MAX_PLANE_PIXELS:
        raise Refused(f"declares array '{path}' of {width}×{height} pixels "
                      f"({spaced(height * width)}), more than the {spaced(MAX_PLANE_PIXELS)} "
                      "watchd reads in one plane", _AGAIN)  # fmt: skip
    if min(chunks) < 1:
        raise Refused(f"declares array '{path}' in chunks of {chunks}", _AGAIN)
    _check_chunk_size(array, path, chunks, max_pixels)
    rows, columns = chunks[-2:]
    cut = math.ceil(height / rows) * math.ceil(width / columns)
    if cut > MAX_PLANE_CHUNKS:
        raise Refused(
            f"cuts array '{path}' into {spaced(cut)} chunks of {columns}×{rows} pixels a plane, "
            f"more than the {spaced(MAX_PLANE_CHUNKS)} watchd reads",
            "write it in larger chunks (e.g. 512×512)",
        )


def _check_chunk_size(array: Any, path: str, chunks: tuple[int, ...], max_pixels: int) -> None:
    rows, columns = chunks[-2:]
    smaller = "write it in smaller chunks (e.g. 512×512"
    more = "or raise params.max_whole_pixels if the job has the memory"
    if rows * columns > max_pixels:
        raise Refused(
            f"stores array '{path}' in chunks of {columns}×{rows} pixels "
            f"({spaced(rows * columns)}), each of which must be decoded at once: more than "
            f"params.max_whole_pixels = {spaced(max_pixels)} allows",
            f"{smaller}: bioformats2raw --tile_width 512 --tile_height 512), {more}",
        )
    decoded = math.prod(chunks) * array.dtype.itemsize
    if decoded > max_pixels * PIXEL_BYTES:
        raise Refused(
            f"stores array '{path}' in chunks of {'×'.join(map(str, chunks))} {array.dtype}, "
            f"{spaced(decoded)} bytes each decoded: more than the "
            f"{spaced(max_pixels * PIXEL_BYTES)} that params.max_whole_pixels = "
            f"{spaced(max_pixels)} allows ({PIXEL_BYTES} bytes a pixel, a TIFF tile's most)",
            f"{smaller}, one channel, time point and Z slice in each), {more}",
        )


class Guard:
    """What each read of one store may take (:class:`pipelines.omezarr.FolderStore` asks):
    a metadata file by its size and nesting, a chunk by its array's :class:`Chunks`, admitted
    before any chunk of that array is read. Nothing else is read."""

    def __init__(self) -> None:
        self.arrays: list[Chunks] = []

    def admit(self, chunks: Chunks) -> None:
        self.arrays.append(chunks)

    def limit(self, key: str) -> int:
        """The most bytes ``key`` may hold (the store reads one more, to tell)."""
        if _is_metadata(key):
            return MAX_METADATA_BYTES
        return self._array(key).max_stored

    def check(self, key: str, data: bytes) -> None:
        """Refused unless ``data``, read as ``key``, is within its bounds."""
        if _is_metadata(key):
            if len(data) > MAX_METADATA_BYTES:
                raise Refused(f"has Zarr metadata '{key}' of more than "
                              f"{spaced(MAX_METADATA_BYTES)} bytes", _FORGED)  # fmt: skip
            if json_depth(data) > MAX_METADATA_DEPTH:
                raise Refused(f"has Zarr metadata '{key}' nested more than "
                              f"{MAX_METADATA_DEPTH} levels deep", _FORGED)  # fmt: skip
            return
        chunks = self._array(key)
        if len(data) > chunks.max_stored:
            raise Refused(f"has chunk '{key}' of more than {spaced(chunks.max_stored)} bytes, "
                          f"more than {chunks} can need encoded", _DAMAGED)  # fmt: skip
        check_frame(key, data[: len(data) - chunks.trailer], chunks)

    def _array(self, key: str) -> Chunks:
        """The admitted array ``key`` is a chunk of (the deepest whose folder holds it)."""
        found = [c for c in self.arrays if key.startswith(f"{c.path}/" if c.path else "")]
        if not found:
            raise Refused(f"has '{key}', which is not a chunk of an array read", _FORGED)
        return max(found, key=lambda c: len(c.path))


def _is_metadata(key: str) -> bool:
    # .zmetadata (consolidated) is not asked for by the readers here, but bounded if it is
    return key.rpartition("/")[2] in METADATA_NAMES | {".zmetadata"}


def json_depth(data: bytes) -> int:
    """How deep the arrays and objects of the JSON text ``data`` nest (brackets in strings
    not counted), without parsing it: a parser given a document nested thousands deep fails
    in recursion, or worse."""
    depth = deepest = skip = 0
    in_string = False
    for match in _JSON_SPECIAL.finditer(data):
        at = match.start()
        if at < skip:  # the character after a backslash in a string
            continue
        char = data[at : at + 1]
        if in_string:
            if char == b"\\":
                skip = at + 2
            in_string = char != b'"'
        elif char == b'"':
            in_string = True
        elif char in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in b"]}":
            depth -= 1
    return deepest


def check_frame(key: str, frame: bytes, chunks: Chunks) -> None:
    """Refused unless the compressed ``frame`` of chunk ``key`` decodes to at most what its
    chunk holds, as its header declares it (or, for gzip, zlib and bz2, as it inflates)."""
    if not chunks.compressor:
        return  # zarr checks an uncompressed chunk's length against its shape
    try:
        if chunks.compressor in _INFLATERS:
            size = _inflated(frame, _INFLATERS[chunks.compressor], chunks.decoded)
            said = f"inflates ({chunks.compressor}) to"
        else:
            size = _DECLARED[chunks.compressor](frame)
            said = f"declares in its {chunks.compressor} header {spaced(size)} bytes decoded,"
    except (struct.error, zlib.error, OSError, IndexError) as exc:
        raise Refused(f"has chunk '{key}' that is not a {chunks.compressor} frame ({exc})",
                      _DAMAGED) from None  # fmt: skip
    if size < 0:
        raise Refused(f"has chunk '{key}' in a zstd frame that does not declare its decoded "
                      "size (it could grow without end)", _SIZED)  # fmt: skip
    if size > chunks.decoded:
        raise Refused(f"has chunk '{key}' that {said} more than the {spaced(chunks.decoded)} "
                      f"bytes {chunks} holds", _DAMAGED)  # fmt: skip


def _blosc(frame: bytes) -> int:
    """A blosc frame's decoded bytes (its header: version, flags, type size, nbytes, block
    size, cbytes), where its header agrees with its length."""
    nbytes, block, cbytes = struct.unpack_from("<4xIII", frame)
    if cbytes != len(frame) or block > nbytes:
        raise struct.error(f"its header says {cbytes} bytes compressed, {nbytes} decoded in "
                           f"blocks of {block}, where it holds {len(frame)}")  # fmt: skip
    return int(nbytes)


def _zstd(frame: bytes) -> int:
    """A zstd frame's content size, from its header (RFC 8878, 3.1.1.1); -1 where the header
    does not declare it."""
    if struct.unpack_from("<I", frame)[0] != _ZSTD_MAGIC:
        raise struct.error("it does not start as one")
    descriptor = frame[4]
    single_segment = descriptor >> 5 & 1
    size_bytes = (single_segment, 2, 4, 8)[descriptor >> 6]
    if not size_bytes:
        return -1
    at = 5 + (1 - single_segment) + (0, 1, 2, 4)[descriptor & 3]
    if len(frame) < at + size_bytes:
        raise struct.error("its header is cut short")
    return int.from_bytes(frame[at : at + size_bytes], "little") + (256 if size_bytes == 2 else 0)


def _lz4(frame: bytes) -> int:
    """The decoded bytes numcodecs' LZ4 puts before the block (little-endian, 32 bits)."""
    return int(struct.unpack_from("<I", frame)[0])


_DECLARED = {"blosc": _blosc, "zstd": _zstd, "lz4": _lz4}
_INFLATERS: dict[str, Callable[[], Any]] = {
    "gzip": lambda: zlib.decompressobj(31),
    "zlib": lambda: zlib.decompressobj(15),
    "bz2": bz2.BZ2Decompressor,
}


def _inflated(frame: bytes, inflater_of: Callable[[], Any], most: int) -> int:
    """The bytes ``frame`` inflates to (streams one after the other, as the decoders take
    them, zeros between gzip members), counted only up to ``most`` + 1: never more is held."""
    total = 0
    while frame and total <= most:
        inflater = inflater_of()
        total += len(inflater.decompress(frame, most + 1 - total))
        if not inflater.eof:  # past the bound, or cut short (the decoder then says so)
            break
        frame = inflater.unused_data.lstrip(b"\0")
    return total
