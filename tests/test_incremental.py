"""Readiness checks that stay cheap on a share: a folder is looked at with one listing, an
input seen complete is not looked at again until the one verification before its batch is
queued, checks that see nothing new back off, and an event on the folder brings the next one
forward; a batch with many inputs is looked at off the loop thread."""

from __future__ import annotations

import os
import threading
import tomllib
from pathlib import Path

import tomli_w

from daemon.contract.safeopen import Presence
from daemon.core.manifest import parse_manifest
from daemon.core.manifest_schema import Kind
from daemon.core.readiness import Ready, Timing, Waiting
from daemon.core.records import Batch
from daemon.core.states import BatchState
from daemon.loop import inputs
from daemon.loop.inputs import check
from daemon.loop.waitroom import INLINE_INPUTS, Schedule, WaitRoom

TIMING = Timing(settle_seconds=1.0, timeout_seconds=1000.0)


def manifest_text(files: list[dict]) -> str:
    return tomli_w.dumps({
        "watchd": 1, "kind": "inference", "owner": {"name": "A"},
        "model": {"name": "m", "version": "latest"}, "files": files,
    })  # fmt: skip


def waiting_batch(folder: Path) -> Batch:
    return Batch(
        id=1, root=str(folder.parent), folder=folder.name, revision=1, manifest_sha256="x",
        manifest_stat="", kind=Kind.INFERENCE, title="", owner="A", contact=None,
        state=BatchState.WAITING, reason="", problems=(), detail="", run_dir="",
        watch_inputs="", created_at=0.0, updated_at=0.0, finished_at=None,
    )  # fmt: skip


def test_an_input_seen_complete_is_taken_from_memory_until_the_verification(
    drop_root: Path,
) -> None:
    (drop_root / "images").mkdir()
    image = drop_root / "images" / "a.png"
    image.write_bytes(b"x" * 10)
    m = parse_manifest(manifest_text([{"path": "images/a.png", "size": 10}]).encode())
    first, memory = check(drop_root, m, 1000, inputs.Memory())
    assert first.files[0].presence is Presence.FILE and memory.complete == {"images/a.png"}
    os.utime(image, ns=(1, 1))  # rewritten in place at the same size
    again, _ = check(drop_root, m, 1000, memory)
    assert again.files[0].mtime_ns == first.files[0].mtime_ns  # not looked at again
    verified, _ = check(drop_root, m, 1000, None)
    assert verified.files[0].mtime_ns == 1  # the verification sees everything


def test_missing_inputs_are_found_from_the_listing_and_arrivals_are_seen(drop_root: Path) -> None:
    files = [{"path": f"images/{i}.png", "size": 3} for i in range(50)]
    m = parse_manifest(manifest_text(files).encode())
    seen, memory = check(drop_root, m, 1000, inputs.Memory())
    assert {f.presence for f in seen.files} == {Presence.MISSING}
    (drop_root / "images").mkdir()
    for i in range(25):
        (drop_root / "images" / f"{i}.png").write_bytes(b"abc")
    (drop_root / "images" / "25.png").write_bytes(b"a")  # still being copied
    seen, memory = check(drop_root, m, 1000, memory)
    present = [f for f in seen.files if f.presence is Presence.FILE]
    assert len(present) == 26 and len(memory.complete) == 25


def test_a_name_spelt_in_the_other_normalisation_is_found_in_the_listing(drop_root: Path) -> None:
    (drop_root / "Bilder ä").mkdir()
    (drop_root / "Bilder ä" / "ö.png").write_bytes(b"x")  # NFC on disk
    nfd = "Bilder a\u0308/o\u0308.png"
    m = parse_manifest(manifest_text([{"path": nfd, "size": 1}]).encode())
    seen, _ = check(drop_root, m, 1000, inputs.Memory())
    assert (seen.files[0].presence, seen.files[0].path) == (Presence.FILE, "Bilder ä/ö.png")


def test_a_rewritten_input_is_caught_by_the_verification_and_the_batch_settles_again(
    drop_root: Path,
) -> None:
    folder = drop_root / "plate"
    folder.mkdir()
    (folder / "a.png").write_bytes(b"x" * 10)
    text = manifest_text([{"path": "a.png", "size": 10}])
    room = WaitRoom(TIMING, Schedule(0.1, 60.0, max_check_seconds=1.0), lambda _: text)
    batch = waiting_batch(folder)
    assert isinstance(room.verdict(batch, 1.0)[0], Waiting)
    os.utime(folder / "a.png", ns=(5, 5))  # changed after it was seen complete
    verdict = room.verdict(batch, 2.5)[0]  # settled as far as it knew; the verification:
    assert isinstance(verdict, Waiting) and verdict.settle.since == 2.5  # the change counts
    assert isinstance(room.verdict(batch, 3.6)[0], Ready)


def test_checks_that_see_nothing_new_back_off_and_an_event_brings_the_next_forward(
    drop_root: Path,
) -> None:
    folder = drop_root / "plate"
    folder.mkdir()
    text = manifest_text([{"path": "a.png", "size": 10}])
    room = WaitRoom(TIMING, Schedule(1.0, 60.0, max_check_seconds=4.0), lambda _: text)
    batch = waiting_batch(folder)
    looked_at = [t for t in (x / 2 for x in range(0, 40)) if room.verdict(batch, t)[0]]
    assert looked_at == [0.0, 1.0, 3.0, 7.0, 11.0, 15.0, 19.0]  # 1, 2, 4, then 4 s apart
    room.touched(str(drop_root), "plate")
    assert room.verdict(batch, 19.5)[0] is not None
    assert Schedule(2.0, 60.0, max_check_seconds=30.0).interval(10) == 30.0


def test_inputs_landing_undo_the_back_off_and_a_settling_batch_is_ready_the_moment_it_can_be(
    drop_root: Path,
) -> None:
    """Files landing (the watcher's mark) bring the next check to ``check_seconds`` after the
    last, however far the checks had backed off, never sooner; once all are there, the batch
    is looked at again when its settle period ends, not at the next ``check_seconds``."""
    folder = drop_root / "plate"
    (folder / "images").mkdir(parents=True)
    text = manifest_text([{"path": f"images/{i}.png", "size": 1} for i in range(2)])
    timing = Timing(settle_seconds=5.0, timeout_seconds=1000.0)
    room = WaitRoom(timing, Schedule(2.0, 60.0, max_check_seconds=30.0), lambda _: text)
    batch = waiting_batch(folder)
    (folder / "images" / "0.png").write_bytes(b"x")
    looked_at = [t for t in range(0, 40) if room.verdict(batch, float(t))[0]]
    assert looked_at == [0, 2, 6, 14, 30]  # nothing new: 2, 4, 8, 16 s apart
    room.arrived(str(drop_root), "plate")
    assert room.verdict(batch, 31.0)[0] is None  # not sooner than 2 s after the last
    (folder / "images" / "1.png").write_bytes(b"x")
    room.arrived(str(drop_root), "plate")
    verdict = room.verdict(batch, 32.0)[0]
    assert isinstance(verdict, Waiting) and not verdict.problems and verdict.settle.since == 32.0
    assert [isinstance(room.verdict(batch, t)[0], Waiting) for t in (34.0, 36.0)] == [True] * 2
    assert room.verdict(batch, 36.9)[0] is None
    assert isinstance(room.verdict(batch, 37.0)[0], Ready)  # 32 + 5 (not 38), verified
    room.arrived(str(drop_root), "elsewhere")  # no batch waits there: nothing


def test_the_folders_inputs_land_in_are_those_of_the_listed_files_and_where_patterns_start() -> (
    None
):
    document = tomllib.loads(manifest_text([
        {"path": "images/a.png", "size": 1}, {"path": "plate 2/b.tif", "size": 1},
        {"path": "c.png", "size": 1}, {"path": "deep/er/d.png", "size": 1},
        {"path": "slide.ome.zarr"},
    ]))  # fmt: skip
    document["patterns"] = [{"glob": "more/*.png"}, {"glob": "x/**/*.tif"}, {"glob": "*.png"},
                            {"glob": "y/z[0-9]/*.png"}]  # fmt: skip
    manifest = parse_manifest(tomli_w.dumps(document).encode())
    assert inputs.input_folders(manifest) == {
        "images", "plate 2", "deep/er", "slide.ome.zarr", "more", "x", "y"}  # fmt: skip


def test_a_batch_with_many_inputs_is_looked_at_off_the_loop_thread(drop_root: Path) -> None:
    folder = drop_root / "plate"
    folder.mkdir()
    files = [{"path": f"{i}.png", "size": 1} for i in range(INLINE_INPUTS + 1)]
    text = manifest_text(files)
    woken: list[Batch] = []
    room = WaitRoom(TIMING, Schedule(0.1, 60.0), lambda _: text, woken.append)
    batch = waiting_batch(folder)
    try:
        assert room.verdict(batch, 0.0)[0] is None  # handed to the thread, which wakes the loop
        names = [t.name for t in threading.enumerate()]
        assert any(n.startswith("watchd-inputs") for n in names)
        for _ in range(200):
            verdict, _changed = room.verdict(batch, 0.0)
            if verdict is not None:
                break
            threading.Event().wait(0.05)
        assert isinstance(verdict, Waiting) and len(verdict.problems) == 21  # 20 and a summary
        assert woken == [batch]
    finally:
        room.close()
