"""The waiting room: batches waiting for their inputs, looked at on a schedule.

Keeps, per batch, when its inputs are next looked at, the settle record (what was seen and
since when it has been unchanged) and what it still waits for (for its status file), plus the
parsed manifests of the batches it looks at. Also looks, once a minute at most, at the inputs
of batches that failed because they were incomplete at the timeout: a change revives them.
State is in memory only: after a restart the settle period simply starts again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from daemon import inputs, readiness
from daemon.errors import ManifestError
from daemon.jobspec import Problem
from daemon.manifest import Manifest, parse_manifest
from daemon.records import Batch
from daemon.states import BatchState


@dataclass(frozen=True)
class Schedule:
    check_seconds: float  # a waiting batch's inputs are looked at this often
    revive_seconds: float  # a batch failed for incomplete inputs, this often
    max_pattern_entries: int = inputs.MAX_PATTERN_ENTRIES  # looked at by one check's patterns


class WaitRoom:
    def __init__(
        self, timing: readiness.Timing, schedule: Schedule, text: Callable[[int], str]
    ) -> None:
        """``text``: a batch's manifest text, by id (the store's; read once per batch)."""
        self.text = text
        self.timing = timing
        self.schedule = schedule
        self._manifests: dict[int, Manifest] = {}
        self._settle: dict[int, readiness.Settle] = {}
        self._next_check: dict[int, float] = {}
        self._waiting: dict[int, tuple[Problem, ...]] = {}

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
        """A verdict on a waiting batch whose check is due (None when not due), and whether
        what it waits for changed (its status file needs writing)."""
        if batch.state is not BatchState.WAITING:
            return None, False
        try:
            manifest = self.parsed(batch)
        except ManifestError as exc:
            return readiness.NotReady(exc.problems, "manifest refused"), True
        if manifest is None:
            return None, False
        if now < self._next_check.get(batch.id, 0.0):
            return None, False
        self._next_check[batch.id] = now + self.schedule.check_seconds
        seen = inputs.observe(batch.path, manifest, self.schedule.max_pattern_entries)
        verdict = readiness.assess(
            manifest, seen, self._settle.get(batch.id), batch.updated_at, now, self.timing
        )
        changed = False
        if isinstance(verdict, readiness.Waiting):
            self._settle[batch.id] = verdict.settle
            changed = verdict.problems != self._waiting.get(batch.id)
            self._waiting[batch.id] = verdict.problems
        return verdict, changed

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

    def keep(self, batch_ids: set[int]) -> None:
        """Forget every batch but these (the active ones and those still watched)."""
        for table in (self._manifests, self._settle, self._next_check, self._waiting):
            for batch_id in [i for i in table if i not in batch_ids]:
                del table[batch_id]

    def moved(self, batch: Batch) -> None:
        """The batch changed state: its settle record and schedule start again."""
        self._settle.pop(batch.id, None)
        self._waiting.pop(batch.id, None)
        self._next_check.pop(batch.id, None)
        if batch.state.terminal and not batch.watch_inputs:
            self._manifests.pop(batch.id, None)
