"""One daemon per database and per drop root.

The database: an exclusive ``flock`` on ``state_dir/watchd.lock``, taken before the store is
opened and held for the daemon's life. The kernel drops it when the process ends, however it
ends (``kill -9`` included), so a crashed daemon never blocks its restart. The file names the
holder, for the daemon that is refused and for ``watchctl doctor``.

A drop root: a lease in the spool (:mod:`daemon.contract.spool`: the service's own folder, out
of the experts' reach, so no expert can forge, swap or remove a lease), ``leases/<key>.json``
with the root's path, naming host, pid, database and when it was last renewed; the loop renews
it every heartbeat. Daemons that share a drop root share the spool too (the spool is the site's,
on the share). No flock there: locks on NFS and GPFS are not reliable across hosts. A lease is
read strictly (:func:`parse_lease`): anything but a lease of the right types, with finite
times no later than one lease ahead, is no lease and is replaced. A lease is taken over only
when stale: a holder on this host that is no longer running, at once; a holder on another host,
once it has not renewed its lease for ``daemon.lease_seconds`` (the hosts' clocks are kept by
NTP). A daemon refused a root goes on with its other roots and takes the root when it is free
again; refused every root at start, it does not start (exit status 1).
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import hashlib
import json
import math
import os
import shutil
import socket
import stat
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, TypeGuard

import structlog

from daemon.contract import atomicfile
from daemon.contract.errors import WatchdError
from daemon.contract.spool import LEASES_DIR, make_private, private_problem
from daemon.site.config import Config
from daemon.site.subprocesses import process_start_ticks

log = structlog.get_logger("watchd")

LOCK_NAME = "watchd.lock"
MAX_LEASE_BYTES = 4096  # read no more than a lease needs
MAX_NAME = 4096  # a host name or database path longer than this is no lease's


class AnotherDaemon(WatchdError):
    """The database, or every drop root, is held by another running watchd."""


class SpoolNotPrivate(WatchdError):
    """The spool is not the service's alone: the daemon does not start (what it hands its jobs
    there could be swapped by someone else)."""


@dataclass(frozen=True)
class Holder:
    """A daemon as its lock file or lease names it."""

    host: str
    pid: int
    start_ticks: int | None  # with the pid, one process for good (pids are reused)
    database: str
    renewed_at: float

    def describe(self) -> str:
        return f"watchd pid {self.pid} on {self.host} (database {self.database})"

    def same_process(self, other: Holder) -> bool:
        return (self.host, self.pid, self.start_ticks) == (other.host, other.pid, other.start_ticks)

    @classmethod
    def me(cls, database: Path, now: float) -> Holder:
        pid = os.getpid()
        return cls(socket.gethostname(), pid, process_start_ticks(pid), str(database), now)


class Verdict(enum.Enum):
    FREE = "free"  # no lease, or none that can be read as one
    OURS = "ours"
    STALE = "stale"  # its holder is gone, or has not renewed it in time: taken over
    HELD = "held"  # by another daemon that is alive


def judge(lease: Holder | None, me: Holder, now: float, lease_seconds: float) -> Verdict:
    """Whether ``me`` may hold a root whose lease is ``lease``. Pure but for asking /proc
    whether a holder on this host still runs."""
    if lease is None:
        return Verdict.FREE
    if lease.host != me.host:
        return Verdict.STALE if now - lease.renewed_at > lease_seconds else Verdict.HELD
    if lease.same_process(me):
        return Verdict.OURS
    return Verdict.HELD if running(lease) else Verdict.STALE


def running(holder: Holder) -> bool:
    """Whether a holder on this host is still the process it names."""
    ticks = process_start_ticks(holder.pid)
    return ticks is not None and (holder.start_ticks is None or ticks == holder.start_ticks)


# -- the state directory's lock -----------------------------------------------------------------


class StateLock:
    """The flock on the state directory, held until :meth:`release` or the process's end."""

    def __init__(self, fd: int, path: Path) -> None:
        self.fd, self.path = fd, path

    @classmethod
    def take(cls, state_dir: Path, me: Holder) -> StateLock:
        """Lock ``state_dir``, or raise AnotherDaemon naming the daemon that holds it."""
        state_dir.mkdir(parents=True, exist_ok=True)
        path = state_dir / LOCK_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o660)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holder = read_state_holder(state_dir)
            who = holder.describe() if holder else "another watchd"
            raise AnotherDaemon(
                f"{who} already runs on this database (it holds {path}); "
                "one daemon per database: stop it first"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(asdict(me)).encode(), 0)
        return cls(fd, path)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the last descriptor drops the flock
            self.fd = -1


def read_state_holder(state_dir: Path) -> Holder | None:
    """The daemon the lock file of ``state_dir`` names (the holder, or the last one)."""
    return _read_holder(state_dir / LOCK_NAME)


# -- the drop roots' leases ---------------------------------------------------------------------


def lease_path(spool: Path, root: Path) -> Path:
    """Where the lease of drop root ``root`` lies in the spool: named by a digest of the root's
    path (daemons sharing a root mount the share at the same path, as their jobs need)."""
    key = hashlib.sha256(str(root).encode("utf-8", "surrogateescape")).hexdigest()[:24]
    return spool / LEASES_DIR / f"{key}.json"


def read_lease(spool: Path, root: Path, now: float, lease_seconds: float) -> Holder | None:
    """The lease of drop root ``root``, or None when there is none that reads as one
    (:func:`parse_lease`: it is replaced when taken)."""
    data = _read_json(lease_path(spool, root))
    return None if data is None else parse_lease(data, root, now, lease_seconds)


def parse_lease(
    data: Any, root: Path | None, now: float, lease_seconds: float
) -> Holder | None:
    """A lease read strictly: a host and database that are short strings, a pid that is a
    positive whole number, a start time that is one or null, a renewal time that is a finite
    number no later than ``now + lease_seconds`` (a lease from the future would hold the root
    for ever), and the root it names (when ``root`` is given) being ``root``. Anything else is
    no lease (None)."""
    if not isinstance(data, Mapping):
        return None
    host, pid, ticks = data.get("host"), data.get("pid"), data.get("start_ticks")
    database, renewed = data.get("database"), data.get("renewed_at")
    if not (_name(host) and _name(database) and _whole(pid) and pid > 0):
        return None
    if not (ticks is None or _whole(ticks)) or not _finite(renewed):
        return None
    if renewed > now + lease_seconds or (root is not None and data.get("root") != str(root)):
        return None
    return Holder(host, pid, ticks, database, float(renewed))


def _name(value: object) -> TypeGuard[str]:
    return isinstance(value, str) and 0 < len(value) <= MAX_NAME


def _whole(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite(value: object) -> TypeGuard[float]:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _read_holder(path: Path) -> Holder | None:
    data = _read_json(path)
    try:
        return None if data is None else Holder(**{k: data[k] for k in Holder.__dataclass_fields__})
    except (TypeError, KeyError):
        return None


def _read_json(path: Path) -> Any:
    """The JSON of a small regular file, read without following a link or waiting on a FIFO;
    None where there is none."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return json.loads(os.read(fd, MAX_LEASE_BYTES))
    except (OSError, ValueError, RecursionError):
        return None
    finally:
        os.close(fd)


class Leases:
    """The leases this daemon holds on its drop roots, in the spool."""

    def __init__(self, me: Holder, lease_seconds: float, spool: Path) -> None:
        self.me, self.lease_seconds, self.spool = me, lease_seconds, spool
        self.held: list[Path] = []

    def _lease(self, root: Path, now: float) -> Holder | None:
        return read_lease(self.spool, root, now, self.lease_seconds)

    def claim(self, roots: Sequence[Path], now: float) -> dict[Path, Holder]:
        """Take every root that is free, ours or stale; the others, with their holders. A lease
        that cannot be written now (the share is away) is written at the next renewal."""
        refused: dict[Path, Holder] = {}
        for root in roots:
            lease = self._lease(root, now)
            if lease is not None and judge(lease, self.me, now, self.lease_seconds) is Verdict.HELD:
                refused[root] = lease
            else:
                self.held.append(root)
                self._write(root, now)
        return refused

    def renew(self, now: float) -> dict[Path, Holder]:
        """Renew the leases held; the roots whose lease another daemon took meanwhile (this one
        stalled for longer than the lease), with that daemon: they are no longer held."""
        lost = {}
        for root in list(self.held):
            lease = self._lease(root, now)
            if lease is not None and judge(lease, self.me, now, self.lease_seconds) is Verdict.HELD:
                self.held.remove(root)
                lost[root] = lease
            else:
                self._write(root, now)
        return lost

    def release(self) -> None:
        """Remove the leases held (a clean stop): another daemon may take the roots at once."""
        for root in self.held:
            data = _read_json(lease_path(self.spool, root))
            lease = None if data is None else parse_lease(data, root, math.inf, 0.0)
            if lease is not None and lease.same_process(self.me):
                with contextlib.suppress(OSError):
                    lease_path(self.spool, root).unlink()
        self.held = []

    def _write(self, root: Path, now: float) -> None:
        path = lease_path(self.spool, root)
        record = {**asdict(replace(self.me, renewed_at=now)), "root": str(root)}
        try:
            _clear(path)
            make_private(path.parent)
            atomicfile.write_text(path, json.dumps(record), fsync=False)
        except OSError as exc:  # the share is away: the next renewal writes it
            log.warning("lease not written", root=str(root), lease=str(path), error=str(exc))


def _clear(path: Path) -> None:
    """Remove what stands at ``path`` if it is not a regular file (a folder there would keep
    the lease from being written, and a second daemon could take the root)."""
    with contextlib.suppress(FileNotFoundError):
        found = os.lstat(path)
        if stat.S_ISDIR(found.st_mode):
            shutil.rmtree(path)
        elif not stat.S_ISREG(found.st_mode):
            path.unlink()


def check_spool(spool: Path) -> None:
    """Make the spool if it is missing, then raise SpoolNotPrivate unless it is private
    (:func:`daemon.contract.spool.private_problem`)."""
    make_private(spool)
    problem = private_problem(spool)
    if problem:
        raise SpoolNotPrivate(
            f"the spool (daemon.spool_dir) is not the service's alone: {problem}; watchd hands "
            "its jobs their specs there, so it does not start (docs/install.md, step 2)"
        )


class Claims:
    """What one daemon holds: the lock on its state directory and the leases on its roots.
    A root another daemon holds is left to it (``refused``) and taken back at a renewal that
    finds it free."""

    def __init__(self, lock: StateLock, leases: Leases, refused: dict[Path, Holder]) -> None:
        self.lock, self.leases = lock, leases
        self.refused = refused  # the roots other daemons hold, with them

    @classmethod
    def take(cls, config: Config, now: float) -> Claims:
        """Lock the state directory, check the spool and claim the roots; raise AnotherDaemon,
        naming the holder, when the lock or every root is held; SpoolNotPrivate when the spool
        is not the service's alone."""
        roots, lease_seconds = [r.path for r in config.roots], config.daemon.lease_seconds
        state_dir, database = config.daemon.state_dir, config.daemon.database
        me = Holder.me(database, now)
        lock = StateLock.take(state_dir, me)
        try:
            check_spool(config.daemon.spool_dir)
        except BaseException:
            lock.release()
            raise
        leases = Leases(me, lease_seconds, config.daemon.spool_dir)
        refused = leases.claim(roots, now)
        if roots and len(refused) == len(roots):
            leases.release()
            lock.release()
            held = "; ".join(f"{root} by {h.describe()}" for root, h in refused.items())
            raise AnotherDaemon(f"every drop root is held by another watchd: {held}")
        for root, holder in refused.items():
            log.error("drop root held by another watchd", root=str(root), holder=holder.describe(),
                      note="left to it; this daemon goes on with its other roots and takes "
                      "this one when it is free")  # fmt: skip
        return cls(lock, leases, refused)

    def renew(self, now: float) -> tuple[dict[Path, Holder], list[Path]]:
        """Renew the leases, and claim the roots other daemons held that are free again: the
        roots lost (another daemon took them meanwhile), and those taken back; both logged."""
        lost = self.leases.renew(now)
        for root, holder in lost.items():
            log.error("drop root taken by another watchd", root=str(root),
                      holder=holder.describe(),
                      note="left to it; the other roots go on, and this one is taken back "
                      "when it is free")  # fmt: skip
        waiting = [root for root in self.refused if root not in lost]
        still = self.leases.claim(waiting, now) if waiting else {}
        back = [root for root in waiting if root not in still]
        for root in back:
            log.info("drop root taken back", root=str(root), note="its holder let it go")
        self.refused = {**still, **lost}
        return lost, back

    def describe_refused(self) -> dict[str, str]:
        return {str(root): holder.describe() for root, holder in self.refused.items()}

    def release(self) -> None:
        self.leases.release()
        self.lock.release()
