"""One daemon per database and per drop root.

The database: an exclusive ``flock`` on ``state_dir/watchd.lock``, taken before the store is
opened and held for the daemon's life. The kernel drops it when the process ends, however it
ends (``kill -9`` included), so a crashed daemon never blocks its restart. The file names the
holder, for the daemon that is refused and for ``watchctl doctor``.

A drop root: a lease, ``ROOT/.watchd-lease.json``, naming host, pid, database and when it was
last renewed; the loop renews it every heartbeat. No flock there: locks on NFS and GPFS are not
reliable across hosts. A lease is taken over only when stale: a holder on this host that is no
longer running, at once; a holder on another host, once it has not renewed its lease for
``daemon.lease_seconds`` (the hosts' clocks are kept by NTP). A daemon refused a root goes on
with its other roots; refused every root, it does not start.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import json
import os
import socket
import stat
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import structlog

from daemon.contract import atomicfile
from daemon.contract.errors import WatchdError
from daemon.site.config import Config
from daemon.site.subprocesses import process_start_ticks

log = structlog.get_logger("watchd")

LOCK_NAME = "watchd.lock"
LEASE_NAME = ".watchd-lease.json"
MAX_LEASE_BYTES = 4096  # the file is in the experts' root: read no more than a lease needs


class AnotherDaemon(WatchdError):
    """The database, or every drop root, is held by another running watchd."""


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


def read_lease(root: Path) -> Holder | None:
    """The lease of a drop root, or None when there is none that can be read as one (a link,
    a FIFO or junk put there in its place counts as none: it is replaced when taken)."""
    return _read_holder(root / LEASE_NAME)


def _read_holder(path: Path) -> Holder | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = json.loads(os.read(fd, MAX_LEASE_BYTES))
        return Holder(**{k: data[k] for k in Holder.__dataclass_fields__})
    except (OSError, ValueError, TypeError, KeyError):
        return None
    finally:
        os.close(fd)


class Leases:
    """The leases this daemon holds on its drop roots."""

    def __init__(self, me: Holder, lease_seconds: float) -> None:
        self.me, self.lease_seconds = me, lease_seconds
        self.held: list[Path] = []

    def claim(self, roots: Sequence[Path], now: float) -> dict[Path, Holder]:
        """Take every root that is free, ours or stale; the others, with their holders. A root
        that cannot be reached now (a share not mounted) is taken: its lease is written when it
        is back, at the next renewal."""
        refused: dict[Path, Holder] = {}
        for root in roots:
            lease = read_lease(root)
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
            lease = read_lease(root)
            if lease is not None and judge(lease, self.me, now, self.lease_seconds) is Verdict.HELD:
                self.held.remove(root)
                lost[root] = lease
            else:
                self._write(root, now)
        return lost

    def release(self) -> None:
        """Remove the leases held (a clean stop): another daemon may take the roots at once."""
        for root in self.held:
            lease = read_lease(root)
            if lease is not None and lease.same_process(self.me):
                with contextlib.suppress(OSError):
                    (root / LEASE_NAME).unlink()
        self.held = []

    def _write(self, root: Path, now: float) -> None:
        lease = replace(self.me, renewed_at=now)
        with contextlib.suppress(OSError):  # the root is away: the next renewal writes it
            atomicfile.write_text(root / LEASE_NAME, json.dumps(asdict(lease)), fsync=False)


class Claims:
    """What one daemon holds: the lock on its state directory and the leases on its roots."""

    def __init__(self, lock: StateLock, leases: Leases, refused: dict[Path, Holder]) -> None:
        self.lock, self.leases = lock, leases
        self.refused = refused  # the roots other daemons hold, with them

    @classmethod
    def take(cls, config: Config, now: float) -> Claims:
        """Lock the state directory and claim the roots; raise AnotherDaemon, naming the
        holder, when the lock or every root is held."""
        roots, lease_seconds = [r.path for r in config.roots], config.daemon.lease_seconds
        state_dir, database = config.daemon.state_dir, config.daemon.database
        me = Holder.me(database, now)
        lock = StateLock.take(state_dir, me)
        leases = Leases(me, lease_seconds)
        refused = leases.claim(roots, now)
        if roots and len(refused) == len(roots):
            leases.release()
            lock.release()
            held = "; ".join(f"{root} by {h.describe()}" for root, h in refused.items())
            raise AnotherDaemon(f"every drop root is held by another watchd: {held}")
        for root, holder in refused.items():
            log.error("drop root held by another watchd", root=str(root), holder=holder.describe(),
                      note="left to it; this daemon goes on with its other roots")  # fmt: skip
        return cls(lock, leases, refused)

    def renew(self, now: float) -> dict[Path, Holder]:
        """Renew the leases; the roots another daemon took meanwhile (logged), now refused."""
        lost = self.leases.renew(now)
        for root, holder in lost.items():
            log.error("drop root taken by another watchd", root=str(root),
                      holder=holder.describe(), note="stopping: one daemon per root")  # fmt: skip
        self.refused.update(lost)
        return lost

    def held(self, config: Config) -> Config:
        """``config`` with the roots that other daemons hold left out."""
        kept = tuple(r for r in config.roots if r.path not in self.refused)
        return config.model_copy(update={"roots": kept})

    def describe_refused(self) -> dict[str, str]:
        return {str(root): holder.describe() for root, holder in self.refused.items()}

    def release(self) -> None:
        self.leases.release()
        self.lock.release()
