"""Replay scenarios: timed file operations on a real drop root against the real daemon loop, a
real SQLite file and the real local executor running the real pipelines. Each asserts on the
store, the outputs, the status file and the logged events."""

from __future__ import annotations

import csv
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import structlog
from PIL import Image
from replay import Replay, at, copy_slowly, write_atomically, write_in_halves, write_now

from daemon.contract.jobspec import job_dir
from daemon.contract.spool import work_dir
from daemon.core.manifest import STATUS_NAME
from daemon.core.manifest_schema import Kind
from daemon.core.records import Batch
from daemon.core.states import BatchState, JobState
from daemon.executors.local import LAUNCH_FILE
from daemon.site.config import Config
from daemon.store import Store

MODES = ["inotify", "polling"]


def store_of(config: Config) -> Store:
    return Store(config.daemon.database)


def batches_are(config: Config, *states: BatchState) -> Callable[[object], bool]:
    """A Replay ``until``: the batches so far are in these states, in order."""

    def check(_service: object) -> bool:
        store = store_of(config)
        try:
            return [b.state for b in store.batches()] == list(states)
        finally:
            store.close()

    return check


def only_batch(config: Config) -> Batch:
    store = store_of(config)
    try:
        (batch,) = store.batches()
        return batch
    finally:
        store.close()


def status_text(folder: Path) -> str:
    return (folder / STATUS_NAME).read_text(encoding="utf-8")


def assert_outputs_complete(batch: Batch, images: int) -> None:
    """Masks for every image (same relative path and name), a full table, a report; no
    half-written file anywhere in the folder."""
    run = Path(batch.run_dir)
    masks = sorted(p.relative_to(run / "masks").as_posix() for p in (run / "masks").rglob("*.png"))
    assert masks == [f"images/img_{i:04d}.png" for i in range(images)]
    for mask in (run / "masks").rglob("*.png"):
        with Image.open(mask) as opened:
            opened.load()
    with open(run / "table.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert sorted(r["path"] for r in rows) == [f"images/img_{i:04d}.png" for i in range(images)]
    assert (run / "report.html").stat().st_size > 1000
    json.loads((run / "summary.json").read_text())
    leftovers = [p for p in batch.path.rglob("*") if p.name.startswith((".tmp-", "."))]
    assert leftovers == []


def states_of(config: Config, batch_id: int) -> list[str]:
    store = store_of(config)
    try:
        return [e.to_state.value for e in store.events(batch_id) if e.job_id is None and e.to_state]
    finally:
        store.close()


@pytest.mark.parametrize("mode", MODES)
def test_a_clean_inference_drop_ends_done_with_masks_table_report_and_status(
    mode: str, config_for: Callable[..., Config], staged: Callable[..., Path], drop_root: Path
) -> None:
    config = config_for(roots={"observer": mode})
    folder = drop_root / "plate 1 ä 'x'"
    with structlog.testing.capture_logs() as logged, Replay(config) as replay:
        replay.run(copy_slowly(staged(), folder, 0.0, 0.01))
    batch = only_batch(config)
    assert batch.state is BatchState.DONE, batch.reason
    assert states_of(config, batch.id) == ["waiting", "queued", "running", "done"]
    assert_outputs_complete(batch, images=6)
    store = store_of(config)
    jobs = store.jobs([batch.id])
    store.close()
    assert [(j.name.split("-", 1)[1], j.state, j.attempts) for j in jobs] == [
        ("infer-0000", JobState.SUCCEEDED, 1),
        ("infer-0001", JobState.SUCCEEDED, 1),
        ("report", JobState.SUCCEEDED, 1),
    ]
    status = status_text(folder)
    assert "State:     DONE" in status and "report.html" in status
    done = [e for e in logged if e["event"] == "batch done"]
    assert done and done[0]["batch_id"] == batch.id and done[0]["folder"] == folder.name


@pytest.mark.parametrize("mode", MODES)
def test_a_manifest_written_first_waits_for_the_files_and_says_what_is_missing(
    mode: str, config_for: Callable[..., Config], staged: Callable[..., Path], drop_root: Path
) -> None:
    config = config_for(roots={"observer": mode})
    source, folder = staged(), drop_root / "manifest first"
    seen_while_waiting: list[str] = []
    steps = [
        at(0.0, "mkdir", folder.mkdir),
        write_atomically(folder / "manifest.toml", (source / "manifest.toml").read_bytes(), 0.1),
        at(1.5, "read status", lambda: seen_while_waiting.append(status_text(folder))),
    ]
    steps += [
        step
        for i, image in enumerate(sorted((source / "images").iterdir()))
        for step in write_in_halves(
            folder / "images" / image.name, image.read_bytes(), 2.0 + 0.2 * i, 0.1
        )
    ]
    with Replay(config) as replay:
        replay.run(steps)
    batch = only_batch(config)
    assert batch.state is BatchState.DONE, batch.reason
    assert "WAITING for the inputs to be complete" in seen_while_waiting[0]
    assert (
        "manifest.toml, files[0]: 'images/img_0000.png' is missing — not copied yet?"
        in seen_while_waiting[0]
    )
    assert_outputs_complete(batch, images=6)


@pytest.mark.parametrize("mode", MODES)
def test_a_slow_copy_with_the_manifest_last_is_taken_once_complete(
    mode: str, config_for: Callable[..., Config], staged: Callable[..., Path], drop_root: Path
) -> None:
    config = config_for(roots={"observer": mode})
    folder = drop_root / "slow copy"
    with Replay(config) as replay:
        replay.run(copy_slowly(staged(), folder, 0.0, 0.3))
    batch = only_batch(config)
    assert batch.state is BatchState.DONE, batch.reason
    assert_outputs_complete(batch, images=6)


def test_a_file_short_past_the_timeout_fails_naming_it_then_revives_when_it_is_complete(
    config_for: Callable[..., Config], staged: Callable[..., Path], drop_root: Path
) -> None:
    config = config_for(intake={"timeout_seconds": 1.5}, daemon={"rescan_seconds": 1.0})
    source, folder = staged(), drop_root / "short file"
    shutil.copytree(source, folder, ignore=shutil.ignore_patterns("manifest.toml"))
    image = folder / "images" / "img_0002.png"
    full = image.read_bytes()
    image.write_bytes(full[:100])
    failed_status: list[str] = []

    failed = batches_are(config, BatchState.FAILED)

    with Replay(config) as replay:
        replay.run(
            [
                write_atomically(
                    folder / "manifest.toml", (source / "manifest.toml").read_bytes(), 0.0
                )
            ],
            until=failed,
        )
        batch = only_batch(config)
        assert batch.reason == "inputs incomplete after 1.5 s"
        failed_status.append(status_text(folder))
        replay.run([write_now(image, full, 0.0)])
    size = f"{len(full):,}".replace(",", " ")
    expected = f"manifest.toml, files[2]: 'images/img_0002.png' is 100 bytes, expected {size} bytes — still copying?"
    assert expected in failed_status[0]
    assert "State:     FAILED" in failed_status[0]
    batch = only_batch(config)
    assert batch.state is BatchState.DONE
    assert states_of(config, batch.id) == [
        "waiting",
        "failed",
        "waiting",
        "queued",
        "running",
        "done",
    ]


def test_the_same_folder_dropped_twice_is_one_batch(
    config_for: Callable[..., Config], staged: Callable[..., Path], drop_root: Path
) -> None:
    config = config_for()
    source, folder = staged(), drop_root / "twice"
    with structlog.testing.capture_logs() as logged, Replay(config) as replay:
        replay.run(copy_slowly(source, folder, 0.0, 0.01))
        replay.run(
            [at(0.0, "remove", lambda: shutil.rmtree(folder))]
            + copy_slowly(source, folder, 0.2, 0.01)
        )
        replay.service.catch_up(0.0)  # a rescan finds the same manifest again
        replay.run()
    store = store_of(config)
    assert len(store.batches()) == 1
    store.close()
    assert any(e["event"] == "manifest unchanged" for e in logged)
    assert "State:     DONE" in status_text(folder)


def test_the_first_job_of_a_batch_is_forked_from_a_warm_start_made_while_its_inputs_settle(
    config_for: Callable[..., Config], staged: Callable[..., Path], drop_root: Path
) -> None:
    """With the default settle period (5 s), the daemon tells the executor that an inference
    job comes as soon as the inputs are all there; its warm start imports meanwhile, and the
    batch's first job (the first of its two shards) is forked from it."""
    config = config_for(intake={"settle_seconds": 5.0})
    with structlog.testing.capture_logs() as logged, Replay(config) as replay:
        replay.run(copy_slowly(staged(), drop_root / "settling", 0.0, 0.01))
    batch = only_batch(config)
    assert batch.state is BatchState.DONE
    work = work_dir(config.daemon.spool_dir, batch.id, batch.run_dir)
    launch = json.loads((job_dir(work, f"b{batch.id:06d}-infer-0000") / LAUNCH_FILE).read_text())
    assert launch["warm"] is True, [e for e in logged if e.get("batch_id") == batch.id]
    assert_outputs_complete(batch, images=6)


def test_a_manifest_edited_after_acceptance_becomes_a_new_revision(
    config_for: Callable[..., Config], staged: Callable[..., Path], drop_root: Path
) -> None:
    config = config_for(intake={"settle_seconds": 1.0})
    source, folder = staged(), drop_root / "edited"
    edited = (source / "manifest.toml").read_text().replace('title = ""', 'title = "edited"')
    assert 'title = "edited"' in edited
    steps = copy_slowly(source, folder, 0.0, 0.01) + [
        write_atomically(folder / "manifest.toml", edited.encode(), 0.5)
    ]
    with Replay(config) as replay:
        replay.run(steps)
    store = store_of(config)
    first, second = store.batches()
    events = store.events(second.id)
    store.close()
    assert (first.revision, first.state) == (1, BatchState.CANCELLED)
    assert first.reason == "cancelled by watchd (superseded by revision 2)"
    assert (second.revision, second.state) == (2, BatchState.DONE)
    assert any(e.reason == "manifest changed: revision 2 replaces 1" for e in events)
    status = status_text(folder)
    assert "revision 2" in status and "State:     DONE" in status
    assert_outputs_complete(second, images=6)


def test_a_broken_manifest_fails_alone_and_its_fix_runs(
    config_for: Callable[..., Config], staged: Callable[..., Path], drop_root: Path
) -> None:
    config = config_for()
    good, broken = drop_root / "good", drop_root / "broken"
    source = staged("b", count=2)
    shutil.copytree(source, broken, ignore=shutil.ignore_patterns("manifest.toml"))
    fixed = (source / "manifest.toml").read_bytes()
    steps = copy_slowly(staged("g", count=2), good, 0.0, 0.01) + [
        write_atomically(
            broken / "manifest.toml", b'watchd = 1\nkind = "inference"\n[owner\n', 0.0
        ),
    ]
    with structlog.testing.capture_logs() as logged, Replay(config) as replay:
        replay.run(steps)
        status = status_text(broken)
        replay.run([write_atomically(broken / "manifest.toml", fixed, 0.0)])
    assert "State:     FAILED" in status and "manifest.toml: not valid TOML" in status
    store = store_of(config)
    by_folder = {(b.folder, b.revision): b for b in store.batches()}
    store.close()
    assert by_folder[("broken", 1)].state is BatchState.FAILED
    assert by_folder[("broken", 1)].reason == "manifest refused"
    assert by_folder[("good", 1)].state is BatchState.DONE
    assert by_folder[("broken", 2)].state is BatchState.DONE
    refused = [e for e in logged if e["event"] == "batch recorded" and e["state"] == "failed"]
    assert refused and "not valid TOML" in refused[0]["problems"][0]


def test_an_ended_batch_folder_is_let_go_and_a_later_fix_is_found_by_the_catch_up_scan(
    config_for: Callable[..., Config], staged: Callable[..., Path], drop_root: Path
) -> None:
    """inotify watches follow the batches under way, not every folder ever dropped: an ended
    batch's folder is watched ``watch_ended_seconds`` longer (here none), a manifest fixed after
    that is found by the catch-up scan, and the new revision's folder is watched again."""
    config = config_for(daemon={"rescan_seconds": 3600.0}, intake={"watch_ended_seconds": 0.0})
    source = staged("b", count=2)
    broken = drop_root / "broken"
    shutil.copytree(source, broken, ignore=shutil.ignore_patterns("manifest.toml"))
    fixed = (source / "manifest.toml").read_bytes()
    with Replay(config) as replay:
        watched = lambda: replay.service.watcher.watched_folders(drop_root)  # noqa: E731
        replay.run([write_atomically(broken / "manifest.toml", b"watchd = 1\n[owner\n", 0.0)])
        assert [b.state for b in store_batches(config)] == [BatchState.FAILED]
        assert "broken" not in watched()
        replay.run([write_atomically(broken / "manifest.toml", fixed, 0.0)])
        assert len(store_batches(config)) == 1  # no watch, no event: the scan is due in an hour
        replay.service.catch_up(time.time())
        assert "broken" in watched()  # revision 2 is under way
        replay.run()
        assert "broken" not in watched()
    assert [(b.revision, b.state) for b in store_batches(config)] == [
        (1, BatchState.FAILED),
        (2, BatchState.DONE),
    ]
    with Replay(config) as replay:  # a restart watches no ended batch's folder, new ones at once
        assert replay.service.watcher.watched_folders(drop_root) == frozenset()
        (drop_root / "new").mkdir()
        replay.run(until=lambda service: "new" in service.watcher.watched_folders(drop_root))


def store_batches(config: Config) -> list[Batch]:
    store = store_of(config)
    try:
        return store.batches()
    finally:
        store.close()


def test_manifests_naming_files_outside_their_folder_are_refused_and_nothing_runs(
    config_for: Callable[..., Config], staged: Callable[..., Path], drop_root: Path, tmp_path: Path
) -> None:
    config = config_for()
    secret = tmp_path / "secret.png"
    secret.write_bytes(b"not yours")
    climbing, linking = drop_root / "climbing", drop_root / "linking"
    shutil.copytree(staged("c", count=1), climbing)
    shutil.copytree(staged("l", count=1), linking)
    (climbing / "manifest.toml").write_text(
        (climbing / "manifest.toml").read_text()
        + f'\n[[files]]\npath = "../../secret.png"\n\n[[files]]\npath = "{secret}"\n'
    )
    os.symlink(secret, linking / "images" / "link.png")
    (linking / "manifest.toml").write_text(
        (linking / "manifest.toml").read_text() + '\n[[files]]\npath = "images/link.png"\n'
    )
    with Replay(config) as replay:
        replay.run()
    store = store_of(config)
    batches = {b.folder: b for b in store.batches()}
    assert store.jobs() == []
    store.close()
    climbed = [p.render() for p in batches["climbing"].problems]
    assert (
        "manifest.toml, files[1] '../../secret.png': path goes up with '..'; inputs must be inside the batch folder"
        in climbed
    )
    assert (
        f"manifest.toml, files[2] '{secret}': path is an absolute path; name files relative to the batch folder"
        in climbed
    )
    assert (
        batches["linking"].state is BatchState.FAILED
        and batches["linking"].reason == "inputs refused"
    )
    assert f"'images/link.png' leads outside the batch folder (to {secret})" in status_text(linking)
    assert not (climbing / "results").exists()  # refused at once: not even a run folder
    # Accepted, then refused at its inputs: the run folder made at intake stays empty.
    (run,) = (linking / "results").iterdir()
    assert run == Path(batches["linking"].run_dir) and list(run.iterdir()) == []


def test_a_batch_folder_that_is_a_link_out_of_the_root_is_refused_unread(
    config_for: Callable[..., Config], staged: Callable[..., Path], drop_root: Path, tmp_path: Path
) -> None:
    config = config_for()
    outside = staged("outside", count=1)
    os.symlink(outside, drop_root / "linked folder")
    with Replay(config) as replay:
        replay.run()
    batch = only_batch(config)
    store = store_of(config)
    assert batch.state is BatchState.FAILED and store.manifest_text(batch.id) == ""
    store.close()
    assert batch.problems[0].message.startswith("is a link to")
    assert not (outside / STATUS_NAME).exists()  # nothing written outside the root


def test_a_drop_made_while_the_daemon_was_down_is_found_at_start_up(
    config_for: Callable[..., Config], staged: Callable[..., Path], drop_root: Path
) -> None:
    config = config_for()
    shutil.copytree(staged(count=2), drop_root / "while down")
    with structlog.testing.capture_logs() as logged, Replay(config) as replay:
        replay.run()
    assert only_batch(config).state is BatchState.DONE
    assert [e for e in logged if e["event"] == "batch recorded"][0]["folder"] == "while down"


@pytest.mark.parametrize("mode", MODES)
def test_a_drop_root_that_goes_away_and_comes_back_is_watched_again(
    mode: str, config_for: Callable[..., Config], staged: Callable[..., Path], drop_root: Path
) -> None:
    config = config_for(roots={"observer": mode}, daemon={"rescan_seconds": 0.5})
    away = drop_root.with_name("unmounted")
    source = staged(count=2)
    steps = [
        at(0.2, "unmount", lambda: drop_root.rename(away)),
        at(1.5, "mount again", lambda: away.rename(drop_root)),
    ] + copy_slowly(source, drop_root / "after remount", 2.5, 0.01)
    with structlog.testing.capture_logs() as logged, Replay(config) as replay:
        replay.run(steps)
    assert only_batch(config).state is BatchState.DONE
    events = [e["event"] for e in logged]
    assert "drop root unavailable" in events and "drop root back" in events


def test_a_waiting_batch_whose_manifest_no_longer_parses_fails_with_the_reason(
    config_for: Callable[..., Config], drop_root: Path
) -> None:
    """A database written by an older watchd may hold a manifest a rule tightened since now
    refuses; the batch fails with the parser's words instead of waiting forever."""
    from daemon.core.records import NewBatch

    config = config_for()
    (drop_root / "old").mkdir()
    text = 'watchd = 1\nkind = "inference"\n[owner]\nname = "A"\n[model]\nname = "m"\n'
    text += '[[patterns]]\nglob = "img**.png"\n'
    store = Store.open(config.daemon.database)
    new = NewBatch(
        str(drop_root),
        "old",
        "sha",
        text,
        "",
        Kind.INFERENCE,
        "",
        "A",
        None,
        str(drop_root / "old" / "results" / "x"),
    )
    store.create_batch(new, BatchState.WAITING, "manifest accepted", 0.0)
    store.close()
    with Replay(config) as replay:
        replay.run()
    batch = only_batch(config)
    assert batch.state is BatchState.FAILED and batch.reason == "manifest refused"
    assert "uses '**' inside a name" in batch.problems[0].message


def test_a_timed_out_revision_replaced_by_a_new_manifest_never_comes_back(
    config_for: Callable[..., Config], staged: Callable[..., Path], drop_root: Path
) -> None:
    config = config_for(intake={"timeout_seconds": 1.0}, daemon={"rescan_seconds": 0.5})
    source, folder = staged(count=2), drop_root / "replaced after timeout"
    shutil.copytree(source, folder, ignore=shutil.ignore_patterns("manifest.toml", "img_0001.png"))
    first = (source / "manifest.toml").read_bytes()
    second = first.replace(b'title = ""', b'title = "second"')
    missing = (source / "images" / "img_0001.png").read_bytes()

    first_failed = batches_are(config, BatchState.FAILED)

    with Replay(config) as replay:
        replay.run([write_atomically(folder / "manifest.toml", first, 0.0)], until=first_failed)
        replay.run(
            [
                write_atomically(folder / "manifest.toml", second, 0.0),
                write_now(folder / "images" / "img_0001.png", missing, 0.3),
            ]
        )
    store = store_of(config)
    old, new = store.batches()
    store.close()
    assert (old.revision, old.state) == (1, BatchState.FAILED)
    assert (new.revision, new.state) == (2, BatchState.DONE)
    assert states_of(config, old.id) == ["waiting", "failed"]
