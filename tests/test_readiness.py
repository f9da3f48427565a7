"""Readiness, on real folders: a batch starts only when every input is complete and has been
unchanged for the settle period; missing and short files wait until the timeout; inputs that
lead outside the folder or are not regular files are refused at once."""

from __future__ import annotations

import os
from pathlib import Path

import tomli_w

from daemon.core.manifest import parse_manifest
from daemon.core.readiness import NotReady, Ready, Timing, Waiting, assess
from daemon.loop.inputs import observe

TIMING = Timing(settle_seconds=5.0, timeout_seconds=100.0)


def manifest(files: list[dict], patterns: list[dict] | None = None, kind: str = "inference"):
    doc = {
        "watchd": 1, "kind": kind, "owner": {"name": "A"},
        "model": {"name": "m"} if kind == "training" else {"name": "m", "version": "latest"},
        "files": files, "patterns": patterns or [],
    }  # fmt: skip
    return parse_manifest(tomli_w.dumps(doc).encode())


def judge(folder: Path, m, previous=None, since: float = 0.0, now: float = 0.0):
    return assess(m, observe(folder, m), previous, since, now, TIMING)


def test_complete_inputs_wait_for_the_settle_period_then_are_ready(drop_root: Path) -> None:
    (drop_root / "ä b.png").write_bytes(b"x" * 10)
    m = manifest([{"path": "ä b.png", "size": 10}])
    first = judge(drop_root, m, now=1.0)
    assert isinstance(first, Waiting) and first.problems == ()
    assert isinstance(judge(drop_root, m, first.settle, now=5.9), Waiting)
    ready = judge(drop_root, m, first.settle, now=6.0)
    assert isinstance(ready, Ready) and ready.inputs[0].path == "ä b.png"


def test_a_change_restarts_the_settle_period(drop_root: Path) -> None:
    path = drop_root / "a.png"
    path.write_bytes(b"x" * 10)
    m = manifest([{"path": "a.png"}])
    first = judge(drop_root, m, now=0.0)
    path.write_bytes(b"y" * 11)
    second = judge(drop_root, m, first.settle, now=4.0)
    assert isinstance(second, Waiting) and second.settle.since == 4.0
    assert isinstance(judge(drop_root, m, second.settle, now=9.0), Ready)


def test_missing_and_short_files_are_named_and_wait_until_the_timeout(drop_root: Path) -> None:
    (drop_root / "short.png").write_bytes(b"x" * 1204)
    m = manifest([{"path": "missing.png", "size": 5}, {"path": "short.png", "size": 4194304}])
    waiting = judge(drop_root, m, now=50.0)
    assert isinstance(waiting, Waiting)
    assert [p.render() for p in waiting.problems] == [
        "manifest.toml, files[0]: 'missing.png' is missing — not copied yet?",
        "manifest.toml, files[1]: 'short.png' is 1 204 bytes, expected 4 194 304 bytes — still copying?",
    ]
    failed = judge(drop_root, m, waiting.settle, since=0.0, now=100.0)
    assert isinstance(failed, NotReady) and failed.reason == "inputs incomplete after 100 s"
    assert failed.problems == waiting.problems


def test_a_symlink_out_of_the_folder_is_refused_at_once(drop_root: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret.png"
    secret.write_bytes(b"s" * 10)
    os.symlink(secret, drop_root / "link.png")
    os.symlink("../" + drop_root.name, drop_root / "loop")
    verdict = judge(drop_root, manifest([{"path": "link.png", "size": 10}]))
    assert isinstance(verdict, NotReady)
    assert (
        verdict.problems[0]
        .render()
        .startswith(
            f"manifest.toml, files[0]: 'link.png' leads outside the batch folder (to {secret})"
        )
    )


def test_a_symlink_inside_the_folder_is_followed(drop_root: Path) -> None:
    (drop_root / "real.png").write_bytes(b"x" * 3)
    os.symlink("real.png", drop_root / "alias.png")
    m = manifest([{"path": "alias.png", "size": 3}])
    first = judge(drop_root, m)
    assert isinstance(judge(drop_root, m, first.settle, now=10.0), Ready)


def test_fifos_and_folders_are_not_inputs(drop_root: Path) -> None:
    os.mkfifo(drop_root / "pipe.png")
    (drop_root / "dir.png").mkdir()
    verdict = judge(drop_root, manifest([{"path": "pipe.png"}, {"path": "dir.png"}]))
    assert isinstance(verdict, NotReady)
    assert [p.message for p in verdict.problems] == [
        "'pipe.png' is a FIFO, not a regular file",
        "'dir.png' is a folder, not a regular file",
    ]


def test_a_file_bigger_than_listed_fails_once_settled(drop_root: Path) -> None:
    (drop_root / "a.png").write_bytes(b"x" * 20)
    m = manifest([{"path": "a.png", "size": 10}])
    first = judge(drop_root, m)
    verdict = judge(drop_root, m, first.settle, now=10.0)
    assert isinstance(verdict, NotReady)
    assert verdict.problems[0].message == "'a.png' is 20 bytes, expected 10 bytes"


def test_patterns_wait_for_their_count_and_skip_what_watchd_writes(drop_root: Path) -> None:
    (drop_root / "images").mkdir()
    (drop_root / "results" / "r").mkdir(parents=True)
    (drop_root / "results" / "r" / "x.png").write_bytes(b"r")
    for i in range(2):
        (drop_root / "images" / f"{i}.png").write_bytes(b"x")
    m = manifest([], [{"glob": "**/*.png", "count": 3}])
    waiting = judge(drop_root, m)
    assert isinstance(waiting, Waiting)
    assert (
        waiting.problems[0].render()
        == "manifest.toml, patterns '**/*.png': 2 of 3 file(s) present — not copied yet?"
    )
    (drop_root / "images" / "2.png").write_bytes(b"x")
    settle = judge(drop_root, m, waiting.settle, now=1.0).settle
    ready = judge(drop_root, m, settle, now=7.0)
    assert isinstance(ready, Ready)
    assert [f.path for f in ready.inputs] == ["images/0.png", "images/1.png", "images/2.png"]


def test_a_vanished_folder_fails_the_batch(tmp_path: Path) -> None:
    verdict = judge(tmp_path / "gone", manifest([{"path": "a.png"}]))
    assert isinstance(verdict, NotReady) and verdict.reason == "folder removed"


def test_many_missing_files_are_summarised(drop_root: Path) -> None:
    m = manifest([{"path": f"{i}.png"} for i in range(50)])
    waiting = judge(drop_root, m)
    assert len(waiting.problems) == 21
    assert waiting.problems[-1].message == "… and 30 more like these"


def test_an_input_that_keeps_changing_fails_at_the_timeout_naming_it(drop_root: Path) -> None:
    growing, still = drop_root / "x.png", drop_root / "y.png"
    still.write_bytes(b"y" * 10)
    os.utime(still, (1.0, 1.0))  # written long ago
    m = manifest([{"path": "y.png"}, {"path": "x.png"}])
    settle = None
    for now in (0.0, 30.0, 60.0, 90.0):
        growing.write_bytes(b"x" * int(now + 1))
        verdict = judge(drop_root, m, settle, since=0.0, now=now)
        assert isinstance(verdict, Waiting) and verdict.problems == ()
        settle = verdict.settle
    growing.write_bytes(b"x" * 200)
    failed = judge(drop_root, m, settle, since=0.0, now=100.0)
    assert isinstance(failed, NotReady) and failed.reason == "inputs still changing after 100 s"
    assert [p.render() for p in failed.problems] == [
        "manifest.toml, files[1]: 'x.png' was still changing after 100 s — "
        "is something still writing it?"
    ]
    assert failed.watch == ""  # not revived by the next change: it keeps changing


def test_the_first_look_after_a_restart_does_not_count_as_a_change(drop_root: Path) -> None:
    """After a restart the settle record starts again: inputs long complete are not failed
    as 'still changing' because the batch has waited past the timeout meanwhile."""
    (drop_root / "a.png").write_bytes(b"x" * 10)
    m = manifest([{"path": "a.png"}])
    first = judge(drop_root, m, None, since=0.0, now=500.0)
    assert isinstance(first, Waiting)
    assert isinstance(judge(drop_root, m, first.settle, since=0.0, now=502.0), Waiting)
    assert isinstance(judge(drop_root, m, first.settle, since=0.0, now=505.0), Ready)


def test_a_name_in_nfd_finds_the_file_named_in_nfc_and_the_jobs_get_the_name_on_disk(
    drop_root: Path,
) -> None:
    on_disk, listed = "K\u00e4fer.png", "Ka\u0308fer.png"  # Linux's ä, a Mac's a + ¨
    (drop_root / on_disk).write_bytes(b"x" * 10)
    m = manifest([{"path": listed, "size": 10}])
    first = judge(drop_root, m, now=0.0)
    assert isinstance(first, Waiting) and first.problems == ()
    ready = judge(drop_root, m, first.settle, now=6.0)
    assert isinstance(ready, Ready) and [f.path for f in ready.inputs] == [on_disk]
    assert ready.inputs[0].size == 10


def test_a_name_missing_under_both_normalisations_is_missing(drop_root: Path) -> None:
    waiting = judge(drop_root, manifest([{"path": "Ka\u0308fer.png"}]))
    assert isinstance(waiting, Waiting)
    assert waiting.problems[0].message == "'Ka\u0308fer.png' is missing"


def test_a_pattern_that_matches_an_instrument_file_fails_the_batch_naming_it(
    drop_root: Path,
) -> None:
    (drop_root / "a.tif").write_bytes(b"x" * 10)
    (drop_root / "b.lif").write_bytes(b"x" * 10)
    m = manifest([], patterns=[{"glob": "*.*"}])
    first = judge(drop_root, m, now=1.0)
    verdict = judge(drop_root, m, first.settle, now=6.0)
    assert isinstance(verdict, NotReady)
    assert verdict.reason == "inputs in a format watchd does not read"
    (problem,) = verdict.problems
    assert problem.where == "input 'b.lif'" and "Leica LIF" in problem.message
