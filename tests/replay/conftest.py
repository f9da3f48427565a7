"""Replay fixtures: a config on a real drop root (awkward names), a real SQLite file, the real
local executor, and a registry holding one tiny model trained by a real training drop."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import synth
import tomli_w
from replay import Replay, copy_slowly, manifest_text

from daemon.core.manifest_schema import Kind
from daemon.site.config import Config, load_config

MODEL = "spheroid-unet"
TINY_TRAINING = {"epochs": 2, "batch_size": 4, "depth": 2, "width": 8, "learning_rate": 0.01}


def write_config(tmp_path: Path, root: Path, registry: Path, **sections: dict) -> Config:
    """A config tuned for tests (fast ticks, short settle), written as TOML and loaded."""
    document = {
        "daemon": {"state_dir": str(tmp_path / "state"), "tick_seconds": 0.05,
                   "heartbeat_seconds": 0.5, "rescan_seconds": 2.0, "shutdown_grace_seconds": 60},
        "roots": [{"path": str(root), "observer": "inotify", "poll_seconds": 0.2}],
        "intake": {"settle_seconds": 0.3, "timeout_seconds": 60, "check_seconds": 0.1},
        "planner": {"shard_size": 4, "max_attempts": 2},
        "executor": {"local": {"max_parallel": 2}},
        "registry": {"path": str(registry)},
        "jobs": {"wandb_mode": "disabled"},
    }  # fmt: skip
    for name, values in sections.items():
        if name == "roots":
            document["roots"] = [{**document["roots"][0], **values}]
        else:
            document[name] = {**document.get(name, {}), **values}
    path = tmp_path / "config.toml"
    path.write_text(tomli_w.dumps(document))
    return load_config(path)


@pytest.fixture(scope="session")
def trained_registry(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A registry with one tiny model, produced by a real training drop through the daemon."""
    base = tmp_path_factory.mktemp("training")
    root, registry = base / "drop", base / "registry"
    root.mkdir()
    config = write_config(base, root, registry)
    staging = base / "staging"
    synth.make_batch(staging, "training", count=12, size=64, seed=3)
    (staging / "manifest.toml").write_bytes(
        manifest_text(staging, Kind.TRAINING, model=MODEL, params=TINY_TRAINING)
    )
    with Replay(config) as replay:
        replay.run(copy_slowly(staging, root / "training", 0.0, 0.01), timeout=240)
    assert (registry / MODEL / "aliases.json").exists(), "the training drop registered no model"
    return registry


@pytest.fixture
def registry(tmp_path: Path, trained_registry: Path) -> Path:
    """A private copy of the trained registry (tests must not see each other's versions)."""
    copy = tmp_path / "registry"
    shutil.copytree(trained_registry, copy)
    return copy


@pytest.fixture
def config_for(tmp_path: Path, drop_root: Path, registry: Path) -> Callable[..., Config]:
    return lambda **sections: write_config(tmp_path, drop_root, registry, **sections)


@pytest.fixture
def staged(tmp_path: Path) -> Callable[..., Path]:
    """Generate an inference batch (images + manifest) in a staging folder outside the root."""

    def make(name: str = "staged", count: int = 6, size: int = 64, **manifest_options: object
             ) -> Path:  # fmt: skip
        folder = tmp_path / "staging" / name
        synth.make_batch(folder, "inference", count=count, size=size, seed=7)
        (folder / "manifest.toml").write_bytes(
            manifest_text(folder, Kind.INFERENCE, model=MODEL, version="latest", **manifest_options)
        )
        return folder

    return make
