"""Shared fixtures and guards: real folders (with awkward names), real SQLite, no leaks."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from daemon.site.subprocesses import process_start_ticks

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))  # the synthetic data generator

AWKWARD = "drop röot 'q' \"dq\""  # spaces, quotes and non-ASCII in every drop root

# Tests that share one machine-wide thing run one after another on one pytest-xdist worker
# (scripts/test runs ``-n 2 --dist loadgroup``): the one-node Slurm cluster, whose two CPUs a
# second worker's jobs would queue behind, and the sshfs test share (every test that uses it),
# whose attribute cache the share tests time their scenarios against and which one of them
# takes away and brings back.
# A module's tests that use one of its module-scoped fixtures share a worker too: each worker
# would otherwise build the fixture again (the bad-input catalogue's one daemon run, 3 minutes).
SHARED_BY_FOLDER = {"slurm": "slurm-cluster"}
SHARED_BY_FILE = {"test_share.py": "test-share"}


# A wrapper, first: the markers are set before pytest-xdist's hook of the same name reads them
# (it suffixes each test's id with its group, which is what its scheduler goes by). pytest 9.2
# keeps a test's id where pytest-xdist 3.8 writes the group: the groups were then silently
# split over both workers (the share's outage test ran beside another share test: ENOTCONN in
# CI; each module fixture was built twice). pyproject.toml pins pytest below 9.2, and the
# controller checks that the groups took (below).
@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_collection_modifyitems(
    items: list[pytest.Item],
) -> Iterator[None]:
    for item in items:
        group = SHARED_BY_FILE.get(item.path.name) or SHARED_BY_FOLDER.get(item.path.parent.name)
        if group is None and "share" in getattr(item, "fixturenames", ()):
            group = SHARED_BY_FILE["test_share.py"]  # elsewhere, on the share (test_fuzz.py)
        if group is None and _uses_a_module_fixture(item):
            group = f"module-fixture:{item.path.relative_to(REPO)}"
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
    yield


def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    """On the controller, as each worker reports what it collected: fail unless the groups
    took (the Slurm tests always have one)."""
    if node.config.getoption("dist") != "loadgroup":
        return
    for nodeid in ids:
        if nodeid.startswith("tests/slurm/") and "@" not in nodeid:
            raise pytest.UsageError(
                f"pytest-xdist did not apply the test groups ({nodeid} has none): this pytest "
                "and pytest-xdist do not work together (see pyproject.toml's pins)"
            )


def _uses_a_module_fixture(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(defs[-1].scope == "module" for defs in info.name2fixturedefs.values() if defs)


def child_pids() -> set[int]:
    """Processes whose parent is this test process (jobs start in their own session but stay
    our children until they end)."""
    me, found = os.getpid(), set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            text = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()
        if int(fields[1]) == me and fields[0] != "Z":
            found.add(int(entry))
    return found


TEST_MARK = "WATCHD_TEST_RUN"  # in the environment of every process a test starts
LAUNCHER = b"daemon.executors.local_job"


def launchers_of(mark: str) -> set[int]:
    """Live launchers, spares and the jobs forked from them (their command line names
    ``local_job``) started in an environment holding ``mark``: children of nobody here too,
    as copies of spares are, and jobs whose launcher was killed."""
    wanted, found = f"{TEST_MARK}={mark}\0".encode(), set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if LAUNCHER not in Path(f"/proc/{entry}/cmdline").read_bytes():
                continue
            if wanted not in Path(f"/proc/{entry}/environ").read_bytes():
                continue
        except OSError:
            continue
        if process_start_ticks(int(entry)) is not None:  # a zombie counts as gone
            found.add(int(entry))
    return found


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test leaves no thread, no child process and no launcher it started behind (a
    test sharing a module's fixtures may leave that fixture's)."""
    threads_before = set(threading.enumerate())
    children_before = child_pids()
    mark = f"{os.getpid()}-{time.monotonic_ns()}"
    before = os.environ.get(TEST_MARK)
    os.environ[TEST_MARK] = mark
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(TEST_MARK, None)
        else:
            os.environ[TEST_MARK] = before
    shared = _uses_a_module_fixture(request.node)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        threads = [t for t in threading.enumerate() if t not in threads_before and t.is_alive()]
        children = child_pids() - children_before
        launchers = set() if shared else launchers_of(mark)
        if not threads and not children and not launchers:
            return
        time.sleep(0.1)
    assert not threads, f"threads left running: {threads}"
    assert not children, f"child processes left running: {children}"
    assert not launchers, f"launchers or spares left running: {launchers}"


@pytest.fixture
def drop_root(tmp_path: Path) -> Path:
    root = tmp_path / AWKWARD
    root.mkdir()
    return root
