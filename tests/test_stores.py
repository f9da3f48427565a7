"""An OME-Zarr store (a folder ``*.zarr``) as an input: the manifest lists it by the folder's
name, without a size or checksum; intake waits for its metadata and for it to stop changing,
walks it without entering a link, refuses one that holds a link, a FIFO or is not a folder, and
stops looking at it once it is seen complete; ``watchctl manifest`` lists it as one input."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import tomli_w

from daemon.cli import manifest_writer
from daemon.contract.safeopen import Presence
from daemon.core.manifest import ManifestError, parse_manifest
from daemon.core.manifest_schema import Kind
from daemon.core.readiness import NotReady, Ready, Timing, Waiting, assess
from daemon.loop import inputs
from daemon.loop.inputs import check, observe

TIMING = Timing(settle_seconds=5.0, timeout_seconds=100.0)


def manifest(files: list[dict], kind: str = "inference"):
    doc = {
        "watchd": 1, "kind": kind, "owner": {"name": "A"},
        "model": {"name": "m"} if kind == "training" else {"name": "m", "version": "latest"},
        "files": files,
    }  # fmt: skip
    return parse_manifest(tomli_w.dumps(doc).encode())


def judge(folder: Path, m, previous=None, now: float = 0.0):
    return assess(m, observe(folder, m), previous, 0.0, now, TIMING)


def store(folder: Path, chunks: int = 3) -> Path:
    """A small store in Zarr v2's layout: group metadata at its top, an array's chunks below."""
    top = folder / "slide.ome.zarr"
    (top / "0" / "0").mkdir(parents=True)
    (top / ".zgroup").write_text('{"zarr_format": 2}')
    (top / ".zattrs").write_text('{"multiscales": []}')
    (top / "0" / ".zarray").write_text("{}")
    for i in range(chunks):
        (top / "0" / "0" / str(i)).write_bytes(b"c" * (100 + i))
    return top


def test_a_store_is_one_input_of_its_files_bytes_ready_once_it_stops_changing(
    drop_root: Path,
) -> None:
    top = store(drop_root)
    m = manifest([{"path": "slide.ome.zarr"}])
    first = judge(drop_root, m, now=0.0)
    assert isinstance(first, Waiting) and first.problems == ()
    (top / "0" / "0" / "3").write_bytes(b"late chunk")  # the copy goes on
    second = judge(drop_root, m, first.settle, now=4.0)
    assert isinstance(second, Waiting) and second.settle.since == 4.0
    ready = judge(drop_root, m, second.settle, now=9.0)
    assert isinstance(ready, Ready)
    (item,) = ready.inputs
    files = [p for p in top.rglob("*") if p.is_file()]
    assert item.path == "slide.ome.zarr" and item.size == sum(p.stat().st_size for p in files)


def test_a_store_without_its_metadata_yet_waits_saying_so(drop_root: Path) -> None:
    top = store(drop_root)
    (top / ".zattrs").unlink()
    (top / ".zgroup").unlink()
    waiting = judge(drop_root, manifest([{"path": "slide.ome.zarr"}]), now=1.0)
    assert isinstance(waiting, Waiting)
    assert [p.render() for p in waiting.problems] == [
        "manifest.toml, files[0]: 'slide.ome.zarr' is missing (no .zattrs or zarr.json in it "
        "yet) — not copied yet?"
    ]


@pytest.mark.parametrize("planted", ["link", "fifo"])
def test_a_store_holding_a_link_or_a_fifo_is_refused_naming_where(
    drop_root: Path, tmp_path: Path, planted: str
) -> None:
    top = store(drop_root)
    secret = tmp_path / "secret"
    secret.write_text("not yours")
    where = top / "0" / "0" / "9"
    os.symlink(secret, where) if planted == "link" else os.mkfifo(where)
    verdict = judge(drop_root, manifest([{"path": "slide.ome.zarr"}]))
    assert isinstance(verdict, NotReady) and verdict.reason == "inputs refused"
    what = "a symbolic link" if planted == "link" else "a FIFO"
    assert [p.render() for p in verdict.problems] == [
        f"manifest.toml, files[0]: 'slide.ome.zarr' holds {what} at '0/0/9': an OME-Zarr store "
        "may hold only folders and regular files — copy the OME-Zarr store itself into the "
        "batch folder, without links"
    ]


def test_a_store_whose_metadata_is_larger_than_any_zarr_library_writes_is_refused_unread(
    drop_root: Path,
) -> None:
    """The walk's own lstat tells (no file of the store is read at intake); the jobs bound
    every read of it further (tests/pipelines/test_storebounds.py)."""
    top = store(drop_root)
    (top / "0" / ".zarray").write_bytes(b" " * (2**20 + 1))
    verdict = judge(drop_root, manifest([{"path": "slide.ome.zarr"}]))
    assert isinstance(verdict, NotReady) and verdict.reason == "inputs refused"
    assert [p.message for p in verdict.problems] == [
        "'slide.ome.zarr' holds Zarr metadata '0/.zarray' of 1 048 577 bytes, more than the "
        "1 048 576 a metadata file may take: no Zarr library writes that much"
    ]
    (top / "0" / ".zarray").write_bytes(b" " * 2**20)  # at the bound: taken in
    assert isinstance(judge(drop_root, manifest([{"path": "slide.ome.zarr"}])), Waiting)


def test_a_store_that_is_a_file_or_a_link_to_a_folder_is_refused(
    drop_root: Path, tmp_path: Path
) -> None:
    (drop_root / "file.zarr").write_bytes(b"not a folder")
    store(drop_root / "real")
    os.symlink("real/slide.ome.zarr", drop_root / "linked.zarr")
    os.symlink(store(tmp_path), drop_root / "outside.zarr")
    m = manifest([{"path": "file.zarr"}, {"path": "linked.zarr"}, {"path": "outside.zarr"}])
    verdict = judge(drop_root, m)
    assert isinstance(verdict, NotReady)
    assert [p.message for p in verdict.problems] == [
        "'file.zarr' is a file: an input named '*.zarr' is an OME-Zarr store, a folder in the "
        "batch folder",
        "'linked.zarr' is a link or lies behind one: an input named '*.zarr' is an OME-Zarr "
        "store, a folder in the batch folder",
        f"'outside.zarr' leads outside the batch folder (to {tmp_path / 'slide.ome.zarr'})",
    ]


def test_a_store_seen_complete_is_not_walked_again_until_the_verification(
    drop_root: Path,
) -> None:
    top = store(drop_root)
    m = manifest([{"path": "slide.ome.zarr"}])
    first, memory = check(drop_root, m, 1000, inputs.Memory())
    second, memory = check(drop_root, m, 1000, memory)
    assert second.files == first.files and memory.complete == {"slide.ome.zarr"}
    (top / "0" / "0" / "0").write_bytes(b"rewritten")
    again, _ = check(drop_root, m, 1000, memory)
    assert again.files == first.files  # not looked at again
    verified, _ = check(drop_root, m, 1000, None)
    assert verified.files[0].size != first.files[0].size  # the verification walks it


def test_a_store_of_more_entries_than_a_check_may_look_at_is_refused(drop_root: Path) -> None:
    store(drop_root, chunks=20)
    seen, _ = check(drop_root, manifest([{"path": "slide.ome.zarr"}]), 10, None)
    assert seen.files[0].presence is Presence.INVALID
    assert seen.files[0].detail.startswith("holds more than 10 entries")


def test_a_store_has_no_size_or_checksum_and_is_not_a_training_image() -> None:
    digest = "0" * 64
    with pytest.raises(ManifestError) as caught:
        manifest([{"path": "a.ome.zarr", "size": 10, "sha256": digest}, {"path": "b.zarr"}])
    assert [p.render() for p in caught.value.problems] == [
        "manifest.toml, files[0] 'a.ome.zarr': is an OME-Zarr store, a folder: it has no one "
        "size (the batch waits until it stops changing) — remove size from this entry",
        "manifest.toml, files[0] 'a.ome.zarr': is an OME-Zarr store, a folder: it has no one "
        "sha256 (the batch waits until it stops changing) — remove sha256 from this entry",
    ]
    with pytest.raises(ManifestError) as caught:
        manifest([{"path": "a.ome.zarr"}], kind="training")
    assert "is an OME-Zarr store, a folder: it is segmented by inference only" in str(
        caught.value.problems
    )


def test_watchctl_manifest_lists_a_store_as_one_input_without_size(drop_root: Path) -> None:
    store(drop_root)
    (drop_root / "more").mkdir()
    (drop_root / "more" / "a.png").write_bytes(b"\x89PNG")
    text = manifest_writer.build(manifest_writer.ManifestRequest(
        folder=drop_root, kind=Kind.INFERENCE, model="m", owner="A", version="latest",
    ))  # fmt: skip
    m = parse_manifest(text.encode())
    assert [(f.path, f.size) for f in m.files] == [("more/a.png", 4), ("slide.ome.zarr", None)]
