"""One daemon per database and per drop root, with real `watchd run` processes: a second daemon
on the same database refuses to start, naming the first; one with a database of its own leaves
a shared drop root to the daemon that holds it (every batch there runs once) and goes on with
its other roots, and refuses to start when it has no other; a daemon killed with SIGKILL is
restarted at once, its lock and lease notwithstanding."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import tomllib
from collections.abc import Callable
from pathlib import Path

import tomli_w
from test_cli import cli
from test_crash import WATCHD, start_daemon, wait_for

from daemon.core.states import BatchState
from daemon.site.claims import LOCK_NAME, lease_path
from daemon.site.config import Config, load_config
from daemon.store import Store


def beating(pid: int) -> Callable[[Store], bool]:
    """The daemon with this pid has written its heartbeat (it has started)."""
    return lambda store: (beat := store.heartbeat()) is not None and beat.pid == pid


def run_refused(config: Config) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [WATCHD, "run", "--config", str(config.source)], capture_output=True, text=True, timeout=60
    )


def stop(daemon: subprocess.Popen[bytes]) -> None:
    daemon.send_signal(signal.SIGTERM)
    daemon.wait(timeout=60)


def holder(pid: int, config: Config) -> str:
    return f"watchd pid {pid} on {socket.gethostname()} (database {config.daemon.database})"


def other_database(config: Config, where: Path, roots: list[Path]) -> Config:
    """The same settings with a state directory (a database) of its own and these roots."""
    document = tomllib.loads(config.source.read_text())
    document["daemon"]["state_dir"] = str(where / "state")
    document["daemon"]["spool_dir"] = str(config.daemon.spool_dir)  # the site's one spool
    document["roots"] = [{**document["roots"][0], "path": str(root)} for root in roots]
    where.mkdir(exist_ok=True)
    (where / "config.toml").write_text(tomli_w.dumps(document))
    return load_config(where / "config.toml")


def test_a_second_daemon_on_the_same_database_refuses_to_start_naming_the_first(
    config_for: Callable[..., Config], tmp_path: Path
) -> None:
    config = config_for()
    first = start_daemon(config, tmp_path / "first.log")
    try:
        wait_for(beating(first.pid), config, 60)
        second = run_refused(config)
    finally:
        stop(first)
    lock = config.daemon.state_dir / LOCK_NAME
    assert (second.returncode, second.stderr.strip()) == (
        1,
        f"Error: {holder(first.pid, config)} already runs on this database (it holds {lock}); "
        "one daemon per database: stop it first",
    )


def test_a_daemon_with_its_own_database_leaves_a_shared_root_to_its_holder(
    config_for: Callable[..., Config],
    tmp_path: Path,
    drop_root: Path,
    staged: Callable[..., Path],
) -> None:
    """Two gateways configured with the same drop root: the batch dropped there runs once, in
    the first; watchctl status of the second shows who holds the root."""
    config = config_for()
    own = tmp_path / "own root"
    own.mkdir()
    second_config = other_database(config, tmp_path / "second", [own, drop_root])
    only_shared = other_database(config, tmp_path / "third", [drop_root])
    first = start_daemon(config, tmp_path / "first.log")
    try:
        wait_for(beating(first.pid), config, 60)
        second = start_daemon(second_config, tmp_path / "second.log")
        try:
            wait_for(beating(second.pid), second_config, 60)
            shutil.copytree(staged("plate", count=2), drop_root / "plate")
            wait_for(lambda s: [b.state for b in s.batches()] == [BatchState.DONE], config, 120)
            status = json.loads(
                cli("watchctl", "status", "--json", "--config", str(second_config.source)).stdout
            )
            text = cli("watchctl", "status", "--config", str(second_config.source)).stdout
            third = run_refused(only_shared)
        finally:
            stop(second)
    finally:
        stop(first)
    store = Store(second_config.daemon.database)
    assert store.batches() == []
    store.close()
    shared = status["roots"][1]
    assert (shared["held_elsewhere"], shared["lease"]["pid"]) == (True, first.pid)
    assert status["roots"][0]["held_elsewhere"] is False
    assert f"root 1: {drop_root} HELD BY ANOTHER {holder(first.pid, config)}\n" in text
    logged = [json.loads(line) for line in (tmp_path / "second.log").read_text().splitlines()]
    refusal = [e for e in logged if e["event"] == "drop root held by another watchd"]
    assert [(e["root"], e["holder"]) for e in refusal] == [
        (str(drop_root), holder(first.pid, config))
    ]
    assert (third.returncode, third.stderr.strip()) == (
        1,
        f"Error: every drop root is held by another watchd: {drop_root} by "
        f"{holder(first.pid, config)}",
    )


def test_a_daemon_killed_with_sigkill_restarts_at_once_and_a_clean_stop_leaves_no_lease(
    config_for: Callable[..., Config], tmp_path: Path, drop_root: Path
) -> None:
    config = config_for()
    first = start_daemon(config, tmp_path / "first.log")
    wait_for(beating(first.pid), config, 60)
    first.kill()
    first.wait()
    lease = lease_path(config.daemon.spool_dir, drop_root)
    assert json.loads(lease.read_text())["pid"] == first.pid  # left behind, stale
    restarted = start_daemon(config, tmp_path / "restarted.log")
    try:
        wait_for(beating(restarted.pid), config, 30)
        assert json.loads(lease.read_text())["pid"] == restarted.pid
    finally:
        stop(restarted)
    assert restarted.returncode == 0
    assert not lease.exists()
    assert not any(p.name.startswith(".watchd") for p in drop_root.iterdir())


def test_a_lease_forged_in_the_drop_root_stops_nothing(
    config_for: Callable[..., Config],
    tmp_path: Path,
    drop_root: Path,
    staged: Callable[..., Path],
) -> None:
    """The red team's: an expert puts a lease naming another host, renewed in the far future,
    where the lease used to lie (and a string for its time beside it). The lease is in the
    spool now: the daemon does not read these, keeps its root, runs the next batch, and starts
    again after a restart."""
    config = config_for()
    daemon = start_daemon(config, tmp_path / "daemon.log")
    try:
        wait_for(beating(daemon.pid), config, 60)
        forged = {"host": "gw-forged", "pid": 4242, "start_ticks": 1, "renewed_at": 1e12,
                  "database": "/elsewhere.sqlite", "root": str(drop_root)}  # fmt: skip
        (drop_root / ".watchd-lease.json").write_text(json.dumps(forged))
        (drop_root / ".watchd-lease-soon.json").write_text(json.dumps({**forged,
                                                                       "renewed_at": "soon"}))
        shutil.copytree(staged("plate", count=2), drop_root / "plate")
        wait_for(lambda s: [b.state for b in s.batches()] == [BatchState.DONE], config, 120)
        assert daemon.poll() is None  # still running: nothing stopped it
    finally:
        stop(daemon)
    again = start_daemon(config, tmp_path / "again.log")
    try:
        wait_for(beating(again.pid), config, 60)
    finally:
        stop(again)
    assert (daemon.returncode, again.returncode) == (0, 0)
    logged = (tmp_path / "daemon.log").read_text() + (tmp_path / "again.log").read_text()
    assert "held by another watchd" not in logged and "taken by another watchd" not in logged
