"""Fuzz campaign: hostile batch folders (scripts/hostile.py) through the real daemon and jobs,
with the invariants of issues 11 and 25 checked after every case.

Each case: a fresh site (scripts/fuzz_site.py: drop root, spool, state folder, a copy of the
registry, a sentinel tree, a canary and a trap folder beside the drop root), the case's folders
made by the intruder (scripts/intruder.py) as the expert, then a real `watchd run` as the
service in a session of its own (local executor, real pipelines) while the intruder acts:
swaps, things put in the run folders once they are there, races on the spool, forged leases.
Where folders forge leases the daemon is stopped and started again once they are there.
Checked (scripts/invariants.py):

- nothing outside the batch folders is written, read or listed: the sentinel tree, the trap
  and the canary's folder are byte for byte as they were, and no atime in them moved; the
  registry's model is byte for byte as it was; the state folder and the drop root hold nothing
  new but the batch folders;
- the canary's token and nothing forged reached an output, the spool, the database, the log
  or watchctl; every spec in the spool is the daemon's; the expert was refused every attempt
  on the spool (with real users); a sweep registered one of its own trials;
- no tick of the loop longer than ``--tick-bound`` seconds: the heartbeat the loop writes to
  the store (every ``heartbeat_seconds``, only between ticks) is never older than that;
- every folder's batch ends (done, failed or cancelled) with a reason, within ``--deadline``;
- the daemon logs no unexpected exception, gives up no root, never exits by itself, starts
  again over forged leases, and stops on SIGTERM with exit status 0;
- no traceback (nor a hang) in `watchctl status`, `batches`, `jobs`, `show ID` of every batch
  and `logs JOB` of every job, each a real subprocess with a time limit; and watchctl too
  reads nothing of the sentinel tree.

With ``--users`` the service and the expert are real unprivileged users (made if missing;
root is needed), and ``--share`` puts the drop root and the spool on the test share
(scripts/netshare, which must be running). A campaign of ``leases`` first checks the real
conflict: a root held by another live watchd is refused, exit status 1.

Every wait is bounded; the daemon's process group and every job it started are killed at the
end of each case, whatever state they are in.

    python scripts/fuzz_campaign.py --cases 25 --seed 1         # the full campaign
    python scripts/fuzz_campaign.py --cases 20 --family results --shrink   # a minimal failing case
    python scripts/fuzz_campaign.py --cases 10 --family canary --users --share
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fault_campaign
import forgeries
import fuzz_site
import hostile
import invariants
import sentinel
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from daemon.core.records import Batch
from daemon.site import logs
from daemon.site.claims import lease_path
from daemon.site.subprocesses import process_start_ticks

BIN = Path(sys.executable).parent
BASIC: dict[str, Any] = {"results": False, "manifests": ("good",), "screen": False}
FAMILIES: dict[str, dict[str, Any]] = {  # what a family draws: plants under results/? which
    # manifests? terminal escapes and markup in names, owner and title? what is put in the run
    # folder once it is there? canary links among the inputs? races on the spool? leases?
    "inputs": BASIC,
    "screen": {**BASIC, "screen": True},
    "manifests": {**BASIC, "manifests": hostile.MANIFESTS},
    "results": {**BASIC, "results": True, "inside": "names"},
    "canary": {**BASIC, "inside": "canary", "canary": True, "runnable": True},
    "races": {**BASIC, "inside": "races", "races": True, "runnable": True},
    "leases": {**BASIC, "leases": True, "runnable": True},
    "all": {"results": True, "manifests": hostile.MANIFESTS, "screen": True, "inside": "names",
            "canary": True, "races": True, "leases": True},
}  # fmt: skip


@dataclass(frozen=True)
class Limits:
    # Seconds a tick may take. Generous: on 2 cores shared by many (load 7-9) ticks of 10 s
    # were seen in cases that stall nothing; what this must catch takes 25 s to forever.
    tick_bound: float = 15.0
    deadline: float = 60.0  # seconds for every batch of a case to end
    startup: float = 30.0  # seconds for the daemon's first heartbeat
    watchctl: float = 30.0  # seconds for one watchctl command (a few run at once)
    window: int = 20  # seconds of run-folder stamps planted from the case's start
    build: float = 120.0  # seconds for the expert to make a case's folders
    sweep: float = 180.0  # seconds more for a case with a sweep (two trainings, three jobs)


@dataclass
class Outcome:
    folders: int
    violations: list[str] = field(default_factory=list)
    seconds: float = 0.0
    slowest_tick: float = 0.0
    counts: Counter[str] = field(default_factory=Counter)  # what the intruder tried, how it ended
    batches: Counter[str] = field(default_factory=Counter)  # how they ended; how many ran jobs

    def said(self) -> str:
        ended = ", ".join(f"{state} {n}" for state, n in sorted(self.batches.items()))
        return f"{self.folders} folders ({ended})"


def scenarios(family: str, scale: hostile.Scale) -> st.SearchStrategy[tuple[hostile.Hostile, ...]]:
    return hostile.scenarios(scale, **FAMILIES[family])


SECTIONS: dict[str, dict[str, Any]] = {  # a fast loop and heartbeat (a tick's length shows
    # within 0.2 s), a short shutdown and intake timeout, and one inference shard per batch
    "daemon": {"tick_seconds": 0.05, "heartbeat_seconds": 0.2, "shutdown_grace_seconds": 2.0},
    "intake": {"timeout_seconds": 8},
    "planner": {"shard_size": 64, "max_attempts": 2},
}


# -- one case --------------------------------------------------------------------------------------


def run_case(
    case: Sequence[hostile.Hostile], base: Path, seed_registry: Path, scale: hostile.Scale,
    limits: Limits, people: fuzz_site.People = fuzz_site.NOBODY, share: bool = False,
) -> Outcome:  # fmt: skip
    """Lay out a site under ``base`` (with ``people``; on the test share if ``share``), make
    the case's folders, run the daemon on them while the intruder acts, check every invariant."""
    started = time.monotonic()
    site = fuzz_site.lay_out(base, seed_registry, people, share, **SECTIONS)
    try:
        outcome = _run(case, site, scale, limits)
    finally:
        fuzz_site.remove_share(site)
    outcome.seconds = time.monotonic() - started
    return outcome


def _run(
    case: Sequence[hostile.Hostile], site: fuzz_site.Site, scale: hostile.Scale, limits: Limits
) -> Outcome:  # fmt: skip
    outcome = Outcome(len(case))
    config = site.config
    outside = [sentinel.Watched(site.sentinel, atimes=True),
               sentinel.Watched(site.trap, atimes=True),
               sentinel.Watched(site.canary.parent, atimes=True)]  # fmt: skip
    models = sentinel.Watched(site.registry / hostile.MODEL, atimes=False)
    plan = site.plan(case, scale, hostile.run_stamps(time.time(), limits.window))
    outcome.violations += fuzz_site.make_folders(site, plan, limits.build)
    log = site.base / "daemon.log"
    daemon = fuzz_site.Daemon(site, log)
    intruding = fuzz_site.Intruder(site, plan)
    try:
        outcome.slowest_tick = watch(daemon, site, case, limits, outcome)
    finally:
        outcome.violations += intruding.stop()
        outcome.violations += daemon.stop(config.daemon.shutdown_grace_seconds + 10)
    outcome.violations += [v for w in outside for v in w.violations("outside (daemon, jobs)")]
    outcome.violations += models.violations("registry")
    outcome.violations += invariants.endings(config, case) + invariants.logged_exceptions(log)
    outcome.batches = invariants.batches_ended(config)
    said: list[bytes] = []
    outcome.violations += invariants.watchctl_outputs(config, limits.watchctl, BIN, said)
    outcome.violations += [v for w in outside for v in w.violations("outside (watchctl)")]
    outcome.violations += after(site, case, log, said, outcome)
    return outcome


def after(
    site: fuzz_site.Site, case: Sequence[hostile.Hostile], log: Path, said: list[bytes],
    outcome: Outcome,
) -> list[str]:  # fmt: skip
    """Issue 25's invariants: what the intruder achieved, where the canary and the forged
    files went, the specs, what was written outside, the sweeps' winners."""
    config = site.config
    violations, counts, forged = invariants.intruder_said(site.journal)
    outcome.counts.update(counts)
    trees = [site.made, config.daemon.spool_dir, site.registry]
    canary = invariants.Finder(site.token, skip=[os.stat(site.canary).st_ino], window=8)
    violations += invariants.found_anywhere(canary, "the canary's token", config, trees, log, said)
    marker = invariants.Finder(forgeries.MARKER, skip=forged)
    violations += invariants.found_anywhere(marker, "a forged file's content", config, trees, log,
                                            said)  # fmt: skip
    violations += invariants.specs(config)
    violations += invariants.written_outside(site.state, site.made, [h.name for h in case])
    violations += invariants.sweep_winners(site.registry, config.daemon.spool_dir)
    return violations


def watch(
    daemon: fuzz_site.Daemon, site: fuzz_site.Site, case: Sequence[hostile.Hostile], limits: Limits,
    outcome: Outcome,
) -> float:  # fmt: skip
    """Follow the daemon until every batch ended (or it is stuck); forge the spool's leases as
    the service (with real users: the expert cannot) and start the daemon again once they are
    there. The slowest tick seen: how old the heartbeat got."""
    config = site.config
    spooled = sorted((f.after, f.kind) for h in case for f in h.leases if f.where == "spool")
    spooled = spooled if site.people.real else []  # else the intruder forges them itself
    acts = [s.after for h in case for s in h.swaps] + [f.after for h in case for f in h.leases]
    quiet = max(acts, default=0.0) + 0.5  # the intruder's timed acts are done by then
    restart = quiet + 0.5 if any(h.leases for h in case) else None
    started, slowest, floor = time.monotonic(), 0.0, 0.0
    since = started
    deadline = limits.deadline + (limits.sweep if any(h.kind == "sweep" for h in case) else 0)
    while (elapsed := time.monotonic() - started) < deadline:
        while spooled and spooled[0][0] <= elapsed:
            forge_as_service(site, spooled.pop(0)[1])
        asked = time.time()  # before reading: a slow read of ours must not age the beat
        beat = heartbeat(config)
        beaten = beat is not None and beat >= floor
        if beaten:
            slowest = max(slowest, asked - beat)
        if restart is not None and elapsed >= restart and beaten:  # once it runs (SIGTERM ends
            # a daemon still importing at once, as systemd expects: no fault of its own)
            restart = None
            outcome.violations += daemon.restart(config.daemon.shutdown_grace_seconds + 10)
            since, floor = time.monotonic(), time.time()  # the new daemon's beats from now
            outcome.counts["daemon restarted over forged leases"] += 1
            continue
        if slowest > limits.tick_bound:
            outcome.violations.append(f"a tick took over {limits.tick_bound:.0f} s (stuck loop)")
            return slowest
        if not beaten and time.monotonic() - since > limits.startup:
            outcome.violations.append(f"no heartbeat within {limits.startup:.0f} s of start")
            return slowest
        if daemon.proc.poll() is not None:
            outcome.violations.append(f"the daemon exited ({daemon.proc.returncode})")
            return slowest
        if elapsed > quiet and restart is None and beaten and all_ended(config, case):
            return slowest  # (beaten: a daemon started again must run before it is stopped)
        time.sleep(0.1)
    return slowest


def forge_as_service(site: fuzz_site.Site, kind: str) -> None:
    """A forged lease at the root's lease in the spool, as the service (or a daemon of an
    older version) could leave it: what the daemon reads there strictly."""
    path = lease_path(site.spool_server, site.drop)
    fuzz_site.service_folder(site, path.parent)
    forgeries.forge_lease(path, kind, str(site.drop), site.canary)
    fuzz_site.own(path, site.people.service)


def heartbeat(config: Any) -> float | None:
    """When the loop last beat, or None before its first beat."""
    beat = invariants.reading(config, lambda store: store.heartbeat())
    return None if beat is None else beat.beat_at


def latest(config: Any, case: Sequence[hostile.Hostile]) -> list[Batch | None]:
    """The newest batch of each of the case's folders (None: none recorded)."""
    root = str(config.roots[0].path)
    found = invariants.reading(
        config, lambda store: [store.latest_revision(root, h.name) for h in case]
    )
    return found if found is not None else [None] * len(case)


def all_ended(config: Any, case: Sequence[hostile.Hostile]) -> bool:
    return all(b is not None and b.state.terminal for b in latest(config, case))


# -- the daemon and the intruder, in sessions of their own -----------------------------------------


# -- the real conflict -----------------------------------------------------------------------------


def conflict(site: fuzz_site.Site, limits: Limits) -> list[str]:
    """The one case where the daemon may not start: its only drop root's lease is held by
    another watchd that is alive (a process of this host, renewing it). It must exit 1 within
    the start-up limit, saying so; violations otherwise."""
    holder = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        lease = {"host": socket.gethostname(), "pid": holder.pid,
                 "start_ticks": process_start_ticks(holder.pid),
                 "database": "/elsewhere/watchd.sqlite", "renewed_at": time.time(),
                 "root": str(site.drop)}  # fmt: skip
        path = lease_path(site.spool_server, site.drop)
        fuzz_site.service_folder(site, path.parent)
        path.write_text(json.dumps(lease))
        fuzz_site.own(path, site.people.service)
        daemon = fuzz_site.Daemon(site, site.base / "conflict.log")
        try:
            code = daemon.proc.wait(timeout=limits.startup)
        except subprocess.TimeoutExpired:
            daemon.stop(2.0)
            return ["a root held by another live watchd: the daemon did not refuse to start"]
        said = (site.base / "conflict.log").read_text(errors="replace")
        if code != 1 or "every drop root is held by another watchd" not in said:
            return [f"a root held by another live watchd: exit {code}: {said.strip()[-300:]}"]
        return []
    finally:
        holder.kill()
        holder.wait()


# -- the campaign ----------------------------------------------------------------------------------


def interrupted(signum: int, frame: object) -> None:
    """SIGTERM unwinds like Ctrl-C, which hypothesis lets through at once (it would take a
    SystemExit for the case's failure and run the case again): each case's daemon and jobs are
    stopped on the way out."""
    raise KeyboardInterrupt


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--family", choices=sorted(FAMILIES), default="all")
    parser.add_argument("--tick-bound", type=float, default=Limits.tick_bound)
    parser.add_argument("--deadline", type=float, default=Limits.deadline)
    parser.add_argument(
        "--users",
        action="store_true",
        help="the service and the expert as real unprivileged users (root only)",
    )
    parser.add_argument(
        "--share",
        action="store_true",
        help="the drop root and the spool on the test share (scripts/netshare)",
    )
    parser.add_argument(
        "--shrink", action="store_true", help="stop at the first violation, shrink it, print it"
    )  # fmt: skip
    args = parser.parse_args()
    people, why = fuzz_site.NOBODY, fuzz_site.share_running() if args.share else ""
    if args.users and not why:
        try:
            people = fuzz_site.people(args.share)
        except RuntimeError as exc:
            why = f"no real users here: {exc}"
    if why:
        print(f"fuzz campaign skipped: {why}")
        return 0
    logs.configure("console", "warning")  # the seed model's training, in this process
    signal.signal(signal.SIGTERM, interrupted)
    base = Path(tempfile.mkdtemp(prefix="watchd-fuzz-"))
    base.chmod(0o755)  # the service and the expert reach the cases' folders in it
    who = "an unprivileged service and expert" if people.real else "this user"
    where = "the test share" if args.share else "local disk"
    print(f"fuzz campaign: {args.cases} cases of {args.family!r}, seed {args.seed}, as {who}, "
          f"on {where}, in {base}")  # fmt: skip
    limits = Limits(tick_bound=args.tick_bound, deadline=args.deadline)
    try:
        return campaign(args, base, limits, people)
    finally:  # also when interrupted, or when --shrink ends at a violation
        shutil.rmtree(base, ignore_errors=True)


def campaign(args: argparse.Namespace, base: Path, limits: Limits, people: fuzz_site.People) -> int:
    seed_registry = fault_campaign.train_seed_model(base)  # the fault campaign's tiny model
    scale = hostile.Scale(folders=3, images=4)
    control: list[str] = []
    if args.family in ("leases", "all"):
        control = control_conflict(base, seed_registry, limits, people, args.share)
        verdict = "VIOLATED: " + "; ".join(control) if control else "refused, exit 1: ok"
        print(f"control: a root held by another live watchd: {verdict}")
    outcomes: list[Outcome] = []

    @settings(max_examples=args.cases, database=None, deadline=None,
              phases=[Phase.generate, *([Phase.shrink] if args.shrink else [])],
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(scenarios(args.family, scale))
    def one(case: tuple[hostile.Hostile, ...]) -> None:
        where = Path(tempfile.mkdtemp(prefix="case-", dir=base))
        outcome = run_case(case, where, seed_registry, scale, limits, people, args.share)
        shutil.rmtree(where, ignore_errors=True)
        outcomes.append(outcome)
        verdict = "ok" if not outcome.violations else "VIOLATED: " + "; ".join(outcome.violations)
        verdict += f"\n  case: {case!r}" if outcome.violations else ""
        print(f"case {len(outcomes):4d}: {outcome.said()}, {outcome.seconds:5.1f} s, "
              f"slowest tick {outcome.slowest_tick:5.2f} s: {verdict}", flush=True)  # fmt: skip
        assert not (args.shrink and outcome.violations), outcome.violations

    hypothesis_seed(args.seed)(one)()
    violated = sum(1 for o in outcomes if o.violations)
    counts = sum((o.counts for o in outcomes), Counter())
    batches = sum((o.batches for o in outcomes), Counter())
    print(f"\ncases: {len(outcomes)}, folders: {sum(o.folders for o in outcomes)}, "
          f"batches: {', '.join(f'{s} {n}' for s, n in sorted(batches.items()))}, "
          f"cases with violations: {violated}, "
          f"violations: {sum(len(o.violations) for o in outcomes) + len(control)}")  # fmt: skip
    for line in tried(counts):
        print(line)
    return 1 if violated or control else 0


def control_conflict(
    base: Path, seed_registry: Path, limits: Limits, people: fuzz_site.People, share: bool
) -> list[str]:  # fmt: skip
    where = Path(tempfile.mkdtemp(prefix="conflict-", dir=base))
    site = fuzz_site.lay_out(where, seed_registry, people, share, **SECTIONS)
    try:
        return conflict(site, limits)
    finally:
        fuzz_site.remove_share(site)
        shutil.rmtree(where, ignore_errors=True)


def tried(counts: Counter[str]) -> list[str]:
    """What the intruders tried, by target and how it ended (every operation together)."""
    ended: dict[str, Counter[str]] = {}
    for key, n in counts.items():
        target, _, how = key.split("\t") if key.count("\t") == 2 else (key, "", "")
        ended.setdefault(target, Counter())[how] += n
    return [f"  {target}: " + ", ".join(f"{how} {n}" for how, n in sorted(ended[target].items()))
            for target in sorted(ended)]  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
