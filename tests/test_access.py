"""watchctl for everyone who may run it, run as real users of their own: whoever may not read
the gateway's configuration or database gets one line naming the file and the group to join
(exit 1, no traceback) from every command; `watchctl manifest` works without any configuration
and says that the daemon's default limits apply."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import accounts
import pytest
import synth

from daemon.store import Store

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not (shutil.which("useradd") and shutil.which("unshare")),
    reason="making throwaway users (useradd) and switching to them (runuser) needs root",
)

WATCHCTL = str(Path(sys.executable).parent / "watchctl")
COMMANDS = [
    ["status"], ["batches"], ["show", "1"], ["jobs"], ["logs", "b000001-infer-0000"],
    ["retry", "1"], ["cancel", "1"], ["requeue", "1"], ["pause", "0"], ["resume", "0"],
    ["doctor"], ["models", "list"],
]  # fmt: skip


@dataclass(frozen=True)
class Site:
    """A gateway laid out as docs/install.md says, in a folder of its own."""

    base: Path
    config: Path  # root:GROUP 0640 in a root:GROUP 0750 folder
    group: str  # the guide's "watchd"
    expert: str  # in neither group
    operator: str  # in GROUP


def _account(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True)


@pytest.fixture(scope="module")
def site() -> Iterator[Site]:
    tag = f"{os.getpid() % 100000}"
    group, expert, operator = f"wdg{tag}", f"wdx{tag}", f"wdo{tag}"
    _account("groupadd", group)
    _account("useradd", "-M", "-N", "-g", "users", "-s", "/usr/sbin/nologin", expert)
    _account("useradd", "-M", "-N", "-g", "users", "-G", group, "-s", "/usr/sbin/nologin", operator)
    base = Path(tempfile.mkdtemp(prefix="watchd-access-", dir="/tmp"))
    try:
        base.chmod(0o755)
        yield _lay_out(base, group, expert, operator)
    finally:
        shutil.rmtree(base)
        for user in (expert, operator):
            _account("userdel", user)
        _account("groupdel", group)


def _lay_out(base: Path, group: str, expert: str, operator: str) -> Site:
    gid = int(subprocess.run(["getent", "group", group], capture_output=True, text=True,
                             check=True).stdout.split(":")[2])  # fmt: skip
    etc, state, drop = base / "etc", base / "state", base / "drop"
    for folder, mode in ((etc, 0o750), (state, 0o2770), (drop, 0o2770)):
        folder.mkdir()
        os.chown(folder, 0, gid)
        folder.chmod(mode)
    config = etc / "config.toml"
    config.write_text(
        f'[daemon]\nstate_dir = "{state}"\n\n[[roots]]\npath = "{drop}"\n\n'
        f'[registry]\npath = "{base / "registry"}"\n'
    )
    os.chown(config, 0, gid)
    config.chmod(0o640)
    Store.open(state / "watchd.sqlite").close()
    for name in os.listdir(state):
        os.chown(state / name, 0, gid)
        (state / name).chmod(0o660)
    return Site(base, config, group, expert, operator)


def as_user(
    user: str, *args: str, cwd: Path = Path("/"), **env: str
) -> subprocess.CompletedProcess[str]:
    """``watchctl ARGS`` run as ``user`` (runuser sets its groups from the group database), in a
    private mount namespace that opens the way to this interpreter when it lies below a folder
    only root may enter (pyenv's in /root)."""
    command = ["runuser", "-u", user, "--", "env", "-i", "PATH=/usr/bin:/bin", "LANG=C.UTF-8",
               *(f"{k}={v}" for k, v in env.items()), WATCHCTL, *args]  # fmt: skip
    with tempfile.TemporaryDirectory() as stash:
        way = accounts.opening([Path(sys.executable).resolve()], Path(stash))
        script = " && ".join([*way, 'exec "$@"'])
        return subprocess.run(
            ["unshare", "-m", "sh", "-c", script, "sh", *command],
            capture_output=True, text=True, timeout=60, cwd=cwd,
        )  # fmt: skip


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_command_tells_a_user_outside_the_group_which_group_to_join(
    site: Site, command: list[str]
) -> None:
    """Found by itself ($WATCHD_CONFIG, as /etc/watchd/config.toml would be) or named with
    --config: the same line."""
    expected = (
        f"Error: the configuration {site.config} cannot be read by {site.expert} "
        f"(permission denied): join the group {site.group} (ask an operator)"
    )
    found = as_user(site.expert, *command, WATCHD_CONFIG=str(site.config))
    named = as_user(site.expert, *command, "--config", str(site.config))
    assert (found.returncode, found.stderr.strip(), found.stdout) == (1, expected, "")
    assert (named.returncode, named.stderr.strip(), named.stdout) == (1, expected, "")


def test_a_readable_configuration_with_an_unreadable_database_names_the_database(
    site: Site,
) -> None:
    """A copy of the configuration the expert may read does not open the database."""
    copy = site.base / "copy.toml"
    shutil.copy(site.config, copy)
    copy.chmod(0o644)
    try:
        done = as_user(site.expert, "status", "--config", str(copy))
    finally:
        copy.unlink()
    database = site.base / "state" / "watchd.sqlite"
    assert (done.returncode, done.stderr.strip()) == (
        1,
        f"Error: the database {database} cannot be read by {site.expert} (permission denied): "
        f"join the group {site.group} (ask an operator)",
    )


def test_a_member_of_the_group_reads_the_status(site: Site) -> None:
    done = as_user(site.operator, "status", "--json", WATCHD_CONFIG=str(site.config))
    assert done.returncode == 0, done.stderr
    assert '"state": "never started"' in done.stdout


def test_manifest_needs_no_configuration_and_says_the_default_limits_apply(site: Site) -> None:
    """On a workstation (no configuration anywhere) and on the gateway without the group: the
    manifest is written, and a note says whose limits it kept to and why."""
    folder = site.base / "plate"
    synth.make_batch(folder, "inference", count=2, size=16, seed=1)
    subprocess.run(["chown", "-R", site.expert, str(folder)], check=True)
    elsewhere = as_user(site.expert, "manifest", str(folder), "--model", "m", cwd=folder)
    assert elsewhere.returncode == 0, elsewhere.stderr
    assert elsewhere.stdout.strip() == f"wrote {folder / 'manifest.toml'}"
    assert elsewhere.stderr.strip() == (
        "note: no site configuration used (no config.toml here or in /etc/watchd; pass --config "
        "PATH); the daemon's default limits apply: a manifest of at most 16,777,216 bytes"
    )
    gateway = as_user(site.expert, "manifest", str(folder), "--force", "--model", "m",
                      cwd=folder, WATCHD_CONFIG=str(site.config))  # fmt: skip
    assert gateway.returncode == 0, gateway.stderr
    assert gateway.stderr.strip() == (
        f"note: no site configuration used (the configuration {site.config} cannot be read by "
        f"{site.expert} (permission denied): join the group {site.group} (ask an operator)); the "
        "daemon's default limits apply: a manifest of at most 16,777,216 bytes"
    )
