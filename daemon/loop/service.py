"""The service: the one imperative shell around the pure planner.

Start-up: migrate, start watching, catch up by scanning every root, re-adopt live jobs (their
handles are in the store; the next poll asks the executor about them). Then tick: drain the
watcher's events, look at waiting inputs, poll live jobs, plan, act, write status files,
heartbeat. Signal handlers only set a flag; this thread alone changes state.

Shutdown is bounded and ordered: stop watching, stop submitting, keep recording what running
jobs report for up to the grace period, then log what was left running (it is re-adopted at
the next start).
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from daemon.contract.jobspec import Problem
from daemon.core import readiness
from daemon.core.owners import Accounts
from daemon.core.planner import BatchView, Policy, Snapshot, opens_work, plan
from daemon.core.readiness import NotReady
from daemon.core.records import Batch, Job
from daemon.core.states import BatchState, JobState
from daemon.executors import Executor
from daemon.loop import reporter
from daemon.loop.acting import Actor, Effects
from daemon.loop.dispatch import Dispatcher
from daemon.loop.endings import Endings
from daemon.loop.inputs import input_folders
from daemon.loop.intake import Intake, LookAgain
from daemon.loop.metrics import Metrics
from daemon.loop.notify import Notifier
from daemon.loop.pulse import Pulse, roots_info
from daemon.loop.selfservice import SelfService
from daemon.loop.waitroom import WaitRoom
from daemon.site.claims import Claims
from daemon.site.config import Config
from daemon.store import Store
from daemon.watcher import FolderTouched, RootLost, Wake, Watcher, WatchEvent, scan_root

log = structlog.get_logger("watchd")

Clock = Callable[[], float]
SCAN_CHUNK = 500  # folders compared with the store at once by the catch-up scan


@dataclass(frozen=True)
class Parts:
    """What the service runs, built from the configuration and the executor by
    :func:`daemon.loop.factory.build_service` (tests and scripts build theirs the same way)."""

    config: Config
    claims: Claims
    executor: Executor
    store: Store
    events: queue.Queue[WatchEvent]  # the watcher's news and wake-ups, read by the loop
    watcher: Watcher
    intake: Intake
    waitroom: WaitRoom
    dispatch: Dispatcher
    actor: Actor
    endings: Endings
    metrics: Metrics
    policy: Policy
    timing: readiness.Timing
    notifier: Notifier
    clock: Clock
    stop: threading.Event  # asks for shutdown, shared with the executor's retries
    # the site's table of owners: turns, caps, quotas
    accounts: Accounts = field(default_factory=Accounts)
    selfservice: SelfService | None = None  # owners cancelling their own batches


class Service:
    def __init__(self, parts: Parts) -> None:
        self.config = config = parts.config
        self.claims, self.executor, self.store = parts.claims, parts.executor, parts.store
        self.events, self.watcher, self.intake = parts.events, parts.watcher, parts.intake
        self.waitroom, self.dispatch, self.actor = parts.waitroom, parts.dispatch, parts.actor
        self.endings, self.metrics, self.policy = parts.endings, parts.metrics, parts.policy
        self.timing, self.notifier, self.clock = parts.timing, parts.notifier, parts.clock
        self.accounts, self.selfservice = parts.accounts, parts.selfservice
        self.pulse = Pulse(
            self.store, self.notifier, self.metrics, config.daemon.heartbeat_seconds,
            lambda: {
                "executor": self.executor.name,
                **roots_info(self.watcher.modes, self._lost_roots),
                "held_elsewhere": self.claims.describe_refused(),
            },
        )  # fmt: skip
        self.stop_requested = parts.stop
        self.force_stop = threading.Event()
        self._deferred: list[LookAgain] = []
        self._dirty: set[int] = set()
        self._lost_roots: set[Path] = set()
        self._to_release: deque[tuple[float, str, str]] = deque()  # (when, root, folder)
        self.paused: frozenset[str] = frozenset()  # drop roots an operator paused
        self._next_rescan = 0.0
        self._next_renewal = 0.0
        self._submitting = True

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        now = self.clock()
        self.executor.wake_on_end(lambda: self.events.put(Wake()))
        self.pulse.started_at = now
        modes = self.watcher.start(skip=self.claims.refused)
        for path, mode in modes.items():
            log.info("watching", root=str(path), mode=mode.value)
        self._self_test()
        self.paused = self.store.paused_roots()
        self._apply_root_intents(now)
        self.catch_up(now)
        live = self.store.jobs(states=[JobState.SUBMITTED, JobState.RUNNING])
        if live:
            log.info("re-adopting jobs", jobs=[j.name for j in live])
        self.pulse.beat(now, force=True)
        self.metrics.serve(self.config.metrics)
        self.endings.start()
        self.pulse.ready()
        log.info("started", pid=os.getpid(), executor=self.executor.name, live_jobs=len(live))

    def _self_test(self) -> None:
        """Say at start-up whether jobs can run; the daemon starts either way (batches are taken
        in and wait until the executor answers)."""
        for check in self.executor.self_test():
            (log.info if check.ok else log.warning)(
                "self-test", check=check.name, ok=check.ok, detail=check.detail
            )

    def _apply_root_intents(self, now: float) -> None:
        """Pauses and resumes asked for while the daemon was down take effect before the first
        scan, so a paused root's new manifests are not taken in at start-up."""
        intents = tuple(i for i in self.store.pending_intents() if i.batch_id is None)
        snapshot = Snapshot(
            now=now, policy=self.policy, intents=intents, submitting=False,
            paused_roots=self.paused,
        )  # fmt: skip
        self._apply(self.actor.carry_out(plan(snapshot), now), now)

    def request_stop(self) -> None:
        """Called from a signal handler: the first asks for a graceful stop, a second forces."""
        if self.stop_requested.is_set():
            self.force_stop.set()
        self.stop_requested.set()

    def run(self) -> None:
        """Start, tick until asked to stop, shut down within the grace period."""
        self.start()
        try:
            while not self.stop_requested.is_set():
                self._wait_for_work(self.pulse.until_ping(self.config.daemon.tick_seconds))
                if not self.stop_requested.is_set():
                    self._tick_safely()
        finally:
            self.shutdown()

    def _tick_safely(self) -> None:
        """A tick that raised is logged and the loop goes on: the next tick starts from what
        the store holds (a bug must not take the daemon down for everyone)."""
        try:
            self.tick(self.clock())
        except Exception:
            log.exception("tick failed")
            self.stop_requested.wait(self.config.daemon.tick_seconds)

    def _wait_for_work(self, timeout: float) -> None:
        """Sleep until the next tick, waking early when the watcher has news."""
        try:
            event = self.events.get(timeout=timeout)
        except queue.Empty:
            return
        self.events.put(event)

    def shutdown(self) -> None:
        now = self.clock()
        self.notifier.stopping("stopping: waiting for running jobs")
        log.info("stopping", grace_seconds=self.config.daemon.shutdown_grace_seconds)
        self.watcher.stop()
        self._submitting = False
        deadline = now + self.config.daemon.shutdown_grace_seconds
        while self._live_jobs() and self.clock() < deadline and not self.force_stop.is_set():
            time.sleep(min(0.5, self.config.daemon.tick_seconds))
            self.tick(self.clock())
        left = self._live_jobs()
        if left:
            names = [j.name for j in left]
            log.warning("left running", count=len(left), jobs=names[:20],
                        note="re-adopted at next start")  # fmt: skip
        self.endings.close(self.clock(), self.config.mail.timeout_seconds)
        self.waitroom.close()
        self.metrics.close()
        self.pulse.beat(self.clock(), force=True, stopped=True)
        self.executor.close()
        self.store.close()
        self.claims.release()
        log.info("stopped")

    def _live_jobs(self) -> list[Job]:
        return self.store.jobs(states=[JobState.SUBMITTED, JobState.RUNNING])

    def idle(self) -> bool:
        """Nothing to do and nothing in flight: no active batch, no news, nothing deferred."""
        return (
            self.events.empty()
            and not self._deferred
            and not self._dirty
            and not self.store.active_batches()
        )

    # -- one tick ----------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        touched = self._drain(now)
        if self.selfservice is not None:
            self.selfservice.look(self.store.active_batches(), touched, now)
        if now >= self._next_rescan:
            self.catch_up(now)
        self.dispatch.deliver_cancels()  # before any submission: a retried job may wait on one
        snapshot = self._snapshot(now)
        actions = plan(snapshot)
        self._apply(self.actor.carry_out(actions, now), now)
        if opens_work(actions):
            self.events.put(Wake())  # the next stage, retry or job goes out now, not in a tick
        self._write_statuses(now)
        for ended in self.endings.follow(now):
            self._ended(ended, now)
        self._release_ended(now)
        self._renew_leases(now)
        self.pulse.beat(now)
        self.pulse.ping(now)

    def _drain(self, now: float) -> set[tuple[str, str]]:
        """Take in what the watcher reported and what was deferred; the folders touched."""
        touched: dict[tuple[Path, str], None] = {}
        while True:
            try:
                event = self.events.get_nowait()
            except queue.Empty:
                break
            if isinstance(event, FolderTouched):
                touched[(event.root, event.folder)] = None
            elif isinstance(event, RootLost):
                self._root_lost(event.root)
        due = [d for d in self._deferred if d.at <= now]
        self._deferred = [d for d in self._deferred if d.at > now]
        for d in due:
            touched[(d.root, d.folder)] = None
        for root, folder in touched:
            self.waitroom.touched(str(root), folder)
            self._look(root, folder, now)
        for section in self.config.roots:
            for folder in self.watcher.arrived(section.path):
                self.waitroom.arrived(str(section.path), folder)
        return {(str(root), folder) for root, folder in touched}

    def _suspended(self) -> frozenset[str]:
        """The drop roots that take in and submit nothing now: those an operator paused and
        those another daemon holds (taken back when it lets them go)."""
        return self.paused | {str(root) for root in self.claims.refused}

    def _look(self, root: Path, folder: str, now: float) -> None:
        if str(root) in self._suspended():
            return  # the manifest waits on disk; the catch-up at resume finds it
        try:
            looked = self.intake.look(root, folder, now)
        except Exception:  # one bad folder never stops the loop
            log.exception("intake failed", root=str(root), folder=folder)
            self.metrics.intake_errors.inc()
            return
        if looked.taken is not None:
            self._taken(looked.taken)
        if looked.again is not None:
            self._deferred.append(looked.again)

    def catch_up(self, now: float) -> None:
        """Scan every root for manifests that events did not announce; re-arm lost roots."""
        self._next_rescan = now + self.config.daemon.rescan_seconds
        for root in self.config.roots:
            if root.path in self.claims.refused:
                continue  # another daemon holds it: neither watched nor scanned
            if root.path in self._lost_roots or not self.watcher.armed(root.path):
                if not self.watcher.arm(root):
                    self._root_lost(root.path)
                elif root.path in self._lost_roots:
                    self._lost_roots.discard(root.path)
                    log.info("drop root back", root=str(root.path))
            if str(root.path) in self._suspended():
                continue
            started = time.monotonic()
            try:
                found = self._scan(root.path, now)
            except OSError as exc:
                if root.path not in self._lost_roots:  # a lost root was said once already
                    log.warning("cannot scan drop root", root=str(root.path), error=str(exc))
                continue
            seconds = time.monotonic() - started
            self.metrics.scanned(root.path, seconds)
            log.debug("scanned", root=str(root.path), folders=found, seconds=round(seconds, 4))

    def _scan(self, root: Path, now: float) -> int:
        """Look at the folders whose manifest changed, a few hundred at a time; how many there
        are. Raises OSError if the root cannot be listed."""
        found = scan_root(root)
        count = 0
        while chunk := list(itertools.islice(found, SCAN_CHUNK)):
            count += len(chunk)
            for folder in self.intake.changed(root, chunk):
                self._look(root, folder, now)
        return count

    # -- which batch folders are watched ------------------------------------------------------

    def _taken(self, batch: Batch) -> None:
        """Intake recorded (or looked again at) a batch: its status file is due; a folder with
        a batch under way is watched for a changed manifest."""
        self._dirty.add(batch.id)
        if not batch.state.terminal:
            self.watcher.follow(Path(batch.root), batch.folder)
        manifest = self.waitroom.manifest(batch) if batch.state is BatchState.WAITING else None
        if manifest is not None:  # files landing there bring its next check forward
            self.watcher.watch_inputs(Path(batch.root), batch.folder, input_folders(manifest))

    def _ended(self, batch: Batch, now: float) -> None:
        linger = self.config.intake.watch_ended_seconds
        self._to_release.append((now + linger, batch.root, batch.folder))

    def _release_ended(self, now: float) -> None:
        """Stop watching the folders whose batch ended ``watch_ended_seconds`` ago and has no
        newer revision under way: the watches follow the batches under way, not the share."""
        while self._to_release and self._to_release[0][0] <= now:
            _, root, folder = self._to_release.popleft()
            latest = self.store.latest_revision(root, folder)
            if latest is None or latest.state.terminal:
                self.watcher.release(Path(root), folder)

    def _root_lost(self, root: Path) -> None:
        if root not in self._lost_roots:
            self._lost_roots.add(root)
            log.warning("drop root unavailable", root=str(root), note="retried at each rescan")
            self._next_rescan = min(self._next_rescan, self.clock() + 5.0)

    def _renew_leases(self, now: float) -> None:
        """Every heartbeat. A root whose lease another daemon took (this one stalled for longer
        than the lease) is its now: this daemon takes in and submits nothing more there, and
        goes on with its other roots. A root held elsewhere that is free again is taken back
        and scanned at once."""
        if now < self._next_renewal:
            return
        self._next_renewal = now + self.config.daemon.heartbeat_seconds
        lost, back = self.claims.renew(now)
        for root in lost:
            self.watcher.disarm(root)
        changed = {str(root) for root in (*lost, *back)}
        self._dirty.update(b.id for b in self.store.active_batches() if b.root in changed)
        if back:
            self._next_rescan = now

    # -- the snapshot ------------------------------------------------------------------------

    def _snapshot(self, now: float) -> Snapshot:
        intents = tuple(self.store.pending_intents())
        batches = {b.id: b for b in self.store.active_batches()}
        for intent in intents:
            if intent.batch_id is not None and intent.batch_id not in batches:
                batches[intent.batch_id] = self.store.batch(intent.batch_id)
        jobs = self.store.jobs(batch_ids=list(batches))
        by_batch: dict[int, list[Job]] = {}
        for job in jobs:
            by_batch.setdefault(job.batch_id, []).append(job)
        views = tuple(self._view(b, by_batch.get(b.id, ()), now) for b in batches.values())
        watched = [
            b
            for b in self.store.batches_watching_inputs(now - self.timing.timeout_seconds)
            if b.id not in batches
        ]
        self.waitroom.keep({*batches, *(b.id for b in watched)})
        views += tuple(
            BatchView(b, self.waitroom.manifest(b), inputs_changed=True)
            for b in watched
            if self._inputs_changed(b, now)
        )
        live = [j for j in jobs if j.state.live]
        slots = self.executor.slots()
        free = None if slots is None else slots - len(live)
        seen = self.dispatch.observe(live)
        self._dirty |= self.dispatch.take_progressed()  # the status files say images done
        return Snapshot(
            now=now, policy=self.policy, batches=views, seen=seen, intents=intents,
            free_slots=free, submitting=self._submitting, paused_roots=self.paused,
            held_elsewhere=frozenset(str(root) for root in self.claims.refused),
            accounts=self.accounts,
            quotas=self.store.quotas_of(batches.values(), self.accounts, now),
        )  # fmt: skip

    def _view(self, batch: Batch, jobs: Iterable[Job], now: float) -> BatchView:
        try:
            verdict, changed = self.waitroom.verdict(batch, now)
        except Exception as exc:  # a bug looking at one batch's inputs must not stop the loop
            log.exception("cannot check inputs", batch_id=batch.id, folder=batch.folder)
            problem = Problem("inputs", f"cannot be checked: {exc}", "tell an operator")
            verdict, changed = NotReady((problem,), "internal error while checking inputs"), True
        if changed:
            self._dirty.add(batch.id)
        return BatchView(batch, self.waitroom.manifest(batch), tuple(jobs), verdict)

    def _inputs_changed(self, batch: Batch, now: float) -> bool:
        try:
            return self.waitroom.inputs_changed(batch, now)
        except Exception:
            log.exception("cannot check inputs", batch_id=batch.id, folder=batch.folder)
            return False

    # -- pausing a drop root ------------------------------------------------------------------

    def _apply(self, effects: Effects, now: float) -> None:
        """What a round of actions did that the loop acts on: status files due; a paused root
        changes what the loop takes in, and a resumed one is scanned at once."""
        self._dirty |= effects.touched
        for action in effects.roots:
            self.paused = self.store.paused_roots()
            # The status files of its batches say whether they are held.
            self._dirty.update(b.id for b in self.store.active_batches() if b.root == action.root)
            if not action.paused:
                self._next_rescan = now  # the next tick's catch-up takes in what waited

    # -- status files and heartbeat ------------------------------------------------------------

    def _write_statuses(self, now: float) -> None:
        dirty, self._dirty = self._dirty, set()
        for batch_id in dirty:
            reporter.publish(
                self.store, batch_id, self.waitroom.waits_for(batch_id), self.timing, now
            )
