"""The job's workers: processes that read the shard's images ahead of the net (the source
stage) and finish their masks behind it (the finish stage), as many as the job has CPUs.

They start when the job starts, before its main process imports torch (which they never
need) and loads the model. A first process is forked, imports the code of the workers' stages
once (Pillow, libpng, scipy, scikit-image: ~0.5 s, which the main process never needs), side by
side with the main process's torch, forks the workers from there (they share the pages of that
code) and ends. The main process is the *subreaper* of its descendants from before that fork
until it waits for that first process (as the workers stop, at the job's end), so the workers
become its children, as if it had forked them. They read the images the net needs
first while the model loads. They run at a lower priority than the main process
(:data:`WORKER_NICENESS`): on a job's CPUs, the main process's work (its imports at the start,
then steering and the device) is the one path every image waits for, and the workers' work is
the slack around it. They hold what the job holds (the batch folder, the run folder:
descriptors, so every read and write goes by :mod:`daemon.contract.heldfolder`'s rule) and their
slabs of shared memory (:mod:`pipelines.inference.slabs`). Each has a pipe to the main process
and serves its requests in order: *read* a run of inputs into a slab, *finish* the images of a
slab whose masks the main process wrote there. A chunk stays with the worker that read it: its
finish needs its pixels (for the statistics), which are still in its slab. A worker dies with
the job (``PR_SET_PDEATHSIG``, set once it is the main process's child): killed, the job leaves
nothing running.

An image too large to decode whole is segmented by the workers side by side
(:mod:`pipelines.inference.slides`), each asked for a *part* of a pass over it
(:meth:`Workers.parts`): a callable the worker runs, such as one region of the image's rows,
whose windows it sends, in a slab of its own, to the main process for the net, which sends back
their probabilities in the same slab. Replies to the requests asked before the parts wait
for the stages (:meth:`Workers.replies`).

Failures cross the pipe as what they were: an entry planted under ``results/`` as
:class:`UnsafeEntry` (the job fails with it as an INPUT problem), a write the results folder's
filesystem refused as :class:`NotWritable` (the owner's problem too), another OS error as an
OSError with its errno (the share gone: the job is retried), anything else as a RuntimeError
carrying the worker's traceback (INTERNAL).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, Pipe, wait
from pathlib import Path
from typing import Any

import numpy as np

from daemon.contract.heldfolder import HeldFolder, NotWritable, UnsafeEntry
from daemon.contract.jobspec import InputFile
from pipelines.inference.masks import MaskFolders, Rules
from pipelines.inference.slabs import CHUNK_BYTES, Slab
from pipelines.job import importing_late

READ, FINISH, STOP, FAILED = "read", "finish", "stop", "failed"
PART, WINDOWS, LARGE = "part", "windows", "large"
SLABS_PER_WORKER = 4  # chunks a worker has at once: reading, waiting for the net, finishing
# Added to a worker's nice value (from the job's): the main process, which steers the stages
# and feeds the device the chunks read, gets a CPU first when it has work; the workers take
# whatever it leaves (docs/benchmarks.md)
WORKER_NICENESS = 10
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_PID_BYTES = 4
_forkers = 0  # of this process's Workers whose forker is not yet waited for: it adopts orphans
_STOP_SECONDS = 10.0


@dataclass(frozen=True)
class Setup:
    """What every worker is given (inherited through the fork, not sent)."""

    batch: HeldFolder
    run: HeldFolder
    max_pixels: int
    channel: Any
    rules: Rules
    chunk_bytes: int = CHUNK_BYTES


@dataclass(frozen=True)
class ToFinish:
    """One image of a chunk for the finish stage: where its pixels and mask lie in the slab."""

    index: int
    path: str
    shape: tuple[int, ...]
    pixel_offset: int
    mask_offset: int
    confidence: float


Failure = tuple[str, Any]  # (kind, details), see :func:`failure` and :func:`raised`
Predict = Callable[[np.ndarray], np.ndarray]  # windows (N, h, w) → their probabilities
Part = Callable[[Setup, Predict], Any]  # a part of a pass, run by a worker (picklable)


def failure(exc: BaseException) -> Failure:
    """An exception as it crosses the pipe."""
    if isinstance(exc, UnsafeEntry):
        return "unsafe", (exc.errno, exc.relative, exc.what, str(exc.folder or ""))
    if isinstance(exc, NotWritable):
        return "unwritable", (exc.errno, exc.strerror, str(exc.folder))
    if isinstance(exc, OSError) and exc.errno is not None:
        return "os", (exc.errno, exc.strerror, exc.filename)
    return "internal", "".join(traceback.format_exception(exc))


def raised(found: Failure) -> BaseException:
    """The exception a failure from a worker stands for, in the main process."""
    kind, details = found
    if kind == "unsafe":
        code, relative, what, folder = details
        exc = UnsafeEntry(code, relative, what)
        exc.folder = Path(folder) if folder else None
        return exc
    if kind == "unwritable":
        code, text, folder = details
        return NotWritable(code, text, Path(folder))
    if kind == "os":
        code, text, name = details
        return OSError(code, text, name) if name else OSError(code, text)
    return RuntimeError(f"a worker of the job failed:\n{details}")


def _prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"prctl({option}): {os.strerror(code)}")


def _die_with_parent(parent: int) -> None:
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the job ended before the line above
        os._exit(1)


def _fork_workers(
    conns: list[Connection], slabs: list[list[Slab]], windows: list[Slab], setup: Setup,
    parent: int, telling: int,
) -> None:  # fmt: skip
    """The first process of the workers: imports their stages' code once, forks them from
    here, says each one's pid on ``telling`` and ends (they become the main process's
    children). What fails here is told to the main process on every worker's pipe."""
    _die_with_parent(parent)
    os.nice(WORKER_NICENESS)
    code = 1
    try:
        with importing_late():  # side by side with the main process's torch
            import pipelines.inference.finish
            import pipelines.inference.source  # noqa: F401
        forker = os.getpid()
        for number, conn in enumerate(conns):
            pid = os.fork()
            if pid == 0:
                try:
                    os.close(telling)
                    for other in conns:
                        if other is not conn:
                            other.close()
                    _serve(conn, slabs[number], windows[number], setup, parent, forker)
                finally:
                    os._exit(1)
            os.write(telling, pid.to_bytes(_PID_BYTES, "little"))
        code = 0
    except BaseException as exc:
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.send((FAILED, failure(exc)))
    finally:
        os._exit(code)


def _finish_all(
    finish_image: Callable[..., dict[str, Any]], masks: MaskFolders, slab: Slab,
    work: Sequence[ToFinish], rules: Rules,
) -> list[tuple[int, dict[str, Any] | None, Failure | None]]:  # fmt: skip
    done: list[tuple[int, dict[str, Any] | None, Failure | None]] = []
    for image in work:
        try:
            row = finish_image(masks, image.path, slab.pixels(image.pixel_offset, image.shape),
                               slab.mask(image.mask_offset, image.shape), image.confidence,
                               rules)  # fmt: skip
        except Exception as exc:
            done.append((image.index, None, failure(exc)))
            continue
        done.append((image.index, row, None))
    return done


class _Stopped(Exception):
    """A worker waiting for probabilities was told to stop: the job is failing."""


def _remote(conn: Connection, slab: Slab) -> Predict:
    """The net, for a part in a worker: its windows go to the main process in ``slab``, and
    their probabilities come back in it (valid until the next call)."""

    def predict(tiles: np.ndarray) -> np.ndarray:
        slab.grow(tiles.nbytes)
        slab.pixels(0, tiles.shape)[...] = tiles
        conn.send((WINDOWS, tiles.shape, slab.size))
        if conn.recv()[0] != WINDOWS:
            raise _Stopped
        return slab.pixels(0, tiles.shape)  # the probabilities, in place

    return predict


def _serve(
    conn: Connection, slabs: list[Slab], windows: Slab, setup: Setup, parent: int, forker: int
) -> None:
    """A worker's life: serve the main process's requests until it says stop or is gone."""
    while os.getppid() == forker:  # until the forker has ended: then the main process's child
        time.sleep(0.001)
    _die_with_parent(parent)
    masks = MaskFolders(setup.run)
    try:
        from pipelines.inference.finish import finish_image  # (imported before the fork)
        from pipelines.inference.source import read_chunk

        while True:
            request = conn.recv()
            if request[0] == STOP:
                break
            if request[0] == READ:
                _, task, slab, items = request
                entries = read_chunk(setup.batch, items, slabs[slab], setup.max_pixels,
                                     setup.channel, setup.chunk_bytes)  # fmt: skip
                conn.send((READ, task, slabs[slab].size, entries))
            elif request[0] == LARGE:  # a large image comes: its code (zarr) imported ahead
                import pipelines.inference.slides  # noqa: F401
            elif request[0] == PART:  # (its class's module imported as it is unpickled)
                _, task, part = request
                conn.send((PART, task, part(setup, _remote(conn, windows))))
            else:
                _, task, slab, work = request
                conn.send((FINISH, task, _finish_all(finish_image, masks, slabs[slab], work,
                                                     setup.rules)))  # fmt: skip
    except (EOFError, _Stopped):
        pass  # the job is gone, or failing
    except BaseException as exc:
        with contextlib.suppress(OSError):
            conn.send((FAILED, failure(exc)))
    finally:
        masks.close()
        sys.stdout.flush()
        os._exit(0)  # nothing of the job's (atexit, buffers) runs twice


def _adopting(change: int) -> None:
    """This process adopts orphaned descendants while a forker of its is not yet waited for
    (``change``: +1 as one starts, -1 once waited for)."""
    global _forkers
    _forkers += change
    if _forkers == (1 if change > 0 else 0):
        _prctl(_PR_SET_CHILD_SUBREAPER, int(_forkers > 0))


class _Process:
    """A worker, seen from the main process (its parent once the forker has ended)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.exitcode: int | None = None

    def poll(self) -> int | None:
        if self.exitcode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.exitcode = os.waitstatus_to_exitcode(status)
        return self.exitcode

    def join(self) -> None:
        """Wait for its end (called once it is ending: its end of a pipe closed)."""
        if self.exitcode is None:
            self.exitcode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])

    def kill(self) -> None:
        if self.poll() is None:  # (not yet reaped: its pid is still its own)
            os.kill(self.pid, signal.SIGKILL)


def _closed(end: Connection | int, deadline: float | None, came: bytes = b"") -> tuple[bool, bytes]:
    """Whether the other end of ``end`` (a worker's pipe, its replies dropped, or the forker's
    pids) was closed by ``deadline`` (every process holding it has ended or is ending), and
    what came through it, after ``came``."""
    while wait([end], None if deadline is None else max(0.0, deadline - time.monotonic())):
        try:
            said = end.recv_bytes() if isinstance(end, Connection) else os.read(end, 4096)
        except (EOFError, ConnectionResetError):  # (reset: it was killed with replies unread)
            return True, came
        if not said:
            return True, came
        came += said
    return False, came


class Workers:
    """The job's worker processes, seen from the main process."""

    def __init__(self, count: int, setup: Setup) -> None:
        self.slabs = [[Slab.make() for _ in range(SLABS_PER_WORKER)] for _ in range(count)]
        self.free = [list(range(SLABS_PER_WORKER)) for _ in range(count)]
        self.windows = [Slab.make() for _ in range(count)]  # a part's windows, each worker's
        self.deferred: list[tuple[int, Any]] = []  # replies that came while parts ran
        self.large_told = False  # told that a large image comes
        self.chunk_bytes = setup.chunk_bytes  # a chunk's bytes, at which a worker stops reading
        self.conns: list[Connection] = []
        theirs: list[Connection] = []
        for _ in range(count):
            ours, mine = Pipe(duplex=True)
            self.conns.append(ours)
            theirs.append(mine)
        parent = os.getpid()
        sys.stdout.flush()
        sys.stderr.flush()
        self.told, telling = os.pipe()
        _adopting(1)  # the workers, orphaned by the forker, come here
        try:
            self.forker = os.fork()
        except OSError:
            _adopting(-1)
            os.close(self.told)
            os.close(telling)
            raise
        if self.forker == 0:
            try:
                os.close(self.told)
                for conn in self.conns:
                    conn.close()
                _fork_workers(theirs, self.slabs, self.windows, setup, parent, telling)
            finally:
                os._exit(1)
        os.close(telling)
        for conn in theirs:
            conn.close()
        self.forker_exit: int | None = None
        self._processes: list[_Process] | None = None  # known once the forker has ended

    @property
    def processes(self) -> list[_Process]:
        """The workers (known once the forker has ended: waited for)."""
        return self._adopt(None)

    def _adopt(self, timeout: float | None) -> list[_Process]:
        """The workers, once the forker has ended (waited for up to ``timeout``, then killed):
        its children are this process's from there."""
        if self._processes is None:
            forker = _Process(self.forker)
            deadline = None if timeout is None else time.monotonic() + timeout
            ended, told = _closed(self.told, deadline)
            if not ended:  # (a worker it forked but had not yet told of is lost with it)
                forker.kill()
                _, told = _closed(self.told, None, told)
            forker.join()
            _adopting(-1)
            self.forker_exit = forker.exitcode
            os.close(self.told)
            pids = [told[at : at + _PID_BYTES] for at in range(0, len(told), _PID_BYTES)]
            self._processes = [_Process(int.from_bytes(pid, "little")) for pid in pids]
        return self._processes

    @property
    def count(self) -> int:
        return len(self.conns)

    def busy(self, worker: int) -> int:
        """The chunks ``worker`` holds (read, waiting for the net, or finishing)."""
        return SLABS_PER_WORKER - len(self.free[worker])

    def idlest(self) -> int | None:
        """The worker with the fewest chunks in hand, if one has a slab free."""
        worker = min(range(self.count), key=self.busy)
        return worker if self.free[worker] else None

    def read(self, worker: int, task: int, items: Sequence[tuple[int, InputFile]]) -> int:
        """Ask ``worker`` to read ``items`` (index, input) into a free slab of its: which."""
        slab = self.free[worker].pop()
        self.conns[worker].send((READ, task, slab, list(items)))
        return slab

    def large_comes(self) -> None:
        """Tell every worker, once, that an image too large to decode whole comes: each
        imports the code for it (zarr, the window readers) before its parts are asked for
        (one worker alone is given none: :func:`pipelines.inference.slides.parts`)."""
        if not self.large_told and self.count > 1:
            self.large_told = True
            for conn in self.conns:
                conn.send((LARGE,))

    def finish(self, worker: int, task: int, slab: int, work: Sequence[ToFinish]) -> None:
        self.conns[worker].send((FINISH, task, slab, list(work)))

    def release(self, worker: int, slab: int) -> None:
        self.free[worker].append(slab)

    def slab(self, worker: int, slab: int, size: int) -> Slab:
        """The main process's mapping of a slab, following the size its worker gave it."""
        found = self.slabs[worker][slab]
        found.follow(size)
        return found

    def replies(
        self, timeout: float | None, kinds: frozenset[str] | None = None
    ) -> list[tuple[int, Any]]:
        """(worker, reply) of every reply waiting, after waiting up to ``timeout`` for one;
        those of other ``kinds`` kept for the next call without kinds (which has them first,
        without waiting)."""
        if kinds is None and self.deferred:
            found, self.deferred = self.deferred, []
            return found
        ready = set(wait(self.conns, timeout))
        found = []
        for worker, conn in enumerate(self.conns):
            if conn not in ready:
                continue
            try:
                reply: Any = conn.recv()
            except (EOFError, ConnectionResetError):  # (reset: it died with requests unread)
                ended = self._end(worker)
                raise RuntimeError(f"worker {worker} of the job died ({ended})") from None
            if reply[0] == FAILED:
                raise raised(reply[1])
            if kinds is not None and reply[0] not in kinds:
                self.deferred.append((worker, reply))
                continue
            found.append((worker, reply))
        return found

    def parts(self, parts: Sequence[Part], predict: Predict | None = None) -> list[Any]:
        """Each of ``parts`` to a worker of its own, their windows through ``predict`` (the
        net, in this process), each worker's batch as it asks (so as one process batches
        them), the first worker's first before any other (the batch a GPU's precision is
        decided on: :mod:`pipelines.inference.placement`): what each part gave back, in order.
        Should it fail, every worker is killed before the failure is raised: none writes on
        while the caller cleans up."""
        if len(parts) > self.count:
            raise ValueError(f"{len(parts)} parts for {self.count} workers")
        try:
            return self._parts(parts, predict)
        except BaseException:
            self.kill()
            raise

    def _parts(self, parts: Sequence[Part], predict: Predict | None) -> list[Any]:
        for worker, part in enumerate(parts):
            self.conns[worker].send((PART, worker, part))
        results: dict[int, Any] = {}
        asked: list[tuple[int, np.ndarray]] = []
        first = True  # the first worker's first batch not yet run
        while len(results) < len(parts):
            for worker, reply in self.replies(None, frozenset((PART, WINDOWS))):
                if reply[0] == PART:
                    results[reply[1]] = reply[2]
                    first = first and worker != 0  # no windows from it: no order to keep
                    continue
                if predict is None:
                    raise RuntimeError(f"worker {worker} asked for the net, and none was given")
                self.windows[worker].follow(reply[2])
                asked.append((worker, self.windows[worker].pixels(0, reply[1])))
            if first and asked:
                if all(worker != 0 for worker, _ in asked):
                    continue
                asked.sort(key=lambda ask: ask[0] != 0)
                first = False
            for worker, windows in asked:
                assert predict is not None
                windows[...] = predict(windows)
                self.conns[worker].send((WINDOWS,))
            asked = []
        return [results[number] for number in range(len(parts))]

    def _end(self, worker: int) -> str:
        """How ``worker``, whose pipe was closed, ended (the forker had: it held the pipe)."""
        if worker >= len(self.processes):
            return f"never forked: the process forking them ended with exit {self.forker_exit}"
        self.processes[worker].join()
        return f"exit {self.processes[worker].exitcode}"

    def kill(self) -> None:
        """Kill every worker now (what they were doing is lost; :meth:`close` still frees
        the rest)."""
        processes = self._adopt(0.0)  # the forker, if it has not ended, killed first
        for process in processes:
            process.kill()
        for process in processes:
            process.join()

    def close(self) -> None:
        """Stop the workers (each after the request in hand) and free the slabs."""
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send((STOP,))
        deadline = time.monotonic() + _STOP_SECONDS
        for process, conn in zip(self._adopt(_STOP_SECONDS), self.conns, strict=False):
            if not _closed(conn, deadline)[0]:
                process.kill()
            process.join()
        for conn in self.conns:
            conn.close()
        for slab in [s for slabs in self.slabs for s in slabs] + self.windows:
            slab.close()
        self.conns, self._processes, self.slabs, self.windows = [], [], [], []
