"""Intake and the batch folder's identity (device, inode): a folder replaced under its name while
its batch runs is a new batch even with the same manifest, and the running one is cancelled;
before any job ran, or after the batch ended, the same manifest dropped again is the same
batch, which then refers to the new folder. An inference batch whose model (or version) the
registry does not have is refused, saying what it has, unless a training batch under way will
register that model. A real store, real folders, a registry laid out as models/catalog.py lays
it out."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import synth

from daemon.cli.manifest_writer import ManifestRequest, build
from daemon.contract.jobspec import Identity
from daemon.contract.names import unregistered
from daemon.core.manifest_schema import Kind
from daemon.core.records import Batch, IntentAction
from daemon.core.states import BatchState
from daemon.loop.intake import Intake
from daemon.loop.registry import ModelCheck
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


@pytest.fixture
def registry(tmp_path: Path) -> Path:
    """Model 'spheroids' with versions 1 and 2 (latest = 2, best = 1), and an empty 'empty'."""
    root = tmp_path / "registry"
    for version in (1, 2):
        (root / "spheroids" / f"v{version:04d}").mkdir(parents=True)
    (root / "spheroids" / "aliases.json").write_text(json.dumps({"latest": 2, "best": 1}))
    (root / "empty").mkdir()
    return root


def _drop_new(root: Path, folder: str, kind: Kind, model: str, version: str | None) -> None:
    where = root / folder
    synth.make_batch(where, kind.value, count=2, size=32, seed=3)
    request = ManifestRequest(where, kind, model, "Owner", version=version,
                              masks="masks" if kind.trains else None)  # fmt: skip
    (where / "manifest.toml").write_text(build(request), encoding="utf-8")


def test_the_registry_says_which_models_and_versions_it_has(registry: Path) -> None:
    assert unregistered(registry, "spheroids", "latest") == ""
    assert unregistered(registry, "spheroids", "best") == ""
    assert unregistered(registry, "spheroids", "1") == ""
    assert unregistered(registry, "spheroids", "3") == (
        "model 'spheroids' has no version '3' (versions: 1, 2, best = 1, latest = 2)"
    )
    assert unregistered(registry, "nuclei", "latest") == (
        "no model named 'nuclei' in the registry (models there: empty, spheroids)"
    )
    assert "no model named 'empty'" in unregistered(registry, "empty", "latest")
    assert "(models there: none)" in unregistered(registry.parent / "nowhere", "x", "latest")
    (registry / "spheroids" / "aliases.json").unlink()  # lost: latest is the newest folder
    assert unregistered(registry, "spheroids", "latest") == ""
    assert "has no version 'best'" in unregistered(registry, "spheroids", "best")


def test_an_inference_batch_naming_a_model_not_in_the_registry_is_refused_at_intake(
    store: Store, registry: Path, drop_root: Path
) -> None:
    check = ModelCheck(registry, store)
    intake = Intake(store, max_manifest_bytes=65536, settle_seconds=0.0, limits=check)
    _drop_new(drop_root, "known", Kind.INFERENCE, "spheroids", "best")
    _drop_new(drop_root, "unknown", Kind.INFERENCE, "nuclei", None)
    _drop_new(drop_root, "no such version", Kind.INFERENCE, "spheroids", "7")
    for number, folder in enumerate(("known", "unknown", "no such version"), start=1):
        intake.look(drop_root, folder, float(number))
    found = {batch.folder: batch for batch in store.batches(root=str(drop_root))}
    assert found["known"].state is BatchState.WAITING
    unknown = found["unknown"]
    assert unknown.state is BatchState.FAILED and unknown.reason == "manifest refused"
    (problem,) = unknown.problems
    assert problem.render() == (
        "manifest.toml, model: no model named 'nuclei' in the registry (models there: empty, "
        "spheroids) — name a model the registry has (watchctl models list), or drop its "
        "training batch first; then write the manifest again"
    )
    assert "has no version '7' (versions: 1, 2" in found["no such version"].problems[0].message


def test_a_model_that_a_training_batch_under_way_will_register_is_accepted(
    store: Store, registry: Path, drop_root: Path
) -> None:
    check = ModelCheck(registry, store)
    intake = Intake(store, max_manifest_bytes=65536, settle_seconds=0.0, limits=check)
    _drop_new(drop_root, "training", Kind.TRAINING, "nuclei", None)
    intake.look(drop_root, "training", 1.0)
    _drop_new(drop_root, "inference", Kind.INFERENCE, "nuclei", None)
    intake.look(drop_root, "inference", 2.0)
    found = {batch.folder: batch for batch in store.batches(root=str(drop_root))}
    assert found["training"].state is BatchState.WAITING
    assert found["inference"].state is BatchState.WAITING
    store.transition_batch(found["training"].id, BatchState.FAILED, "inputs missing", 3.0)
    _drop_new(drop_root, "later", Kind.INFERENCE, "nuclei", None)  # the training is over
    intake.look(drop_root, "later", 4.0)
    (later,) = [b for b in store.batches(root=str(drop_root)) if b.folder == "later"]
    assert later.state is BatchState.FAILED
