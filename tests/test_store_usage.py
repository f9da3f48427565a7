"""The store's accounting on a real SQLite file: ended attempts charged once to their owner,
group and account, summed by each; what a subject used against its quota; operators' quotas;
holds; and migration 8 keeping the intents recorded before it."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from daemon.contract.jobspec import InputFile, Pipeline, Role
from daemon.contract.usage import JobUsage
from daemon.core.manifest_schema import Kind
from daemon.core.owners import Period, Quota
from daemon.core.records import IntentAction, JobChange, NewBatch, NewJob
from daemon.core.states import BatchState, JobState
from daemon.store import Store, statements
from daemon.store.migrations import MIGRATIONS
from daemon.store.usage import Charged

NOW = 1_780_000_000.0


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store.open(tmp_path / "w.sqlite")


def new_batch(store: Store, folder: str, user: str, group: str) -> int:
    new = NewBatch(
        root="/r", folder=folder, manifest_sha256="s", manifest_text="", manifest_stat="",
        kind=Kind.INFERENCE, title="", owner="Shown Name", contact=None, run_dir="/r/x/results/1",
        owner_uid=1000 + len(folder), owner_gid=2000, owner_user=user, owner_group=group,
    )  # fmt: skip
    return store.create_batch(new, BatchState.WAITING, "accepted", NOW).id


def ended(store: Store, batch_id: int, name: str, images: int, state: JobState) -> int:
    inputs = tuple(InputFile(f"i/{k}.png", 1, role=Role.IMAGE) for k in range(images))
    (created,) = store.create_jobs(
        batch_id, [NewJob(name, Pipeline.INFER, 0, 0, 1, inputs, "local")], NOW
    )
    store.transition_job(created.id, JobState.SUBMITTED, "s", NOW,
                         JobChange(handle=f"slurm:{created.id}", new_attempt=True))  # fmt: skip
    return store.transition_job(created.id, state, "e", NOW).id


def test_ended_attempts_are_charged_once_and_summed_by_owner_group_and_account(
    store: Store,
) -> None:
    ann, bob = new_batch(store, "a", "ann", "lab"), new_batch(store, "b", "bob", "lab")
    used = JobUsage(wall_s=3600.0, cpu_s=7200.0, gpu_s=1800.0, bytes_in=10, bytes_out=5)
    for batch_id, name, images, state, account in (
        (ann, "a-0", 4, JobState.SUCCEEDED, "acct-a"),
        (ann, "a-1", 3, JobState.FAILED, "acct-a"),
        (bob, "b-0", 2, JobState.SUCCEEDED, "acct-b"),
    ):
        job = store.job(ended(store, batch_id, name, images, state))
        user = "ann" if batch_id == ann else "bob"
        store.record_usage(job, Charged(user, "lab", account), used, NOW)
        store.record_usage(job, Charged(user, "lab", account), used, NOW)  # the same attempt
    by_owner = {line.key: line for line in store.usage_by("owner", NOW - 1)}
    assert by_owner["ann"].jobs == 2 and by_owner["ann"].batches == 1
    assert by_owner["ann"].images == 4  # a failed attempt's images are not counted
    assert by_owner["ann"].cpu_hours == 4.0 and by_owner["ann"].gpu_hours == 1.0
    assert by_owner["bob"].bytes_in == 10 and by_owner["bob"].bytes_out == 5
    (lab,) = store.usage_by("group", NOW - 1)
    assert (lab.key, lab.batches, lab.jobs, lab.images) == ("lab", 2, 3, 6)
    assert [line.key for line in store.usage_by("account", NOW - 1)] == ["acct-a", "acct-b"]
    assert store.usage_by("owner", NOW + 1) == []
    assert sorted(h for h, _ in store.handles_since(NOW - 1))[0].startswith("slurm:")


def test_a_subject_uses_what_ended_and_what_its_running_batches_committed(store: Store) -> None:
    ann = new_batch(store, "a", "ann", "lab")
    job = store.job(ended(store, ann, "a-0", 4, JobState.SUCCEEDED))
    store.record_usage(job, Charged("ann", "lab", ""), JobUsage(cpu_s=3600.0), NOW)
    running = new_batch(store, "c", "ann", "lab")
    store.transition_batch(running, BatchState.QUEUED, "q", NOW)
    store.transition_batch(running, BatchState.RUNNING, "r", NOW)
    inputs = tuple(InputFile(f"i/{k}.png", 1, role=Role.IMAGE) for k in range(5))
    store.create_jobs(running, [NewJob("c-0", Pipeline.INFER, 0, 0, 1, inputs, "local")], NOW)
    used = store.used("user:ann", NOW - 1)
    assert used.images == 9 and used.cpu_hours == 1.0
    assert store.used("group:lab", NOW - 1).images == 9
    assert store.used("user:bob", NOW - 1).images == 0


def test_an_operators_quota_replaces_the_sites_until_it_is_lifted(store: Store) -> None:
    site = Quota(Period.MONTH, images=10)
    assert store.quota_account("user:ann", site, NOW).quota == site  # type: ignore[union-attr]
    assert store.quota_account("user:ann", None, NOW) is None
    raised = Quota(Period.DAY, images=1000)
    store.set_quota("user:ann", raised, "op", NOW)
    found = store.quota_account("user:ann", site, NOW)
    assert found is not None and found.quota == raised and found.set_by == "op"
    store.set_quota("user:ann", None, "op", NOW)
    assert store.quota_account("user:ann", site, NOW).quota == site  # type: ignore[union-attr]


def test_a_hold_is_recorded_with_a_note_and_released(store: Store) -> None:
    ann = new_batch(store, "a", "ann", "lab")
    store.set_hold(ann, "over the quota", NOW)
    assert store.batch(ann).hold == "over the quota"
    store.set_hold(ann, "", NOW + 1)
    assert store.batch(ann).hold == ""
    notes = [e.reason for e in store.events(ann) if e.to_state is None]
    assert notes == ["held: over the quota", "no longer held: it may start"]


def test_an_intent_names_exactly_one_batch_root_or_subject(store: Store) -> None:
    intent = store.add_subject_intent(IntentAction.QUOTA, "user:ann", '{"images": 5}', NOW, "op")
    assert (intent.subject, intent.value, intent.batch_id, intent.root) == (
        "user:ann", '{"images": 5}', None, None,
    )  # fmt: skip
    with pytest.raises(sqlite3.IntegrityError):
        store.db.execute(
            "INSERT INTO intents (at, action, root, subject) VALUES (1, 'quota', '/r', 'user:x')"
        )


def test_migration_8_keeps_the_intents_and_batches_recorded_before_it(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE migrations (version INTEGER PRIMARY KEY, applied_at TEXT)")
    for version, script in MIGRATIONS:
        if version >= 8:
            break
        for statement in statements(script):
            db.execute(statement)
        db.execute("INSERT INTO migrations VALUES (?, 'then')", [version])
    db.execute(
        "INSERT INTO intents (at, action, root, requested_by) VALUES (1, 'pause', '/r', 'op')"
    )
    db.commit()
    db.close()
    store = Store.open(path)
    assert store.schema_version() == MIGRATIONS[-1][0]  # 8 and every one after it
    (kept,) = store.pending_intents()
    assert (kept.action, kept.root, kept.subject, kept.value) == (
        IntentAction.PAUSE,
        "/r",
        None,
        "",
    )
