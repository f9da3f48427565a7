"""Leases on drop roots and the state directory's lock, on real files: who may take a root
(free, ours, stale, held); leases live in the spool (the service's own) and are read strictly:
junk, a link, a FIFO, a folder or a forged lease (a time from the future, a string for a time,
another root's) is no lease and is replaced, never followed; a lease another daemon took
meanwhile is given up, and taken back once it is free; the lock refuses a second holder; a
spool that is not the service's alone is refused."""

from __future__ import annotations

import json
import math
import os
import socket
from pathlib import Path

import pytest

from daemon.site.claims import (
    AnotherDaemon,
    Claims,
    Holder,
    Leases,
    SpoolNotPrivate,
    StateLock,
    Verdict,
    check_spool,
    judge,
    lease_path,
    read_lease,
)
from daemon.site.config import parse_config
from daemon.site.subprocesses import process_start_ticks

NOW = 1_800_000_000.0
LEASE = 120.0


def me(database: str = "/var/lib/watchd/watchd.sqlite") -> Holder:
    return Holder.me(Path(database), NOW)


def elsewhere(renewed_at: float) -> Holder:
    return Holder("gw2", 4242, 99, "/var/lib/watchd/watchd.sqlite", renewed_at)


def write_lease(spool: Path, root: Path, holder: Holder | dict[str, object]) -> None:
    data = holder if isinstance(holder, dict) else {**holder.__dict__, "root": str(root)}
    path = lease_path(spool, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def lease_of(spool: Path, root: Path) -> Holder | None:
    return read_lease(spool, root, NOW, LEASE)


def test_a_lease_on_another_host_is_held_until_it_is_older_than_the_lease_time() -> None:
    assert judge(elsewhere(NOW - LEASE + 1), me(), NOW, LEASE) is Verdict.HELD
    assert judge(elsewhere(NOW - LEASE - 1), me(), NOW, LEASE) is Verdict.STALE
    assert judge(None, me(), NOW, LEASE) is Verdict.FREE


def test_a_lease_on_this_host_is_held_while_its_process_runs_and_stale_at_once_after() -> None:
    """Whatever its age: the pid (with its start time) says whether the holder runs."""
    host = socket.gethostname()
    init = Holder(host, 1, process_start_ticks(1), "/other.sqlite", NOW)
    reused = Holder(host, 1, (process_start_ticks(1) or 0) + 1, "/other.sqlite", NOW)
    gone = Holder(host, 2**22 + 1, 5, "/other.sqlite", NOW)  # above pid_max: never a process
    assert judge(init, me(), NOW, LEASE) is Verdict.HELD
    assert judge(reused, me(), NOW, LEASE) is Verdict.STALE  # the pid is another process now
    assert judge(gone, me(), NOW, LEASE) is Verdict.STALE
    assert judge(me(), me(), NOW + 10 * LEASE, LEASE) is Verdict.OURS


def test_claim_takes_free_and_stale_roots_and_refuses_a_held_one(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    free, stale, held = (tmp_path / n for n in ("free", "stale", "held"))
    write_lease(spool, stale, elsewhere(NOW - LEASE - 1))
    write_lease(spool, held, elsewhere(NOW - 1))
    leases = Leases(me(), LEASE, spool)
    refused = leases.claim([free, stale, held], NOW)
    assert refused == {held: elsewhere(NOW - 1)}
    assert leases.held == [free, stale]
    assert lease_of(spool, free) == lease_of(spool, stale) == me()
    assert not any(p.name.startswith(".watchd") for p in (free, stale) if p.exists())
    leases.release()
    assert not lease_path(spool, free).exists() and not lease_path(spool, stale).exists()
    assert lease_of(spool, held) == elsewhere(NOW - 1)


@pytest.mark.parametrize("planted", ["junk", "link", "fifo", "folder"])
def test_a_lease_that_is_not_one_is_replaced_and_never_followed(
    tmp_path: Path, planted: str
) -> None:
    """Whatever stands at a lease's name is replaced by the lease (a folder too: left there, a
    second daemon could take the root while this one could not write its lease)."""
    spool, root, target = tmp_path / "spool", tmp_path / "root", tmp_path / "target"
    target.write_text("keep me")
    lease = lease_path(spool, root)
    lease.parent.mkdir(parents=True)
    if planted == "junk":
        lease.write_text("{not json")
    elif planted == "link":
        lease.symlink_to(target)
    elif planted == "fifo":
        os.mkfifo(lease)
    else:
        (lease / "inner").mkdir(parents=True)
    leases = Leases(me(), LEASE, spool)
    assert leases.claim([root], NOW) == {}
    assert target.read_text() == "keep me"
    assert lease.is_file() and not lease.is_symlink() and lease_of(spool, root) == me()


FORGED = {
    "from the future": {"renewed_at": 1e12},  # the red team's: would hold the root for ever
    "a string for a time": {"renewed_at": "soon"},  # the red team's: a TypeError at every start
    "not a number": {"renewed_at": math.nan},
    "infinite": {"renewed_at": math.inf},
    "a boolean pid": {"pid": True},
    "a negative pid": {"pid": -4},
    "a list for a host": {"host": ["gw2"]},
    "a huge host": {"host": "g" * 10_000},
    "another root's": {"root": "/elsewhere"},
    "no root": {"root": None},
}


@pytest.mark.parametrize("forged", sorted(FORGED))
def test_a_forged_lease_is_no_lease_and_is_replaced(tmp_path: Path, forged: str) -> None:
    """Read strictly: right types, finite times no later than one lease ahead, this root's."""
    spool, root = tmp_path / "spool", tmp_path / "root"
    good = {**elsewhere(NOW - 1).__dict__, "root": str(root)}
    write_lease(spool, root, good)
    assert lease_of(spool, root) == elsewhere(NOW - 1)  # the unforged lease is one (held)
    write_lease(spool, root, {**good, **FORGED[forged]})
    assert lease_of(spool, root) is None
    leases = Leases(me(), LEASE, spool)
    assert leases.claim([root], NOW) == {}
    assert lease_of(spool, root) == me()


def test_a_lease_renewed_up_to_one_lease_ahead_is_still_one(tmp_path: Path) -> None:
    """Clocks differ a little between gateways: a lease a little ahead is not refused."""
    spool, root = tmp_path / "spool", tmp_path / "root"
    write_lease(spool, root, elsewhere(NOW + LEASE))
    assert lease_of(spool, root) == elsewhere(NOW + LEASE)


def test_renew_gives_up_a_root_whose_lease_another_daemon_took(tmp_path: Path) -> None:
    """This daemon stalled past its lease and another host took the root over."""
    spool = tmp_path / "spool"
    kept, taken = tmp_path / "kept", tmp_path / "taken"
    leases = Leases(me(), LEASE, spool)
    leases.claim([kept, taken], NOW)
    write_lease(spool, taken, elsewhere(NOW + 200))
    assert leases.renew(NOW + 201) == {taken: elsewhere(NOW + 200)}
    assert leases.held == [kept]
    renewed = read_lease(spool, kept, NOW + 201, LEASE)
    assert renewed is not None and renewed.renewed_at == NOW + 201


def test_claims_give_up_only_the_root_taken_and_take_it_back_once_it_is_free(
    tmp_path: Path,
) -> None:
    """Losing one root stops only that root; when its holder lets it go (or lets it go stale),
    the next renewal takes it back."""
    roots = [{"path": str(tmp_path / name)} for name in ("kept", "taken")]
    config = parse_config({"roots": roots}, source=tmp_path / "config.toml")
    spool = config.daemon.spool_dir
    kept, taken = (r.path for r in config.roots)
    claims = Claims.take(config, NOW)
    try:
        write_lease(spool, taken, elsewhere(NOW + 10))
        lost, back = claims.renew(NOW + 11)
        assert (lost, back) == ({taken: elsewhere(NOW + 10)}, [])
        assert set(claims.refused) == {taken} and claims.leases.held == [kept]
        assert claims.renew(NOW + 12) == ({}, [])  # still held by the other: still left to it
        lost, back = claims.renew(NOW + 10 + LEASE + 1)  # the other stopped renewing
        assert (lost, back) == ({}, [taken])
        assert claims.refused == {} and sorted(claims.leases.held) == sorted([kept, taken])
        assert read_lease(spool, taken, NOW + 10 + LEASE + 1, LEASE) is not None
    finally:
        claims.release()


@pytest.mark.parametrize("how", ["group-writable", "open parent", "someone else's"])
def test_a_spool_that_is_not_the_services_alone_is_refused(tmp_path: Path, how: str) -> None:
    """Anyone who could write the spool, or move it away from its parent, could swap a job's
    spec: the daemon does not start on it."""
    parent = tmp_path / "share"
    spool = parent / "spool"
    spool.mkdir(parents=True)
    if how == "group-writable":
        spool.chmod(0o770)
        said = "is writable by its group or by others"
    elif how == "open parent":
        parent.chmod(0o777)
        said = "writable by its group or by others without the sticky bit"
    else:
        os.chown(spool, 4321, 4321)
        said = "is owned by uid 4321, not by the service's user"
    with pytest.raises(SpoolNotPrivate, match=said):
        check_spool(spool)
    if how == "open parent":
        parent.chmod(0o1777)  # the sticky bit: no one else may move what is the service's
        check_spool(spool)


def test_the_state_lock_refuses_a_second_holder_naming_the_first_until_released(
    tmp_path: Path,
) -> None:
    first = StateLock.take(tmp_path / "state", me(str(tmp_path / "state" / "watchd.sqlite")))
    with pytest.raises(AnotherDaemon, match=r"^watchd pid \d+ on .* already runs on this database"):
        StateLock.take(tmp_path / "state", me())
    first.release()
    StateLock.take(tmp_path / "state", me()).release()
