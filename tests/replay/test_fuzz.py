"""Hostile batch folders through the real daemon and jobs (the fuzz campaign's short version):
nothing outside the batch folders is written, read or listed, no tick outlasts its bound, every
batch ends with a reason, no watchctl output carries a traceback. The long campaign is
`scripts/fuzz_campaign.py --cases 25`; both draw from scripts/hostile.py.

CI draws few cases, derandomized (the same ones each run), and does not shrink. To find the
minimal failing case of a family: `scripts/fuzz_campaign.py --family results --shrink`.

Issue 25's families (a canary only the service may read, races on the jobs' files, forged
leases, FIFOs and links at every name a job or the report reads) run one explicit case each,
as an unprivileged service and an unprivileged expert (real users, made if missing: root only;
elsewhere they skip, saying why). A sweep's races (its trials' candidates) cost minutes: they
are the campaign's (`--family races`), not CI's.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import fuzz_campaign
import fuzz_site
import hostile
import pytest
import sentinel
from hostile import Hostile, Inside, Lease, Plant
from hypothesis import HealthCheck, Phase, example, given, settings
from test_share import Share, share  # noqa: F401 (the test share, a fixture)

SCALE = hostile.Scale(folders=2, images=2, plants=3, depth=6, width=20, huge_bytes=1 << 20)
LIMITS = fuzz_campaign.Limits(deadline=45.0, watchctl=15.0)
# The first failure ends a test (no search for more): a FIFO that hangs the daemon costs each
# of its bounded waits in full.
CI = settings(
    derandomize=True, database=None, deadline=None, phases=[Phase.explicit, Phase.generate],
    report_multiple_bugs=False, suppress_health_check=list(HealthCheck),
)  # fmt: skip


def no_violations(
    case: tuple[hostile.Hostile, ...], registry: Path,
    people: fuzz_site.People = fuzz_site.NOBODY,
) -> fuzz_campaign.Outcome:  # fmt: skip
    base = Path(tempfile.mkdtemp(prefix="fuzz case "))
    try:
        outcome = fuzz_campaign.run_case(case, base, registry, SCALE, LIMITS, people)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    assert outcome.violations == [], "\n".join(outcome.violations)
    return outcome


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


@pytest.mark.campaign  # four daemon runs, 2.5 minutes: `scripts/test -m campaign`
@settings(CI, max_examples=1)
@given(fuzz_campaign.scenarios("all", SCALE))
@example(case=planted("log", "link"))
@example(case=planted("log", "fifo"))
@example(case=planted("masks", "link"))
def test_links_fifos_markup_and_hostile_manifests_anywhere_keep_every_invariant(
    trained_registry: Path, case: tuple[hostile.Hostile, ...]
) -> None:
    no_violations(case, trained_registry)


# -- issue 25's families, as real users ------------------------------------------------------------


@pytest.fixture(scope="module")
def people() -> fuzz_site.People:
    """An unprivileged service and an unprivileged expert of the experts' group."""
    try:
        return fuzz_site.people(share=False)
    except RuntimeError as exc:
        pytest.skip(f"real users: {exc}")


def ended(outcome: fuzz_campaign.Outcome, target: str, *, but: str = "") -> dict[str, int]:
    """How the intruder's attempts on ``target`` ended (those made ``but`` way left out):
    outcome → count."""
    found: dict[str, int] = {}
    for key, n in outcome.counts.items():
        if key.startswith(f"{target}\t") and key.split("\t")[1] != but:
            how = key.split("\t")[2]
            found[how] = found.get(how, 0) + n
    return found


NOT_MASKS = tuple(n for n in hostile.RUN_NAMES if not n.startswith("masks"))


def test_a_canary_only_the_service_may_read_reaches_no_output(
    trained_registry: Path, people: fuzz_site.People
) -> None:
    """A file only the service may read, named every way its owner could: links to it at every
    name a job or the report reads, files there naming its absolute path (previews index, model
    card, candidates, shard tables, specs, results), the masks swapped for links to it, hard
    links tried (the kernel refuses the expert: the file is not theirs), an input that links
    to it. Its token is in no output, status file, table row, log or watchctl output."""
    kinds = [Inside(n, ("canary", "forged")[i % 2], 0.0, True) for i, n in enumerate(NOT_MASKS)]
    kinds += [Inside("masks/{image}", "canary", 1.0, True),
              Inside("masks/{image}", "canary-hard", 0.5, True)]  # fmt: skip
    case = (
        Hostile("canary plate", "Ann", "", ("images/a.png",), inside=tuple(kinds)),
        Hostile("canary input", "Bo", "", ("images/a.png",),
                plants=(Plant("images/c.png", "canary", listed=True),
                        Plant("watchd-status.txt", "canary"))),
    )  # fmt: skip
    outcome = no_violations(case, trained_registry, people)
    assert ended(outcome, "canary") == {"EACCES": 1}, "the expert could read the canary"
    assert ended(outcome, "put").get("EPERM", 0) > 0, "no hard link to it was refused"


def test_races_on_the_jobs_files_are_refused_in_the_spool_and_ignored_in_the_results(
    trained_registry: Path, people: fuzz_site.People
) -> None:
    """The expert swaps spec.json, launch.json, log.txt, result.json, progress.json and trial
    candidates, again and again while the jobs run: forged at their old names under results/
    (the red team's spec sends the job to "/" and a trap folder), and at their real places in
    the spool, where every read, write, rename, link and removal is refused (EACCES). Every
    job ran from the spec the daemon wrote; nothing forged reached an output."""
    case = (
        Hostile(
            "race plate",
            "Ann",
            "",
            ("images/a.png",),
            races=hostile.SPOOL_TARGETS,
            inside=tuple(Inside(n, "forged", 0.0, True) for n in hostile.RACE_NAMES),
        ),
    )
    outcome = no_violations(case, trained_registry, people)
    for target in hostile.SPOOL_TARGETS:
        assert set(ended(outcome, target)) == {"EACCES"}, target
    assert ended(outcome, "spool") == {"EACCES": ended(outcome, "spool")["EACCES"]}


def test_forged_leases_stop_no_root_and_a_real_conflict_is_refused_with_exit_1(
    trained_registry: Path, people: fuzz_site.People
) -> None:
    """Leases forged at the drop root's old lease name (by the expert) and at the root's lease
    in the spool (the expert is refused; the service's own garbage there is read strictly):
    future times, strings, NaN, infinity, odd pids, another root's, not JSON, 8 MB, a folder,
    a link, a FIFO. The daemon gives up no root, never exits by itself, starts again over them
    and its batch ends. A root held by another live watchd is the one refusal: exit 1."""
    leases = tuple(Lease(0.2 + 0.1 * i, kind, where) for i, kind in enumerate(hostile.LEASE_KINDS)
                   for where in hostile.LEASE_PLACES)  # fmt: skip
    case = (Hostile("lease plate", "Ann", "", ("images/a.png",), leases=leases),)
    outcome = no_violations(case, trained_registry, people)
    assert outcome.counts["daemon restarted over forged leases"] == 1
    assert ended(outcome, "lease") == {"done": len(hostile.LEASE_KINDS),
                                       "EACCES": len(hostile.LEASE_KINDS)}  # fmt: skip
    base = Path(tempfile.mkdtemp(prefix="fuzz conflict "))  # the service reaches /tmp's
    try:
        base.chmod(0o755)
        refused = fuzz_campaign.control_conflict(base, trained_registry, LIMITS, people, False)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    assert refused == []


def test_fifos_and_links_at_every_name_a_job_or_the_report_reads_hang_nothing(
    trained_registry: Path, people: fuzz_site.People
) -> None:
    """The results family at issue 25's names (training/, parts/, jobs/<job>/*, trials/,
    sweep/, logs/, …): FIFOs once the run folder is there, and links out of the folder, to the
    registry's weights, dangling and looping, again and again; masks/ as a FIFO in another
    folder. Nothing hangs, nothing outside is read or written, every batch ends."""
    kinds = ("fifo", "file-out", "dir-out", "weights", "dangling", "loop")
    case = (
        Hostile("every name", "Ann", "", ("images/a.png",),
                inside=tuple(Inside(n, kinds[i % len(kinds)], 0.0, i % 2 == 1)
                             for i, n in enumerate(NOT_MASKS))),
        Hostile("masks fifo", "Bo", "", ("images/a.png",),
                inside=(Inside("masks", "fifo"), Inside("logs", "fifo"))),
    )  # fmt: skip
    no_violations(case, trained_registry, people)


def test_the_families_on_the_share_as_real_users(
    trained_registry: Path,
    share: Share,  # noqa: F811
) -> None:
    """The drop root and the spool on the test share (sshfs: the daemon polls; what the
    expert writes on the server's side, as from another host, sends no event), the service
    root without the capabilities that override file permissions (the share's files are all
    root's), the expert a real user: a canary folder, a racing folder and one that forges
    leases, at once. Every invariant holds there too."""
    try:
        people = fuzz_site.people(share=True)
    except RuntimeError as exc:
        pytest.skip(f"real users: {exc}")
    kinds = tuple(
        Inside(n, ("canary", "forged")[i % 2], 0.0, True) for i, n in enumerate(NOT_MASKS)
    )
    races = tuple(Inside(n, "forged", 0.0, True) for n in hostile.RACE_NAMES)
    leases = tuple(Lease(0.5, kind, "spool") for kind in ("future", "folder", "nan"))
    case = (
        Hostile("canary", "Ann", "", ("images/a.png",), inside=kinds),
        Hostile("races", "Bo", "", ("images/a.png",), races=hostile.SPOOL_TARGETS, inside=races),
        Hostile("leases", "Cy", "", ("images/a.png",),
                leases=(*leases, Lease(0.5, "future", "drop"))),
    )  # fmt: skip
    base = Path(tempfile.mkdtemp(prefix="fuzz share "))
    try:
        limits = fuzz_campaign.Limits(deadline=150.0, watchctl=15.0)
        outcome = fuzz_campaign.run_case(case, base, trained_registry, SCALE, limits, people,
                                         share=True)  # fmt: skip
    finally:
        shutil.rmtree(base, ignore_errors=True)
    assert outcome.violations == [], "\n".join(outcome.violations)
    for target in hostile.SPOOL_TARGETS:  # the lease forged at the drop root is the expert's
        assert set(ended(outcome, target, but="drop")) == {"EACCES"}, target
    assert outcome.counts["lease\tdrop\tdone"] == 1
    assert outcome.counts["daemon restarted over forged leases"] == 1
