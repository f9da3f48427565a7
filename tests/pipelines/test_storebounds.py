"""An OME-Zarr store is read within what it declares (pipelines/storebounds.py): its metadata
bounded in size and nesting before zarr parses it, its arrays' shapes, chunks and codecs
checked before a chunk is read, each chunk file read only up to what its chunk can need
encoded and refused before its decoder allocates where it would inflate past its chunk. Each
refusal names the input, the figures and what decides; a store of fill value only is not an
image, and windows over chunks a store leaves out are skipped as glass is. Stores written with
every codec allowed still read bit for bit."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import textwrap
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numcodecs
import numpy as np
import pytest
import zarr
from zarr.codecs import BloscCodec, Crc32cCodec, GzipCodec, TransposeCodec, ZstdCodec
from zarr.core.sync import cleanup_resources

from daemon.contract.heldfolder import HeldFolder
from daemon.contract.jobspec import InputFile
from pipelines.job import InputError
from pipelines.ngff import StoreReader
from pipelines.omezarr import LabelImage, overview_and_labels
from pipelines.storebounds import Refused, json_depth
from pipelines.tiles import segment_tiled

ITEM = InputFile("images/bomb.ome.zarr")
MiB = 2**20
V3_CODECS = {
    "zstd": {"level": 0, "checksum": False},
    "gzip": {"level": 5},
    "blosc": {"typesize": 2, "cname": "zstd", "clevel": 5, "shuffle": "shuffle", "blocksize": 0},
}


@pytest.fixture(autouse=True)
def zarr_threads_stopped() -> Iterator[None]:
    yield
    cleanup_resources()


def multiscales(axes: str, fmt: int) -> dict[str, Any]:
    found = {"axes": [{"name": a} for a in axes], "datasets": [{"path": "0"}]}
    if fmt == 2:
        return {"multiscales": [{**found, "version": "0.4"}]}
    return {"ome": {"version": "0.5", "multiscales": [found]}}


def hand_store(
    path: Path, shape: list[int], chunks: list[int], *, fmt: int = 2, dtype: str = "uint16",
    codec: str | None = None, files: dict[str, bytes] | None = None, axes: str = "",
) -> Path:  # fmt: skip
    """A store written by hand, as a forger would: its metadata, then ``files`` (chunk keys
    relative to the array, as its format names them) and nothing else. ``codec``: v2's
    compressor id, or v3's one bytes-to-bytes codec."""
    axes = axes or "tczyx"[-len(shape) :]
    (path / "0").mkdir(parents=True)
    if fmt == 2:
        (path / ".zgroup").write_text('{"zarr_format": 2}')
        (path / ".zattrs").write_text(json.dumps(multiscales(axes, 2)))
        array = {"zarr_format": 2, "shape": shape, "chunks": chunks, "order": "C",
                 "dtype": np.dtype(dtype).str, "fill_value": 0, "filters": None,
                 "compressor": None if codec is None else {"id": codec}}  # fmt: skip
        (path / "0" / ".zarray").write_text(json.dumps(array))
    else:
        group = {"zarr_format": 3, "node_type": "group", "attributes": multiscales(axes, 3)}
        (path / "zarr.json").write_text(json.dumps(group))
        codecs = [{"name": "bytes", "configuration": {"endian": "little"}}]
        codecs += [] if codec is None else [{"name": codec, "configuration": V3_CODECS[codec]}]
        array = {"zarr_format": 3, "node_type": "array", "shape": shape, "data_type": dtype,
                 "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunks}},
                 "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
                 "fill_value": 0, "codecs": codecs}  # fmt: skip
        (path / "0" / "zarr.json").write_text(json.dumps(array))
    for key, data in (files or {}).items():
        (path / "0" / key).parent.mkdir(parents=True, exist_ok=True)
        (path / "0" / key).write_bytes(data)
    return path


def first_chunk(fmt: int) -> str:
    return "0.0" if fmt == 2 else "c/0/0"


def refusal(path: Path, max_pixels: int = 4_194_304, rows: int = 64) -> str:
    """What reading ``rows`` rows of the store says (InputError, naming the input)."""
    with HeldFolder.open(path) as folder, pytest.raises(InputError) as caught:
        reader = StoreReader(folder, ITEM, 256, max_pixels=max_pixels)
        try:
            reader.region(0, rows, 0, reader.width)
        finally:
            reader.close()
    (problem,) = caught.value.problems
    assert problem.where == "input 'images/bomb.ome.zarr'" and problem.hint
    return problem.message


def zstd_frame(blocks: int, content_size: int | None) -> bytes:
    """A zstd frame of ``blocks`` RLE blocks of 128 KiB (4 bytes each: what makes a bomb),
    declaring ``content_size`` in its header, or nothing (then not a single segment)."""
    if content_size is None:
        frame = struct.pack("<IBB", 0xFD2FB528, 0x00, 0x58)  # window descriptor, no size
    else:
        frame = struct.pack("<IBQ", 0xFD2FB528, 0xE0, content_size)  # 8-byte size, one segment
    for number in range(blocks):
        header = (number == blocks - 1) | 1 << 1 | (128 * 1024) << 3  # last?, RLE, size
        frame += struct.pack("<I", header)[:3] + b"\x07"
    return frame


def gzip_of_zeros(count: int) -> bytes:
    """A gzip member of ``count`` zero bytes (about a thousandth of it), made a MiB at a time."""
    deflater = zlib.compressobj(9, zlib.DEFLATED, 31)
    parts = [deflater.compress(bytes(MiB)) for _ in range(count // MiB)]
    return b"".join([*parts, deflater.flush()])


# -- the red team's store, and bombs: refused before anything is allocated ---------------------

PEAK_PROBE = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from daemon.contract.heldfolder import HeldFolder
    from daemon.contract.jobspec import InputFile
    from pipelines.job import InputError
    from pipelines.ngff import StoreReader

    def peak_kb():
        with open("/proc/self/status") as status:
            return int(next(l for l in status if l.startswith("VmHWM")).split()[1])

    said = []
    for number, path in enumerate(sys.argv[1:]):
        with HeldFolder.open(Path(path)) as folder:
            try:
                reader = StoreReader(folder, InputFile("images/bomb.ome.zarr"), 256)
                try:
                    grey = reader.region(0, 256, 0, 256)
                finally:
                    reader.close()
                said.append(f"read {float(grey.sum()):.0f}")
            except InputError as exc:
                said.append(exc.problems[0].message)
        if number == 0:
            before = peak_kb()
    print(json.dumps({"said": said, "before_kb": before, "after_kb": peak_kb()}))
""")


def test_the_red_team_store_and_chunk_bombs_are_refused_before_the_decoder_allocates(
    tmp_path: Path,
) -> None:
    """In a process of its own: a good store is read first (the process's peak RSS then is
    the baseline), then the red team's store (a .zarray declaring shape and chunks [30000,
    30000] uint16, no chunk files: 1.8 GB a chunk) and chunks that would inflate to 768 MiB
    or more (a zstd frame declaring 1 GiB, one declaring nothing, a gzip stream, in v2 and v3
    stores). Each is refused naming what it is, and all of them together add less than
    100 MB to the peak."""
    good = hand_store(tmp_path / "good", [256, 256], [256, 256], dtype="uint8", codec="zstd",
                      files={"0.0": numcodecs.Zstd().encode(np.full(65536, 255, np.uint8))})  # fmt: skip
    red = hand_store(tmp_path / "red", [30000, 30000], [30000, 30000])
    bombs = [
        hand_store(tmp_path / f"zstd v{fmt}", [1024, 1024], [256, 256], fmt=fmt, dtype="uint8",
                   codec="zstd", files={first_chunk(fmt): zstd_frame(8192, 2**30)})
        for fmt in (2, 3)
    ]  # fmt: skip
    bombs.append(hand_store(tmp_path / "zstd unsized", [1024, 1024], [256, 256], dtype="uint8",
                            codec="zstd", files={"0.0": zstd_frame(8192, None)}))  # fmt: skip
    bombs.append(hand_store(tmp_path / "gzip", [1024, 1024], [512, 512], fmt=3, codec="gzip",
                            files={"c/0/0": gzip_of_zeros(768 * MiB)}))  # fmt: skip
    probe = subprocess.run(
        [sys.executable, "-c", PEAK_PROBE, *map(str, [good, red, *bombs])],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    found = json.loads(probe.stdout)
    assert found["said"] == [
        "read 65536",
        "stores array '0' in chunks of 30000×30000 pixels (900 000 000), each of which must be "
        "decoded at once: more than params.max_whole_pixels = 4 194 304 allows",
        "has chunk '0/0.0' that declares in its zstd header 1 073 741 824 bytes decoded, more "
        "than the 65 536 bytes a chunk of 256×256 uint8 holds",
        "has chunk '0/c/0/0' that declares in its zstd header 1 073 741 824 bytes decoded, "
        "more than the 65 536 bytes a chunk of 256×256 uint8 holds",
        "has chunk '0/0.0' in a zstd frame that does not declare its decoded size (it could "
        "grow without end)",
        "has chunk '0/c/0/0' that inflates (gzip) to more than the 524 288 bytes a chunk of "
        "512×512 uint16 holds",
    ]
    assert found["after_kb"] - found["before_kb"] < 100 * 1024, found


# -- what a store declares -------------------------------------------------------------------


@pytest.mark.parametrize("fmt", [2, 3])
def test_a_chunk_larger_than_a_tiff_tile_may_be_is_refused_by_its_pixels_and_its_bytes(
    tmp_path: Path, fmt: int
) -> None:
    """A chunk's y × x is bounded by max_whole_pixels, as a TIFF's strip or tile; its bytes,
    every dimension and the sample's size counted, by max_whole_pixels × 8."""
    wide = hand_store(tmp_path / "wide", [30000, 30000], [30000, 30000], fmt=fmt)
    assert refusal(wide) == (
        "stores array '0' in chunks of 30000×30000 pixels (900 000 000), each of which must be "
        "decoded at once: more than params.max_whole_pixels = 4 194 304 allows"
    )
    deep = hand_store(tmp_path / "deep", [1, 5, 1, 64, 64], [1, 5, 1, 64, 64], fmt=fmt)
    assert refusal(deep, max_pixels=4096) == (
        "stores array '0' in chunks of 1×5×1×64×64 uint16, 40 960 bytes each decoded: more "
        "than the 32 768 that params.max_whole_pixels = 4 096 allows (8 bytes a pixel, a TIFF "
        "tile's most)"
    )


@pytest.mark.parametrize(
    ("shape", "chunks", "said"),
    [
        ([0, 100], [64, 64], "declares array '0' with 0 rows: it holds no image"),
        ([100, 300000], [64, 64], "declares array '0' with 300 000 columns: more than the "
                                  "262 144 watchd reads"),
        ([70000, 4, 64, 64], [1, 1, 64, 64], "declares array '0' with 70 000 time points: more "
                                             "than the 65 536 watchd reads"),
        ([2**17, 2**18], [2048, 2048], "declares array '0' of 262144×131072 pixels "
                                       "(34 359 738 368), more than the 17 179 869 184 watchd "
                                       "reads in one plane"),
        ([65536, 65536], [32, 32], "cuts array '0' into 4 194 304 chunks of 32×32 pixels a "
                                   "plane, more than the 1 048 576 watchd reads"),
    ],
)  # fmt: skip
def test_a_shape_no_image_has_is_refused_before_a_chunk_is_read(
    tmp_path: Path, shape: list[int], chunks: list[int], said: str
) -> None:
    axes = "tcyx"[-len(shape) :]
    assert refusal(hand_store(tmp_path / "s", shape, chunks, fmt=3, axes=axes)) == said


@pytest.mark.parametrize(
    ("fmt", "codecs", "said"),
    [
        (2, {"compressors": numcodecs.LZMA()}, "compresses array '0' with lzma, which watchd "
         "does not decode: it cannot tell what a chunk inflates to before it does"),
        (2, {"filters": [numcodecs.Delta(dtype="u2")]}, "filters array '0' with delta before "
         "compressing it"),
        (3, {"shards": (128, 128)}, "stores array '0' in shards (sharding_indexed), which "
         "watchd does not read"),
        (3, {"compressors": [ZstdCodec(), GzipCodec()]}, "compresses array '0' with zstd, gzip "
         "one after the other"),
    ],
)  # fmt: skip
def test_a_codec_whose_output_cannot_be_bounded_is_refused_naming_it(
    tmp_path: Path, fmt: int, codecs: dict[str, Any], said: str
) -> None:
    group = zarr.open_group(str(tmp_path / "s"), mode="w", zarr_format=fmt)
    group.create_array("0", data=np.ones((256, 256), np.uint16), chunks=(64, 64), **codecs)
    group.attrs.update(multiscales("yx", fmt))
    assert refusal(tmp_path / "s") == said


@pytest.mark.parametrize(
    "codecs",
    [
        {"compressors": numcodecs.Blosc(cname="zstd", shuffle=numcodecs.Blosc.BITSHUFFLE)},
        {"compressors": numcodecs.Blosc(cname="lz4")},
        {"compressors": numcodecs.Zstd(level=3)},
        {"compressors": numcodecs.LZ4()},
        {"compressors": numcodecs.GZip()},
        {"compressors": numcodecs.Zlib()},
        {"compressors": numcodecs.BZ2()},
        {"compressors": None},
        {"zarr_format": 3},
        {"zarr_format": 3, "compressors": BloscCodec(cname="zstd", shuffle="bitshuffle")},
        {"zarr_format": 3, "compressors": [GzipCodec(), Crc32cCodec()]},
        {"zarr_format": 3, "filters": [TransposeCodec(order=(1, 0))], "compressors": None},
    ],
    ids=["blosc-zstd", "blosc-lz4", "zstd", "lz4", "gzip", "zlib", "bz2", "none", "v3",
         "v3-blosc", "v3-gzip-crc32c", "v3-transpose"],
)  # fmt: skip
def test_every_codec_allowed_reads_bit_for_bit(tmp_path: Path, codecs: dict[str, Any]) -> None:
    """Chunks compressed well (the uniform rows) and not at all (the noise), and edge chunks."""
    fmt = codecs.pop("zarr_format", 2)
    pixels = np.random.default_rng(3).integers(0, 65535, (300, 200), dtype=np.uint16)
    pixels[:100] = 7
    group = zarr.open_group(str(tmp_path / "s"), mode="w", zarr_format=fmt)
    group.create_array("0", data=pixels, chunks=(64, 64), **codecs)
    group.attrs.update(multiscales("yx", fmt))
    with HeldFolder.open(tmp_path / "s") as folder:
        reader = StoreReader(folder, ITEM, 256)
        try:
            grey = reader.region(0, 300, 0, 200)
        finally:
            reader.close()
    np.testing.assert_array_equal(np.round(grey * 65535).astype(np.uint16), pixels)


# -- what its files hold ---------------------------------------------------------------------


def test_metadata_too_large_or_nested_too_deep_is_refused_before_zarr_parses_it(
    tmp_path: Path,
) -> None:
    """Consolidated metadata (.zmetadata) is not read at all: each node's is."""
    unread = hand_store(tmp_path / "unread", [64, 64], [64, 64], files={"0.0": bytes(8192)})
    (unread / ".zmetadata").write_bytes(b"[" * 2 * MiB)
    with HeldFolder.open(unread) as folder:
        reader = StoreReader(folder, ITEM, 256)
        assert reader.region(0, 64, 0, 64).tolist() == np.zeros((64, 64)).tolist()
        reader.close()
    large = hand_store(tmp_path / "large", [64, 64], [64, 64])
    attrs = multiscales("yx", 2) | {"padding": " " * MiB}
    (large / ".zattrs").write_text(json.dumps(attrs))
    assert refusal(large) == "has Zarr metadata '.zattrs' of more than 1 048 576 bytes"
    deep = hand_store(tmp_path / "deep", [64, 64], [64, 64], fmt=3)
    group = json.loads((deep / "zarr.json").read_text())
    group["attributes"]["nested"] = json.loads("[" * 100 + "]" * 100)  # zarr would parse it
    (deep / "zarr.json").write_text(json.dumps(group))
    assert refusal(deep) == "has Zarr metadata 'zarr.json' nested more than 32 levels deep"


def test_json_depth_counts_brackets_outside_strings_only() -> None:
    assert json_depth(b'{"a": [1, {"b": "[[[{{{"}], "c\\"[": "\\\\"}') == 3
    assert json_depth(b'"[[[["') == 0 and json_depth(b"[[[]]]") == 3


@pytest.mark.parametrize(
    ("fmt", "codec", "chunk", "said"),
    [
        (2, None, bytes(3 * 8192), "has chunk '0/0.0' of more than 20 480 bytes, more than a "
         "chunk of 64×64 uint16 can need encoded"),
        (3, "blosc", struct.pack("<BBBBIII", 2, 1, 0x95, 2, 2**31, 2**16, 16), "has chunk "
         "'0/c/0/0' that declares in its blosc header 2 147 483 648 bytes decoded, more than the "
         "8 192 bytes a chunk of 64×64 uint16 holds"),
        (2, "blosc", struct.pack("<BBBBIII", 2, 1, 0x95, 2, 8192, 8192, 999), "has chunk '0/0.0' "
         "that is not a blosc frame (its header says 999 bytes compressed, 8192 decoded in "
         "blocks of 8192, where it holds 16)"),
        (2, "lz4", struct.pack("<I", 2**30) + bytes(12), "has chunk '0/0.0' that declares in its "
         "lz4 header 1 073 741 824 bytes decoded, more than the 8 192 bytes a chunk of 64×64 "
         "uint16 holds"),
        (3, "zstd", zstd_frame(2, 2**26), "has chunk '0/c/0/0' that declares in its zstd header "
         "67 108 864 bytes decoded, more than the 8 192 bytes a chunk of 64×64 uint16 holds"),
        (2, "zstd", b"not a zstd frame", "has chunk '0/0.0' that is not a zstd frame (it does not "
         "start as one)"),
        (2, "zlib", zlib.compress(bytes(8193)), "has chunk '0/0.0' that inflates (zlib) to more "
         "than the 8 192 bytes a chunk of 64×64 uint16 holds"),
        (2, "gzip", 2 * zlib.compress(b"", wbits=31) + gzip_of_zeros(MiB), "has chunk '0/0.0' "
         "that inflates (gzip) to more than the 8 192 bytes a chunk of 64×64 uint16 holds"),
        (2, "bz2", numcodecs.BZ2().encode(bytes(MiB)), "has chunk '0/0.0' that inflates (bz2) to "
         "more than the 8 192 bytes a chunk of 64×64 uint16 holds"),
    ],
)  # fmt: skip
def test_a_chunk_larger_than_its_array_declares_is_refused_before_it_is_decoded(
    tmp_path: Path, fmt: int, codec: str | None, chunk: bytes, said: str
) -> None:
    store = hand_store(tmp_path / "s", [64, 64], [64, 64], fmt=fmt, codec=codec,
                       files={first_chunk(fmt): chunk})  # fmt: skip
    assert refusal(store) == said


def test_the_report_reads_a_label_image_within_the_same_bounds(tmp_path: Path) -> None:
    """The owner may alter results/: a planted bomb chunk in a label image's overview is
    refused (a ValueError, which the report warns about) before it is decoded."""
    with HeldFolder.open(tmp_path) as folder:
        labels = LabelImage(folder, 300, 300)
        labels.finish(np.full((300, 300), 9, np.uint8), 1)
        labels.close()
        bomb = struct.pack("<BBBBIII", 2, 1, 0x95, 1, 2**31, 2**16, 16)
        (tmp_path / "0" / "0" / "0").write_bytes(bomb)
        with pytest.raises(Refused) as caught:
            overview_and_labels(folder)
    assert isinstance(caught.value, ValueError) and caught.value.message == (
        "has chunk '0/0/0' that declares in its blosc header 2 147 483 648 bytes decoded, more "
        "than the 262 144 bytes a chunk of 512×512 uint8 holds"
    )


# -- chunks it does not hold -----------------------------------------------------------------


@pytest.mark.parametrize("fmt", [2, 3])
def test_a_store_holding_none_of_its_images_chunks_is_not_an_image(
    tmp_path: Path, fmt: int
) -> None:
    """The red team's store again, in chunks a job may decode: 3 481 windows' worth of fill
    value. Chunks of another channel than the one read do not make it one."""
    store = hand_store(tmp_path / "s", [30000, 30000], [512, 512], fmt=fmt)
    assert refusal(store) == (
        "has none of the 3 481 chunks of array '0' stored: all of it would be the fill value "
        "0, which is not an image"
    )
    other = bytes(2 * 512 * 512)
    channels = hand_store(tmp_path / "c", [2, 3000, 3000], [1, 512, 512], fmt=fmt, axes="cyx",
                          files={"1.0.0" if fmt == 2 else "c/1/0/0": other})  # fmt: skip
    with HeldFolder.open(channels) as folder, pytest.raises(InputError) as caught:
        StoreReader(folder, ITEM, 256, channel=0)
    assert caught.value.problems[0].message == (
        "has none of the 36 chunks of array '0' stored for the plane read: all of it would be "
        "the fill value 0, which is not an image"
    )


def test_windows_over_chunks_a_store_leaves_out_are_skipped_as_glass_and_counted(
    tmp_path: Path,
) -> None:
    """A 2048² store of which one chunk of 256² is stored (bright discs on black): only the
    windows over it run; the objects are those of the chunk; the other windows count as
    skipped, as windows over glass do."""
    rows, columns = np.ogrid[:256, :256]
    chunk = np.where((rows % 64 - 32) ** 2 + (columns % 64 - 32) ** 2 < 100, 200, 0)
    store = hand_store(tmp_path / "s.zarr", [2048, 2048], [256, 256], dtype="uint8",
                       files={"3.4": chunk.astype(np.uint8).tobytes()})  # fmt: skip
    (tmp_path / "out").mkdir()
    with HeldFolder.open(store) as folder, HeldFolder.open(tmp_path / "out") as out:
        reader = StoreReader(folder, ITEM, 512 + 512)
        try:
            result = segment_tiled(reader, out, "s.ome.zarr",
                                   lambda tiles: np.where(tiles > 0.5, 0.95, 0.05),
                                   threshold=0.5, min_area=4, window=256, overlap=32)  # fmt: skip
        finally:
            reader.close()
    assert result.objects == 16 and result.area == 16 * int((chunk[:64, :64] > 0).sum())
    boxes = {(row["bbox_top"] // 256, row["bbox_left"] // 256) for row in result.table}
    assert boxes == {(3, 4)}
    # windows of 256² every 224 pixels, 9 × 9 of them; the chunk's rows 768:1024 are reached
    # by the windows starting at 672 and 896, its columns 1024:1280 by those at 896 and 1120
    assert (result.windows_run, result.windows_glass) == (4, 77)
