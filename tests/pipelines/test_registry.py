"""The model registry: versions, aliases, safe loading, concurrent publication."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from models import registry
from models.registry import ModelError
from models.unet import UNet


def small_state(seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return UNet(depth=1, width=2).state_dict()


def publish(root: Path, dice: float | None, name: str = "spheroids") -> registry.ModelVersion:
    meta = {"architecture": {"depth": 1, "width": 2, "in_channels": 1}, "manifest_sha256": "ab"}
    return registry.register(root, name, small_state(), meta, val_dice=dice)


def test_a_registered_version_loads_back_with_weights_only(tmp_path: Path) -> None:
    published = publish(tmp_path, 0.8)
    assert published.version == 1 and published.path == tmp_path / "spheroids" / "v0001"
    data = published.weights_path.read_bytes()
    assert published.sha256 == hashlib.sha256(data).hexdigest()
    metadata = json.loads((published.path / "metadata.json").read_text())
    assert metadata["version"] == 1 and metadata["sha256"] == published.sha256
    assert metadata["val_dice"] == 0.8 and metadata["manifest_sha256"] == "ab"
    state = registry.load(registry.resolve(tmp_path, "spheroids", "latest"))
    net = UNet(**published.architecture)
    net.load_state_dict(state)
    for key, value in small_state().items():
        assert torch.equal(state[key], value)


def test_best_moves_only_when_val_dice_improves(tmp_path: Path) -> None:
    publish(tmp_path, 0.5)
    publish(tmp_path, 0.4)
    assert registry.read_aliases(tmp_path, "spheroids") == {"latest": 2, "best": 1}
    publish(tmp_path, 0.7)
    publish(tmp_path, None)
    assert registry.read_aliases(tmp_path, "spheroids") == {"latest": 4, "best": 3}
    assert registry.resolve(tmp_path, "spheroids", "best").version == 3
    assert registry.resolve(tmp_path, "spheroids", "v0002").version == 2
    assert registry.resolve(tmp_path, "spheroids", "2").version == 2


def test_unknown_models_and_versions_list_what_is_available(tmp_path: Path) -> None:
    publish(tmp_path, 0.5)
    publish(tmp_path, 0.6)
    publish(tmp_path, 0.1, name="nuclei")
    with pytest.raises(
        ModelError, match=r"no model named 'cells'.*available models: nuclei, spheroids"
    ):
        registry.resolve(tmp_path, "cells", "latest")
    with pytest.raises(ModelError, match=r"no version 7; available versions of 'spheroids': 1, 2"):
        registry.resolve(tmp_path, "spheroids", "7")
    with pytest.raises(ModelError, match=r"invalid model version 'newest'"):
        registry.resolve(tmp_path, "spheroids", "newest")


@pytest.mark.parametrize("name", ["../escape", "a/b", ".hidden", "", "x" * 101])
def test_model_names_cannot_leave_the_registry(tmp_path: Path, name: str) -> None:
    with pytest.raises(ModelError, match="invalid model name"):
        registry.resolve(tmp_path, name, "latest")
    with pytest.raises(ModelError, match="invalid model name"):
        publish(tmp_path, 0.5, name=name)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("damage", ["flip", "truncate", "remove"])
def test_damaged_weights_are_refused_with_what_was_expected(tmp_path: Path, damage: str) -> None:
    published = publish(tmp_path, 0.5)
    data = bytearray(published.weights_path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
        published.weights_path.write_bytes(bytes(data))
    elif damage == "truncate":
        published.weights_path.write_bytes(bytes(data[: len(data) // 3]))
    else:
        published.weights_path.unlink()
    expected = "recorded " + published.sha256 if damage != "remove" else "cannot read"
    with pytest.raises(ModelError, match=expected):
        registry.load(registry.resolve(tmp_path, "spheroids", "1"))


class _Exploit:
    """Unpickling this would create a file: it must never happen."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (Path.touch, (str(self.marker),))  # type: ignore[return-value]


def test_a_pickle_with_code_is_refused_even_when_its_hash_matches(tmp_path: Path) -> None:
    """weights_only=True refuses arbitrary objects; the sha256 check alone is not the defence."""
    published = publish(tmp_path, 0.5)
    marker = tmp_path / "exploited"
    torch.save({"weight": _Exploit(marker)}, published.weights_path)
    metadata_path = published.path / "metadata.json"
    metadata = json.loads(metadata_path.read_text())
    metadata["sha256"] = hashlib.sha256(published.weights_path.read_bytes()).hexdigest()
    metadata_path.write_text(json.dumps(metadata))
    with pytest.raises(ModelError, match="refused to load"):
        registry.load(registry.resolve(tmp_path, "spheroids", "1"))
    assert not marker.exists()


def test_concurrent_registrations_take_distinct_versions(tmp_path: Path) -> None:
    count = 8
    barrier = threading.Barrier(count)
    versions: list[int] = []

    def register(index: int) -> None:
        barrier.wait()
        versions.append(publish(tmp_path, index / 10).version)

    threads = [threading.Thread(target=register, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(versions) == list(range(1, count + 1))
    assert registry.list_versions(tmp_path, "spheroids") == list(range(1, count + 1))
    aliases = registry.read_aliases(tmp_path, "spheroids")
    assert aliases["latest"] == count
    best = registry.resolve(tmp_path, "spheroids", "best")
    assert best.metadata["val_dice"] == (count - 1) / 10
    for version in range(1, count + 1):
        published = registry.resolve(tmp_path, "spheroids", str(version))
        assert published.metadata["version"] == version
        registry.load(published)
    assert not [p for p in (tmp_path / "spheroids").iterdir() if p.name.startswith(".tmp-")]


def test_publishing_onto_a_taken_number_takes_the_next_one(tmp_path: Path) -> None:
    """The race another trainer wins: our staged folder lands on the next free number."""
    publish(tmp_path, 0.5)
    model_dir = tmp_path / "spheroids"
    staging = model_dir / ".tmp-version-test"
    staging.mkdir()
    (staging / "weights.pt").write_bytes(b"x")
    (model_dir / "v0002").mkdir()
    (model_dir / "v0002" / "weights.pt").write_bytes(b"theirs")
    version = registry.publish(staging, model_dir, {"sha256": "00"}, first=2)
    assert version == 3
    assert json.loads((model_dir / "v0003" / "metadata.json").read_text())["version"] == 3
    assert (model_dir / "v0002" / "weights.pt").read_bytes() == b"theirs"


def publish_with(root: Path, metrics: dict[str, float], rule: registry.BestRule) -> int:
    meta = {"architecture": {"depth": 1, "width": 2, "in_channels": 1}, "metrics": metrics}
    return registry.register(
        root, "spheroids", small_state(), meta, val_dice=metrics["val_dice"], rule=rule
    ).version


def test_best_needs_to_beat_the_margin_on_the_chosen_metric(tmp_path: Path) -> None:
    by_iou = registry.BestRule(metric="val_iou", margin=0.05)
    publish_with(tmp_path, {"val_dice": 0.80, "val_iou": 0.70}, by_iou)
    publish_with(tmp_path, {"val_dice": 0.95, "val_iou": 0.74}, by_iou)  # +0.04 IoU: not enough
    assert registry.read_aliases(tmp_path, "spheroids") == {"latest": 2, "best": 1}
    publish_with(tmp_path, {"val_dice": 0.70, "val_iou": 0.76}, by_iou)  # +0.06 IoU: best
    assert registry.read_aliases(tmp_path, "spheroids") == {"latest": 3, "best": 3}
    lines = (tmp_path / "spheroids" / "history.jsonl").read_text().splitlines()
    history = [json.loads(line) for line in lines]
    assert [(h["alias"], h["to"]) for h in history] == [
        ("latest", 1), ("best", 1), ("latest", 2), ("latest", 3), ("best", 3),
    ]  # fmt: skip


def test_best_can_be_chosen_by_the_validation_objects_f1(tmp_path: Path) -> None:
    """A version that finds the objects better becomes best even with a lower pixel Dice."""
    by_objects = registry.BestRule(metric="val_object_f1")
    publish_with(tmp_path, {"val_dice": 0.97, "val_object_f1": 0.80}, by_objects)
    publish_with(tmp_path, {"val_dice": 0.95, "val_object_f1": 0.96}, by_objects)
    assert registry.read_aliases(tmp_path, "spheroids") == {"latest": 2, "best": 2}


def test_promote_moves_an_alias_and_refuses_a_damaged_version(tmp_path: Path) -> None:
    from models import catalog

    publish(tmp_path, 0.9)
    second = publish(tmp_path, 0.5)
    assert catalog.promote(tmp_path, "spheroids", "2", "best", by="ops") == {"latest": 2, "best": 2}
    last = json.loads((tmp_path / "spheroids" / "history.jsonl").read_text().splitlines()[-1])
    assert (last["alias"], last["from"], last["to"], last["by"]) == ("best", 1, 2, "ops")
    second.weights_path.write_bytes(second.weights_path.read_bytes()[:100])
    with pytest.raises(
        ModelError, match=r"version 2: weights.pt has sha256 .* the registry recorded"
    ):
        catalog.promote(tmp_path, "spheroids", "2", "best")
    with pytest.raises(ModelError, match="unknown alias 'newest'"):
        catalog.promote(tmp_path, "spheroids", "1", "newest")


def watchctl(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [str(Path(sys.executable).parent / "watchctl"), "models", *args, "-c", str(config)]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)


def test_watchctl_lists_and_promotes_through_the_catalogue(tmp_path: Path) -> None:
    """watchctl (which never imports torch) runs ``python -m models.catalog`` for it."""
    root = tmp_path / "registry"
    publish(root, 0.9)  # from before objects were scored: no object scores
    scores = {"val_dice": 0.5, "val_iou": 0.4, "val_object_f1": 0.9612, "val_matched_iou": 0.8833,
              "val_count_error": 0.025}  # fmt: skip
    meta = {"architecture": {"depth": 1, "width": 2, "in_channels": 1}, "metrics": scores}
    registry.register(root, "spheroids", small_state(), meta, val_dice=0.5)
    config = tmp_path / "config.toml"
    config.write_text(f'[[roots]]\npath = "{tmp_path / "drop"}"\n[registry]\npath = "{root}"\n')
    listed = watchctl(config, "list", "--json")
    assert listed.returncode == 0, listed.stderr
    (model,) = json.loads(listed.stdout)["models"]
    assert model["aliases"] == {"latest": 2, "best": 1}
    assert [(v["version"], v["aliases"], v["val_dice"]) for v in model["versions"]] == [
        (2, ["latest"], 0.5), (1, ["best"], 0.9),
    ]  # fmt: skip
    newest = model["versions"][0]
    assert (newest["val_object_f1"], newest["val_count_error"]) == (0.9612, 0.025)
    assert model["versions"][1]["val_object_f1"] is None
    table = watchctl(config, "list")
    assert "spheroids" in table.stdout and "0.9000" in table.stdout
    assert "obj_f1@.5" in table.stdout and "count_err" in table.stdout
    assert "0.9612" in table.stdout and "0.8833" in table.stdout and "2.5%" in table.stdout
    promoted = watchctl(config, "promote", "spheroids", "2")
    assert promoted.returncode == 0, promoted.stderr
    assert promoted.stdout.strip() == "spheroids: best → version 2 (best = 2, latest = 2)"
    missing = watchctl(config, "promote", "spheroids", "7")
    assert missing.returncode == 1
    assert missing.stderr.strip() == (
        "Error: model 'spheroids' has no version 7; available versions of 'spheroids': 1, 2 "
        "(best = 2, latest = 2)"
    )
