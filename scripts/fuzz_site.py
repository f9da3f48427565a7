"""Where a fuzz case runs and as whom (scripts/fuzz_campaign.py): a drop root, a spool, a state
folder and a copy of the registry laid out as docs/install.md says; the daemon started as the
service (:class:`Daemon`), the intruder (scripts/intruder.py) as an expert (:func:`make_folders`,
:class:`Intruder`), each in a session of its own.

With real users (:func:`people`), the service is an unprivileged user of its own and the expert
an unprivileged member of the experts' group (scripts/accounts.py makes them):

- the drop root ``3770 service:experts`` with the ACLs and default ACLs of docs/install.md,
  step 3 (``u:service:rwx,g:experts:rwx,o::---``), the spool ``2750 service:service``, the
  state folder ``2770`` and the registry the service's, the service's umask 007, the expert's
  umask 007;
- a canary: a file only the service may read (``0400``), its content a random token, beside
  the drop root; the sentinel tree and the trap folder (where forged specs send the jobs) are
  the service's, so that it could write them if it were fooled into it.

On the test share (scripts/netshare: sshfs, whose SFTP server runs as root, so that everything
made through the mount is root's) the drop root and the spool lie on the share, the rest on
local disk; the service is root without the capabilities that override file permissions (a
user of its own could not write back into the folders it made there), in the experts' group as
docs/install.md puts it (the share shows the expert's files without their ACLs), the expert a
real user who writes on the server's side, as an instrument PC writes to the share from another
host.

Without real users everything runs as this process's user, as before.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import string
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import accounts
import fault_campaign
import intruder
import sentinel

from daemon.site.claims import lease_path
from daemon.site.config import Config

BIN = Path(sys.executable).parent
SCRIPTS = Path(__file__).resolve().parent
INTRUDER = SCRIPTS / "intruder.py"
SERVICE, EXPERT, EXPERTS = "wdfuzz-svc", "wdfuzz-expert", "wdfuzz-experts"
SHARE_DIR = Path(os.environ.get("WATCHD_SHARE_DIR", "/var/lib/watchd-netshare"))


@dataclass(frozen=True)
class People:
    """Who runs what: the service (the daemon and its jobs) and the expert (the folders, the
    swaps, the races). Neither changes anything without real users."""

    service: accounts.Identity
    expert: accounts.Identity
    experts_gid: int

    @property
    def real(self) -> bool:
        return self.expert.changes


NOBODY = People(accounts.Identity(), accounts.Identity(), os.getegid())


def people(share: bool) -> People:
    """The service and the expert as real users (made if missing); on the test share the
    service is root without the capabilities that override file permissions. Raises
    RuntimeError where real users cannot be had (scripts/accounts.py says why)."""
    why = accounts.unavailable()
    if why:
        raise RuntimeError(why)
    expert = accounts.user(EXPERT, EXPERTS)
    if share:
        # in the experts' group, as docs/install.md puts the service: the share shows the
        # expert's files with their owner and mode but without their ACLs
        service = accounts.Identity(without_dac=True, groups=(expert.gid,))
    else:
        service = accounts.Identity(accounts.user(SERVICE, SERVICE))
    return People(service, accounts.Identity(expert), expert.gid)


def share_running() -> str:
    """Why the test share cannot be used ('' when its mount answers)."""
    done = subprocess.run([str(SCRIPTS / "netshare"), "status"], capture_output=True, text=True)
    if done.returncode != 0:
        said = " ".join(done.stderr.split())
        return f"the test share is not running ({said}); start it as root: scripts/netshare start"
    return ""


@dataclass(frozen=True)
class Site:
    base: Path  # the case's own folder, on local disk
    drop: Path  # the drop root, as the daemon names it
    made: Path  # the drop root where the expert makes its folders (server side on the share)
    spool: Path
    spool_server: Path  # the spool where the campaign forges leases as the service
    state: Path
    registry: Path
    sentinel: Path
    canary: Path
    trap: Path
    journal: Path  # the expert's folder: its plan's journal
    stash: Path  # root's, for the opening of the ways (scripts/accounts.py)
    ways: tuple[Path, ...]  # what the expert must reach (the share's two sides)
    token: str  # the canary's content
    people: People
    config: Config

    def plan(self, cases: Any, scale: Any, stamps: list[str]) -> Path:
        """Write the intruder's plan for ``cases``: its path."""
        spools = (
            (self.spool, self.spool_server) if self.spool != self.spool_server else (self.spool,)
        )
        outside = intruder.hostile.Outside(self.sentinel, self.registry, self.canary, self.trap)
        plan = intruder.Plan(
            self.made, spools, str(lease_path(self.spool, self.drop).relative_to(self.spool)),
            str(self.drop), outside, tuple(cases), scale, tuple(stamps), len(cases),
            self.journal, attack_spool=self.people.real,
        )  # fmt: skip
        path = self.base / "plan.json"
        plan.save(path)
        return path

    def as_service(self, argv: list[str]) -> list[str]:
        env = {"PATH": f"{BIN}:/usr/bin:/bin", "HOME": str(self.base / "home"),
               "LANG": "C.UTF-8"}  # fmt: skip
        return self.people.service.command(argv, env=env, stash=self.stash / "service",
                                           ways=self.ways)  # fmt: skip

    def as_expert(self, argv: list[str]) -> list[str]:
        env = {"PATH": f"{BIN}:/usr/bin:/bin", "HOME": str(self.journal), "LANG": "C.UTF-8"}
        return self.people.expert.command(argv, env=env, stash=self.stash / "expert",
                                          ways=self.ways)  # fmt: skip


def lay_out(
    base: Path, seed_registry: Path, people: People, share: bool, **sections: dict[str, Any]
) -> Site:  # fmt: skip
    """Make a case's site under ``base`` (on the test share too, where ``share``); ``sections``:
    the configuration's keys the campaign sets (fault_campaign.write_config)."""
    base.chmod(0o755)
    service, expert = people.service, people.expert
    if share:
        server = SHARE_DIR / "server" / f"fuzz-{base.name}"
        server.mkdir(mode=0o755)
        drop, made = SHARE_DIR / "mount" / server.name / "drop", server / "drop"
        spool, spool_server = drop.parent / "spool", server / "spool"
        ways: tuple[Path, ...] = (server, drop.parent)
        roots = {"observer": "auto", "poll_seconds": 0.5}
    else:
        drop = made = base / "drop"
        spool = spool_server = base / "spool"
        ways, roots = (), {}
    made.mkdir(mode=0o770)
    os.chown(made, service.uid, people.experts_gid)
    made.chmod(0o3770)
    if people.real:
        accounts.grant(made, [service.uid], [people.experts_gid])
    if not share:  # on the share the service makes it, through the mount (root's there)
        _folder(spool, service, 0o2750)
    state, registry = _folder(base / "state", service, 0o2770), base / "registry"
    shutil.copytree(seed_registry, registry)
    own(registry, service)
    token = "".join(
        secrets.choice(string.ascii_letters) for _ in range(32)
    )  # no hex digest holds 8
    canary = base / "canary" / "canary.txt"
    canary.parent.mkdir(mode=0o755)
    canary.write_text(f"{token}\n{token} is the service's alone\n")
    os.chown(canary, service.uid, service.gid)
    canary.chmod(0o400)
    tree = sentinel.make(base / "sentinel")
    trap = _folder(base / "trap", service, 0o750)
    own(tree, service)
    _folder(base / "home", service, 0o700)
    journal = _folder(base / "expert", expert, 0o700)
    stash = _folder(base / "stash", accounts.Identity(), 0o700)
    sections = {**sections, "daemon": {**sections.get("daemon", {}), "spool_dir": str(spool)},
                "roots": roots}  # fmt: skip
    config = fault_campaign.write_config(base, drop, registry, **sections)
    return Site(base, drop, made, spool, spool_server, state, registry, tree, canary, trap,
                journal, stash, ways, token, people, config)  # fmt: skip


def remove_share(site: Site) -> None:
    """Remove the case's folder on the share (its local folder is the caller's)."""
    if site.made != site.drop:
        shutil.rmtree(site.made.parent, ignore_errors=True)


def service_folder(site: Site, path: Path) -> None:
    """The folder ``path`` (a folder of the spool, where the campaign forges as the service)
    and those missing above it, made as the spool makes them: the service's, 0750."""
    if not path.is_dir():
        service_folder(site, path.parent)
        _folder(path, site.people.service, 0o750)


def _folder(path: Path, owner: accounts.Identity, mode: int) -> Path:
    path.mkdir(mode=0o700)
    os.chown(path, owner.uid, owner.gid)
    path.chmod(mode)
    return path


def own(top: Path, owner: accounts.Identity) -> None:
    """Make ``top`` and all below it ``owner``'s (links themselves, never what they lead to)."""
    for folder, dirs, files in os.walk(top):
        for name in [*dirs, *files]:
            os.chown(Path(folder) / name, owner.uid, owner.gid, follow_symlinks=False)
    os.chown(top, owner.uid, owner.gid, follow_symlinks=False)


# -- the daemon as the service, the intruder as the expert -----------------------------------------


def make_folders(site: Site, plan: Path, timeout: float) -> list[str]:
    """The intruder makes the case's folders, as the expert."""
    argv = site.as_expert([sys.executable, str(INTRUDER), "build", str(plan)])
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [f"the expert did not make the folders within {timeout:.0f} s"]
    if done.returncode != 0:
        return [f"the expert could not make the folders: {done.stderr.strip()[-600:]}"]
    return []


class Daemon:
    """``watchd run`` as the service, its output appended to ``log``."""

    def __init__(self, site: Site, log: Path) -> None:
        self.site, self.log = site, log
        self.proc = self._start()

    def _start(self) -> subprocess.Popen[bytes]:
        argv = [str(BIN / "watchd"), "run", "--config", str(self.site.config.source)]
        with open(self.log, "ab") as out:
            return subprocess.Popen(
                self.site.as_service(argv), stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip

    def restart(self, grace: float) -> list[str]:
        """Stop it (SIGTERM: it must exit 0) and start it again."""
        violations = self._terminate(grace)
        self.proc.wait()
        self.proc = self._start()
        return violations

    def _terminate(self, grace: float) -> list[str]:
        if self.proc.poll() is not None:
            return []
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            return [f"the daemon did not stop within {grace:.0f} s of SIGTERM"]
        return [f"the daemon exited {code} on SIGTERM"] if code != 0 else []

    def stop(self, grace: float) -> list[str]:
        """SIGTERM, then after ``grace`` SIGKILL to its group; every job it started (each in a
        session of its own) is killed too. What went wrong, as violations."""
        jobs = descendants(self.proc.pid)
        violations = self._terminate(grace)
        kill_group(self.proc.pid)
        self.proc.wait()
        for pid in jobs | descendants(self.proc.pid):
            kill_group(pid)
        gone_within(jobs, 10.0)
        return violations


class Intruder:
    """scripts/intruder.py acting as the expert while the daemon runs."""

    def __init__(self, site: Site, plan: Path) -> None:
        self.log = site.base / "intruder.log"
        argv = site.as_expert([sys.executable, str(INTRUDER), "act", str(plan)])
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip

    def stop(self) -> list[str]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            kill_group(self.proc.pid)
            self.proc.wait()
            return ["the intruder did not stop within 30 s of SIGTERM"]
        if code != 0:
            return [f"the intruder failed ({code}): {self.log.read_text()[-600:]}"]
        return []


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid``, from /proc."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                text = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents.setdefault(int(text[text.rindex(")") + 2 :].split()[1]), []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def kill_group(pid: int) -> None:
    for kill in (os.killpg, os.kill):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            kill(pid, signal.SIGKILL)


def gone_within(pids: set[int], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in pids):
        time.sleep(0.1)
