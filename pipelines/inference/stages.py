"""The inference job's stages run together: source (the workers read and decode ahead) →
device (the net, in this process) → finish (the workers label, measure and write) → commit
(masks made durable together, then their ledger lines).

The main process only steers: it asks the workers for runs of inputs (chunks) as their slabs
come free, feeds the net each chunk's images as soon as the chunk is read (the lowest first of
those read), in batches of one size, hands each chunk back to its worker once every image of it
has its mask, and passes what the workers finished to the :class:`Committer`. It waits only
when nothing is ready: for the device when a batch is in flight, for a worker otherwise; a
partial batch goes to an idle device rather than leave it waiting. No chunk read waits for one
before it: a slab is held only while its chunk is read, on the device or finished (what the
table and the ledger record does not depend on the order; the table is written in input
order). A run a worker cut short (its slab full) is asked for again, split into runs that fit,
before any later run, the lowest first: every slab that comes free reads a part of it, side by
side (docs/benchmarks.md, "Large images"). An image too large to decode whole is segmented
here, window by window (the ``tiled`` callback), when its chunk is taken.

How many images a run holds: a share of a batch at first (:func:`chunk_images`), then, once a
chunk is read, as many of its size as a slab holds, up to :data:`MAX_CHUNK_IMAGES`
(:func:`images_that_fit`): every hand-over costs the main process a message both ways and its
pickling, and a run cut short is read in two. Small images go in runs of 32 (a 2-CPU stand-in
job's main process: 0.35 CPU-ms per 256² image against 0.40–0.45 in runs of 4,
docs/benchmarks.md), large ones in runs that fit.

The workers start reading before the device is there (:meth:`Stages.ahead`): while the job's
main process imports torch and loads the model, each fills its slabs with the images the net
needs first.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from daemon.contract.heldfolder import HeldFolder
from daemon.contract.jobspec import InputFile, Problem
from pipelines.inference.durable import sync_filesystem
from pipelines.inference.pool import FINISH, READ, SLABS_PER_WORKER, ToFinish, Workers, raised
from pipelines.inference.slabs import Entry, layout
from pipelines.ledger import Ledger

if TYPE_CHECKING:  # torch: imported after the first fork, where it is needed
    from pipelines.inference.device import DeviceStage

COMMIT_SECONDS = 1.0  # masks finished are made durable and recorded at least this often …
COMMIT_IMAGES = 512  # … or once this many are waiting
MAX_CHUNK_IMAGES = 32  # images a worker reads at once, at most


class Committer:
    """Makes finished masks durable together (one syncfs, :mod:`pipelines.inference.durable`)
    and then records them in the ledger, in a thread of its own, every :data:`COMMIT_SECONDS`
    or :data:`COMMIT_IMAGES` images: the main process never waits for the disk. Counts the
    images done for the progress file (``tick``) in the same thread, after their commit."""

    def __init__(
        self, run: HeldFolder, ledger: Ledger, tick: Callable[[int], None], fsync_each: bool,
        provenance: dict[str, Any],
    ) -> None:  # fmt: skip
        self.run, self.ledger, self._tick, self.fsync_each = run, ledger, tick, fsync_each
        self.provenance = provenance  # of every row: the model's, the manifest's, the code's
        self.rows: dict[str, dict[str, Any]] = {}  # of the images recorded, by path
        self.pending: list[tuple[InputFile, str, dict[str, Any]]] = []
        self.since = time.monotonic()
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="committer")
        self.futures: deque[Future[None]] = deque()

    def add(self, item: InputFile, digest: str, stats: dict[str, Any]) -> None:
        """An image whose mask is written (not yet durable) and its measures."""
        self.pending.append((item, digest, {"path": item.path, **stats, **self.provenance}))
        if len(self.pending) >= COMMIT_IMAGES or time.monotonic() - self.since > COMMIT_SECONDS:
            self.flush()

    def tick(self, count: int = 1) -> None:
        """Images done that have nothing to commit (a problem, a region's share)."""
        self._submit(self._tick, count)

    def flush(self) -> None:
        if self.pending:
            self._submit(self._commit, self.pending)
        self.pending, self.since = [], time.monotonic()

    def _submit(self, work: Callable[..., None], *args: Any) -> None:
        self.futures.append(self.thread.submit(work, *args))
        while self.futures and self.futures[0].done():
            self.futures.popleft().result()  # a commit that failed fails the job here

    def _commit(self, done: list[tuple[InputFile, str, dict[str, Any]]]) -> None:
        if not self.fsync_each:
            sync_filesystem(self.run.fd)
        self.ledger.record_all([(item.path, digest, row) for item, digest, row in done])
        for item, _, row in done:
            self.rows[item.path] = row
        self._tick(len(done))

    def close(self) -> None:
        """Commit what is finished, wait for every commit; the first failure is raised."""
        try:
            self.flush()
            while self.futures:
                self.futures.popleft().result()
        finally:
            self.thread.shutdown(wait=True)


@dataclass
class Chunk:
    """A run of inputs ``first:end`` one worker reads into one of its slabs."""

    task: int
    worker: int
    slab: int
    first: int
    end: int
    entries: list[Entry] | None = None  # once read
    waiting: int = 0  # its images still on their way through the device
    consumed: bool = False  # every entry taken (to the device, or done with)
    confidences: dict[int, float] = field(default_factory=dict)


class Stages:
    """Steers a shard's whole images through the stages (see the module's docstring)."""

    device: DeviceStage  # (these three given to run)
    committer: Committer
    tiled: Callable[[InputFile], list[Problem]]

    def __init__(
        self, items: Sequence[InputFile], workers: Workers, whole: bool, chunk_images: int
    ) -> None:
        """``whole``: whether this job segments the images that are not too large to decode
        whole (a region's job other than the first does not)."""
        self.items, self.workers = items, workers
        self.whole, self.chunk_images = whole, chunk_images
        self.problems: list[Problem] = []
        self.next_read = 0  # the next input to ask for
        self.again: list[tuple[int, int]] = []  # runs a worker did not get to: a heap
        self.tasks: dict[int, Chunk] = {}
        self.read: list[tuple[int, int]] = []  # (first, task) of the chunks read, not taken: a heap
        self.pending: list[tuple[Chunk, Entry]] = []
        self.digests: dict[int, str] = {}
        self.asked = 0  # read tasks asked for: the next one's number

    def ahead(self) -> None:
        """Give every slab of every worker a run to read before the device is there (the main
        process imports torch and loads the model meanwhile): the shard spread over all slabs,
        up to :data:`MAX_CHUNK_IMAGES` a run. The first run read sizes those after it
        (:func:`images_that_fit`)."""
        slabs = self.workers.count * SLABS_PER_WORKER
        spread = min(MAX_CHUNK_IMAGES, -(-len(self.items) // slabs))
        self.chunk_images = max(self.chunk_images, spread)
        self._ask()

    def run(
        self, device: DeviceStage, committer: Committer, tiled: Callable[[InputFile], list[Problem]]
    ) -> list[Problem]:
        """Every input through ``device``, finished masks to ``committer``, ``tiled``: what
        segments an input too large to decode whole; the problems of those that could not be
        read."""
        self.device, self.committer, self.tiled = device, committer, tiled
        while not self._over():
            self._ask()
            if self._advance() or self._land(wait=False):
                continue
            replies = self.workers.replies(0)
            if not replies and self.pending and not self.device.busy:
                self._flush()  # an idle device gets what there is
                continue
            if not replies and self.device.busy:
                self._land(wait=True)
                continue
            for worker, reply in replies or self.workers.replies(None):
                self._reply(worker, reply)
        return self.problems

    def _over(self) -> bool:
        return (self.next_read >= len(self.items) and not self.again and not self.tasks
                and not self.device.busy)  # fmt: skip

    def _ask(self) -> None:
        """Give workers with a slab free the next runs of inputs to read."""
        while self.again or self.next_read < len(self.items):
            worker = self.workers.idlest()
            if worker is None:
                return
            if self.again:  # the lowest first: the one the device needs next, if any
                first, end = heapq.heappop(self.again)
            else:
                first = self.next_read
                end = self.next_read = min(first + self.chunk_images, len(self.items))
            task, self.asked = self.asked, self.asked + 1
            slab = self.workers.read(worker, task, [(i, self.items[i]) for i in range(first, end)])
            self.tasks[task] = Chunk(task, worker, slab, first, end)

    def _advance(self) -> bool:
        """Take the chunks read to the device, the lowest first; whether one was taken."""
        taken = bool(self.read)
        while self.read:
            chunk = self.tasks[heapq.heappop(self.read)[1]]
            assert chunk.entries is not None
            for entry in chunk.entries:
                self._take(chunk, entry)
            chunk.consumed = True
            self._maybe_finish(chunk)
        return taken

    def _take(self, chunk: Chunk, entry: Entry) -> None:
        if entry.problems or (not entry.tiled and not self.whole):
            self.problems += entry.problems
            self.committer.tick()
        elif entry.tiled:
            self._flush()
            self.problems += self.tiled(entry.item)
            self.committer.tick()
        else:
            if self.pending and self.pending[0][1].shape != entry.shape:
                self._flush()
            self.pending.append((chunk, entry))
            self.digests[entry.index] = entry.sha256
            chunk.waiting += 1
            if len(self.pending) >= self.device.batch_size(entry.shape):
                self._flush()

    def _flush(self) -> None:
        if not self.pending:
            return
        images = [self._slab(chunk).pixels(e.pixel_offset, e.shape) for chunk, e in self.pending]
        self.device.submit(images, self.pending)
        self.pending = []

    def _slab(self, chunk: Chunk) -> Any:
        return self.workers.slabs[chunk.worker][chunk.slab]

    def _land(self, wait: bool) -> bool:
        """Masks back from the device into their chunks' slabs; whether any came."""
        results = self.device.done(wait)
        for tag, masks, confidences in results:
            for (chunk, entry), mask, sure in zip(tag, masks, confidences, strict=True):
                self._slab(chunk).mask(entry.mask_offset, entry.shape)[...] = mask
                chunk.confidences[entry.index] = float(sure)
                chunk.waiting -= 1
                self._maybe_finish(chunk)
        return bool(results)

    def _maybe_finish(self, chunk: Chunk) -> None:
        """A chunk taken whole and back from the device goes to its worker to be finished."""
        if not chunk.consumed or chunk.waiting:
            return
        assert chunk.entries is not None
        work = [ToFinish(e.index, e.item.path, e.shape, e.pixel_offset, e.mask_offset,
                         chunk.confidences[e.index])
                for e in chunk.entries if e.index in chunk.confidences]  # fmt: skip
        if work:
            self.workers.finish(chunk.worker, chunk.task, chunk.slab, work)
        else:
            self._done(chunk)

    def _done(self, chunk: Chunk) -> None:
        self.workers.release(chunk.worker, chunk.slab)
        del self.tasks[chunk.task]

    def _reply(self, worker: int, reply: tuple[Any, ...]) -> None:
        kind, task = reply[0], reply[1]
        chunk = self.tasks[task]
        if kind == READ:
            _, _, size, entries = reply
            self.workers.slab(worker, chunk.slab, size)  # mapped again if it grew
            chunk.entries = entries
            if any(entry.tiled for entry in entries):
                self.workers.large_comes()
            read_to = entries[-1].index + 1
            self.chunk_images = images_that_fit(entries, self.workers.chunk_bytes,
                                                self.chunk_images)  # fmt: skip
            # the slab was full: the rest is asked for again, in runs that fit, so that every
            # slab that comes free reads a part of it side by side
            for first in range(read_to, chunk.end, self.chunk_images):
                heapq.heappush(self.again, (first, min(first + self.chunk_images, chunk.end)))
            chunk.end = min(chunk.end, read_to)
            heapq.heappush(self.read, (chunk.first, task))
            return
        assert kind == FINISH
        failed = []
        for index, row, failure in reply[2]:
            if failure is not None:
                failed.append(raised(failure))
            else:
                stats = {**row, "precision": self.device.precision}
                self.committer.add(self.items[index], self.digests.pop(index), stats)
        self._done(chunk)
        if failed:
            raise failed[0]  # the masks finished before it are committed as the job ends


def chunk_images(batch_size: int, workers: int) -> int:
    """Images a worker reads at once before any is seen: a share of a batch, at least 4, at
    most :data:`MAX_CHUNK_IMAGES`."""
    return int(np.clip(-(-batch_size // max(workers, 1)), 4, MAX_CHUNK_IMAGES))


def images_that_fit(entries: Sequence[Entry], budget: int, before: int) -> int:
    """Images a worker reads at once after a chunk of ``entries``: as many of its largest image
    as a worker reads into one slab without a cut (it stops after the image that reaches
    ``budget`` bytes), at most :data:`MAX_CHUNK_IMAGES`; ``before`` where the chunk has no
    pixels (problems, an image too large to decode whole)."""
    largest = max((layout([entry.shape])[2] for entry in entries if entry.shape), default=0)
    if not largest:
        return before
    return min(MAX_CHUNK_IMAGES, (budget - 1) // largest + 1)
