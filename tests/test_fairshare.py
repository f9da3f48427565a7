"""The fair order, as a pure function: pending and live jobs of several owners in, the jobs
that go out (in turns), the ones that yield and who waits why out."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.contract.jobspec import Pipeline
from daemon.core.fairshare import Stake, resumable, share_out
from daemon.core.records import Job
from daemon.core.states import JobState

OWNER_OF_BATCH = {1: "user:ann", 2: "user:bob", 3: "user:cy", 4: "user:ann"}


def job(
    id: int,
    batch_id: int,
    state: JobState = JobState.PENDING,
    *,
    pipeline: Pipeline = Pipeline.INFER,
    images: int = 100,
    done: int = 0,
    params: dict | None = None,
) -> Job:
    return Job(
        id, batch_id, f"j{id}", pipeline, 0, 0, 1, state, 1, "local", "h", None, None, "",
        0.0, 0.0, None, None, params or {}, images=images, images_done=done,
    )  # fmt: skip


def subject(j: Job) -> str:
    return OWNER_OF_BATCH[j.batch_id]


def ids(jobs: Sequence[Job]) -> list[int]:
    return [j.id for j in jobs]


def test_free_slots_go_to_owners_in_turns_not_to_the_oldest_batch() -> None:
    pending = [job(i, 1) for i in range(1, 11)] + [job(20, 2), job(21, 2)]
    turns = share_out(pending, [], subject, {}, free=4)
    assert ids(turns.submit) == [1, 20, 2, 21]


def test_within_one_owner_the_oldest_batch_goes_first() -> None:
    pending = [job(1, 4), job(2, 1), job(3, 4)]  # batch 1 older than batch 4, both ann's
    assert ids(share_out(pending, [], subject, {}, free=3).submit) == [2, 1, 3]


def test_an_owner_with_fewer_running_jobs_has_the_next_turn() -> None:
    live = [job(1, 1, JobState.RUNNING), job(2, 1, JobState.RUNNING)]
    pending = [job(3, 1), job(4, 2)]
    assert ids(share_out(pending, live, subject, {}, free=1).submit) == [4]


def test_weights_share_the_slots_in_their_proportion() -> None:
    pending = [job(i, 1) for i in range(1, 7)] + [job(i, 2) for i in range(10, 16)]
    stakes = {"user:ann": Stake(weight=2.0), "user:bob": Stake(weight=1.0)}
    chosen = share_out(pending, [], subject, stakes, free=6).submit
    assert sum(subject(j) == "user:ann" for j in chosen) == 4
    assert sum(subject(j) == "user:bob" for j in chosen) == 2


def test_a_cap_keeps_an_owner_below_it_even_with_slots_free() -> None:
    live = [job(1, 1, JobState.RUNNING)]
    pending = [job(2, 1), job(3, 1), job(4, 2)]
    turns = share_out(pending, live, subject, {"user:ann": Stake(cap=2)}, free=3)
    assert ids(turns.submit) == [4, 2]
    ann = next(s for s in turns.standings if s.subject == "user:ann")
    assert ann.running == 2 and ann.pending == 1
    assert ann.waits == "at its cap: 2 of max_running 2 live"


def test_without_a_slot_limit_every_job_goes_out_but_for_the_caps() -> None:
    pending = [job(i, 1) for i in range(1, 6)] + [job(9, 2)]
    turns = share_out(pending, [], subject, {"user:ann": Stake(cap=3)}, free=None)
    assert sorted(ids(turns.submit)) == [1, 2, 3, 9]
    assert turns.preempt == ()


def test_an_owner_below_its_share_takes_a_slot_from_one_above_it_at_once() -> None:
    live = [job(1, 1, JobState.RUNNING, done=90), job(2, 1, JobState.RUNNING, done=10)]
    turns = share_out([job(3, 2)], live, subject, {}, free=0)
    assert turns.submit == ()
    assert ids(turns.preempt) == [2]  # the one with the most images left
    bob = next(s for s in turns.standings if s.subject == "user:bob")
    assert bob.share == 1.0 and bob.pending == 1


def test_an_owner_waits_for_a_slot_due_to_free_within_its_patience_instead() -> None:
    """Stopping a shard costs its restart: when one of the live jobs ends sooner than the
    waiting owner's patience runs out, the owner waits for that slot and nothing is stopped."""
    live = [job(1, 1, JobState.RUNNING, done=90), job(2, 1, JobState.RUNNING, done=10)]
    turns = share_out([job(3, 2)], live, subject, {}, free=0,
                      patience={"user:bob": 25.0}, due={1: 4.0, 2: 300.0})  # fmt: skip
    assert turns.preempt == ()
    bob = next(s for s in turns.standings if s.subject == "user:bob")
    assert bob.waits.endswith("a slot frees in about 4 s: it waits for that, no job is stopped")


def test_a_slot_takes_back_once_the_patience_is_spent_or_no_job_ends_within_it() -> None:
    live = [job(1, 1, JobState.RUNNING, done=90), job(2, 1, JobState.RUNNING, done=10)]
    spent = share_out([job(3, 2)], live, subject, {}, free=0,
                      patience={"user:bob": 0.0}, due={1: 4.0})  # fmt: skip
    assert ids(spent.preempt) == [2]
    too_far = share_out([job(3, 2)], live, subject, {}, free=0,
                        patience={"user:bob": 25.0}, due={1: 40.0, 2: 300.0})  # fmt: skip
    assert ids(too_far.preempt) == [2]
    unknown = share_out([job(3, 2)], live, subject, {}, free=0, patience={"user:bob": 25.0})
    assert ids(unknown.preempt) == [2]


def test_one_job_due_to_end_is_awaited_for_one_owed_slot_only() -> None:
    """Bob is owed two of four slots: one of Ann's jobs ends soon and covers one; the other
    is taken back at once."""
    live = [job(i, 1, JobState.RUNNING, done=10 * i) for i in range(1, 5)]
    turns = share_out([job(5, 2), job(6, 2)], live, subject, {}, free=0,
                      patience={"user:bob": 30.0}, due={4: 2.0})  # fmt: skip
    assert len(turns.preempt) == 1 and turns.preempt[0].id != 4


def test_a_job_not_started_yet_yields_before_a_running_one() -> None:
    live = [job(1, 1, JobState.RUNNING), job(2, 1, JobState.SUBMITTED)]
    assert ids(share_out([job(3, 2)], live, subject, {}, free=0).preempt) == [2]


def test_only_inference_shards_yield_they_resume_from_their_ledger() -> None:
    region = {"region": {"image": "s.tif", "index": 0, "count": 2}}
    live = [
        job(1, 1, JobState.RUNNING, pipeline=Pipeline.TRAIN),
        job(2, 1, JobState.RUNNING, pipeline=Pipeline.REPORT),
        job(3, 1, JobState.RUNNING, params=region),
    ]
    assert not any(resumable(j) for j in live)
    assert share_out([job(9, 2)], live, subject, {}, free=0).preempt == ()


def test_no_yielding_when_the_site_turns_it_off() -> None:
    live = [job(1, 1, JobState.RUNNING), job(2, 1, JobState.RUNNING)]
    assert share_out([job(3, 2)], live, subject, {}, free=0, preempt=False).preempt == ()


def test_three_owners_on_two_slots_do_not_take_turns_stopping_each_other() -> None:
    """With shares of 2/3 each, an owner holding one slot is not above its share rounded up:
    the third waits for a slot to end instead of stopping one."""
    live = [job(1, 1, JobState.RUNNING), job(2, 2, JobState.RUNNING)]
    turns = share_out([job(3, 3)], live, subject, {}, free=0)
    assert turns.preempt == ()
    cy = next(s for s in turns.standings if s.subject == "user:cy")
    assert cy.waits.startswith("every slot is busy (2)")


def test_an_owner_who_needs_less_than_its_part_leaves_the_rest_to_the_others() -> None:
    """Four slots: bob needs one, so ann and cy share the other three; ann, holding three,
    gives one up (she keeps 2, her share rounded up)."""
    live = [job(i, 1, JobState.RUNNING) for i in range(1, 4)] + [job(4, 2, JobState.RUNNING)]
    turns = share_out([job(9, 3), job(10, 3)], live, subject, {}, free=0)
    shares = {s.subject: s.share for s in turns.standings}
    assert shares == {"user:ann": 1.5, "user:bob": 1.0, "user:cy": 1.5}
    assert [subject(j) for j in turns.preempt] == ["user:ann"]


def _after(running: list[Job], waiting: list[Job], turns) -> tuple[list[Job], list[Job]]:
    """The jobs live and pending once a round's decisions are carried out."""
    stopped = set(ids(turns.preempt))
    chosen = set(ids(turns.submit))
    live = [j for j in running if j.id not in stopped]
    live += [job(j.id, j.batch_id, JobState.RUNNING) for j in turns.submit]
    pending = [j for j in waiting if j.id not in chosen]
    pending += [job(j.id, j.batch_id) for j in turns.preempt]
    return live, pending


@settings(max_examples=300, deadline=None)
@given(
    live=st.lists(st.sampled_from([1, 2, 3]), max_size=8),
    pending=st.lists(st.sampled_from([1, 2, 3]), max_size=12),
    free=st.integers(0, 4),
)
def test_rounds_never_overfill_never_push_an_owner_below_its_share_and_settle(
    live: list[int], pending: list[int], free: int
) -> None:
    """Whatever the jobs: no more go out than slots are free; an owner that yields keeps at
    least its share; and once the freed slots are handed out, nobody yields again."""
    running = [job(100 + i, b, JobState.RUNNING) for i, b in enumerate(live)]
    waiting = [job(200 + i, b) for i, b in enumerate(pending)]
    slots = free + len(running)
    first = share_out(waiting, running, subject, {}, free=free)
    assert len(first.submit) <= free
    shares = {s.subject: s.share or 0.0 for s in first.standings}
    running, waiting = _after(running, waiting, first)
    for donor in {subject(j) for j in first.preempt}:
        assert sum(subject(j) == donor for j in running) >= shares[donor] - 1e-9
    second = share_out(waiting, running, subject, {}, free=slots - len(running))
    assert second.preempt == ()
    running, waiting = _after(running, waiting, second)
    assert len(running) <= slots
    third = share_out(waiting, running, subject, {}, free=slots - len(running))
    assert third.preempt == () and third.submit == ()


def test_on_one_slot_owners_take_turns_the_one_served_longest_ago_first() -> None:
    pending = [job(1, 1), job(2, 1), job(9, 2)]
    served = {"user:ann": 50.0, "user:bob": 10.0}
    assert ids(share_out(pending, [], subject, {}, free=1, served=served).submit) == [9]
    assert ids(share_out(pending, [], subject, {}, free=1, served={"user:bob": 60.0}).submit) == [1]
    assert ids(share_out(pending, [], subject, {}, free=3, served=served).submit) == [9, 1, 2]
