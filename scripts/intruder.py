"""What an expert who means harm does to watchd, done as that expert: scripts/fuzz_campaign.py
runs this script through setpriv as the unprivileged expert of the experts' group (or as
itself where it has no real users), first to make a case's folders, then while the daemon runs.

    python scripts/intruder.py build PLAN.json     make the case's folders, manifest last
    python scripts/intruder.py act PLAN.json       act until SIGTERM

While it acts, every few hundredths of a second:

- each run folder that appears under a folder's ``results/`` gets the folder's ``inside``
  things (scripts/hostile.py: links, FIFOs, hard links and forged files at every name a job or
  the report reads) at their times, and again and again where they race the jobs;
- the case's timed swaps of inputs and outputs are made;
- races on the spool (``races``): for every run folder seen, the jobs' files at their real
  places in the spool (the expert can name them: the spool's layout is documented) are read,
  written, replaced by a rename, replaced by a link and removed, and the spool is listed; the
  expert must be refused each time (EACCES);
- leases are forged at their times: at the drop root's old lease name, which the expert may
  write, and at the root's lease in the spool, which it may not.

It writes down what it did in the plan's journal folder: ``journal.jsonl`` (a line for each
thing done to the spool that was not refused, each forged file with its inode, each error of
its own) and, at the end, ``counts.json`` (how each attempt ended, by target and operation).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import hostile
from forgeries import OLD_LEASE, clear, forge_lease, forged, is_folder, lease_bytes

from daemon.contract import spool

TICK = 0.05
AGAIN = 0.3  # seconds between two puts of a racing thing
RACE_EVERY = 0.25  # seconds between two rounds of attempts on the spool


@dataclass(frozen=True)
class Plan:
    """What the expert is to do, written by the campaign as JSON."""

    drop: Path  # where the expert makes its folders: the drop root (server side on the share)
    spools: tuple[Path, ...]  # the ways to the spool the expert tries
    lease: str  # the drop root's lease, relative to the spool
    root: str  # the drop root as the daemon names it (in its leases)
    outside: hostile.Outside
    cases: tuple[hostile.Hostile, ...]
    scale: hostile.Scale
    stamps: tuple[str, ...]
    batches: int
    journal: Path  # a folder of the expert's
    attack_spool: bool  # False where the expert is the service itself: nothing to refuse

    def save(self, path: Path) -> None:
        data = {**asdict(self), "cases": hostile.to_json(self.cases)}
        path.write_text(json.dumps(data, default=str))

    @classmethod
    def load(cls, path: Path) -> Plan:
        data = json.loads(path.read_text())
        outside = hostile.Outside(**{k: Path(v) for k, v in data["outside"].items()})
        return cls(
            Path(data["drop"]), tuple(Path(p) for p in data["spools"]), data["lease"],
            data["root"], outside, hostile.from_json(data["cases"]),
            hostile.Scale(**data["scale"]), tuple(data["stamps"]), data["batches"],
            Path(data["journal"]), data["attack_spool"],
        )  # fmt: skip


def build(plan: Plan) -> None:
    for case in plan.cases:
        hostile.build(plan.drop, case, plan.outside, plan.scale, stamps=list(plan.stamps),
                      batches=plan.batches)  # fmt: skip


# -- the journal -----------------------------------------------------------------------------------


class Journal:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.counts: Counter[str] = Counter()
        self.lines = open(folder / "journal.jsonl", "a", encoding="utf-8")  # noqa: SIM115

    def note(self, **what: Any) -> None:
        self.lines.write(json.dumps(what, default=str) + "\n")
        self.lines.flush()

    def tried(self, target: str, op: str, outcome: str, path: Path, refusal_expected: bool) -> None:
        self.counts[f"{target}\t{op}\t{outcome}"] += 1
        if outcome == "done" and refusal_expected:
            self.note(event="not refused", target=target, op=op, path=str(path))

    def close(self) -> None:
        (self.folder / "counts.json").write_text(json.dumps(self.counts))
        self.lines.close()


def outcome_of(exc: OSError) -> str:
    return errno.errorcode.get(exc.errno or 0, str(exc.errno))


# -- in the run folders ----------------------------------------------------------------------------


def runs_of(folder: Path) -> list[Path]:
    """The run folders under ``folder``'s results/ (real folders only: never through a link)."""
    try:
        with os.scandir(folder / "results") as listing:
            return [Path(e.path) for e in listing
                    if e.is_dir(follow_symlinks=False) and not e.name.startswith(".")]  # fmt: skip
    except OSError:
        return []


def job_names(batches: int, jobs: tuple[str, ...]) -> list[str]:
    """The names of ``jobs`` (hostile.JOBS) for each batch id a case's folder may have."""
    return [f"b{i:06d}-{job}" for i in range(1, batches + 1) for job in jobs]


def expand(name: str, case: hostile.Hostile, batches: int) -> Iterator[tuple[str, str]]:
    """The names a RUN_NAME stands for, each with the job it concerns ('' if none)."""
    if "{job}" in name:
        for job in job_names(batches, hostile.JOBS[case.kind]):
            yield name.replace("{job}", job), job
    elif "{image}" in name:
        for image in hostile.sweep_images(case) or case.images:
            yield name.replace("{image}", image), ""
    else:
        yield name, ""


def put(plan: Plan, journal: Journal, run: Path, name: str, kind: str, job: str) -> None:
    """``kind`` at ``run/name`` in place of what is there (renamed over it; a folder there is
    moved aside), the folders on the way made; never through a link or a FIFO on the way."""
    here = run
    for part in name.split("/")[:-1]:
        here = here / part
        if os.path.lexists(here) and not is_folder(here):
            return
        with contextlib.suppress(FileExistsError):
            here.mkdir()
    path = here / name.split("/")[-1]
    fresh = path.with_name(".swap-" + path.name[:200])
    clear(fresh)
    if kind == "forged":
        work = spool.work_dir(plan.spools[0], _batch_of(job), run.name)
        fresh.write_bytes(forged(name, plan.outside, work, job))
        journal.note(event="forged", path=str(path), inode=os.lstat(fresh).st_ino)
    else:
        hostile.make_odd(fresh, kind, plan.outside, target=path)
    if is_folder(path):
        os.replace(path, path.with_name(f"{path.name[:200]}.moved-{time.monotonic_ns()}"))
    os.replace(fresh, path)


def _batch_of(job: str) -> int:
    return int(job[1:7]) if job[:1] == "b" and job[1:7].isdigit() else 1


def swap(folder: Path, case: hostile.Hostile, what: str, outside: hostile.Outside) -> None:
    """Swap an input or an output for a link out of the folder or a FIFO (renamed over it, so
    there is no moment without the name)."""
    if what.startswith("image"):
        targets = [folder / case.images[0]]
    elif what.startswith("log"):
        targets = [p for p in real_files(folder / "results") if p.name == "log.txt"]
    else:
        targets = [p for p in real_dirs(folder / "results") if p.name == "masks"]
    for path in targets:
        replace_with(path, "fifo" if what.endswith("fifo") else _link_kind(what), outside)


def _link_kind(what: str) -> str:
    return "dir-out" if what == "masks-link" else "file-out"


def replace_with(path: Path, kind: str, outside: hostile.Outside) -> None:
    fresh = path.with_name(".swap-" + path.name[:200])
    if os.path.lexists(fresh):
        return
    hostile.make_odd(fresh, kind, outside, target=path)
    if path.is_dir() and not path.is_symlink():
        os.replace(path, path.with_name(path.name + ".moved"))
    os.replace(fresh, path)


def real_files(top: Path) -> list[Path]:
    """Regular files under ``top``, never through a link (os.walk does not follow them)."""
    return [Path(d) / f for d, _, files in os.walk(top) for f in files if _regular(Path(d) / f)]


def real_dirs(top: Path) -> list[Path]:
    return [
        Path(d) / n for d, dirs, _ in os.walk(top) for n in dirs if not (Path(d) / n).is_symlink()
    ]


def _regular(path: Path) -> bool:
    return path.is_file() and not path.is_symlink()


# -- in the spool ----------------------------------------------------------------------------------


def spool_targets(
    plan: Plan, way: Path, run: str, target: str, case: hostile.Hostile
) -> Iterator[tuple[Path, str]]:  # fmt: skip
    """Where ``target`` (hostile.SPOOL_TARGETS) lies in the spool reached by ``way``, for each
    batch a run folder named ``run`` may belong to: paths, each with its job."""
    if target == "lease":
        yield way / plan.lease, ""
        return
    trial = target.startswith("candidate")
    jobs = hostile.JOBS["sweep"][:2] if trial else hostile.JOBS[case.kind]
    for job in job_names(plan.batches, jobs):
        folder = spool.work_dir(way, _batch_of(job), run) / ("trials" if trial else "jobs")
        yield folder / job / target, job


def attack(plan: Plan, journal: Journal, path: Path, target: str, data: bytes) -> None:
    """Read, write, replace (by a rename, by a link) and remove ``path``: each must be refused."""
    flags = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    fresh = path.with_name(f".forged-{os.getpid()}")

    def read() -> None:
        os.close(os.open(path, os.O_RDONLY | flags))

    def write() -> None:
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC | flags)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)

    def rename() -> None:
        fd = os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_EXCL | flags, 0o666)
        os.write(fd, data)
        os.close(fd)
        os.replace(fresh, path)

    def link() -> None:
        os.symlink(plan.outside.canary, fresh)
        os.replace(fresh, path)

    for op, do in (("read", read), ("write", write), ("rename", rename), ("link", link),
                   ("remove", lambda: os.unlink(path))):  # fmt: skip
        try:
            do()
        except OSError as exc:
            journal.tried(target, op, outcome_of(exc), path, plan.attack_spool)
        else:
            journal.tried(target, op, "done", path, plan.attack_spool)


def race(plan: Plan, journal: Journal, case: hostile.Hostile, runs: list[Path]) -> None:
    """One round of attempts on the spool for ``case``'s targets in each of its run folders."""
    for way in plan.spools:
        for listed in (way, way / spool.RUNS_DIR):
            try:
                os.listdir(listed)
            except OSError as exc:
                journal.tried("spool", "list", outcome_of(exc), listed, plan.attack_spool)
            else:
                journal.tried("spool", "list", "done", listed, plan.attack_spool)
        for run in runs:
            for target in case.races:
                for path, job in spool_targets(plan, way, run.name, target, case):
                    work = path.parent.parent.parent  # <work>/jobs/<job>/<target>
                    data = (lease_bytes("future", plan.root) if target == "lease"
                            else forged(target, plan.outside, work, job))  # fmt: skip
                    attack(plan, journal, path, target, data)


def lease(plan: Plan, journal: Journal, forgery: hostile.Lease) -> None:
    """A forged lease at the drop root's old lease name, or at the root's lease in the spool
    (refused, where the expert is not the service)."""
    if forgery.where == "drop":
        paths = [plan.drop / OLD_LEASE]
    else:
        paths = [way / plan.lease for way in plan.spools]
    for path in paths:
        try:
            forge_lease(path, forgery.kind, plan.root, plan.outside.canary)
        except OSError as exc:
            journal.tried("lease", forgery.where, outcome_of(exc), path, forgery.where == "spool")
        else:
            refused = forgery.where == "spool" and plan.attack_spool
            journal.tried("lease", forgery.where, "done", path, refused)


# -- acting ----------------------------------------------------------------------------------------


class Acts:
    """The state of one act: run folders seen, and what was put there when."""

    def __init__(self, plan: Plan, journal: Journal) -> None:
        self.plan, self.journal = plan, journal
        self.started = time.monotonic()
        self.seen: dict[Path, float] = {}  # a run folder → when it was first seen
        self.last: dict[tuple[Path, int], float] = {}  # (run folder, inside index) → last put
        self.swaps = sorted((s.after, i, s.what) for i, h in enumerate(plan.cases) for s in h.swaps)
        self.leases = sorted((f for h in plan.cases for f in h.leases), key=lambda f: f.after)
        self.raced = -RACE_EVERY

    def tick(self) -> None:
        now = time.monotonic() - self.started
        racing = now - self.raced >= RACE_EVERY and self.plan.attack_spool
        for case in self.plan.cases:
            folder = self.plan.drop / case.name
            runs = runs_of(folder)
            for run in runs:
                self.seen.setdefault(run, now)
                self._inside(case, run, now)
            if racing and case.races:
                race(self.plan, self.journal, case, runs)
        self.raced = now if racing else self.raced
        while self.swaps and self.swaps[0][0] <= now:
            _, i, what = self.swaps.pop(0)
            case = self.plan.cases[i]
            self._guarded(functools.partial(swap, self.plan.drop / case.name, case, what,
                                            self.plan.outside))  # fmt: skip
        while self.leases and self.leases[0].after <= now:
            lease(self.plan, self.journal, self.leases.pop(0))

    def _inside(self, case: hostile.Hostile, run: Path, now: float) -> None:
        for index, item in enumerate(case.inside):
            last = self.last.get((run, index))
            due = now - self.seen[run] >= item.at and (
                last is None or (item.again and now - last >= AGAIN)
            )
            if not due:
                continue
            self.last[(run, index)] = now
            for name, job in expand(item.name, case, self.plan.batches):
                self._guarded(functools.partial(put, self.plan, self.journal, run, name,
                                                item.kind, job))  # fmt: skip

    def _guarded(self, do: Callable[[], None]) -> None:
        """Do it; what the system refuses is counted (a hard link to another's file, a name
        the job made meanwhile), never fatal."""
        try:
            do()
        except OSError as exc:
            self.journal.counts[f"put\t-\t{outcome_of(exc)}"] += 1
        else:
            self.journal.counts["put\t-\tdone"] += 1


def act(plan: Plan) -> None:
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    journal = Journal(plan.journal)
    try:  # the canary is the service's alone: the expert may not read it either
        with open(plan.outside.canary, "rb"):
            journal.tried("canary", "read", "done", plan.outside.canary, plan.attack_spool)
    except OSError as exc:
        journal.tried("canary", "read", outcome_of(exc), plan.outside.canary, plan.attack_spool)
    acts = Acts(plan, journal)
    try:
        while not stopping:
            acts.tick()
            time.sleep(TICK)
    except Exception as exc:  # an error of its own: written down, the campaign says so
        journal.note(event="intruder failed", error=f"{type(exc).__name__}: {exc}")
        raise
    finally:
        journal.close()


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("build", "act"):
        print("usage: intruder.py build|act PLAN.json", file=sys.stderr)
        return 2
    plan = Plan.load(Path(argv[1]))
    build(plan) if argv[0] == "build" else act(plan)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
