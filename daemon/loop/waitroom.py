"""The waiting room: batches waiting for their inputs, looked at on a schedule.

Keeps, per batch, when its inputs are next looked at, the settle record (what was seen and
since when it has been unchanged) and what it still waits for (for its status file), plus the
parsed manifests of the batches it looks at. Also looks, once a minute at most, at the inputs
of batches that failed because they were incomplete at the timeout: a change revives them.
State is in memory only: after a restart the settle period simply starts again.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from daemon.contract.errors import ManifestError
from daemon.contract.jobspec import Problem
from daemon.contract.names import is_store
from daemon.core import readiness
from daemon.core.manifest import Manifest, parse_manifest
from daemon.core.records import Batch
from daemon.core.states import BatchState
from daemon.loop import inputs

INLINE_INPUTS = 2_000  # a batch with more inputs is looked at off the loop thread


@dataclass(frozen=True)
class Schedule:
    check_seconds: float  # a waiting batch's inputs are looked at this often
    revive_seconds: float  # a batch failed for incomplete inputs, this often
    max_pattern_entries: int = inputs.MAX_PATTERN_ENTRIES  # looked at by one check's patterns
    max_check_seconds: float = 30.0  # checks that see no change back off up to this

    def interval(self, quiet: int) -> float:
        """The time to the next check after ``quiet`` checks in a row that saw no change."""
        return min(self.check_seconds * 2.0 ** min(quiet, 30), self.max_check_seconds)


@dataclass(frozen=True)
class _Looked:
    """One check's result: what was seen, what the next check may take from it, and whether
    it looked at everything (the verification a batch passes before it is queued)."""

    seen: readiness.InputsSeen
    memory: inputs.Memory
    verified: bool
    at: float  # when the check began: what it saw is judged as of then


class WaitRoom:
    def __init__(
        self,
        timing: readiness.Timing,
        schedule: Schedule,
        text: Callable[[int], str],
        wake: Callable[[Batch], None] = lambda batch: None,
    ) -> None:
        """``text``: a batch's manifest text, by id (the store's; read once per batch);
        ``wake``: called from the checking thread when a batch's check is done (the loop
        picks its result up at once instead of at the next tick)."""
        self.text = text
        self.wake = wake
        self.timing = timing
        self.schedule = schedule
        self._manifests: dict[int, Manifest] = {}
        self._settle: dict[int, readiness.Settle] = {}
        self._next_check: dict[int, float] = {}
        self._last_check: dict[int, float] = {}  # when its last check began
        self._waiting: dict[int, tuple[Problem, ...]] = {}
        self._memory: dict[int, inputs.Memory] = {}  # absent: the next check looks at all
        self._quiet: dict[int, int] = {}  # checks in a row that saw no change
        self._looking: dict[int, Future[_Looked]] = {}  # checks under way off the loop thread
        self._folders: dict[tuple[str, str], int] = {}  # (root, folder) → batch waiting there
        self._pool: ThreadPoolExecutor | None = None

    def manifest(self, batch: Batch) -> Manifest | None:
        """The batch's manifest, parsed once (the store keeps its text); None if it has none
        or it no longer parses (a database from an older watchd, a rule tightened since)."""
        try:
            return self.parsed(batch)
        except ManifestError:
            return None

    def parsed(self, batch: Batch) -> Manifest | None:
        """Like ``manifest``, but a manifest that no longer parses raises ManifestError."""
        if batch.id not in self._manifests and batch.kind is not None:
            self._manifests[batch.id] = parse_manifest(self.text(batch.id).encode())
        return self._manifests.get(batch.id)

    def verdict(self, batch: Batch, now: float) -> tuple[readiness.Verdict | None, bool]:
        """A verdict on a waiting batch whose check is due (None when not due, or while its
        check runs off the loop thread), and whether what it waits for changed (its status
        file needs writing)."""
        if batch.state is not BatchState.WAITING:
            return None, False
        try:
            manifest = self.parsed(batch)
        except ManifestError as exc:
            return readiness.NotReady(exc.problems, "manifest refused"), True
        if manifest is None:
            return None, False
        for _ in range(2):  # a check, then (if it finds the batch ready) the verification
            looked = self._looked(batch, manifest, now)
            if looked is None:
                return None, False
            verdict = self._judge(batch, manifest, looked, now)
            if verdict is not None:
                return verdict
        return None, False

    def _looked(self, batch: Batch, manifest: Manifest, now: float) -> _Looked | None:
        """A check's result if one is ready: a large batch's runs off the loop thread, so the
        loop (heartbeats, watchdog pings, other batches) never waits for one batch's share."""
        under_way = self._looking.get(batch.id)
        if under_way is not None:
            if not under_way.done():
                return None
            del self._looking[batch.id]
            return under_way.result()
        if now < self._next_check.get(batch.id, 0.0):
            return None
        self._next_check[batch.id] = now + self.schedule.check_seconds
        self._last_check[batch.id] = now
        self._folders[(batch.root, batch.folder)] = batch.id
        memory = self._memory.get(batch.id)
        if self._inline(manifest):
            return self._look(batch.path, manifest, memory, now)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="watchd-inputs")
        future = self._pool.submit(self._look, batch.path, manifest, memory, now)
        future.add_done_callback(lambda _: self.wake(batch))
        self._looking[batch.id] = future
        return None

    def _look(
        self, folder: Path, manifest: Manifest, memory: inputs.Memory | None, now: float
    ) -> _Looked:
        entries = self.schedule.max_pattern_entries
        seen, learnt = inputs.check(folder, manifest, entries, memory)
        return _Looked(seen, learnt, verified=memory is None, at=now)

    @staticmethod
    def _inline(manifest: Manifest) -> bool:
        """Whether a check of the batch is small enough for the loop thread: a few listed
        inputs, no pattern and no OME-Zarr store (whose walks may look at up to
        ``max_pattern_entries`` entries each)."""
        return (
            len(manifest.files) <= INLINE_INPUTS
            and not manifest.patterns
            and not any(is_store(f.path) for f in manifest.files)
        )

    def _judge(
        self, batch: Batch, manifest: Manifest, looked: _Looked, now: float
    ) -> tuple[readiness.Verdict, bool] | None:
        """The verdict on what a check saw, or None when it found the batch ready without
        looking at everything: then the verification is due at once."""
        previous = self._settle.get(batch.id)
        verdict = readiness.assess(
            manifest, looked.seen, previous, batch.updated_at, looked.at, self.timing
        )
        self._memory[batch.id] = looked.memory
        if isinstance(verdict, readiness.Ready) and not looked.verified:
            self._memory.pop(batch.id)  # one look at everything before it is queued
            self._next_check[batch.id] = now
            return None
        changed = False
        if isinstance(verdict, readiness.Waiting):
            self._settle[batch.id] = verdict.settle
            changed = verdict.problems != self._waiting.get(batch.id)
            self._waiting[batch.id] = verdict.problems
            self._back_off(batch.id, verdict, previous, now)
        return verdict, changed

    def _back_off(
        self,
        batch_id: int,
        verdict: readiness.Waiting,
        previous: readiness.Settle | None,
        now: float,
    ) -> None:
        """A batch still waiting for files, where nothing changed since the last check, is
        looked at less often (up to ``max_check_seconds``); one settling is not."""
        unchanged = previous is not None and verdict.settle == previous
        quiet = self._quiet.get(batch_id, 0) + 1 if unchanged and verdict.problems else 0
        self._quiet[batch_id] = quiet
        later = now + self.schedule.interval(quiet)
        if not verdict.problems:  # all there, settling: looked at again the moment it may be
            later = min(later, max(now, verdict.settle.since + self.timing.settle_seconds))
        self._next_check[batch_id] = later

    def touched(self, root: str, folder: str) -> None:
        """Something happened in a waiting batch's folder (a watcher event): look at once."""
        batch_id = self._folders.get((root, folder))
        if batch_id is not None:
            self._next_check[batch_id] = 0.0
            self._quiet.pop(batch_id, None)

    def arrived(self, root: str, folder: str) -> None:
        """Inputs landed in a waiting batch's folders (:meth:`daemon.watcher.Watcher.arrived`):
        its next check comes ``check_seconds`` after its last at the latest, however far
        its checks had backed off while nothing came (no sooner: a copy under way would be
        looked at for every file)."""
        batch_id = self._folders.get((root, folder))
        if batch_id is None or batch_id not in self._next_check:
            return
        self._quiet.pop(batch_id, None)
        soon = self._last_check.get(batch_id, 0.0) + self.schedule.check_seconds
        self._next_check[batch_id] = min(self._next_check[batch_id], soon)

    def close(self) -> None:
        """Wait for a check under way off the loop thread, and end that thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def inputs_changed(self, batch: Batch, now: float) -> bool:
        """For a batch failed with incomplete inputs: have they changed since?"""
        manifest = self.manifest(batch)
        if manifest is None or now < self._next_check.get(batch.id, 0.0):
            return False
        self._next_check[batch.id] = now + self.schedule.revive_seconds
        seen = inputs.observe(batch.path, manifest, self.schedule.max_pattern_entries)
        return seen.folder_ok and readiness.fingerprint(seen) != batch.watch_inputs

    def waits_for(self, batch_id: int) -> tuple[Problem, ...]:
        return self._waiting.get(batch_id, ())

    def _tables(self) -> tuple[dict[int, Any], ...]:
        return (
            self._manifests, self._settle, self._next_check, self._waiting, self._memory,
            self._quiet, self._looking, self._last_check,
        )  # fmt: skip

    def keep(self, batch_ids: set[int]) -> None:
        """Forget every batch but these (the active ones and those still watched)."""
        for table in self._tables():
            for batch_id in [i for i in table if i not in batch_ids]:
                del table[batch_id]
        for where in [w for w, i in self._folders.items() if i not in batch_ids]:
            del self._folders[where]

    def moved(self, batch: Batch) -> None:
        """The batch changed state: its settle record and schedule start again."""
        for table in self._tables()[1:]:
            table.pop(batch.id, None)
        if batch.state.terminal and not batch.watch_inputs:
            self._manifests.pop(batch.id, None)
