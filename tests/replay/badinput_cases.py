"""The bad-input catalogue: what experts get wrong, each as a folder maker and what its owner
must read. docs/bad-input.md lists the same cases (a test keeps the two in step).

Each case makes one batch folder under the drop root; the catalogue test drops them all at
once next to good batches and checks, per case, the status file, watchctl and the log.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import synth
import tifffile
import tomli_w
from replay import manifest_text

from daemon.core.manifest_schema import Kind

MODEL = "spheroid-unet"


@dataclass(frozen=True)
class Case:
    id: str
    what: str  # the mistake, as docs/bad-input.md names it
    make: Callable[[Path], None]
    says: str  # what the owner reads in the status file (a fragment)
    stage: str  # where it is caught: manifest | inputs | job
    root_only: bool = False
    unprivileged_only: bool = False  # root reads a file whatever its mode


def images(folder: Path, count: int = 2, **options: object) -> None:
    synth.make_batch(folder, "inference", count=count, size=32, seed=5, **options)  # type: ignore[arg-type]


def good_manifest(folder: Path, kind: Kind = Kind.INFERENCE, **options: object) -> str:
    if kind is Kind.TRAINING:
        return manifest_text(folder, kind, model=MODEL, **options).decode()
    return manifest_text(folder, kind, model=MODEL, version="latest", **options).decode()


def with_manifest(edit: Callable[[str], str], count: int = 2) -> Callable[[Path], None]:
    """Images plus a correct manifest, then ``edit`` applied to the manifest's text."""

    def make(folder: Path) -> None:
        images(folder, count)
        (folder / "manifest.toml").write_text(edit(good_manifest(folder)), encoding="utf-8")

    return make


def raw_manifest(data: bytes) -> Callable[[Path], None]:
    def make(folder: Path) -> None:
        images(folder)
        (folder / "manifest.toml").write_bytes(data)

    return make


def replace(old: str, new: str) -> Callable[[str], str]:
    def edit(text: str) -> str:
        assert old in text, f"{old!r} not in the manifest"
        return text.replace(old, new, 1)

    return edit


def add(extra: str) -> Callable[[str], str]:
    return lambda text: text + "\n" + extra + "\n"


def then_damage(
    damage: Callable[[Path], None], count: int = 2, **manifest: object
) -> Callable[[Path], None]:
    """A correct batch whose files are damaged after the manifest was written."""

    def make(folder: Path) -> None:
        images(folder, count)
        text = good_manifest(folder, **manifest)
        damage(folder)
        (folder / "manifest.toml").write_text(text, encoding="utf-8")

    return make


def image_file(folder: Path, index: int = 1) -> Path:
    return folder / "images" / f"img_{index:04d}.png"


def listed_then(change: Callable[[Path], None]) -> Callable[[Path], None]:
    """A manifest listing images/extra.png (no size), where ``change`` puts something odd."""

    def make(folder: Path) -> None:
        images(folder)
        text = good_manifest(folder) + '\n[[files]]\npath = "images/extra.png"\n'
        change(folder / "images" / "extra.png")
        (folder / "manifest.toml").write_text(text, encoding="utf-8")

    return make


def outside_link(link: Path) -> None:
    """images/extra.png → a file beside the drop root (link: root/case/images/extra.png)."""
    drop_root = link.parents[2]
    secret = drop_root.parent / "outside-secret.png"
    secret.write_bytes(b"\x89PNG not yours")
    os.symlink(secret, link)


def png_without_end(path: Path) -> None:
    data = image_file(path.parent.parent, 0).read_bytes()
    path.write_bytes(data[: len(data) // 2])


def tiff(pixels: np.ndarray) -> Callable[[Path], None]:
    def write(folder: Path) -> None:
        images(folder, 1)
        tifffile.imwrite(folder / "images" / "odd.tif", pixels)
        (folder / "manifest.toml").write_text(good_manifest(folder), encoding="utf-8")

    return write


def sparse_after_header(path: Path) -> None:
    """A real PNG's bytes, then holes up to 4 GiB (``truncate``): nothing stored past them."""
    with open(path, "wb") as handle:
        handle.write(image_file(path.parent.parent, 0).read_bytes())
        handle.truncate(4 * 2**30)


def one_compressed_strip(folder: Path) -> None:
    """A 3000×3000 TIFF in a single deflate strip (a few KB): more than max_whole_pixels."""
    images(folder, 1)
    tifffile.imwrite(folder / "images" / "plate.tif", np.zeros((3000, 3000), np.uint8),
                     compression="zlib", rowsperstrip=3000)  # fmt: skip
    (folder / "manifest.toml").write_text(good_manifest(folder), encoding="utf-8")


_NGFF = {"multiscales": [{"version": "0.4", "axes": [{"name": "y"}, {"name": "x"}],
                          "datasets": [{"path": "0"}]}]}  # fmt: skip


def forged_store(
    shape: list[int], chunks: list[int], dtype: str = "<u2", compressor: str | None = None,
    chunk: Callable[[], bytes] | None = None, attrs: str = json.dumps(_NGFF),
) -> Callable[[Path], None]:  # fmt: skip
    """One image and an OME-Zarr store ``images/bomb.ome.zarr`` written by hand, as a forger
    would (Zarr v2): a 2-D array of ``shape`` in ``chunks``, its first chunk made by ``chunk``
    if given, its group's attributes ``attrs``; both listed by watchctl manifest."""

    def make(folder: Path) -> None:
        images(folder, 1)
        store = folder / "images" / "bomb.ome.zarr"
        (store / "0").mkdir(parents=True)
        (store / ".zgroup").write_text('{"zarr_format": 2}')
        (store / ".zattrs").write_text(attrs)
        array = {"zarr_format": 2, "shape": shape, "chunks": chunks, "dtype": dtype,
                 "compressor": compressor and {"id": compressor}, "fill_value": 0,
                 "filters": None, "order": "C"}  # fmt: skip
        (store / "0" / ".zarray").write_text(json.dumps(array))
        if chunk is not None:
            (store / "0" / "0.0").write_bytes(chunk())
        (folder / "manifest.toml").write_text(good_manifest(folder), encoding="utf-8")

    return make


def zstd_bomb() -> bytes:
    """A zstd frame of 32 KB whose header declares 1 GiB, and that holds it: 8 192 RLE
    blocks of 128 KiB (4 bytes each)."""
    frame = struct.pack("<IBQ", 0xFD2FB528, 0xE0, 2**30)
    for number in range(8192):
        header = (number == 8191) | 1 << 1 | (128 * 1024) << 3
        frame += struct.pack("<I", header)[:3] + b"\x07"
    return frame


def gzip_bomb() -> bytes:
    """A gzip stream of 64 KB that inflates to 64 MiB of zeros."""
    return zlib.compress(bytes(64 * 2**20), wbits=31)


_DEEP = '{"x": ' + "[" * 100 + "]" * 100 + ", " + json.dumps(_NGFF)[1:]  # nested 100 deep


def sharded_store(folder: Path) -> None:
    """An OME-Zarr 0.5 image on Zarr v3 with its chunks in shards (what the reader refuses)."""
    import zarr

    images(folder, 1)
    group = zarr.open_group(str(folder / "images" / "bomb.ome.zarr"), mode="w", zarr_format=3)
    group.create_array("0", data=np.ones((256, 256), np.uint8), chunks=(64, 64), shards=(128, 128))
    group.attrs.update({"ome": {"version": "0.5", **_NGFF}})
    (folder / "manifest.toml").write_text(good_manifest(folder), encoding="utf-8")


def png_bit_depth_1(folder: Path) -> None:
    """A valid 1-bit PNG, which the pipeline does not take."""
    images(folder, 1)
    raw = b"".join(b"\x00" + b"\xaa" * 4 for _ in range(32))
    header = struct.pack(">IIBBBBB", 32, 32, 1, 0, 0, 0, 0)

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        )

    data = (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )
    (folder / "images" / "one-bit.png").write_bytes(data)
    (folder / "manifest.toml").write_text(good_manifest(folder), encoding="utf-8")


def duplicate_entry(text: str) -> str:
    start = text.index("[[files]]")
    end = text.index("[[files]]", start + 1)
    return text + "\n" + text[start:end]


def training_without_mask(folder: Path) -> None:
    """Written by hand (watchctl manifest refuses to write this one)."""
    synth.make_batch(folder, "training", count=2, size=32, seed=5)
    (folder / "masks" / "img_0001.png").unlink()
    files = [
        {"path": p.relative_to(folder).as_posix(), "size": p.stat().st_size,
         **({"role": "mask"} if p.parent.name == "masks" else {})}
        for p in sorted(folder.rglob("*.png"))
    ]  # fmt: skip
    document = {
        "watchd": 1,
        "kind": "training",
        "owner": {"name": "A"},
        "model": {"name": MODEL},
        "files": files,
    }
    (folder / "manifest.toml").write_text(tomli_w.dumps(document), encoding="utf-8")


def training_with_version(folder: Path) -> None:
    synth.make_batch(folder, "training", count=2, size=32, seed=5)
    text = good_manifest(folder, Kind.TRAINING)
    text = text.replace(f'name = "{MODEL}"', f'name = "{MODEL}"\nversion = "latest"')
    (folder / "manifest.toml").write_text(text, encoding="utf-8")


def pattern_too_few(folder: Path) -> None:
    images(folder, 2)
    text = 'watchd = 1\nkind = "inference"\n[owner]\nname = "A"\n[model]\nname = "spheroid-unet"\n'
    text += '[[patterns]]\nglob = "images/*.png"\ncount = 5\n'
    (folder / "manifest.toml").write_text(text, encoding="utf-8")


def manifest_symlink(folder: Path) -> None:
    images(folder)
    real = folder.parent.parent / f"real manifest of {folder.name}.toml"
    real.write_text(good_manifest(folder), encoding="utf-8")
    os.symlink(real, folder / "manifest.toml")


def manifest_fifo(folder: Path) -> None:
    images(folder)
    os.mkfifo(folder / "manifest.toml")


def manifest_folder(folder: Path) -> None:
    images(folder)
    (folder / "manifest.toml").mkdir()


def huge_manifest(folder: Path) -> None:
    images(folder)
    text = good_manifest(folder) + "\n# padding\n" + ("#" * 99 + "\n") * 700  # > 64 KiB
    (folder / "manifest.toml").write_text(text, encoding="utf-8")


def wrong_size_type(text: str) -> str:
    start = text.index("size = ")
    end = text.index("\n", start)
    return text[:start] + 'size = "big"' + text[end:]


def tampered_checksum(folder: Path) -> None:
    data = bytearray(image_file(folder).read_bytes())
    data[-20] ^= 0xFF  # inside the IEND/IDAT tail: same size, other bytes
    image_file(folder).write_bytes(bytes(data))


def pattern_through_link(folder: Path) -> None:
    """A pattern through a link to someone's home beside the drop root: nothing there may be
    listed (the catalogue test checks that 'id_rsa' appears nowhere)."""
    images(folder)
    text = good_manifest(folder) + '\n[[patterns]]\nglob = "peek/**/*"\n'
    home = folder.parent.parent / f"home beside the root ({folder.name})"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_rsa").write_bytes(b"-----BEGIN OPENSSH PRIVATE KEY-----")
    os.symlink(home, folder / "peek")
    (folder / "manifest.toml").write_text(text, encoding="utf-8")


def pattern_too_deep(folder: Path) -> None:
    images(folder)
    text = good_manifest(folder) + '\n[[patterns]]\nglob = "deep/**/*.png"\n'
    deepest = folder.joinpath("deep", *["d"] * 66)
    deepest.mkdir(parents=True)
    (deepest / "x.png").write_bytes(image_file(folder, 0).read_bytes())
    (folder / "manifest.toml").write_text(text, encoding="utf-8")


def many_duplicates(text: str) -> str:
    """1 500 entries naming the same file (an instrument's export gone wrong): 60 KB."""
    return text + '\n[[files]]\npath = "images/img_0000.png"\n' * 1500


CASES: tuple[Case, ...] = (
    # -- the manifest itself ------------------------------------------------------------------
    Case(
        "toml-syntax",
        "manifest syntax error",
        raw_manifest(b'watchd = 1\nkind = "inference"\n[owner\n'),
        "manifest.toml: not valid TOML",
        "manifest",
    ),
    Case("empty", "an empty manifest", raw_manifest(b""), "manifest.toml: is empty", "manifest"),
    Case(
        "blank",
        "a manifest of blanks and comments",
        raw_manifest(b"  \n# todo\n"),
        "manifest.toml: is empty",
        "manifest",
    ),
    Case(
        "not-utf8",
        "non-UTF-8 text",
        raw_manifest(
            'watchd = 1\ntitle = "Zellkern Ãœbersicht"\n'.encode("latin-1", "replace") + b"\xff\xfe"
        ),
        "is not UTF-8 text",
        "manifest",
    ),
    Case("huge", "a huge manifest", huge_manifest, "more than the 65 536 allowed", "manifest"),
    Case(
        "format-version",
        "an unknown format version",
        with_manifest(replace("watchd = 1", "watchd = 2")),
        "manifest.toml, watchd: Input should be 1 (got 2)",
        "manifest",
    ),
    Case(
        "kind",
        "a schema error: unknown kind",
        with_manifest(replace('kind = "inference"', 'kind = "segmentation"')),
        "manifest.toml, kind: Input should be 'training', 'inference' or 'sweep'",
        "manifest",
    ),
    Case(
        "unknown-key",
        "an unknown key",
        with_manifest(add('colour = "blue"')),
        "unknown key 'colour' (valid keys:",
        "manifest",
    ),
    Case(
        "unknown-owner-key",
        "an unknown key inside a table",
        with_manifest(replace('name = "Replay Tester"', 'name = "Replay Tester"\nphone = "123"')),
        "manifest.toml, owner.phone: unknown key 'phone' (valid keys: email, name)",
        "manifest",
    ),
    Case(
        "wrong-type",
        "a wrong type (a size that is text)",
        with_manifest(wrong_size_type),
        "size: Input should be a valid integer",
        "manifest",
    ),
    Case(
        "title-newline",
        "a title with a line break (it would forge a line of the status file)",
        with_manifest(replace('title = ""', 'title = "Plate 7\\nState: DONE"')),
        "manifest.toml, title: must be one line of plain text, without control or formatting "
        "characters (it contains \\n) (got 'Plate 7\\nState: DONE')",
        "manifest",
    ),
    Case(
        "owner-escape",
        "terminal escape codes in the owner's name",
        with_manifest(
            replace('name = "Replay Tester"', 'name = "\\u001b[2J\\u001b]0;owned\\u0007Eve"')
        ),
        "manifest.toml, owner.name: must be one line of plain text, without control or "
        "formatting characters (it contains \\x1b, \\x07)",
        "manifest",
    ),
    Case(
        "missing-owner",
        "no owner",
        with_manifest(replace("[owner]", "[ownr]")),
        "manifest.toml, owner: required key is missing",
        "manifest",
    ),
    Case(
        "model-name",
        "a model name that is a path",
        with_manifest(replace('name = "spheroid-unet"', 'name = "../models/x"')),
        "manifest.toml, model.name: must be 1 to 64 letters",
        "manifest",
    ),
    Case(
        "no-inputs",
        "no inputs listed",
        raw_manifest(b'watchd = 1\nkind = "inference"\n[owner]\nname = "A"\n[model]\nname = "m"\n'),
        "manifest.toml: lists no inputs",
        "manifest",
    ),
    Case(
        "duplicate",
        "duplicate file names",
        with_manifest(duplicate_entry),
        "is listed twice (also files[0])",
        "manifest",
    ),
    Case(
        "traversal",
        "path traversal",
        with_manifest(add('[[files]]\npath = "../../etc/passwd"')),
        "path goes up with '..'; inputs must be inside the batch folder",
        "manifest",
    ),
    Case(
        "absolute",
        "an absolute path",
        with_manifest(add('[[files]]\npath = "/etc/passwd"')),
        "path is an absolute path",
        "manifest",
    ),
    Case(
        "backslash",
        "a Windows path",
        with_manifest(add('[[files]]\npath = "images\\\\img_0000.png"')),
        "contains a backslash; use / between folders",
        "manifest",
    ),
    Case(
        "into-results",
        "an input inside results/",
        with_manifest(add('[[files]]\npath = "results/old/mask.png"')),
        "is inside 'results/', which watchd writes",
        "manifest",
    ),
    Case(
        "zero-size",
        "a zero-byte image listed with its size",
        with_manifest(add('[[files]]\npath = "images/empty.png"\nsize = 0')),
        "has size 0: an empty file is not an image",
        "manifest",
    ),
    Case(
        "bad-checksum-format",
        "a checksum that is not one",
        with_manifest(replace("sha256 = ", 'sha256 = "abc"\n# ')),
        "sha256: must be 64 hexadecimal digits",
        "manifest",
    ),
    Case(
        "param-bounds",
        "a parameter out of bounds",
        with_manifest(replace("[params]", "[params]\nthreshold = 1.5")),
        "manifest.toml, params.threshold: Input should be less than 1 (got 1.5)",
        "manifest",
    ),
    Case(
        "param-overlap",
        "windows overlapping by half or more (a job that would run practically forever)",
        with_manifest(replace("[params]", "[params]\ntile_size = 64\ntile_overlap = 63")),
        "manifest.toml, params.tile_overlap: must be less than half of tile_size (64)",
        "manifest",
    ),
    Case(
        "param-unknown",
        "an unknown parameter",
        with_manifest(replace("[params]", "[params]\ntreshold = 0.4")),
        "params.treshold: unknown key 'treshold' (valid keys: batch_size, channel, glass_tolerance, gpu_batch_size, gpu_compile, max_whole_pixels, min_object_area, mixed_precision, split_neck, threshold, tile_overlap, tile_size)",
        "manifest",
    ),
    Case(
        "param-type",
        "a parameter of the wrong type",
        with_manifest(replace("[params]", '[params]\nmin_object_area = "small"')),
        "params.min_object_area: Input should be a valid integer",
        "manifest",
    ),
    Case(
        "kind-model",
        "a kind/model mismatch: a version for a training batch",
        training_with_version,
        "model.version: is chosen by the registry for a training batch",
        "manifest",
    ),
    Case(
        "bad-version",
        "a version that is not one",
        with_manifest(replace('version = "latest"', 'version = "newest"')),
        "'newest' is not 'latest', 'best' or a version number",
        "manifest",
    ),
    Case(
        "manifest-symlink",
        "a manifest that is a symbolic link",
        manifest_symlink,
        "manifest.toml: is a symbolic link",
        "manifest",
    ),
    Case(
        "manifest-fifo",
        "a manifest that is a FIFO",
        manifest_fifo,
        "manifest.toml: is not a regular file",
        "manifest",
    ),
    Case(
        "manifest-folder",
        "a manifest that is a folder",
        manifest_folder,
        "manifest.toml: is not a regular file",
        "manifest",
    ),
    Case(
        "many-duplicates",
        "thousands of entries wrong the same way",
        with_manifest(many_duplicates),
        "… and 1 480 more like these",
        "manifest",
    ),
    Case(
        "nested",
        "a value nested thousands deep",
        with_manifest(add("x = " + "[" * 5000 + "]" * 5000)),
        "manifest.toml: is nested more than 32 levels deep",
        "manifest",
    ),
    Case(
        "email-list",
        "two addresses where one goes",
        with_manifest(replace("tester@example.org", "tester@example.org,root")),
        "owner.email: must be one e-mail address, such as name@example.org",
        "manifest",
    ),
    Case(
        "email-crlf",
        "a line break in the e-mail address",
        with_manifest(replace("tester@example.org", "tester@example.org\\r\\nBcc: root")),
        "owner.email: must be one e-mail address, such as name@example.org",
        "manifest",
    ),
    # -- the inputs on disk -------------------------------------------------------------------
    Case(
        "missing-file",
        "a missing file",
        then_damage(lambda f: image_file(f).unlink()),
        "'images/img_0001.png' is missing — not copied yet?",
        "inputs",
    ),
    Case(
        "short-file",
        "a short file",
        then_damage(lambda f: image_file(f).write_bytes(image_file(f).read_bytes()[:50])),
        "'images/img_0001.png' is 50 bytes, expected",
        "inputs",
    ),
    Case(
        "long-file",
        "a file bigger than listed",
        then_damage(lambda f: image_file(f).write_bytes(image_file(f).read_bytes() + b"junk")),
        "the file differs from the one the manifest lists",
        "inputs",
    ),
    Case(
        "symlink-out",
        "a symlink out of the folder",
        listed_then(outside_link),
        "'images/extra.png' leads outside the batch folder",
        "inputs",
    ),
    Case(
        "fifo-input",
        "a FIFO as an input",
        listed_then(os.mkfifo),
        "'images/extra.png' is a FIFO, not a regular file",
        "inputs",
    ),
    Case(
        "device-input",
        "a device file as an input",
        listed_then(lambda p: os.mknod(p, 0o600 | 0o020000, os.makedev(1, 3))),
        "'images/extra.png' is a character device, not a regular file",
        "inputs",
        root_only=True,
    ),
    Case(
        "folder-input",
        "a folder named as an input",
        listed_then(lambda p: p.mkdir()),
        "'images/extra.png' is a folder, not a regular file",
        "inputs",
    ),
    Case(
        "pattern-short",
        "a pattern matching too few files",
        pattern_too_few,
        "patterns 'images/*.png': 2 of 5 file(s) present",
        "inputs",
    ),
    Case(
        "pattern-link-out",
        "a pattern through a link to a folder outside",
        pattern_through_link,
        "patterns 'peek/**/*': 'peek' leads outside the batch folder",
        "inputs",
    ),
    Case(
        "pattern-deep",
        "a pattern over folders nested deeper than the bound",
        pattern_too_deep,
        "patterns 'deep/**/*.png': goes deeper than 64 folders, the most a pattern may",
        "inputs",
    ),
    Case(
        "unpaired",
        "a training image without its mask",
        training_without_mask,
        "has no mask with the same file name",
        "manifest",
    ),
    # -- what only reading the files shows ----------------------------------------------------
    Case("checksum", "a checksum mismatch", then_damage(tampered_checksum), "sha256 is", "job"),
    Case(
        "zero-byte",
        "a zero-byte image (size not listed)",
        listed_then(lambda p: p.write_bytes(b"")),
        "'images/extra.png'",
        "job",
    ),
    Case("corrupt", "a corrupt image", listed_then(png_without_end), "'images/extra.png'", "job"),
    Case(
        "not-an-image",
        "a non-image file",
        listed_then(lambda p: p.write_text("Sample,Well\nA1,3\n")),
        "'images/extra.png'",
        "job",
    ),
    Case(
        "bit-depth",
        "an unsupported bit depth (1-bit PNG)",
        png_bit_depth_1,
        "'images/one-bit.png'",
        "job",
    ),
    Case(
        "float-tiff",
        "an unsupported sample type (32-bit float TIFF)",
        tiff(np.zeros((32, 32), np.float32)),
        "'images/odd.tif'",
        "job",
    ),
    Case(
        "channels",
        "an unsupported channel count (2 channels)",
        tiff(np.zeros((32, 32, 2), np.uint8)),
        "'images/odd.tif'",
        "job",
    ),
    Case(
        "sparse-image",
        "a sparse file passed as an image (4 GiB of holes behind a PNG header)",
        listed_then(sparse_after_header),
        "'images/extra.png': is a sparse file: ",
        "job",
    ),
    Case(
        "compressed-strip",
        "a large TIFF compressed in one strip (it would be decoded whole)",
        one_compressed_strip,
        "stores them in compressed strips of 3000×3000 pixels",
        "job",
    ),
    Case(
        "zarr-huge-chunk",
        "an OME-Zarr store declaring shape and chunks [30000, 30000] uint16, holding no chunk "
        "(the red team's 20 KB store: 5.6 GB and thousands of windows of fill value before)",
        forged_store([30000, 30000], [30000, 30000]),
        "'images/bomb.ome.zarr': stores array '0' in chunks of 30000×30000 pixels (900 000 000)",
        "job",
    ),
    Case(
        "zarr-no-chunks",
        "an OME-Zarr store of 30000² in chunks of 512², holding none of them",
        forged_store([30000, 30000], [512, 512]),
        "has none of the 3 481 chunks of array '0' stored: all of it would be the fill value 0",
        "job",
    ),
    Case(
        "zarr-zstd-bomb",
        "an OME-Zarr chunk of 32 KB in a zstd frame that declares and holds 1 GiB",
        forged_store([256, 256], [256, 256], "|u1", "zstd", zstd_bomb),
        "has chunk '0/0.0' that declares in its zstd header 1 073 741 824 bytes decoded, more "
        "than the 65 536 bytes a chunk of 256×256 uint8 holds",
        "job",
    ),
    Case(
        "zarr-gzip-bomb",
        "an OME-Zarr chunk of 64 KB in a gzip stream that inflates to 64 MiB",
        forged_store([256, 256], [256, 256], "|u1", "gzip", gzip_bomb),
        "has chunk '0/0.0' that inflates (gzip) to more than the 65 536 bytes a chunk of 256×256 "
        "uint8 holds",
        "job",
    ),
    Case(
        "zarr-sharded",
        "an OME-Zarr store in shards (Zarr v3 sharding, which the reader cannot bound)",
        sharded_store,
        "stores array '0' in shards (sharding_indexed), which watchd does not read",
        "job",
    ),
    Case(
        "zarr-metadata-deep",
        "OME-Zarr metadata nested 100 deep",
        forged_store([256, 256], [256, 256], attrs=_DEEP),
        "has Zarr metadata '.zattrs' nested more than 32 levels deep",
        "job",
    ),
    Case(
        "zarr-metadata-huge",
        "OME-Zarr metadata of 2 MB",
        forged_store([256, 256], [256, 256], attrs=json.dumps(_NGFF).ljust(2_000_000)),
        "'images/bomb.ome.zarr' holds Zarr metadata '.zattrs' of 2 000 000 bytes, more than the "
        "1 048 576 a metadata file may take",
        "inputs",
    ),
    Case(
        "whole-pixels",
        "an image over max_whole_pixels that is not a TIFF",
        with_manifest(replace("[params]", "[params]\nmax_whole_pixels = 1")),
        "more than params.max_whole_pixels = 1 allows to segment as a whole",
        "job",
    ),
    Case(
        "unreadable-image",
        "an image the daemon's account may not read (chmod 000)",
        then_damage(lambda f: image_file(f).chmod(0)),
        "'images/img_0001.png': cannot be read (Permission denied)",
        "job",
        unprivileged_only=True,
    ),
    Case(
        "unknown-model",
        "an unknown model",
        with_manifest(replace('name = "spheroid-unet"', 'name = "no-such-model"')),
        "manifest.toml, model: no model named 'no-such-model' in the registry (models there: "
        "spheroid-unet)",
        "manifest",
    ),
    Case(
        "unknown-version",
        "an unknown model version",
        with_manifest(replace('version = "latest"', "version = 99")),
        "manifest.toml, model: model 'spheroid-unet' has no version '99' (versions: 1, best = 1, "
        "latest = 1)",
        "manifest",
    ),
)


def make_all(root: Path, cases: tuple[Case, ...]) -> None:
    for case in cases:
        folder = root / f"case {case.id}"
        folder.mkdir()
        case.make(folder)


def cleanup(root: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)
