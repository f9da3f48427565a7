"""``python -m daemon.watchd`` and ``python -m daemon.cli.watchctl`` are the console scripts
``watchd`` and ``watchctl``: the same output, the same exit status."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


@pytest.mark.parametrize(
    ("module", "script", "args"),
    [
        ("daemon.watchd", "watchd", ["check-config", "--config", "{config}"]),
        ("daemon.watchd", "watchd", ["check-config", "--config", "{missing}"]),
        ("daemon.watchd", "watchd", ["run", "--config", "{missing}"]),
        ("daemon.cli.watchctl", "watchctl", ["--help"]),
        ("daemon.cli.watchctl", "watchctl", ["doctor", "--config", "{missing}"]),
        ("daemon.cli.watchctl", "watchctl", ["no-such-command"]),
    ],
)
def test_the_module_runs_as_its_console_script(
    tmp_path: Path, module: str, script: str, args: list[str]
) -> None:
    config = tmp_path / "config.toml"
    config.write_text(f'[daemon]\nstate_dir = "{tmp_path}/state"\n[[roots]]\npath = "{tmp_path}"\n')
    argv = [a.format(config=config, missing=tmp_path / "missing.toml") for a in args]
    by_module = subprocess.run([sys.executable, "-m", module, *argv], capture_output=True,
                               text=True, cwd=tmp_path, check=False)  # fmt: skip
    by_script = subprocess.run([str(BIN / script), *argv], capture_output=True, text=True,
                               cwd=tmp_path, check=False)  # fmt: skip
    assert by_module.returncode == by_script.returncode
    assert (by_module.stdout, by_module.stderr) == (by_script.stdout, by_script.stderr)
    assert by_module.stdout or by_module.stderr  # it did something: said something
