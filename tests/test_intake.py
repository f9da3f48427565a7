"""Intake and the batch folder's identity (device, inode): a folder replaced under its name while
its batch runs is a new batch even with the same manifest, and the running one is cancelled;
before any job ran, or after the batch ended, the same manifest dropped again is the same
batch, which then refers to the new folder. A real store, real folders."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import synth

from daemon.cli.manifest_writer import ManifestRequest, build
from daemon.contract.jobspec import Identity
from daemon.core.manifest_schema import Kind
from daemon.core.records import Batch, IntentAction
from daemon.core.states import BatchState
from daemon.loop.intake import Intake
from daemon.store import Store


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    opened = Store.open(tmp_path / "watchd.sqlite")
    yield opened
    opened.close()


@pytest.fixture
def staged(tmp_path: Path) -> Path:
    """A batch folder (images and a manifest) outside the drop root, to copy in."""
    folder = tmp_path / "staging"
    synth.make_batch(folder, "inference", count=2, size=32, seed=3)
    request = ManifestRequest(folder, Kind.INFERENCE, "spheroid-unet", "Owner", version="1")
    (folder / "manifest.toml").write_text(build(request), encoding="utf-8")
    return folder


def _drop(staged: Path, folder: Path) -> Identity:
    shutil.copytree(staged, folder)
    return Identity.of(os.stat(folder), os.stat(folder.parent))


def _replace(staged: Path, folder: Path, away: Path) -> Identity:
    os.rename(folder, away)
    return _drop(staged, folder)


def _intake(store: Store) -> Intake:
    return Intake(store, max_manifest_bytes=65536, settle_seconds=0.0)


def _revisions(store: Store, root: Path) -> list[Batch]:
    return store.batches(root=str(root))


def test_the_folder_identity_is_recorded_when_the_batch_is_taken_in(
    store: Store, staged: Path, drop_root: Path
) -> None:
    identity = _drop(staged, drop_root / "plate")
    _intake(store).look(drop_root, "plate", 1.0)
    (batch,) = _revisions(store, drop_root)
    assert batch.identity == identity


def test_a_folder_replaced_while_its_batch_runs_is_a_new_revision_and_the_old_is_cancelled(
    store: Store, staged: Path, drop_root: Path, tmp_path: Path
) -> None:
    intake, folder = _intake(store), drop_root / "plate"
    _drop(staged, folder)
    intake.look(drop_root, "plate", 1.0)
    (first,) = _revisions(store, drop_root)
    store.transition_batch(first.id, BatchState.QUEUED, "inputs ready", 2.0)
    store.transition_batch(first.id, BatchState.RUNNING, "submitted", 3.0)
    new = _replace(staged, folder, tmp_path / "moved away")  # the very same manifest
    intake.look(drop_root, "plate", 4.0)
    first, second = _revisions(store, drop_root)
    assert (second.revision, second.identity) == (2, new)
    (cancel,) = store.intents_of(first.id)
    assert (cancel.action, cancel.requested_by) == (
        IntentAction.CANCEL,
        "watchd (the batch folder was replaced; superseded by revision 2)",
    )
    notes = [e.reason for e in store.events(second.id)]
    assert "the batch folder was replaced: revision 2 replaces 1" in notes


@pytest.mark.parametrize("state", [BatchState.WAITING, BatchState.DONE])
def test_the_same_manifest_dropped_again_before_any_job_or_after_the_end_is_the_same_batch(
    state: BatchState, store: Store, staged: Path, drop_root: Path, tmp_path: Path
) -> None:
    intake, folder = _intake(store), drop_root / "plate"
    _drop(staged, folder)
    intake.look(drop_root, "plate", 1.0)
    (batch,) = _revisions(store, drop_root)
    if state is BatchState.DONE:
        for step in (BatchState.QUEUED, BatchState.RUNNING, BatchState.DONE):
            store.transition_batch(batch.id, step, step.value, 2.0)
    new = _replace(staged, folder, tmp_path / "moved away")
    intake.look(drop_root, "plate", 3.0)
    (batch,) = _revisions(store, drop_root)
    assert (batch.state, batch.identity) == (state, new)
    assert store.intents_of(batch.id) == []
