"""Configuration: the top-level config.toml is valid; every problem is reported at once;
unknown keys list the valid ones; relative paths are taken from the file's folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.contract.errors import ConfigError
from daemon.contract.jobspec import Pipeline
from daemon.core.manifest import ResourceRequest
from daemon.executors.resources import local_bounds, problems, shape
from daemon.site.config import JobShapes, LocalExecutorSection, ObserverMode, load_config

REPO = Path(__file__).resolve().parent.parent


def test_the_documented_default_loads(tmp_path: Path) -> None:
    config = load_config(REPO / "config.toml")
    assert config.roots[0].path == REPO / "var" / "drop"
    assert config.daemon.database == REPO / "var" / "state" / "watchd.sqlite"
    assert config.roots[0].observer is ObserverMode.AUTO
    assert config.executor.kind == "local"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_every_problem_is_listed_with_its_location(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
[daemon]
tick_seconds = -1
colour = "red"
[[roots]]
path = "d"
observer = "sometimes"
[planner]
shard_size = -1
""",
    )
    with pytest.raises(ConfigError) as info:
        load_config(path)
    problems = info.value.problems
    assert "daemon.tick_seconds: Input should be greater than 0 (got -1)" in problems
    assert any(
        p.startswith(
            "daemon.colour: unknown key 'colour' (valid keys: heartbeat_seconds, lease_seconds,"
        )
        for p in problems
    )
    assert any(
        p.startswith("roots[0].observer: Input should be 'auto', 'inotify' or 'polling'")
        for p in problems
    )
    assert "planner.shard_size: Input should be greater than or equal to 0 (got -1)" in problems
    assert str(info.value).startswith(f"{path}: 4 problem(s)")


def test_a_config_needs_a_drop_root(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, "[daemon]\n"))
    assert info.value.problems == ("roots: required key is missing",)


def test_relative_paths_are_taken_from_the_config_folder(tmp_path: Path) -> None:
    config = load_config(
        write(tmp_path, '[[roots]]\npath = "drop"\n[registry]\npath = "/abs/reg"\n')
    )
    assert config.roots[0].path == tmp_path / "drop"
    assert str(config.registry.path) == "/abs/reg"


def test_a_missing_or_broken_file_is_one_clear_problem(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match=r"at line 1, column 8"):
        load_config(write(tmp_path, "[[roots]\n"))


def test_a_root_listed_twice_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="listed twice"):
        load_config(write(tmp_path, '[[roots]]\npath = "d"\n[[roots]]\npath = "./d"\n'))


def test_the_local_executor_bounds_what_a_manifest_may_ask() -> None:

    bounds = local_bounds(LocalExecutorSection())
    assert problems(ResourceRequest(tasks=2, time_minutes=600), bounds) == []
    (tasks,) = problems(ResourceRequest(tasks=3), bounds)
    assert tasks.render() == (
        "manifest.toml, resources.tasks: asks for 3, more than this site allows (2)"
        " — ask for at most 2, or ask an operator to raise max_tasks"
    )
    (gpus,) = problems(ResourceRequest(gpus=1), bounds)
    assert gpus.message == "asks for 1, more than this site allows (0)"
    assert shape(ResourceRequest(tasks=2), Pipeline.TRAIN) == (0, 2)
    assert shape(ResourceRequest(tasks=2, gpus=1), Pipeline.INFER) == (1, 1)
    assert shape(ResourceRequest(gpus=1), Pipeline.REPORT) == (0, 1)


def test_inference_runs_on_the_sites_inference_gpus_unless_its_manifest_says(
    tmp_path: Path,
) -> None:
    site = JobShapes(training_gpus=4, inference_gpus=1)
    assert shape(ResourceRequest(), Pipeline.INFER, site) == (1, 1)
    assert shape(ResourceRequest(gpus=0), Pipeline.INFER, site) == (0, 1)  # the CPU, asked for
    assert shape(ResourceRequest(), Pipeline.TRAIN, site) == (4, 1)
    assert shape(ResourceRequest(), Pipeline.REPORT, site) == (0, 1)
    path = tmp_path / "config.toml"
    path.write_text('[executor.local]\ninference_gpus = 1\n[[roots]]\npath = "d"\n')
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    assert "inference_gpus = 1 is above max_gpus = 0" in str(refused.value)
    path.write_text('[executor]\nkind = "slurm"\n[executor.slurm]\ninference_gpus = 1\n'
                    '[[roots]]\npath = "d"\n')  # fmt: skip
    assert load_config(path).executor.slurm.shapes == JobShapes(0, 1, 1)


def test_a_lease_shorter_than_three_heartbeats_is_refused(tmp_path: Path) -> None:
    """A daemon on another host would take the roots over while their holder merely renews late."""
    text = '[daemon]\nheartbeat_seconds = 5.0\nlease_seconds = 10.0\n[[roots]]\npath = "d"\n'
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    assert info.value.problems[0].startswith("daemon: lease_seconds = 10.0 is below 3 × heartbeat")
