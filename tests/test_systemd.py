"""The systemd unit: its sandbox scores at most 3.0 in systemd's own offline analysis, every
setting says why it is there, and it agrees with the daemon (notify, watchdog, stop timeout).

systemd-analyze comes from Debian's systemd package (scripts/setup-env installs it where it
can); it analyses unit files offline, without systemd running as PID 1.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from daemon.site.config import load_config, parse_config

REPO = Path(__file__).resolve().parent.parent
UNIT = REPO / "systemd" / "watchd.service"
LOCAL_DROP_IN = REPO / "systemd" / "watchd-local.conf"
MAX_EXPOSURE = 3.0

analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="systemd-analyze is not installed (scripts/setup-env installs it when run as root)",
)


def exposure(*args: str) -> tuple[float, str]:
    """The overall exposure systemd-analyze prints, and its warnings (stderr)."""
    done = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", "--no-pager", *args],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", done.stdout)
    assert found, f"no exposure in the output:\n{done.stdout}\n{done.stderr}"
    return float(found.group(1)), done.stderr


def settings(path: Path) -> list[tuple[int, str, str]]:
    """(line number, key, value) of every setting in a unit file or drop-in."""
    found = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            found.append((number, key.strip(), value.strip()))
    return found


@analyze
def test_the_unit_exposure_is_at_most_3_and_every_setting_is_understood() -> None:
    score, warnings = exposure(str(UNIT))
    print(f"systemd-analyze security --offline=true systemd/watchd.service: {score}")
    assert warnings == "", warnings  # an unknown key or a bad value would be ignored silently
    assert score <= MAX_EXPOSURE


@analyze
def test_the_local_executor_drop_in_applies_and_its_cost_is_reported(tmp_path: Path) -> None:
    """Installed as a drop-in, it loosens what jobs need (devices, JIT memory) and nothing
    else; the score goes up, and it is shown so that the cost is known."""
    units = tmp_path / "etc" / "systemd" / "system"
    (units / "watchd.service.d").mkdir(parents=True)
    shutil.copy(UNIT, units / "watchd.service")
    shutil.copy(LOCAL_DROP_IN, units / "watchd.service.d" / "local.conf")
    base, _ = exposure(str(UNIT))
    score, warnings = exposure(f"--root={tmp_path}", "watchd.service")
    print(f"with systemd/watchd-local.conf as a drop-in: {score}")
    assert warnings == "", warnings
    assert base < score <= MAX_EXPOSURE + 1.0


@pytest.mark.parametrize("path", [UNIT, LOCAL_DROP_IN], ids=lambda p: p.name)
def test_every_setting_has_a_comment_saying_why(path: Path) -> None:
    """Each setting is preceded by a comment (directly, or through the settings right above it
    that share that comment, at most two)."""
    lines = path.read_text().splitlines()
    bare = []
    for number, key, _ in settings(path):
        above = lines[max(0, number - 4) : number - 1]
        if not any(line.startswith("#") for line in above):
            bare.append(f"{path.name}:{number}: {key}")
    assert bare == []


def test_the_unit_agrees_with_the_daemon() -> None:
    """Type=notify with a watchdog that only the daemon feeds; a stop timeout longer than the
    daemon's shutdown grace; a restart policy with a start limit; the documented paths."""
    unit = {key: value for _, key, value in settings(UNIT)}
    grace = load_config(REPO / "config.toml").daemon.shutdown_grace_seconds
    assert unit["Type"] == "notify"
    assert unit["NotifyAccess"] == "main"
    assert int(unit["WatchdogSec"]) >= 10
    assert float(unit["TimeoutStopSec"]) > grace
    assert unit["Restart"] == "on-failure"
    assert int(unit["StartLimitBurst"]) > 1
    assert unit["ExecStart"].split()[1:] == ["run", "--config", "/etc/watchd/config.toml"]
    assert unit["StateDirectory"] == "watchd"
    assert unit["User"] == "watchd"
    read_write = [v for _, k, v in settings(UNIT) if k == "ReadWritePaths"]
    assert len(read_write) == 2  # the drop root and the registry, to be edited by the operator


def test_the_install_guide_matches_the_unit_and_its_example_config_is_valid(
    tmp_path: Path,
) -> None:
    """The guide's example config validates, Slurm backend included, and uses the paths the
    unit's example makes writable."""
    guide = (REPO / "docs" / "install.md").read_text()
    (example,) = re.findall(
        r"<!-- drill: file /etc/watchd/config.toml -->\n```toml\n(.*?)```", guide, flags=re.DOTALL
    )
    additions = re.findall(r"Add, for\nexample:\n\n```toml\n(.*?)```", guide, flags=re.DOTALL)
    assert additions, "the guide's [accounts] example"
    for addition in additions:  # the sections the guide says to add validate with the example
        parse_config(tomllib.loads(example + addition), source=tmp_path / "config.toml")
    document = tomllib.loads(example)
    config = parse_config(document, source=tmp_path / "config.toml")
    assert config.executor.kind == "slurm"
    assert config.executor.slurm.python == "/lsdf/watchd/venv-train/bin/python"
    assert config.daemon.state_dir == Path("/var/lib/watchd")
    assert config.daemon.shutdown_grace_seconds < float(
        {k: v for _, k, v in settings(UNIT)}["TimeoutStopSec"]
    )
    written = [v.lstrip("-") for _, k, v in settings(UNIT) if k == "ReadWritePaths"]
    assert written == [str(config.roots[0].path), str(config.registry.path)]
    assert config.mail.enabled and config.metrics.enabled
