"""Hostile batch folders through the real daemon and jobs (the fuzz campaign's short version):
nothing outside the batch folders is written, read or listed, no tick outlasts its bound, every
batch ends with a reason, no watchctl output carries a traceback. The long campaign is
`scripts/fuzz_campaign.py --cases 25`; both draw from scripts/hostile.py.

CI draws few cases, derandomized (the same ones each run), and does not shrink. To find the
minimal failing case of a family: `scripts/fuzz_campaign.py --family results --shrink`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import fuzz_campaign
import hostile
import sentinel
from hypothesis import HealthCheck, Phase, example, given, settings

SCALE = hostile.Scale(folders=2, images=2, plants=3, depth=6, width=20, huge_bytes=1 << 20)
LIMITS = fuzz_campaign.Limits(deadline=45.0, watchctl=15.0)
# The first failure ends a test (no search for more): a FIFO that hangs the daemon costs each
# of its bounded waits in full.
CI = settings(
    derandomize=True, database=None, deadline=None, phases=[Phase.explicit, Phase.generate],
    report_multiple_bugs=False, suppress_health_check=list(HealthCheck),
)  # fmt: skip


def no_violations(case: tuple[hostile.Hostile, ...], registry: Path) -> None:
    base = Path(tempfile.mkdtemp(prefix="fuzz case "))
    try:
        outcome = fuzz_campaign.run_case(case, base, registry, SCALE, LIMITS)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    assert outcome.violations == [], "\n".join(outcome.violations)


def test_the_sentinel_sees_a_read_a_listing_and_a_write_but_not_a_stat(tmp_path: Path) -> None:
    """The detector itself, on this machine's filesystem: reads and listings move an atime set
    in the past (relatime), lstat and stat through a link do not."""
    tree = sentinel.make(tmp_path / "sentinel")
    os.symlink(tree / "notes", tmp_path / "link")
    watched = sentinel.Watched(tree, atimes=True)
    os.stat(tmp_path / "link")
    os.lstat(tree / "id_rsa")
    assert watched.violations("tree") == []
    (tree / "id_rsa").read_bytes()
    os.listdir(tmp_path / "link")
    with open(tree / "notes" / "deeper" / "still" / "deeper.txt", "a") as handle:
        handle.write("appended")
    found = watched.violations("tree")
    assert "tree: id_rsa read or listed" in found
    assert "tree: notes read or listed" in found
    assert any(v.startswith("tree: notes/deeper/still/deeper.txt changed") for v in found)
    assert len(found) == 3, found  # the write is no read: the file was only opened to append


@settings(CI, max_examples=2)
@given(fuzz_campaign.scenarios("inputs", SCALE))
def test_links_fifos_and_odd_names_among_the_inputs_keep_every_invariant(
    trained_registry: Path, case: tuple[hostile.Hostile, ...]
) -> None:
    no_violations(case, trained_registry)


def planted(level: str, kind: str) -> tuple[hostile.Hostile, ...]:
    """One plain folder with ``kind`` planted at ``level`` of its run's names as the code before
    issue 11 made them (today's run folders have a random part: these must miss), and the same
    swapped in once the run folder exists (the job's log, its masks' folder)."""
    swaps = tuple(hostile.Swap(after, f"{level}-{kind}") for after in (0.5, 2.0))
    return (hostile.Hostile(f"{level} {kind}", "Ann", "", ("images/a.png",),
                            results=(hostile.Plant(level, "fifo" if kind == "fifo" else "file-out"),),
                            swaps=swaps),)  # fmt: skip


@settings(CI, max_examples=1)
@given(fuzz_campaign.scenarios("all", SCALE))
@example(case=planted("log", "link"))
@example(case=planted("log", "fifo"))
@example(case=planted("masks", "link"))
def test_links_fifos_markup_and_hostile_manifests_anywhere_keep_every_invariant(
    trained_registry: Path, case: tuple[hostile.Hostile, ...]
) -> None:
    no_violations(case, trained_registry)
