"""Health checks: what ``watchctl doctor`` shows. Each is a :class:`Check` (name, ok, detail,
and a hint when it failed); :func:`run` loads the config (its first check) and runs the rest,
so a new kind of check is one more function added to GROUPS.

The checks run as whoever runs watchctl: "writable" means writable by that user, which is the
daemon's view only when doctor runs as the daemon's user (``sudo -u watchd watchctl doctor``).
"""

from __future__ import annotations

import os
import sqlite3
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from daemon.cli.base import liveness
from daemon.contract.errors import ConfigError, WatchdError
from daemon.contract.names import model_names
from daemon.contract.spool import private_problem
from daemon.contract.version import code_version
from daemon.executors import Check, make_executor
from daemon.site.access import user_name
from daemon.site.claims import Holder, Verdict, judge, read_lease, read_state_holder
from daemon.site.config import Config, ObserverMode, RootSection, load_config
from daemon.site.mounts import choose_mode, filesystem_type, is_network
from daemon.store import Store
from daemon.store.migrations import MIGRATIONS

CheckGroup = Callable[[Config, Mapping[str, str]], list[Check]]
INOTIFY_LIMITS = Path("/proc/sys/fs/inotify")


def run(path: Path, environ: Mapping[str, str]) -> list[Check]:
    """Load the config at ``path`` (every problem in it is the first check's failure), then
    run every other check on it."""
    try:
        config = load_config(path)
    except ConfigError as exc:
        return [Check("config", False, str(exc), "fix what is listed (the daemon refuses it too)")]
    return [check for group in GROUPS for check in group(config, environ)]


def config_checks(config: Config, environ: Mapping[str, str]) -> list[Check]:
    roots = ", ".join(str(r.path) for r in config.roots)
    detail = f"{config.source}: executor {config.executor.kind}, roots {roots}"
    return [Check("config", True, detail)]


# -- drop roots ---------------------------------------------------------------------------------


def root_checks(config: Config, environ: Mapping[str, str]) -> list[Check]:
    """Each root: there, a folder, readable and writable; its filesystem and observer mode."""
    found = []
    for index, root in enumerate(config.roots):
        found += [_root_access(f"root {index}", root.path), _observer(f"root {index}", root)]
        found.append(_lease(f"root {index} lease", root.path, config))
    return found


def _lease(name: str, root: Path, config: Config) -> Check:
    """Which daemon holds the root: this configuration's, or another (with its own database)
    that keeps this one's daemon off it while it runs."""
    now = time.time()
    holder = read_lease(config.daemon.spool_dir, root, now, config.daemon.lease_seconds)
    if holder is None:
        return Check(name, True, "none (the daemon takes it when it starts)")
    detail = f"{holder.describe()}, renewed {now - holder.renewed_at:.0f} s ago"
    if holder.database == str(config.daemon.database):
        return Check(name, True, detail)
    me = Holder.me(config.daemon.database, now)
    if judge(holder, me, now, config.daemon.lease_seconds) is Verdict.STALE:
        return Check(name, True, f"{detail}: stale, this configuration's daemon takes it over")
    hint = (
        "one daemon per drop root: stop the other daemon, or remove this root from one of the "
        "two configurations"
    )
    return Check(name, False, f"held by another daemon: {detail}", hint)


def _root_access(name: str, path: Path) -> Check:
    if not path.exists():
        hint = "mount the share or create the folder (the daemon scans it once it is there)"
        return Check(name, False, f"{path}: does not exist", hint)
    if not path.is_dir():
        return Check(name, False, f"{path}: is not a folder", "name a folder in roots[].path")
    try:
        with os.scandir(path) as entries:
            folders = sum(1 for e in entries if e.is_dir(follow_symlinks=False))
    except OSError as exc:
        return Check(name, False, f"{path}: cannot be listed ({exc.strerror})", _ACCESS_HINT)
    problem = _write_problem(path)
    if problem:
        return Check(name, False, f"{path}: {problem}", _ACCESS_HINT)
    return Check(name, True, f"{path}: {folders} folder(s), readable and writable by {user_name()}")


_ACCESS_HINT = (
    "watchd writes status files and results into the batch folders: give its user read and "
    "write access (and the unit's ReadWritePaths=)"
)


def _observer(name: str, root: RootSection) -> Check:
    fstype = filesystem_type(root.path)
    mode = choose_mode(root.observer, fstype)
    chosen = f" → {mode.value}" if root.observer is ObserverMode.AUTO else ""
    detail = f"{fstype or 'unknown'} filesystem, observer {root.observer.value}{chosen}"
    if mode is ObserverMode.INOTIFY and fstype is not None and is_network(fstype):
        hint = 'inotify sees no writes made on other hosts: set observer = "auto" or "polling"'
        return Check(f"{name} observer", False, detail, hint)
    return Check(f"{name} observer", True, detail)


def inotify_checks(config: Config, environ: Mapping[str, str]) -> list[Check]:
    """One watch per root and per folder directly under it whose batch has not ended (those the
    daemon watches when it starts); one inotify instance."""
    watched = [
        r.path
        for r in config.roots
        if choose_mode(r.observer, filesystem_type(r.path)) is ObserverMode.INOTIFY
    ]
    if not watched:
        return [Check("inotify", True, "no root is watched with inotify")]
    ended = _ended_folders(config.daemon.database, watched)
    needed = sum(1 + len(_folder_names(path) - ended[path]) for path in watched)
    watches = _read_limit(INOTIFY_LIMITS / "max_user_watches")
    instances = _read_limit(INOTIFY_LIMITS / "max_user_instances")
    return [inotify_limits(needed, watches, instances)]


def inotify_limits(needed: int, watches: int | None, instances: int | None) -> Check:
    """Whether the kernel's per-user limits leave room for ``needed`` watches and one instance
    (both limits are shared by every process of the user)."""
    if watches is None or instances is None:
        return Check("inotify", True, f"{needed} watch(es) needed; the limits are unknown here")
    detail = (
        f"{needed} watch(es) needed of max_user_watches {watches}, "
        f"1 instance of max_user_instances {instances}"
    )
    if needed > watches:
        hint = (
            f"raise fs.inotify.max_user_watches above {needed} (sysctl, and a file in "
            '/etc/sysctl.d/ to keep it), or set observer = "polling" on the biggest root'
        )
        return Check("inotify", False, detail, hint)
    if instances < 1:
        return Check("inotify", False, detail, "raise fs.inotify.max_user_instances")
    return Check("inotify", True, detail)


def _folder_names(path: Path) -> set[str]:
    try:
        with os.scandir(path) as entries:
            return {e.name for e in entries if e.is_dir(follow_symlinks=False)}
    except OSError:
        return set()


def _ended_folders(database: Path, roots: list[Path]) -> dict[Path, set[str]]:
    """For each root, the folders whose newest batch has ended (none if there is no database)."""
    if not database.is_file():
        return {root: set() for root in roots}
    try:
        store = Store(database)
        try:
            return {root: store.ended_folders(str(root)) for root in roots}
        finally:
            store.close()
    except sqlite3.Error:
        return {root: set() for root in roots}  # the database check says what is wrong


def _read_limit(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


# -- the database, the daemon, the registry -----------------------------------------------------


def database_checks(config: Config, environ: Mapping[str, str]) -> list[Check]:
    """Integrity, schema version, WAL; and whether this user can record intents."""
    path = config.daemon.database
    if not path.exists():
        detail = f"{path}: not created yet (the daemon creates it at its first start)"
        problem = _write_problem(_nearest_existing(path.parent))
        if problem:
            hint = "make daemon.state_dir writable for the daemon (the unit's StateDirectory=)"
            return [Check("database", False, f"{detail}; its folder: {problem}", hint)]
        return [Check("database", True, detail)]
    try:
        store = Store(path)
        try:
            integrity, version, journal = (
                store.integrity(), store.schema_version(), store.journal_mode()
            )  # fmt: skip
        finally:
            store.close()
    except sqlite3.Error as exc:
        hint = "stop watchd, keep a copy of the file, and recover it (sqlite3 FILE .recover)"
        return [Check("database", False, f"{path}: {exc}", hint)]
    return [_database(path, integrity, version, journal, _writable(path))]


def _database(path: Path, integrity: str, version: int, journal: str, writable: bool) -> Check:
    latest = MIGRATIONS[-1][0]
    size = f"{path.stat().st_size / 1e6:.1f} MB"
    detail = f"{path}: integrity {integrity}, schema version {version} of {latest}, "
    detail += f"journal {journal}, {size}"
    if integrity != "ok":
        hint = "stop watchd, keep a copy of the file, and recover it (sqlite3 FILE .recover)"
        return Check("database", False, detail, hint)
    if version > latest:
        return Check("database", False, detail, "this watchctl is older than the daemon: upgrade")
    if journal.lower() != "wal":
        return Check("database", False, detail, "the daemon sets WAL when it opens the file")
    if not writable:
        hint = f"{user_name()} cannot record intents (retry, cancel, pause): join the group watchd"
        return Check("database", False, detail + f"; not writable by {user_name()}", hint)
    if version < latest:
        detail += " (the daemon migrates it at its next start)"
    return Check("database", True, detail)


def daemon_checks(config: Config, environ: Mapping[str, str]) -> list[Check]:
    """Whether the daemon runs, and runs the version installed here."""
    if not config.daemon.database.exists():
        return [Check("daemon", True, "never started with this config")]
    store = Store(config.daemon.database)
    try:
        beat = store.heartbeat()
    finally:
        store.close()
    live = liveness(beat, time.time(), config.daemon.heartbeat_seconds)
    mine = code_version()
    if beat is None or not live["alive"]:
        return [Check("daemon", True, f"{live['state']}; this watchctl is version {mine}")]
    detail = f"running (pid {beat.pid} on {beat.host}), version {beat.version}"
    if (holder := read_state_holder(config.daemon.state_dir)) is not None:
        detail += f"; the database's lock names {holder.describe()}"
    if beat.version != mine:
        hint = "restart watchd to run the version installed here"
        return [Check("daemon", False, f"{detail}; this watchctl is version {mine}", hint)]
    return [Check("daemon", True, detail)]


def registry_checks(config: Config, environ: Mapping[str, str]) -> list[Check]:
    path = config.registry.path
    hint = "training jobs write new model versions there: make it writable for watchd's user"
    if not path.exists():
        return [_to_be_made("registry", path, "the first training creates it", hint)]
    if not path.is_dir():
        return [Check("registry", False, f"{path}: is not a folder", "name a folder")]
    problem = _write_problem(path)
    if problem:
        return [Check("registry", False, f"{path}: {problem}", hint)]
    models = len(model_names(path))
    return [Check("registry", True, f"{path}: {models} model(s), writable by {user_name()}")]


def spool_checks(config: Config, environ: Mapping[str, str]) -> list[Check]:
    """The spool: there (or makeable) and the service's alone. Only as the daemon's user does
    "alone" mean the service's (``sudo -u watchd watchctl doctor``)."""
    path = config.daemon.spool_dir
    hint = "docs/install.md, step 2: install -d -o watchd -g watchd -m 0750 SPOOL, beside the roots"
    if not path.exists():
        return [_to_be_made("spool", path, "the daemon makes it at its first start", hint)]
    problem = private_problem(path)
    if problem:
        return [Check("spool", False, f"not the service's alone: {problem}", hint)]
    return [Check("spool", True, f"{path}: private to {user_name()}")]


def executor_checks(config: Config, environ: Mapping[str, str]) -> list[Check]:
    """The executor's own self-test (the one the daemon logs at start-up): for Slurm, the
    controller reachable, client and controller versions, the partitions."""
    try:
        executor = make_executor(config, environ)
    except WatchdError as exc:
        detail = str(exc).splitlines()[0]
        return [Check(f"{config.executor.kind} executor", False, detail)]
    try:
        return executor.self_test()
    finally:
        executor.close()


# -- probes -------------------------------------------------------------------------------------


def _write_problem(folder: Path) -> str | None:
    """Why a file cannot be made in ``folder`` (tried: a temporary file made and removed)."""
    try:
        fd, name = tempfile.mkstemp(prefix=".watchd-doctor-", dir=folder)
    except OSError as exc:
        return f"not writable by {user_name()} ({exc.strerror})"
    os.close(fd)
    os.unlink(name)
    return None


def _to_be_made(name: str, path: Path, by: str, hint: str) -> Check:
    """A folder not there yet: fine if it can be made where it goes (``by`` says who makes it)."""
    problem = _write_problem(_nearest_existing(path.parent))
    detail = f"{path}: not there yet ({by})"
    if problem:
        return Check(name, False, f"{detail}; its folder: {problem}", hint)
    return Check(name, True, detail)


def _writable(path: Path) -> bool:
    """The database file and its folder (SQLite writes its -wal and -shm files beside it)."""
    return os.access(path, os.W_OK) and os.access(path.parent, os.W_OK)


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


GROUPS: tuple[CheckGroup, ...] = (
    config_checks,
    root_checks,
    inotify_checks,
    database_checks,
    daemon_checks,
    registry_checks,
    spool_checks,
    executor_checks,
)
