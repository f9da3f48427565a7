"""The [executor.slurm] section: documented defaults, bounds, and the switch from local."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from daemon.contract.errors import ConfigError
from daemon.core.manifest import ResourceRequest
from daemon.executors.resources import problems, slurm_bounds
from daemon.site.config import SlurmExecutorSection, load_config, parse_config

REPO = Path(__file__).resolve().parents[2]


def test_the_commented_slurm_section_of_config_toml_shows_the_real_defaults() -> None:
    text = (REPO / "config.toml").read_text()
    block = text[text.index("# [executor.slurm]") :].split("\n\n")[0]
    uncommented = "\n".join(line.removeprefix("# ") for line in block.splitlines())
    documented = tomllib.loads(uncommented)["executor"]["slurm"]
    documented.pop("slurm_conf")  # an example path: unset by default
    defaults = SlurmExecutorSection().model_dump(exclude={"slurm_conf"})
    assert documented == defaults


def test_moving_to_slurm_is_one_line_of_config(tmp_path: Path) -> None:
    text = (REPO / "config.toml").read_text().replace('kind = "local"', 'kind = "slurm"', 1)
    (tmp_path / "config.toml").write_text(text)
    config = load_config(tmp_path / "config.toml")
    assert config.executor.kind == "slurm" and config.executor.slurm == SlurmExecutorSection()
    assert config.executor.slurm.cpus_per_task == 1


def test_defaults_above_their_bounds_are_refused(tmp_path: Path) -> None:
    data = {"roots": [{"path": "d"}], "executor": {"slurm": {"gpus": 4, "max_gpus": 2}}}
    with pytest.raises(ConfigError, match=r"executor.slurm: .*gpus = 4 is above max_gpus = 2"):
        parse_config(data, source=tmp_path / "config.toml")


def test_a_relative_slurm_conf_is_taken_from_the_config_files_folder(tmp_path: Path) -> None:
    data = {"roots": [{"path": "d"}], "executor": {"slurm": {"slurm_conf": "etc/slurm.conf"}}}
    config = parse_config(data, source=tmp_path / "config.toml")
    assert config.executor.slurm.slurm_conf == tmp_path / "etc" / "slurm.conf"


def test_a_manifest_may_ask_up_to_the_sites_bounds_and_is_told_which_it_passed() -> None:
    site = SlurmExecutorSection(max_gpus=2, max_time_minutes=120)
    assert problems(ResourceRequest(gpus=2, time_minutes=120), slurm_bounds(site)) == []
    (found,) = problems(ResourceRequest(gpus=3), slurm_bounds(site))
    assert found.render() == (
        "manifest.toml, resources.gpus: asks for 3, more than this site allows (2)"
        " — ask for at most 2, or ask an operator to raise max_gpus"
    )


MANIFEST = """\
watchd = 1
kind = "{kind}"
[owner]
name = "Ada"
[model]
name = "m"
[[patterns]]
glob = "images/*.png"
[resources]
{resources}
"""


def test_the_manifest_resources_table_is_read_with_its_own_bounds() -> None:
    from daemon.core.manifest import parse_manifest

    text = MANIFEST.format(kind="training", resources="time_minutes = 90\ngpus = 2\ntasks = 2")
    manifest = parse_manifest(text.encode())
    assert manifest.resources == ResourceRequest(time_minutes=90, gpus=2, tasks=2)
    assert parse_manifest(MANIFEST.format(kind="inference", resources="").encode()).resources == (
        ResourceRequest()
    )


def test_only_a_training_batch_may_ask_for_several_tasks_and_no_value_may_be_silly() -> None:
    from daemon.contract.errors import ManifestError
    from daemon.core.manifest import parse_manifest

    text = MANIFEST.format(kind="inference", resources="tasks = 2\nmemory_mb = 0\ncpus = 4")
    with pytest.raises(ManifestError) as caught:
        parse_manifest(text.encode())
    found = [p.render() for p in caught.value.problems]
    assert any(
        f.startswith("manifest.toml, resources.memory_mb: Input should be greater") for f in found
    )
    assert any(f.startswith("manifest.toml, resources.cpus: unknown key 'cpus'") for f in found)
    text = MANIFEST.format(kind="inference", resources="tasks = 2")
    with pytest.raises(
        ManifestError, match=r"only training \(and a sweep's trials\) runs several tasks"
    ):
        parse_manifest(text.encode())
