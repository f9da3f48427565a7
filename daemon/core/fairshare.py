"""Fair order: which pending jobs go out, owner by owner in turns, and which running job yields.
Pure.

Jobs are handed out by subject (each owner, or each group: ``[accounts] fair_by``) in turns,
by weighted fair queueing: the next free slot goes to the subject with the fewest running jobs
for its weight; between equals, to the one served least recently (its last job handed out
longest ago: on one slot, owners take turns), then the one whose oldest pending batch is oldest;
within a subject, oldest batch first. A subject never has more than its cap (``max_running``)
live at once.

With a fixed number of slots (the local executor's ``max_parallel``; Slurm's ``max_jobs``) a
subject's share is its weight's part of the slots, given out by water-filling (a subject that
needs less than its part leaves the rest to the others). A subject below its share that waits
while another runs more than its share, rounded up, takes a slot back at once: one of the other's
inference jobs is stopped and goes back to pending (it resumes from its ledger, so only the image
in flight is done again). The rounding up keeps it from swinging back: a subject that gave a slot
up still holds at least its share, so it never takes it back in turn.

Taking a slot back costs the stopped shard its restart (and leaves its batch's last shards
unevenly spread), so it is done only when no slot frees by itself soon: a waiting subject with
``patience`` left (the site's ``preempt_grace_seconds`` less what it has waited so far) waits
for a live job ``due`` to end within it, and takes one back only when none is, or once it has
waited that long.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from daemon.contract.jobspec import Pipeline
from daemon.core.records import Job
from daemon.core.states import JobState


@dataclass(frozen=True)
class Stake:
    """A subject's terms in the fair order: its weight and its cap (0: none)."""

    weight: float = 1.0
    cap: int = 0


@dataclass(frozen=True)
class Standing:
    """One subject's place in this round, for ``watchctl status``: live jobs, jobs pending,
    its share of the slots (None: no fixed slots), and why it waits ('' when it does not)."""

    subject: str
    running: int
    pending: int
    share: float | None
    waits: str = ""


@dataclass(frozen=True)
class Turns:
    """What one round of the fair order decided."""

    submit: tuple[Job, ...] = ()
    preempt: tuple[Job, ...] = ()
    standings: tuple[Standing, ...] = field(default=())


def share_out(
    pending: Sequence[Job],
    live: Sequence[Job],
    subject_of: Callable[[Job], str],
    stakes: Mapping[str, Stake],
    free: int | None,
    *,
    preempt: bool = True,
    served: Mapping[str, float] | None = None,
    patience: Mapping[str, float] | None = None,
    due: Mapping[int, float] | None = None,
) -> Turns:
    """Hand ``pending`` out within ``free`` slots (None: no limit but the caps), in turns, and
    name the live jobs to stop so that a subject below its share gets a slot. ``served``: when
    each subject last had a job handed out (none: never); ``patience``: how long each subject
    may still wait for a slot that frees by itself (none: not at all); ``due``: the seconds a
    live job (by id) is expected to run still (none: not known)."""
    queues: dict[str, list[Job]] = {}
    for job in sorted(pending, key=lambda j: (j.batch_id, j.id)):  # oldest batch first
        queues.setdefault(subject_of(job), []).append(job)
    running: dict[str, int] = {}
    for job in live:
        running[subject_of(job)] = running.get(subject_of(job), 0) + 1
    subjects = sorted({*queues, *running})
    stake = {s: stakes.get(s, Stake()) for s in subjects}
    waiting = {s: len(q) for s, q in queues.items()}
    chosen = _in_turns(queues, running, stake, free, dict(served or {}))
    after = dict(running)
    for job in chosen:
        after[subject_of(job)] = after.get(subject_of(job), 0) + 1
        waiting[subject_of(job)] -= 1
    slots = None if free is None else max(0, free) + len(live)
    shares = _shares(subjects, after, waiting, stake, slots)
    stopped: list[Job] = []
    awaited: dict[str, float] = {}
    if preempt and slots is not None and len(chosen) == max(0, free or 0):
        stopped = _yielding(live, subject_of, after, waiting, stake, shares,
                            _Soon(patience or {}, due or {}), awaited)  # fmt: skip
    standings = tuple(
        Standing(s, after.get(s, 0), waiting.get(s, 0), shares.get(s),
                 _why(s, after, waiting, stake, shares, slots, awaited.get(s)))
        for s in subjects
    )  # fmt: skip
    return Turns(tuple(chosen), tuple(stopped), standings)


def _key(subject: str, running: Mapping[str, int], stake: Mapping[str, Stake],
         queues: Mapping[str, list[Job]], served: Mapping[str, float],
         ) -> tuple[float, float, int, int]:  # fmt: skip
    """A subject's place in the turns: fewest running for its weight first, then the one served
    least recently, then the one whose oldest pending job is oldest."""
    head = queues[subject][0]
    load = (running.get(subject, 0) + 1) / stake[subject].weight
    return (load, served.get(subject, -math.inf), head.batch_id, head.id)


def _open(subject: str, running: Mapping[str, int], stake: Mapping[str, Stake]) -> bool:
    cap = stake[subject].cap
    return not cap or running.get(subject, 0) < cap


def _in_turns(
    queues: dict[str, list[Job]],
    running: Mapping[str, int],
    stake: Mapping[str, Stake],
    free: int | None,
    served: dict[str, float],
) -> list[Job]:
    """The jobs that go out, in the order they are given their slots."""
    left = {s: list(q) for s, q in queues.items()}
    taken = dict(running)
    chosen: list[Job] = []
    while free is None or len(chosen) < free:
        ready = [s for s, q in left.items() if q and _open(s, taken, stake)]
        if not ready:
            break
        subject = min(ready, key=lambda s: _key(s, taken, stake, left, served))
        chosen.append(left[subject].pop(0))
        taken[subject] = taken.get(subject, 0) + 1
        served[subject] = math.inf  # served now: after everyone served before
    return chosen


def _shares(
    subjects: Sequence[str],
    running: Mapping[str, int],
    waiting: Mapping[str, int],
    stake: Mapping[str, Stake],
    slots: int | None,
) -> dict[str, float]:
    """Each subject's share of ``slots`` by weight, water-filled: a subject needs its running
    and pending jobs (up to its cap); what one needs less than its part goes to the others."""
    if slots is None:
        return {}
    need = {}
    for s in subjects:
        wanted = running.get(s, 0) + waiting.get(s, 0)
        need[s] = float(min(wanted, stake[s].cap) if stake[s].cap else wanted)
    shares = dict.fromkeys(subjects, 0.0)
    left, open_ = float(slots), [s for s in subjects if need[s] > 0]
    while open_ and left > 1e-9:
        weights = sum(stake[s].weight for s in open_)
        level = left / weights
        full = [s for s in open_ if need[s] - shares[s] <= level * stake[s].weight + 1e-9]
        if not full:
            for s in open_:
                shares[s] += level * stake[s].weight
            break
        for s in full:
            left -= need[s] - shares[s]
            shares[s] = need[s]
        open_ = [s for s in open_ if s not in full]
    return shares


@dataclass
class _Soon:
    """The live jobs due to end soon, each awaited by one waiting subject at most."""

    patience: Mapping[str, float]
    due: Mapping[int, float]
    claimed: set[int] = field(default_factory=set)

    def await_one(self, subject: str) -> float | None:
        """The seconds until the soonest unclaimed live job ends, claimed for ``subject``, if
        that is within its patience; else None."""
        left = self.patience.get(subject, 0.0)
        open_ = [(seconds, job) for job, seconds in self.due.items()
                 if job not in self.claimed and seconds <= left]  # fmt: skip
        if left <= 0 or not open_:
            return None
        seconds, job = min(open_)
        self.claimed.add(job)
        return seconds


def _yielding(
    live: Sequence[Job],
    subject_of: Callable[[Job], str],
    running: dict[str, int],
    waiting: Mapping[str, int],
    stake: Mapping[str, Stake],
    shares: Mapping[str, float],
    soon: _Soon,
    awaited: dict[str, float],
) -> list[Job]:
    """Live jobs to stop: one per slot a waiting subject below its share is owed and no slot
    frees for within its patience, each taken from the subject furthest above its share
    (rounded up) that has one that can resume. ``awaited`` gets the subjects that wait for a
    slot to free instead, with the seconds until it does."""
    owed = [s for s in sorted(waiting, key=lambda s: running.get(s, 0) / stake[s].weight)
            for _ in range(_owed(s, running, waiting, stake, shares))]  # fmt: skip
    movable: dict[str, list[Job]] = {}
    for job in sorted(live, key=_yield_order):
        if resumable(job):
            movable.setdefault(subject_of(job), []).append(job)
    stopped: list[Job] = []
    for subject in owed:
        seconds = soon.await_one(subject)
        if seconds is not None:
            awaited[subject] = max(awaited.get(subject, 0.0), seconds)
            continue
        donors = [s for s, jobs in movable.items()
                  if jobs and running.get(s, 0) > math.ceil(shares.get(s, 0.0) - 1e-9)]  # fmt: skip
        if not donors:
            break
        donor = max(donors, key=lambda s: running[s] - shares.get(s, 0.0))
        stopped.append(movable[donor].pop(0))
        running[donor] -= 1
    return stopped


def _owed(
    subject: str,
    running: Mapping[str, int],
    waiting: Mapping[str, int],
    stake: Mapping[str, Stake],
    shares: Mapping[str, float],
) -> int:
    """Slots a waiting subject is owed: up to its share (rounded up), its cap, its jobs."""
    have = running.get(subject, 0)
    target = math.ceil(shares.get(subject, 0.0) - 1e-9)
    if stake[subject].cap:
        target = min(target, stake[subject].cap)
    return max(0, min(waiting.get(subject, 0), target - have))


def resumable(job: Job) -> bool:
    """Whether a live job can be stopped and run again later at the cost of the image in
    flight: an inference shard (its ledger skips the images done); not a slide's region, a
    training or a report."""
    return job.pipeline is Pipeline.INFER and "region" not in job.params and job.state.live


def _yield_order(job: Job) -> tuple[int, int, int]:
    """Which of a subject's jobs yields first: one not started yet (nothing lost), then the one
    with the most images left, then the newest."""
    started = 0 if job.state is JobState.SUBMITTED else 1
    return (started, -(job.images - job.images_done), -job.id)


def _why(
    subject: str,
    running: Mapping[str, int],
    waiting: Mapping[str, int],
    stake: Mapping[str, Stake],
    shares: Mapping[str, float],
    slots: int | None,
    awaited: float | None = None,
) -> str:
    """Why a subject's pending jobs wait after this round ('' when none waits)."""
    if not waiting.get(subject):
        return ""
    have, cap = running.get(subject, 0), stake[subject].cap
    if cap and have >= cap:
        return f"at its cap: {have} of max_running {cap} live"
    if slots is None:
        return "offered again at the next round"
    share = shares.get(subject, 0.0)
    busy = f"every slot is busy ({slots}); its share is {share:.2g}, it has {have}"
    if awaited is not None:
        busy += f"; a slot frees in about {awaited:.0f} s: it waits for that, no job is stopped"
    return busy
