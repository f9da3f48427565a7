"""The bad-input catalogue, against the real daemon: every case's owner finds a clear reason in
the batch folder's status file, the operator finds it in `watchctl show` and in the log, no
other batch is affected, and the daemon keeps running.

All static cases are dropped at once into one drop root beside good batches; the cases that
need something to happen mid-run (a folder deleted, a manifest replaced, a results folder that
cannot be written, a full disk) have scenarios of their own below.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import structlog
import synth
from badinput_cases import CASES, Case, images, make_all

# At import, while "conftest" is this folder's (a conftest of another folder collected later,
# e.g. tests/slurm/, takes the name over).
from conftest import MODEL, write_config
from replay import Replay, at, copy_slowly, manifest_text, write_atomically
from test_crash import wait_for

from daemon.contract.jobspec import Identity
from daemon.contract.spool import work_dir
from daemon.core.manifest import STATUS_NAME
from daemon.core.manifest_schema import Kind
from daemon.core.records import Batch
from daemon.core.states import BatchState, JobState
from daemon.site.config import Config
from daemon.store import Store

BIN = Path(sys.executable).parent
DOCS = Path(__file__).resolve().parents[2] / "docs" / "bad-input.md"
IS_ROOT = os.geteuid() == 0


def runs_here(case: Case) -> bool:
    return not (case.root_only and not IS_ROOT) and not (case.unprivileged_only and IS_ROOT)


@dataclass(frozen=True)
class Outcome:
    config: Config
    root: Path
    batches: dict[str, Batch]  # folder name → its newest revision
    logged: list[dict[str, Any]]
    alive_after: bool


@pytest.fixture(scope="module")
def outcome(tmp_path_factory: pytest.TempPathFactory, trained_registry: Path) -> Iterator[Outcome]:
    base = tmp_path_factory.mktemp("bad input")
    root, registry = base / "drop röot 'q'", base / "registry"
    root.mkdir()
    shutil.copytree(trained_registry, registry)
    config = write_config(
        base, root, registry,
        intake={"timeout_seconds": 4, "max_manifest_bytes": 65536, "settle_seconds": 0.3},
    )  # fmt: skip
    cases = tuple(c for c in CASES if runs_here(c))
    make_all(root, cases)
    for name in ("good one", "good two"):
        images(root / name, 3)
        from replay import manifest_text

        from daemon.core.manifest_schema import Kind

        (root / name / "manifest.toml").write_bytes(
            manifest_text(root / name, Kind.INFERENCE, model=MODEL, version="latest")
        )
    with structlog.testing.capture_logs() as logged, Replay(config) as replay:
        replay.run(timeout=240)
        # Still running? A good batch dropped after all the bad ones goes through.
        late = base / "staging late"
        images(late, 2)
        (late / "manifest.toml").write_bytes(
            manifest_text(late, Kind.INFERENCE, model=MODEL, version="latest")
        )
        replay.run(copy_slowly(late, root / "good late", 0.0, 0.01), timeout=120)
    store = Store(config.daemon.database)
    batches = {b.folder: b for b in store.batches()}  # later revisions overwrite earlier ones
    store.close()
    yield Outcome(config, root, batches, logged, batches["good late"].state is BatchState.DONE)


def test_the_catalogue_has_at_least_40_cases_and_the_docs_list_each() -> None:
    assert len(CASES) >= 40
    documented = DOCS.read_text(encoding="utf-8")
    missing = [c.id for c in CASES if f"`{c.id}`" not in documented]
    assert missing == [], f"docs/bad-input.md lacks {missing}"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_the_owner_and_the_operator_read_a_clear_reason(case: Case, outcome: Outcome) -> None:
    if not runs_here(case):
        pytest.skip("making a device file needs root" if case.root_only else "root reads any file")
    folder = f"case {case.id}"
    batch = outcome.batches[folder]
    assert batch.state is BatchState.FAILED, f"{case.id}: {batch.state} ({batch.reason})"
    status = (outcome.root / folder / STATUS_NAME).read_text(encoding="utf-8")
    assert "State:     FAILED" in status
    assert case.says in status, f"{case.id}: the status file does not say {case.says!r}:\n{status}"
    assert "Next step:" in status
    if case.stage == "manifest":  # the daemon refuses a retry of a refused manifest
        assert "watchctl retry" not in status and "save manifest.toml again" in status
    shown = subprocess.run(
        [str(BIN / "watchctl"), "show", str(batch.id), "--json", "--config", str(outcome.config.source)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    detail = json.loads(shown.stdout)
    told = (
        detail["reason"]
        + " "
        + " ".join(p["where"] + " " + p["message"] for p in detail["problems"])
    )
    assert told.strip() and detail["state"] == "failed"
    logged = [
        e
        for e in outcome.logged
        if e.get("batch_id") == batch.id
        and e.get("state", e["event"]) in ("failed", "batch failed")
    ]
    assert logged, f"{case.id}: no log event says the batch failed"


def test_no_other_batch_is_affected_and_the_daemon_kept_running(outcome: Outcome) -> None:
    for name in ("good one", "good two", "good late"):
        assert outcome.batches[name].state is BatchState.DONE, name
    assert outcome.alive_after
    reasons = {b.folder: b.reason for b in outcome.batches.values()}
    assert len({r for f, r in reasons.items() if f.startswith("case ")}) > 5  # each says its own


def test_a_pattern_through_a_link_never_lists_a_name_from_outside(outcome: Outcome) -> None:
    folder = outcome.root / "case pattern-link-out"
    status = (folder / STATUS_NAME).read_text(encoding="utf-8")
    batch = outcome.batches[folder.name]
    logged = repr([e for e in outcome.logged if e.get("batch_id") == batch.id])
    told = repr(batch.problems) + batch.reason
    for text in (status, logged, told):
        assert "id_rsa" not in text and ".ssh" not in text


# -- cases that need something to happen during the run ---------------------------------------


def only(config: Config, folder: str) -> Batch:
    found = newest(config, folder)
    assert found is not None, f"no batch for {folder}"
    return found


def newest(config: Config, folder: str) -> Batch | None:
    store = Store(config.daemon.database)
    try:
        return store.latest_revision(str(config.roots[0].path), folder)
    finally:
        store.close()


def in_state(config: Config, folder: str, state: BatchState) -> Callable[[object], bool]:
    def check(service: object) -> bool:
        batch = newest(config, folder)
        return batch is not None and batch.state is state

    return check


def test_a_folder_deleted_mid_run_fails_its_batch_and_nothing_else(
    config_for: Callable[..., Config], staged: Callable[..., Path], drop_root: Path
) -> None:
    config = config_for(executor={"local": {"max_parallel": 1}}, planner={"shard_size": 1})
    doomed, kept = drop_root / "deleted mid run", drop_root / "kept"
    steps = copy_slowly(staged("d", count=4), doomed, 0.0, 0.01) + copy_slowly(
        staged("k", count=2), kept, 0.0, 0.01
    )

    with structlog.testing.capture_logs() as logged, Replay(config) as replay:
        replay.run(steps, until=in_state(config, doomed.name, BatchState.RUNNING))
        shutil.rmtree(doomed)
        replay.run()
    gone = only(config, doomed.name)
    assert gone.state is BatchState.FAILED
    assert only(config, kept.name).state is BatchState.DONE
    assert any(e.get("batch_id") == gone.id and e["event"] == "batch failed" for e in logged)


def test_a_manifest_replaced_mid_run_cancels_the_old_revision_and_runs_the_new(
    config_for: Callable[..., Config], staged: Callable[..., Path], drop_root: Path
) -> None:
    config = config_for(executor={"local": {"max_parallel": 1}}, planner={"shard_size": 1})
    folder = drop_root / "replaced"
    source = staged(count=3)
    replaced = (source / "manifest.toml").read_text().replace('title = ""', 'title = "second try"')

    with Replay(config) as replay:
        replay.run(
            copy_slowly(source, folder, 0.0, 0.01),
            until=in_state(config, folder.name, BatchState.RUNNING),
        )
        replay.run([write_atomically(folder / "manifest.toml", replaced.encode(), 0.0)])
    store = Store(config.daemon.database)
    first, second = store.batches()
    store.close()
    assert first.state is BatchState.CANCELLED and "superseded by revision 2" in first.reason
    assert second.state is BatchState.DONE
    status = (folder / STATUS_NAME).read_text()
    assert "revision 2" in status and "State:     DONE" in status


def test_a_batch_folder_replaced_mid_run_is_a_new_batch_and_its_images_are_never_read_by_the_old(
    config_for: Callable[..., Config], staged: Callable[..., Path], drop_root: Path, tmp_path: Path
) -> None:
    """The folder is moved away while its batch runs and a new folder with images of the same
    names (other pictures) and a new manifest is made under its name. The new folder's manifest
    is taken in at once (the catch-up scan is minutes away), the old batch is cancelled with the
    reason, and every image the old batch's jobs read is an old one (the manifests carry no
    checksums: nothing but the folder's identity tells the two apart)."""
    config = config_for(
        daemon={"rescan_seconds": 300},
        executor={"local": {"max_parallel": 1}},
        planner={"shard_size": 1},
    )
    folder, moved = drop_root / "swapped", tmp_path / "moved away"
    old = staged("old", count=4, checksums=False)
    new = tmp_path / "staging" / "new"
    synth.make_batch(new, "inference", count=4, size=64, seed=11)
    (new / "manifest.toml").write_bytes(
        manifest_text(new, Kind.INFERENCE, model=MODEL, version="latest", checksums=False)
    )
    with structlog.testing.capture_logs() as logged, Replay(config) as replay:
        replay.run(copy_slowly(old, folder, 0.0, 0.01), until=lambda service: _a_job_done(config))
        os.rename(folder, moved)
        # The folder is made first and its manifest ~1 s later: only a watch on the new folder
        # (not the old one's, on the moved inode) sees the manifest before the catch-up scan.
        taken_in = replay.run(copy_slowly(new, folder, 0.0, 0.2), timeout=30,
                              until=lambda service: only(config, folder.name).revision == 2)  # fmt: skip
        replay.run(until=in_state(config, folder.name, BatchState.DONE), timeout=240)
    assert taken_in < 6, f"the new folder's manifest waited {taken_in:.1f} s"
    store = Store(config.daemon.database)
    first, second = store.batches()
    events = [e.reason for e in store.events(second.id)]
    refused = [job.name for job in store.jobs([first.id], [JobState.FAILED])]
    store.close()
    # cancelled by the new folder's manifest, or, where a job of the old batch started after
    # the swap and refused the new folder first, by that refusal (its jobs start in ~0.3 s)
    assert first.state is BatchState.CANCELLED
    assert first.reason in (
        "cancelled by watchd (the batch folder was replaced; superseded by revision 2)",
        *(f"cancelled by watchd (the batch folder was replaced: job {name} found another folder "
          "under its name)" for name in refused[:1]),
    ), first.reason
    assert "the batch folder was replaced: revision 2 replaces 1" in events
    assert (second.state, second.identity) == (
        BatchState.DONE,
        Identity.of(os.stat(folder), os.stat(folder.parent)),
    )
    assert first.identity == Identity.of(os.stat(moved), os.stat(drop_root)) != second.identity
    old_read, new_read = _inputs_read(config, first), _inputs_read(config, second)
    assert old_read and old_read <= _digests(old) and not old_read & _digests(new)
    assert new_read == _digests(new)
    status = (folder / STATUS_NAME).read_text()
    assert "revision 2" in status and "State:     DONE" in status
    assert any(e.get("batch_id") == first.id and e["event"] == "job cancelled" for e in logged)


def _a_job_done(config: Config) -> bool:
    """Whether one of the (first) batch's jobs has succeeded: it has read some old images."""
    store = Store(config.daemon.database)
    try:
        return bool(store.jobs(states=[JobState.SUCCEEDED]))
    finally:
        store.close()


def _inputs_read(config: Config, batch: Batch) -> set[str]:
    """The sha256 of every input an inference job of ``batch`` segmented (from its ledgers, in
    its work folder in the spool)."""
    work = work_dir(config.daemon.spool_dir, batch.id, batch.run_dir)
    lines = [line for path in work.glob("ledger/*") for line in path.read_text().splitlines()]
    return {json.loads(line)["input_sha256"] for line in lines}


def _digests(folder: Path) -> set[str]:
    return {hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.glob("images/*")}


@pytest.mark.skipif(not IS_ROOT or shutil.which("chattr") is None, reason="needs root and chattr")
def test_a_results_folder_that_cannot_be_written_fails_the_batch_with_a_reason(
    config_for: Callable[..., Config], staged: Callable[..., Path], drop_root: Path
) -> None:
    config = config_for()
    folder = drop_root / "read only"
    shutil.copytree(staged(count=1), folder)
    (folder / "results").mkdir()
    subprocess.run(["chattr", "+i", str(folder / "results")], check=True)  # even root cannot write
    try:
        with Replay(config) as replay:
            replay.run()
    finally:
        subprocess.run(["chattr", "-i", str(folder / "results")], check=True)
    batch = only(config, folder.name)
    assert batch.state is BatchState.FAILED and batch.reason == "results folder not writable"
    status = (folder / STATUS_NAME).read_text()
    assert "results folder: cannot be written: Operation not permitted" in status


@pytest.mark.skipif(not IS_ROOT or shutil.which("chattr") is None, reason="needs root and chattr")
def test_a_status_file_that_cannot_be_written_is_said_in_watchctl_and_the_log(
    tmp_path: Path, staged: Callable[..., Path], drop_root: Path
) -> None:
    """Its owner reads a stale state (or none): the operator is told, once per change."""
    config = write_config(tmp_path, drop_root, tmp_path / "registry")
    folder = drop_root / "immutable"
    shutil.copytree(staged(count=1), folder)
    subprocess.run(["chattr", "+i", str(folder)], check=True)  # even root cannot write there
    try:
        with structlog.testing.capture_logs() as logged, Replay(config) as replay:
            replay.run()
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)
    batch = only(config, folder.name)
    assert batch.state is BatchState.FAILED and not (folder / STATUS_NAME).exists()
    shown = subprocess.run(
        [str(BIN / "watchctl"), "show", str(batch.id), "--config", str(config.source)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    note = f"{STATUS_NAME} not written: Operation not permitted; its owner does not see this"
    assert note in " ".join(shown.replace("│", " ").split())
    assert any(
        e["event"] == "cannot write status file" and e.get("batch_id") == batch.id for e in logged
    )


@pytest.mark.skipif(not IS_ROOT or shutil.which("setpriv") is None, reason="needs root, setpriv")
def test_a_manifest_the_service_cannot_read_fails_visibly_and_is_taken_in_once_readable(
    staged: Callable[..., Path],
) -> None:
    """The daemon runs as an unprivileged user (nobody), the folder belongs to another."""
    with tempfile.TemporaryDirectory(dir="/tmp") as where:
        base = Path(where)
        root, state, spool = base / "drop", base / "state", base / "spool"
        for made in (root, state):
            made.mkdir()
            made.chmod(0o777)
        spool.mkdir(mode=0o750)
        os.chown(spool, 65534, 65534)  # the service's own
        base.chmod(0o755)
        (base / "registry" / MODEL / "v0001").mkdir(parents=True)  # what intake looks for
        config = write_config(base, root, base / "registry", daemon={"spool_dir": str(spool)})
        folder = root / "locked manifest"
        shutil.copytree(staged(count=1), folder)
        folder.chmod(0o777)
        (folder / "manifest.toml").chmod(0o600)
        log = base / "daemon.log"
        as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        with open(log, "wb") as out:
            daemon = subprocess.Popen(
                [*as_nobody, str(BIN / "watchd"), "run", "--config", str(config.source)],
                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "HOME": str(base)},
            )  # fmt: skip
        try:
            written = folder / STATUS_NAME
            wait_for(lambda _: written.exists() and "FAILED" in written.read_text(), config, 60)
            status = written.read_text(encoding="utf-8")
            (folder / "manifest.toml").chmod(0o644)
            wait_for(lambda store: len(store.batches()) == 2, config, 60)
        finally:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(60)
        store = Store(config.daemon.database)
        first, second = store.batches()
        store.close()
    assert "State:     FAILED" in status and "watchctl retry" not in status
    assert (
        "manifest.toml: cannot be read by the watchd service: Permission denied — make it "
        "readable for the service (e.g. chmod a+r manifest.toml, or the ACLs of "
        "docs/install.md, step 3); watchd reads it again every 30 s"
    ) in status.replace("\n", " ").replace("  ", " ")
    assert (first.state, first.reason) == (BatchState.FAILED, "unreadable by watchd")
    assert second.kind is Kind.INFERENCE and second.revision == 2


@pytest.mark.skipif(not IS_ROOT, reason="mounting a small filesystem needs root")
def test_a_full_disk_while_writing_fails_cleanly_and_leaves_no_half_written_output(
    config_for: Callable[..., Config], staged: Callable[..., Path], tmp_path: Path
) -> None:
    small = tmp_path / "small share"
    small.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(small)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        root = small / "drop"
        root.mkdir()
        config = write_config(
            tmp_path, root, config_for().registry.path, planner={"shard_size": 100}
        )
        folder = root / "fills the disk"
        shutil.copytree(staged(count=6), folder)
        filler = small / "filler"
        filler.write_bytes(
            b"\0" * (small_free(small) - 40_000)
        )  # room for the inputs, not the outputs
        with Replay(config) as replay:
            replay.run(timeout=120)
        batch = only(config, folder.name)
        assert batch.state is BatchState.FAILED
        leftovers = [p for p in folder.rglob("*") if p.name.startswith(".tmp-")]
        assert leftovers == [], "a half-written file was left behind"
        assert batch.problems[0].render() == (
            "results folder: cannot be written: No space left on device — "
            "the share is full (or over quota): free space, then ask for a retry"
        )
        status = (folder / STATUS_NAME).read_text()  # overwritten in place: no room for a new file
        assert "State:     FAILED" in status and "the share is full" in status
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)


def small_free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def test_a_results_folder_that_is_a_link_out_of_the_batch_is_refused_and_nothing_written_there(
    config_for: Callable[..., Config], staged: Callable[..., Path], drop_root: Path, tmp_path: Path
) -> None:
    config = config_for()
    elsewhere = tmp_path / "another lab's folder"
    elsewhere.mkdir()
    folder = drop_root / "linked results"
    shutil.copytree(staged(count=1), folder)
    os.symlink(elsewhere, folder / "results")
    with Replay(config) as replay:
        replay.run()
    batch = only(config, folder.name)
    assert batch.state is BatchState.FAILED and batch.reason == "results folder not writable"
    assert batch.problems[0].render() == (
        "results folder: cannot be written: 'results' is a symbolic link, not a folder — "
        "remove it: watchd writes its results only inside the batch folder"
    )
    assert list(elsewhere.iterdir()) == []


# -- links and FIFOs planted under results/ (one rule for every write under a batch folder) ---


def watchctl(config: Config, *args: str) -> subprocess.CompletedProcess[str]:
    command = [str(BIN / "watchctl"), *args, "--config", str(config.source)]
    return subprocess.run(command, capture_output=True, text=True, timeout=30)


def planted_mid_run(
    config: Config, source: Path, folder: Path, plant: Callable[[Path], None]
) -> Batch:
    """Drop ``source`` as ``folder`` with one input held back (the batch waits, its run folder
    made), let ``plant`` put something in the first job's folder as its owner could, then give
    the last input: the batch's end, as the daemon recorded it."""
    shutil.copytree(source, folder)
    last = sorted(folder.rglob("*.png"))[-1]
    held_back = last.read_bytes()
    last.unlink()
    with Replay(config) as replay:
        replay.run(until=lambda _service: newest(config, folder.name) is not None)
        batch = only(config, folder.name)
        assert Path(batch.run_dir).is_dir()  # made by the daemon at intake
        job_dir = Path(batch.run_dir) / "jobs" / f"b{batch.id:06d}-infer-0000"
        plant(job_dir)
        last.write_bytes(held_back)
        replay.run()
    return only(config, folder.name)


def _plants(job_dir: Path, kind: str, victim: Path, elsewhere: Path, state: Path) -> None:
    """What an owner plants where a job's files were under results/ before they moved to the
    spool (issue 25): the log as a link or a FIFO, the job's folder as a link, a forged spec
    (the red team's: the batch folder "/" and the run folder in the daemon's state), a forged
    result; and where the daemon copies the job's log for the owner, a link."""
    job_dir.mkdir(parents=True)
    if kind == "log link":
        (job_dir / "log.txt").symlink_to(victim)
    elif kind == "log fifo":
        os.mkfifo(job_dir / "log.txt")
    elif kind == "job folder link":
        job_dir.rmdir()
        job_dir.symlink_to(elsewhere)
    elif kind == "forged spec":
        forged = {"batch_dir": "/", "run_dir": str(state / "owned"), "spec_version": 2,
                  "job_name": job_dir.name, "pipeline": "infer"}  # fmt: skip
        (job_dir / "spec.json").write_text(json.dumps(forged))
    elif kind == "forged result":
        (job_dir / "result.json").write_text(json.dumps(
            {"ok": True, "pipeline": "infer", "finished_at": "2026-01-01", "summary": {}}
        ))  # fmt: skip
    logs = job_dir.parent.parent / "logs"
    logs.mkdir(exist_ok=True)
    (logs / f"{job_dir.name}.log").symlink_to(victim)


@pytest.mark.parametrize(
    "kind", ["log link", "log fifo", "job folder link", "forged spec", "forged result"]
)
def test_what_an_owner_plants_where_the_jobs_files_were_is_neither_read_nor_written(
    config_for: Callable[..., Config], staged: Callable[..., Path], drop_root: Path,
    tmp_path: Path, kind: str,
) -> None:  # fmt: skip
    """The job's spec, log, result and launch record live in the spool, which the owner cannot
    write: a plant under results/ at their old names changes nothing. The batch ends DONE, the
    file a link points to (the registry's weights) is unchanged, nothing is written in the
    folder a link leads to or in the daemon's state, `watchctl logs` prints the job's real log,
    and the owner's copy of it replaced the link planted at its name."""
    config = config_for()
    victim = next(config.registry.path.rglob("*.pt"))
    was = victim.read_bytes()
    elsewhere = tmp_path / "another lab's folder"
    elsewhere.mkdir()
    state = config.daemon.state_dir
    folder = drop_root / f"planted {kind}"
    batch = planted_mid_run(
        config, staged(count=1), folder,
        lambda job_dir: _plants(job_dir, kind, victim, elsewhere, state),
    )  # fmt: skip
    assert batch.state is BatchState.DONE, batch.reason
    assert victim.read_bytes() == was
    assert list(elsewhere.iterdir()) == []
    assert not (state / "owned").exists() and not list(state.rglob("*.png"))
    job = f"b{batch.id:06d}-infer-0000"
    logs = watchctl(config, "logs", job)
    assert logs.returncode == 0 and "attempt 1 started" in logs.stdout, logs.stderr
    copy = Path(batch.run_dir) / "logs" / f"{job}.log"
    assert copy.is_file() and not copy.is_symlink()
    assert "attempt 1 started" in copy.read_text()


def test_an_input_named_like_a_status_temporary_is_never_deleted(
    config_for: Callable[..., Config], staged: Callable[..., Path], drop_root: Path
) -> None:
    """The status writer's clean-up once removed `.tmp-watchd-status.txt.*`: now only the exact
    temporaries it makes itself."""
    config = config_for()
    folder = drop_root / "odd input name"
    shutil.copytree(staged(count=1), folder)
    odd = folder / ".tmp-watchd-status.txt.png"
    shutil.copy(next(folder.rglob("*.png")), odd)
    was = odd.read_bytes()
    with Replay(config) as replay:
        replay.run()
    assert only(config, folder.name).state is BatchState.DONE
    assert odd.read_bytes() == was


def test_an_input_still_growing_at_the_timeout_fails_the_batch_naming_it(
    config_for: Callable[..., Config], staged: Callable[..., Path], drop_root: Path
) -> None:
    config = config_for(intake={"timeout_seconds": 2, "settle_seconds": 0.5})
    folder = drop_root / "still growing"
    source = staged(count=2)
    shutil.copytree(source, folder)
    growing = folder / "images" / "growing.png"
    growing.write_bytes(b"\x89PNG")
    text = (source / "manifest.toml").read_text() + '\n[[files]]\npath = "images/growing.png"\n'

    def append() -> None:
        with open(growing, "ab") as handle:
            handle.write(b"more")

    steps = [write_atomically(folder / "manifest.toml", text.encode(), 0.0)]
    steps += [at(0.2 + 0.2 * i, "append to growing.png", append) for i in range(30)]
    with structlog.testing.capture_logs() as logged, Replay(config) as replay:
        replay.run(steps, timeout=60)
    batch = only(config, folder.name)
    assert batch.state is BatchState.FAILED and batch.reason == "inputs still changing after 2 s"
    status = (folder / STATUS_NAME).read_text()
    assert (
        "manifest.toml, files[2]: 'images/growing.png' was still changing after 2 s — "
        "is something still writing it?"
    ) in status
    assert any(e.get("batch_id") == batch.id and e["event"] == "batch failed" for e in logged)
