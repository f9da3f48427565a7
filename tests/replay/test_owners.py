"""Many owners, one facility, with real unprivileged owners (made with useradd here): each batch
is charged to its folder's user and group, watchctl usage adds up what their jobs measured, a
second owner's batch does not wait for the first one's backlog, a quota holds a batch saying
why until an operator raises it, an owner cancels their own batch with a file, and an owner the
site does not know is refused with a line saying so.

The daemon runs as root in this process; the folders belong to the throwaway owners, as an
expert's copy onto the share leaves them."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import owners
import pytest
from owners import Person, drop
from replay import Replay
from test_cli import cli

from daemon.core.manifest import CANCEL_NAME, STATUS_NAME
from daemon.core.records import Batch
from daemon.core.states import BatchState, JobState
from daemon.loop.service import Service
from daemon.site.config import Config
from daemon.store import Store

pytestmark = pytest.mark.skipif(
    not owners.available(), reason="making throwaway owners (useradd) needs root"
)


@pytest.fixture(scope="module")
def people() -> Iterator[list[Person]]:
    with owners.made("wdo", 3) as made:
        yield made


def batch_of(service: Service, folder: str) -> Batch | None:
    found = [b for b in service.store.batches() if b.folder == folder]
    return max(found, key=lambda b: b.revision) if found else None


def state_of(folder: str, *states: BatchState) -> Callable[[Service], bool]:
    def reached(service: Service) -> bool:
        batch = batch_of(service, folder)
        return batch is not None and batch.state in states

    return reached


def watchctl(config: Config, *args: str) -> str:
    return cli("watchctl", *args, "--config", str(config.source)).stdout


def test_each_batch_is_charged_to_its_folders_owner_and_watchctl_usage_adds_it_up(
    config_for: Callable[..., Config],
    staged: Callable[..., Path],
    drop_root: Path,
    people: list[Person],
) -> None:
    ann, bob, _ = people
    accounts = {
        "default": {"account": "general"},
        "users": {ann.user: {"account": "lab-ann"}},
        "groups": {bob.group: {"account": "lab-bob", "qos": "normal"}},
    }
    config = config_for(accounts=accounts)
    drop(staged("a", count=4, owner="Written By Hand"), drop_root, "plate ann", ann)
    drop(staged("b", count=2), drop_root, "plate bob", bob)
    with Replay(config) as replay:
        replay.run(timeout=240)
    store = Store.open(config.daemon.database)
    done = {b.folder: b for b in store.batches()}
    assert {b.state for b in done.values()} == {BatchState.DONE}
    assert (done["plate ann"].owner_user, done["plate ann"].owner_group) == (ann.user, ann.group)
    assert (done["plate ann"].owner_uid, done["plate bob"].owner_uid) == (ann.uid, bob.uid)
    assert done["plate ann"].owner == "Written By Hand"  # the manifest's name: shown, not charged
    status = (drop_root / "plate ann" / STATUS_NAME).read_text()
    assert f"Charged:   user {ann.user}, group {ann.group}" in status

    by_owner = watchctl(config, "usage", "--by", "owner")
    print(f"$ watchctl usage --by owner\n{by_owner}")
    rows = json.loads(watchctl(config, "usage", "--by", "owner", "--json"))["usage"]
    mine = {r["owner"]: r for r in rows}
    assert (mine[ann.user]["batches"], mine[ann.user]["images"]) == (1, 4)
    assert (mine[bob.user]["batches"], mine[bob.user]["images"]) == (1, 2)
    assert all(r["cpu_hours"] > 0 and r["bytes_in"] > 0 and r["bytes_out"] > 0 for r in rows)
    assert mine[ann.user]["jobs"] == len(store.jobs([done["plate ann"].id]))
    by_account = watchctl(config, "usage", "--by", "account")
    print(f"$ watchctl usage --by account\n{by_account}")
    accounts_seen = {r["account"] for r in json.loads(
        watchctl(config, "usage", "--by", "account", "--json"))["usage"]}  # fmt: skip
    assert accounts_seen == {"lab-ann", "lab-bob"}
    assert ann.group in watchctl(config, "usage", "--by", "group")


def test_a_second_owners_batch_is_done_before_the_first_owners_backlog(
    config_for: Callable[..., Config],
    staged: Callable[..., Path],
    drop_root: Path,
    people: list[Person],
) -> None:
    """Two slots, all of them ann's when bob's batch comes: one of ann's shards yields its slot
    at once (no grace: her short shards would end soon enough for bob to wait for one) and
    resumes later; bob's batch ends first, ann's ends done with every mask."""
    ann, bob, _ = people
    # ann's shards long enough (10 images of 512²) that neither ends before bob's batch is
    # planned, and bob's staged beforehand: with 2 images of 64² a shard (a warm start, under
    # 1 s), one of ann's once ended as bob's batch came, and bob took its slot without a yield
    config = config_for(planner={"shard_size": 10}, accounts={"preempt_grace_seconds": 0})
    ann_images, bobs = 30, staged("b", count=2)
    with Replay(config) as replay:
        drop(staged("a", count=ann_images, size=512), drop_root, "plate ann", ann)

        def ann_holds_both(service: Service) -> bool:
            return len(service.store.jobs(states=[JobState.RUNNING])) == 2

        replay.run(until=ann_holds_both, timeout=120)
        drop(bobs, drop_root, "plate bob", bob)
        replay.run(timeout=300)
    store = Store.open(config.daemon.database)
    done = {b.folder: b for b in store.batches()}
    ann_batch, bob_batch = done["plate ann"], done["plate bob"]
    assert ann_batch.state is BatchState.DONE and bob_batch.state is BatchState.DONE
    assert bob_batch.finished_at is not None and ann_batch.finished_at is not None
    assert bob_batch.finished_at < ann_batch.finished_at
    yielded = [e for e in store.events(ann_batch.id) if "yielded its slot" in e.reason]
    assert yielded and f"to user:{bob.user}" in yielded[0].reason
    jobs = store.jobs([ann_batch.id])
    assert all(j.state is JobState.SUCCEEDED and j.tries == 1 for j in jobs)
    assert len(list((Path(ann_batch.run_dir) / "masks").rglob("*.png"))) == ann_images


def test_a_batch_over_its_owners_quota_waits_queued_saying_why_until_an_operator_raises_it(
    config_for: Callable[..., Config],
    staged: Callable[..., Path],
    drop_root: Path,
    people: list[Person],
) -> None:
    _, bob, _ = people
    quota = {"per": "month", "images": 3}
    config = config_for(accounts={"users": {bob.user: {"quota": quota}}})
    folder = drop(staged("b", count=4), drop_root, "plate bob", bob)
    with Replay(config) as replay:

        def held(service: Service) -> bool:
            batch = batch_of(service, "plate bob")
            return batch is not None and bool(batch.hold)

        replay.run(until=held, timeout=60)
        status = (folder / STATUS_NAME).read_text()
        print(f"$ cat '{folder.name}/{STATUS_NAME}'\n{status}")
        assert "State:     QUEUED: inputs complete, jobs waiting for their turn" in status
        assert (
            f"Held: over the monthly quota of user {bob.user}: 0 of 3 images used this month "
            "(this batch needs 4, more than the whole quota); it does not free by itself: an "
            "operator must raise it (watchctl quota)"
        ) in status
        assert f"user:{bob.user}: 3 images per month" in watchctl(config, "quota")
        queue = json.loads(watchctl(config, "status", "--json"))["queue"]
        assert [h["folder"] for h in queue["held"]] == ["plate bob"]
        watchctl(config, "quota", f"user:{bob.user}", "--images", "100")
        replay.run(until=state_of("plate bob", BatchState.DONE), timeout=180)
    listed = watchctl(config, "quota")
    print(f"$ watchctl quota\n{listed}")
    assert f"user:{bob.user}: 100 images per month" in listed and "used 4 images" in listed
    history = (folder / STATUS_NAME).read_text()
    assert "no longer held: it may start" in history


def make_file(path: Path, person: Person) -> None:
    path.write_text("")
    os.chown(path, person.uid, person.gid)


def test_the_folders_owner_cancels_their_batch_with_a_file_and_no_one_else_can(
    config_for: Callable[..., Config],
    staged: Callable[..., Path],
    drop_root: Path,
    people: list[Person],
) -> None:
    ann, bob, _ = people
    config = config_for(intake={"cancel_check_seconds": 0.2})
    folder = drop(staged("a", count=3), drop_root, "plate ann", ann)
    next(folder.rglob("*.png")).unlink()  # still copying: the batch waits for it
    with Replay(config) as replay:
        replay.run(until=state_of("plate ann", BatchState.WAITING), timeout=60)
        make_file(folder / CANCEL_NAME, bob)  # bob may write here; it is not his batch
        ignored = (
            f"{CANCEL_NAME} ignored: made by uid {bob.uid}, not by the folder's owner ({ann.user})"
        )

        def noted(service: Service) -> bool:
            return any(e.reason == ignored for e in service.store.events())

        replay.run(until=noted, timeout=30)
        for _ in range(20):  # a second of ticks: the intent would be applied in the next one
            replay.service.tick(time.time())
            time.sleep(0.05)
        assert state_of("plate ann", BatchState.WAITING)(replay.service)
        (folder / CANCEL_NAME).unlink()
        make_file(folder / CANCEL_NAME, ann)
        replay.run(until=state_of("plate ann", BatchState.CANCELLED), timeout=30)
    status = (folder / STATUS_NAME).read_text()
    print(f"$ cat '{folder.name}/{STATUS_NAME}'\n{status}")
    assert f"Why: cancelled by its folder's owner {ann.user} ({CANCEL_NAME})" in status
    assert f"to run it again, remove {CANCEL_NAME} from this folder" in status


def test_an_owner_the_site_does_not_know_is_refused_with_a_line_naming_them(
    config_for: Callable[..., Config],
    staged: Callable[..., Path],
    drop_root: Path,
    people: list[Person],
) -> None:
    ann, _, eve = people
    config = config_for(accounts={"unknown": "refuse", "users": {ann.user: {"account": "a"}}})
    known = drop(staged("a", count=2), drop_root, "plate ann", ann)
    next(known.rglob("*.png")).unlink()  # keeps it waiting: no job needs to run here
    stranger = drop(staged("e", count=2), drop_root, "plate eve", eve)
    with Replay(config) as replay:
        replay.run(until=state_of("plate eve", BatchState.FAILED), timeout=60)
        assert batch_of(replay.service, "plate ann").state is BatchState.WAITING  # type: ignore[union-attr]
    status = (stranger / STATUS_NAME).read_text()
    print(f"$ cat '{stranger.name}/{STATUS_NAME}'\n{status}")
    assert "Why: owner refused: not in the site's [accounts]" in status
    assert (
        f"batch folder: is owned by user {eve.user} (uid {eve.uid}), group {eve.group} "
        f"(gid {eve.gid}), who has no account at this site — ask an operator to add the user "
        "or the group to [accounts] in watchd's config.toml, then save the manifest again"
    ) in status
