"""Patterns, on real folders: one walk however many '**' a pattern has, bounded in depth and in
entries looked at, never entering a link to a folder (so nothing outside the batch folder is
ever listed), and matching what pathlib's glob matches."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import tomli_w
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.contract.safeopen import Presence
from daemon.core.manifest import parse_manifest
from daemon.core.readiness import NotReady, Timing, assess
from daemon.loop.inputs import observe
from daemon.loop.patterns import MAX_DEPTH, Bound, expand


def manifest_with(*globs: str):
    doc = {
        "watchd": 1, "kind": "inference", "owner": {"name": "A"},
        "model": {"name": "m", "version": "latest"}, "patterns": [{"glob": g} for g in globs],
    }  # fmt: skip
    return parse_manifest(tomli_w.dumps(doc).encode())


def nested(folder: Path, depth: int) -> int:
    """``depth`` folders one inside the other, a PNG in each; how many entries that makes."""
    here = folder
    for i in range(depth):
        here = here / f"d{i:02d}"
        here.mkdir(parents=True)
        (here / f"img_{i:02d}.png").write_bytes(b"png")
    return 2 * depth


def never_skip(relative: str) -> bool:
    return False


def test_six_double_stars_over_30_nested_folders_cost_one_walk(drop_root: Path) -> None:
    entries = nested(drop_root, 30)
    one = expand(str(drop_root), "**/*.png", 10**6, never_skip)
    six = expand(str(drop_root), "**/**/**/**/**/**/*.png", 10**6, never_skip)
    assert len(six.paths) == 30 and six.paths == one.paths
    assert six.visited == one.visited == entries  # each entry looked at once, not once per '**'


def test_a_pattern_through_a_link_to_a_folder_outside_lists_nothing_there(
    drop_root: Path, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "someone's home"
    (elsewhere / ".ssh").mkdir(parents=True)
    (elsewhere / ".ssh" / "id_rsa").write_bytes(b"secret")
    (elsewhere / "notes.txt").write_bytes(b"private")
    os.symlink(elsewhere, drop_root / "peek")
    (drop_root / "a.png").write_bytes(b"png")
    m = manifest_with("peek/**/*", "**/*")
    seen = observe(drop_root, m)
    listed = [f.path for p in seen.patterns for f in p.matches]
    assert not any("id_rsa" in p or "notes" in p or ".ssh" in p for p in listed), listed
    assert [(f.path, f.presence) for f in seen.patterns[0].matches] == [("peek", Presence.OUTSIDE)]
    verdict = assess(m, seen, None, 0.0, 0.0, Timing(0.0, 60.0))
    assert isinstance(verdict, NotReady) and verdict.reason == "inputs refused"
    assert (
        verdict.problems[0]
        .render()
        .startswith(
            "manifest.toml, patterns 'peek/**/*': 'peek' leads outside the batch folder (to "
        )
    )


def test_a_link_to_a_folder_inside_is_passed_over_and_its_files_matched_where_they_are(
    drop_root: Path,
) -> None:
    (drop_root / "images").mkdir()
    (drop_root / "images" / "a.png").write_bytes(b"png")
    os.symlink(drop_root / "images", drop_root / "alias")
    found = expand(str(drop_root), "**/*.png", 1000, never_skip)
    assert found.paths == ("images/a.png",) and found.linked == ("alias",)
    seen = observe(drop_root, manifest_with("**/*.png"))
    assert [f.path for f in seen.patterns[0].matches] == ["images/a.png"]


def test_a_walk_past_the_entry_bound_stops_and_fails_the_batch_naming_pattern_and_bound(
    drop_root: Path,
) -> None:
    (drop_root / "images").mkdir()
    for i in range(150):
        (drop_root / "images" / f"{i}.png").write_bytes(b"png")
    m = manifest_with("**/*.png")
    seen = observe(drop_root, m, max_entries=100)
    assert seen.patterns[0].matches == ()
    verdict = assess(m, seen, None, 0.0, 0.0, Timing(0.0, 60.0))
    assert isinstance(verdict, NotReady)
    assert verdict.problems[0].render() == (
        "manifest.toml, patterns '**/*.png': looks at more than 100 entries of the folder, the "
        "most one check may (intake.max_pattern_entries) — name the folder the inputs are in "
        "(e.g. 'images/*.png') instead of '**'"
    )
    assert len(observe(drop_root, m, max_entries=200).patterns[0].matches) == 150


def test_the_patterns_of_a_batch_share_one_budget(drop_root: Path) -> None:
    (drop_root / "images").mkdir()
    for i in range(60):
        (drop_root / "images" / f"{i}.png").write_bytes(b"png")
    seen = observe(drop_root, manifest_with("images/*.png", "images/*"), max_entries=100)
    assert len(seen.patterns[0].matches) == 60 and seen.patterns[0].stopped == ""
    assert "looks at more than 100 entries" in seen.patterns[1].stopped


def test_a_walk_deeper_than_the_depth_bound_stops_and_says_so(drop_root: Path) -> None:
    nested(drop_root, MAX_DEPTH + 2)
    found = expand(str(drop_root), "**/*.png", 10**6, never_skip)
    assert found.paths == () and found.stopped is Bound.DEPTH
    seen = observe(drop_root, manifest_with("**/*.png"))
    assert seen.patterns[0].stopped == "goes deeper than 64 folders, the most a pattern may"
    assert expand(str(drop_root), "d00/*.png", 10**6, never_skip).paths == ("d00/img_00.png",)


def test_literal_folders_are_looked_up_not_listed(drop_root: Path) -> None:
    (drop_root / "images" / "plate 1").mkdir(parents=True)
    for i in range(50):
        (drop_root / f"other_{i}.txt").write_bytes(b"x")
    (drop_root / "images" / "plate 1" / "a.png").write_bytes(b"png")
    found = expand(str(drop_root), "images/plate 1/*.png", 1000, never_skip)
    assert found.paths == ("images/plate 1/a.png",) and found.visited == 3


def test_what_watchd_writes_is_neither_matched_nor_walked(drop_root: Path) -> None:
    (drop_root / "results" / "run").mkdir(parents=True)
    for i in range(500):
        (drop_root / "results" / "run" / f"{i}.png").write_bytes(b"m")
    (drop_root / ".tmp-watchd-status.txt.png").write_bytes(b"t")
    (drop_root / "a.png").write_bytes(b"png")
    seen = observe(drop_root, manifest_with("**/*.png"), max_entries=100)
    assert [f.path for f in seen.patterns[0].matches] == ["a.png"]


names = st.sampled_from(["a", "b.png", "c.tif", ".h.png", "ä.png", "x[1].png"])
trees = st.lists(st.lists(names, min_size=1, max_size=4), max_size=12)
globs = st.lists(
    st.sampled_from(["**", "*", "*.png", "a", "?.png", "[ab]*", "*.tif", "x[[]1].png"]),
    min_size=1,
    max_size=4,
).map("/".join)


@settings(max_examples=200, deadline=None)
@given(trees, globs)
def test_a_pattern_matches_the_files_that_pathlib_glob_matches(
    tree: list[list[str]], glob: str
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for parts in tree:
            path = root.joinpath(*parts)
            if any(p.is_file() for p in [path, *path.parents] if p != root and p.exists()):
                continue  # a name already a file cannot be a folder too
            path.parent.mkdir(parents=True, exist_ok=True)
            if not path.exists():
                path.write_bytes(b"x")
        expected = sorted({p.relative_to(root).as_posix() for p in root.glob(glob) if p.is_file()})
        assert list(expand(tmp, glob, 10**6, never_skip).paths) == expected
