"""`watchctl manifest`'s writer: the manifest it writes is always one the daemon accepts, within
the daemon's size limit; a folder too large to list gets counted patterns instead, and the
daemon's readiness then finds exactly the listed images."""

from __future__ import annotations

from pathlib import Path

import synth

from daemon.cli.manifest_writer import ManifestRequest, compose
from daemon.core.manifest import parse_manifest
from daemon.core.manifest_schema import Kind
from daemon.core.readiness import Ready, Timing, assess
from daemon.loop.inputs import observe

LIMIT = 2048  # bytes: a listing of 24 files with checksums does not fit


def _request(folder: Path, kind: Kind = Kind.TRAINING, **options: object) -> ManifestRequest:
    masks = "masks" if kind.trains else None
    return ManifestRequest(folder, kind, "m1", "Anna", masks=masks, **options)  # type: ignore[arg-type]


def _role(path: Path) -> str:
    return "mask" if path.parent.name == "masks" else "image"


def _ready_inputs(folder: Path, text: str, limit: int) -> list[tuple[str, str]]:
    manifest = parse_manifest(text.encode(), max_bytes=limit)
    verdict = assess(manifest, observe(folder, manifest), None, 0.0, 0.0, Timing(0.0, 60.0))
    assert isinstance(verdict, Ready), verdict
    return sorted((f.path, f.role.value) for f in verdict.inputs)


def test_a_folder_that_fits_is_listed_file_by_file_with_checksums(drop_root: Path) -> None:
    folder = drop_root / "annotated"
    synth.make_batch(folder, "training", count=3, size=32, seed=1)
    composed = compose(_request(folder))
    manifest = parse_manifest(composed.text.encode())
    assert composed.note == "" and not manifest.patterns
    assert len(manifest.files) == 6 and all(f.sha256 and f.size for f in manifest.files)


def test_a_folder_too_large_to_list_gets_counted_patterns_the_daemon_accepts(
    drop_root: Path,
) -> None:
    folder = drop_root / "plate [1] ü"
    files = synth.make_batch(folder, "training", count=12, size=16, seed=1)
    (folder / "images" / "._img_0000.png").write_bytes(b"macOS resource fork")
    (folder / "images" / "odd.PNG").write_bytes((folder / "images" / "img_0001.png").read_bytes())
    (folder / "masks" / "odd.PNG").write_bytes((folder / "masks" / "img_0001.png").read_bytes())
    listed = compose(_request(folder, max_bytes=1 << 20))
    assert len(listed.text.encode()) > LIMIT  # what this test is about: it would not fit
    composed = compose(_request(folder, max_bytes=LIMIT))
    manifest = parse_manifest(composed.text.encode(), max_bytes=LIMIT)
    assert not manifest.files
    assert [(p.glob, p.role.value, p.count) for p in manifest.patterns] == [
        ("images/[!.]*.PNG", "image", 1),
        ("images/[!.]*.png", "image", 12),
        ("masks/[!.]*.PNG", "mask", 1),
        ("masks/[!.]*.png", "mask", 12),
    ]
    assert composed.note.startswith("note: listing all 26 files would make the manifest larger")
    expected = [(p.relative_to(folder).as_posix(), _role(p)) for p in files]
    expected += [("images/odd.PNG", "image"), ("masks/odd.PNG", "mask")]
    assert _ready_inputs(folder, composed.text, LIMIT) == sorted(expected)


def test_glob_characters_in_folder_names_are_matched_literally(drop_root: Path) -> None:
    folder = drop_root / "batch"
    synth.make_batch(folder / "plate [1]*?", "inference", count=30, size=16, seed=2)
    synth.make_batch(folder / "plate 1", "inference", count=2, size=16, seed=3)
    composed = compose(_request(folder, Kind.INFERENCE, checksums=False, max_bytes=LIMIT))
    manifest = parse_manifest(composed.text.encode(), max_bytes=LIMIT)
    assert [(p.glob, p.count) for p in manifest.patterns] == [
        ("plate 1/images/[!.]*.png", 2),
        ("plate [[]1][*][?]/images/[!.]*.png", 30),
    ]
    found = _ready_inputs(folder, composed.text, LIMIT)
    assert len(found) == 32 and sum(p.startswith("plate [1]*?/") for p, _ in found) == 30
