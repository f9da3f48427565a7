"""Leases on drop roots and the state directory's lock, on real files: who may take a root
(free, ours, stale, held), a lease that is junk, a link or a FIFO is replaced (never followed),
a lease another daemon took meanwhile is given up, and the lock refuses a second holder."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from daemon.site.claims import (
    LEASE_NAME,
    AnotherDaemon,
    Holder,
    Leases,
    StateLock,
    Verdict,
    judge,
    read_lease,
)
from daemon.site.subprocesses import process_start_ticks

NOW = 1_800_000_000.0
LEASE = 120.0


def me(database: str = "/var/lib/watchd/watchd.sqlite") -> Holder:
    return Holder.me(Path(database), NOW)


def elsewhere(renewed_at: float) -> Holder:
    return Holder("gw2", 4242, 99, "/var/lib/watchd/watchd.sqlite", renewed_at)


def write_lease(root: Path, holder: Holder) -> None:
    (root / LEASE_NAME).write_text(json.dumps(holder.__dict__))


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
    free, stale, held = (tmp_path / n for n in ("free", "stale", "held"))
    for root in (free, stale, held):
        root.mkdir()
    write_lease(stale, elsewhere(NOW - LEASE - 1))
    write_lease(held, elsewhere(NOW - 1))
    leases = Leases(me(), LEASE)
    refused = leases.claim([free, stale, held], NOW)
    assert refused == {held: elsewhere(NOW - 1)}
    assert leases.held == [free, stale]
    assert read_lease(free) == read_lease(stale) == me()
    leases.release()
    assert not (free / LEASE_NAME).exists() and not (stale / LEASE_NAME).exists()
    assert read_lease(held) == elsewhere(NOW - 1)


@pytest.mark.parametrize("planted", ["junk", "link", "fifo", "folder"])
def test_a_lease_that_is_not_one_is_replaced_and_never_followed(
    tmp_path: Path, planted: str
) -> None:
    """The drop root is the experts': anything may stand where the lease should be."""
    root, target = tmp_path / "root", tmp_path / "target"
    root.mkdir()
    target.write_text("keep me")
    lease = root / LEASE_NAME
    if planted == "junk":
        lease.write_text("{not json")
    elif planted == "link":
        lease.symlink_to(target)
    elif planted == "fifo":
        os.mkfifo(lease)
    else:
        lease.mkdir()
    leases = Leases(me(), LEASE)
    assert leases.claim([root], NOW) == {}
    assert target.read_text() == "keep me"
    if planted == "folder":
        assert lease.is_dir()  # cannot be replaced by a rename: claimed, renewed when it can
    else:
        assert not lease.is_symlink() and read_lease(root) == me()


def test_renew_gives_up_a_root_whose_lease_another_daemon_took(tmp_path: Path) -> None:
    """This daemon stalled past its lease and another host took the root over."""
    kept, taken = tmp_path / "kept", tmp_path / "taken"
    kept.mkdir()
    taken.mkdir()
    leases = Leases(me(), LEASE)
    leases.claim([kept, taken], NOW)
    write_lease(taken, elsewhere(NOW + 200))
    assert leases.renew(NOW + 201) == {taken: elsewhere(NOW + 200)}
    assert leases.held == [kept]
    assert read_lease(kept) is not None and read_lease(kept).renewed_at == NOW + 201


def test_the_state_lock_refuses_a_second_holder_naming_the_first_until_released(
    tmp_path: Path,
) -> None:
    first = StateLock.take(tmp_path / "state", me(str(tmp_path / "state" / "watchd.sqlite")))
    with pytest.raises(AnotherDaemon, match=r"^watchd pid \d+ on .* already runs on this database"):
        StateLock.take(tmp_path / "state", me())
    first.release()
    StateLock.take(tmp_path / "state", me()).release()
