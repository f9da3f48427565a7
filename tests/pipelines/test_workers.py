"""The job's workers: real forked processes read the inputs ahead into shared slabs, in order,
whole, as an in-process read gives them (across chunks, with bad inputs among them, a chunk cut
short when its slab is full), finish masks from the same slabs, and a worker that dies or fails
is said so in the main process. They are the main process's children, forked from one that
imported their code, and die with it."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tifffile
from PIL import Image
from zarr.core.sync import cleanup_resources

from daemon.contract.heldfolder import HeldFolder, NotWritable, UnsafeEntry
from daemon.contract.jobspec import Identity, InputFile
from daemon.contract.names import INFERENCE, inference_params
from daemon.site.subprocesses import process_start_ticks
from pipelines.images import open_item, read_image_hashed
from pipelines.inference.masks import Rules
from pipelines.inference.pool import (
    FINISH,
    READ,
    WORKER_NICENESS,
    Setup,
    ToFinish,
    Workers,
    failure,
    raised,
)
from pipelines.inference.slabs import Entry
from pipelines.inference.slides import HalvePart, Held, RegionPart
from pipelines.instances import label_objects
from pipelines.omezarr import work_array
from pipelines.tiles import RegionReader, segment_region

MAX_PIXELS = 100 * 100


def read_mask(path: Path) -> np.ndarray:
    return tifffile.imread(path) if path.suffix == ".tif" else np.asarray(Image.open(path))


def _folder(batch_dir: Path) -> list[InputFile]:
    """Nine inputs (two chunks of four and one more): two sizes of grey PNG, a 16-bit RGB
    TIFF, a cut PNG, an unsupported suffix, a TIFF and a PNG too large to decode whole."""
    rng = np.random.default_rng(5)
    images = batch_dir / "images"
    images.mkdir(parents=True)
    for name, shape in (("a.png", (40, 60)), ("b.png", (40, 60)), ("c.png", (72, 48))):
        Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(images / name)
    tifffile.imwrite(images / "d.tif", rng.integers(0, 65536, (50, 30, 3), dtype=np.uint16))
    (images / "cut.png").write_bytes((images / "a.png").read_bytes()[:200])
    (images / "e.jpg").write_bytes(b"\xff\xd8\xff")
    tifffile.imwrite(images / "big.tif", rng.integers(0, 256, (128, 128), dtype=np.uint8))
    Image.fromarray(rng.integers(0, 256, (128, 128), dtype=np.uint8)).save(images / "big.png")
    Image.fromarray(rng.integers(0, 256, (33, 33), dtype=np.uint8)).save(images / "f.png")
    names = ["a.png", "cut.png", "b.png", "d.tif", "e.jpg", "big.tif", "c.png", "big.png", "f.png"]
    return [
        InputFile(f"images/{n}", hashlib.sha256((images / n).read_bytes()).hexdigest())
        for n in names
    ]


@pytest.fixture
def held(tmp_path: Path) -> Iterator[tuple[list[InputFile], HeldFolder, HeldFolder]]:
    """The inputs of :func:`_folder`, the batch folder and its run folder, held as a job
    holds them."""
    items = _folder(tmp_path / "batch")
    with HeldFolder.open(tmp_path / "batch") as batch, batch.folder("results", create=True) as run:
        yield items, batch, run


def read_all(
    workers: Workers, items: list[InputFile], chunk: int
) -> dict[int, tuple[Entry, np.ndarray | None, int]]:
    """Every input read by the workers, a chunk at a time, as the main process asks: by index,
    (entry, a copy of its pixels, the worker that read it); a chunk cut short is asked again."""
    runs = [(first, min(first + chunk, len(items))) for first in range(0, len(items), chunk)]
    asked: dict[int, tuple[int, int, int]] = {}
    found: dict[int, tuple[Entry, np.ndarray | None, int]] = {}
    while runs or asked:
        while runs and (worker := workers.idlest()) is not None:
            first, end = runs.pop(0)
            task = first
            asked[task] = (
                worker,
                workers.read(worker, task, list(enumerate(items))[first:end]),
                end,
            )
        for worker, (kind, task, size, entries) in workers.replies(None):
            assert kind == READ
            _, slab_number, end = asked.pop(task)
            slab = workers.slab(worker, slab_number, size)
            for entry in entries:
                pixels = slab.pixels(entry.pixel_offset, entry.shape) if entry.shape else None
                found[entry.index] = (entry, None if pixels is None else pixels.copy(), worker)
            if entries[-1].index + 1 < end:
                runs.insert(0, (entries[-1].index + 1, end))
            workers.release(worker, slab_number)
    return found


@pytest.mark.parametrize(("count", "chunk_bytes"), [(1, 2**20), (2, 2**20), (2, 20_000)],
                         ids=["one-worker", "two-workers", "slabs-cut-short"])  # fmt: skip
def test_workers_read_every_input_as_an_in_process_read_gives_it(
    tmp_path: Path, held: Any, count: int, chunk_bytes: int
) -> None:
    items, batch, run = held
    workers = Workers(count, Setup(batch, run, MAX_PIXELS, None, Rules(0, 0.0, False), chunk_bytes))
    try:
        found = read_all(workers, items, chunk=4)
    finally:
        workers.close()
    assert sorted(found) == list(range(len(items)))
    assert {worker for _, _, worker in found.values()} == set(range(count))
    by_name = {Path(entry.item.path).name: (entry, pixels) for entry, pixels, _ in found.values()}
    for name in ("a.png", "b.png", "c.png", "d.tif", "f.png"):
        expected, digest = read_image_hashed(tmp_path / "batch", by_name[name][0].item)
        entry, pixels = by_name[name]
        assert pixels is not None and pixels.dtype == np.float32
        np.testing.assert_array_equal(pixels, expected)
        assert entry.sha256 == digest and not entry.problems and not entry.tiled
    assert "cannot be decoded as PNG" in by_name["cut.png"][0].problems[0].message
    assert "is a '.jpg' file; watchd reads PNG and TIFF" in by_name["e.jpg"][0].problems[0].message
    assert by_name["big.tif"][0].tiled and by_name["big.tif"][1] is None
    assert "more than params.max_whole_pixels = 10 000" in by_name["big.png"][0].problems[0].message
    assert all(by_name[n][1] is None for n in ("cut.png", "e.jpg", "big.png"))


def test_a_worker_finishes_masks_from_its_slab_and_a_planted_entry_comes_back_as_such(
    tmp_path: Path, held: Any
) -> None:
    """The main process writes masks into the slab after the pixels; the worker labels,
    measures and writes them. A file planted where a folder of masks goes comes back as the
    UnsafeEntry it was, naming the entry and the folder it is in."""
    items, batch, run = held
    workers = Workers(1, Setup(batch, run, MAX_PIXELS, None, Rules(4, INFERENCE.split_neck, False)))
    try:
        found = read_all(workers, items[:4], chunk=4)  # a, cut, b, d (one chunk)
        assert workers.busy(0) == 0
        slab_number = workers.read(0, 7, [(i, items[i]) for i in range(4)])
        ((_, (_, _, size, entries)),) = workers.replies(None)
        slab = workers.slab(0, slab_number, size)
        work = []
        for entry in entries:
            if not entry.shape:
                continue
            probabilities = found[entry.index][1]
            assert probabilities is not None
            slab.mask(entry.mask_offset, entry.shape)[...] = probabilities > 0.5
            work.append(ToFinish(entry.index, entry.item.path, entry.shape, entry.pixel_offset,
                                 entry.mask_offset, 0.25))  # fmt: skip
        workers.finish(0, 7, slab_number, work)
        ((_, (kind, task, done)),) = workers.replies(None)
        assert (kind, task) == (FINISH, 7)
        assert [index for index, _, _ in done] == [0, 2, 3]
        for index, row, failure in done:
            probabilities = found[index][1]
            assert probabilities is not None
            labels = label_objects(probabilities, 0.5, 4, INFERENCE.split_neck)
            mask, objects = labels > 0, int(labels.max())
            assert failure is None and row is not None
            written = read_mask(tmp_path / "batch" / "results" / "masks" / items[index].path)
            assert np.array_equal(written > 0, mask) and row["objects"] == objects
            assert row["area_px"] == int(mask.sum()) and row["confidence"] == 0.25
        (tmp_path / "batch" / "results" / "masks" / "planted").write_text("not a folder")
        moved = dataclasses.replace(work[0], path="planted/a.png")
        workers.finish(0, 8, slab_number, [moved])
        ((_, (_, _, [(_, row, failure)])),) = workers.replies(None)
    finally:
        workers.close()
    assert row is None and failure is not None
    exc = raised(failure)
    assert isinstance(exc, UnsafeEntry) and exc.relative == "masks/planted"
    assert exc.path == tmp_path / "batch" / "results" / "masks" / "planted"


@pytest.mark.parametrize("unread", [False, True])
def test_a_worker_that_dies_is_said_so_and_the_others_are_stopped(held: Any, unread: bool) -> None:
    """Killed waiting for a request, or with one it never read (its pipe is then reset)."""
    _, batch, run = held
    workers = Workers(2, Setup(batch, run, MAX_PIXELS, None, Rules(0, 0.0, False)))
    try:
        if unread:
            os.kill(workers.processes[1].pid, signal.SIGSTOP)
            workers.read(1, 1, [])
        os.kill(workers.processes[1].pid, signal.SIGKILL)
        workers.processes[1].join()
        with pytest.raises(RuntimeError, match=r"worker 1 of the job died \(exit -9\)"):
            workers.replies(5)
    finally:
        workers.close()
    assert workers.processes == []


def _serving(workers: Workers) -> None:
    """Once each worker has answered a request."""
    for worker in range(workers.count):
        workers.read(worker, worker, [])
    answered: list[int] = []
    while len(answered) < workers.count:
        replies = workers.replies(10)
        assert replies, f"only workers {answered} answered within 10 s"
        answered += [worker for worker, _ in replies]
    assert sorted(answered) == list(range(workers.count))


def test_the_workers_yield_their_cpus_to_the_main_process(held: Any) -> None:
    """The main process steers and feeds the device: its work comes first on the job's CPUs."""
    _, batch, run = held
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    workers = Workers(2, Setup(batch, run, MAX_PIXELS, None, Rules(0, 0.0, False)))
    try:
        _serving(workers)  # (the workers set their priority before they serve)
        niceness = [os.getpriority(os.PRIO_PROCESS, p.pid or 0) for p in workers.processes]
    finally:
        workers.close()
    assert niceness == [min(mine + WORKER_NICENESS, 19)] * 2
    assert os.getpriority(os.PRIO_PROCESS, 0) == mine


def _waited_for(pid: int) -> bool:
    """Whether ``pid`` is no (longer a) child of this process: it was waited for."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return False


def test_the_workers_are_forked_from_one_that_imported_their_code_and_are_the_jobs_children(
    held: Any,
) -> None:
    """A first process imports the workers' code once, forks them and ends: they are then this
    process's own children (waited for, killed), and this process no longer adopts orphans."""
    _, batch, run = held
    libc = ctypes.CDLL(None, use_errno=True)
    subreaper = ctypes.c_int(-1)
    workers = Workers(2, Setup(batch, run, MAX_PIXELS, None, Rules(0, 0.0, False)))
    try:
        _serving(workers)
        pids = [process.pid for process in workers.processes]
        assert workers.forker_exit == 0 and _waited_for(workers.forker)
        assert all(os.waitpid(pid, os.WNOHANG) == (0, 0) for pid in pids)  # ours, running
        assert libc.prctl(37, ctypes.byref(subreaper), 0, 0, 0) == 0  # PR_GET_CHILD_SUBREAPER
    finally:
        workers.close()
    assert subreaper.value == 0
    assert all(_waited_for(pid) for pid in pids)


def test_workers_killed_while_the_forker_forks_are_the_ones_it_told_of(
    held: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """:meth:`Workers.kill` while the forker is between two forks (here held there): the
    forker is killed before it forks another, and the worker it had told of is killed and
    waited for, not lost with what was read before the forker ended."""
    _, batch, run = held
    job, fork, forks = os.getpid(), os.fork, []

    def slow_fork() -> int:
        if os.getpid() != job:  # the forker's: the second waits
            forks.append(1)
            if len(forks) >= 2:
                time.sleep(30)
        return fork()

    monkeypatch.setattr(os, "fork", slow_fork)
    workers = Workers(3, Setup(batch, run, MAX_PIXELS, None, Rules(0, 0.0, False)))
    try:
        assert wait([workers.told], 30)  # the first worker's pid
        time.sleep(0.1)
        workers.kill()
        assert [process.exitcode for process in workers.processes] == [-signal.SIGKILL]
        assert workers.forker_exit == -signal.SIGKILL
    finally:
        workers.close()
    assert _waited_for(workers.forker)


_JOB = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from daemon.contract.heldfolder import HeldFolder
    from pipelines.inference.masks import Rules
    from pipelines.inference.pool import Setup, Workers

    class Busy:  # a part that runs long: the worker is not waiting on its pipe
        def __call__(self, setup, predict):
            (Path(sys.argv[1]) / "busy" / str(os.getpid())).touch()
            time.sleep(120)

    with HeldFolder.open(sys.argv[1]) as batch, batch.folder("results", create=True) as run:
        Workers(2, Setup(batch, run, 100, None, Rules(0, 0.0, False))).parts([Busy(), Busy()])
""")


def test_a_job_killed_leaves_no_worker_running(tmp_path: Path) -> None:
    """The main process killed (SIGKILL: nothing of it runs) while its workers are busy: they
    die with it (``PR_SET_PDEATHSIG``, set once they are its children)."""
    busy = tmp_path / "batch" / "busy"
    busy.mkdir(parents=True)
    job = subprocess.Popen([sys.executable, "-c", _JOB, str(tmp_path / "batch")],
                           cwd=Path(__file__).resolve().parents[2])  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while len(workers := [int(path.name) for path in busy.iterdir()]) < 2:
            assert job.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        parents = {int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
                   for pid in workers}  # fmt: skip
        assert parents == {job.pid}  # the job's own children
        started = {pid: process_start_ticks(pid) for pid in workers}
    finally:
        job.kill()
        job.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if all(process_start_ticks(pid) != started[pid] for pid in workers):  # (a zombie: None)
            break
        time.sleep(0.05)
    assert all(process_start_ticks(pid) != started[pid] for pid in workers)


def test_failures_cross_the_pipe_as_what_they_were() -> None:
    """A planted entry, a refused write (full share) and the share gone keep their kind, errno
    and folder; anything else comes back as a RuntimeError carrying the worker's traceback."""
    unsafe = UnsafeEntry(errno.ELOOP, "masks/x", "is a symbolic link, not a folder")
    unsafe.folder = Path("/drop/b/results")
    back = raised(failure(unsafe))
    assert isinstance(back, UnsafeEntry) and str(back) == str(unsafe)
    assert back.path == Path("/drop/b/results/masks/x")
    full = raised(failure(NotWritable(errno.ENOSPC, "No space left on device", Path("/d/r"))))
    assert isinstance(full, NotWritable) and (full.errno, full.folder) == (
        errno.ENOSPC,
        Path("/d/r"),
    )
    gone = raised(failure(OSError(errno.ESTALE, "Stale file handle")))
    assert type(gone) is OSError and gone.errno == errno.ESTALE
    try:
        raise ValueError("a bug")
    except ValueError as exc:
        bug = raised(failure(exc))
    assert isinstance(bug, RuntimeError) and "ValueError: a bug" in str(bug)


def _grey_pngs(batch_dir: Path, count: int, shape: tuple[int, int], seed: int) -> list[InputFile]:
    """``count`` PNGs of random grey in ``batch_dir/images``, as the inputs of a shard."""
    rng = np.random.default_rng(seed)
    images = batch_dir / "images"
    images.mkdir(parents=True)
    items = []
    for number in range(count):
        path = images / f"{number:03d}.png"
        Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(path)
        items.append(
            InputFile(f"images/{path.name}", hashlib.sha256(path.read_bytes()).hexdigest())
        )
    return items


@contextlib.contextmanager
def _shard_run(
    batch_dir: Path, budget: int | None = None, device_stage: type | None = None
) -> Iterator[tuple[Workers, Any, Any]]:
    """Two real workers over ``batch_dir`` (slabs of ``budget`` bytes, else the job's), the
    committer of their masks, and a CPU device stage (of class ``device_stage``) with a small
    net, 4 images at once; the workers stopped and everything closed after."""
    import torch

    from models.unet import UNet
    from pipelines.inference.device import DeviceStage
    from pipelines.inference.placement import Placement
    from pipelines.inference.stages import Committer
    from pipelines.ledger import Ledger

    torch.manual_seed(0)
    rules = Rules(0, 0.0, False)
    setup = {} if budget is None else {"chunk_bytes": budget}
    with HeldFolder.open(batch_dir) as batch, batch.folder("results", create=True) as run, \
            batch.folder("work", create=True) as work:  # fmt: skip
        workers = Workers(2, Setup(batch, run, MAX_PIXELS, None, rules, **setup))
        ledger = Ledger(work, "shard-0000.jsonl", "0" * 64, {})
        committer = Committer(run, ledger, lambda count: None, False, {})
        net = UNet(depth=1, width=2).eval()
        device = (device_stage or DeviceStage)(net, Placement("cpu", 4, False, "test"), 0.5, rules)
        try:
            yield workers, committer, device
        finally:
            workers.close()  # (a hung main loop then ends on the closed pipes)
            committer.close()
            ledger.close()


def test_runs_cut_short_go_out_again_in_input_order_so_the_next_image_always_gets_a_slab(
    tmp_path: Path,
) -> None:
    """Images large for their slabs (two to a slab), more chunks than slabs: each chunk is cut
    short and its rest asked again, before any later run, the lowest first; no slab is held by
    a chunk that waits for another (a job of 1,024² images on a GPU hung so, when chunks went
    to the net in input order and rests were asked newest first: 7 workers, chunks of 10, 4
    images a slab). Every image is segmented, in a bounded time, as one chunk each would
    segment it."""
    import threading

    from pipelines.inference.stages import Stages

    items = _grey_pngs(tmp_path / "batch", 48, (40, 60), seed=3)
    found: list[Any] = []
    with _shard_run(tmp_path / "batch", 2 * (40 * 60 * 5) + 1) as (workers, committer, device):
        stages = Stages(items, workers, True, 10)
        thread = threading.Thread(
            target=lambda: found.append(stages.run(device, committer, lambda item: [])), daemon=True
        )
        thread.start()
        thread.join(60)
        hung = thread.is_alive()
    assert not hung, "the job's main loop waits forever: every slab is held by chunks ahead"
    assert found == [[]]
    assert sorted(committer.rows) == sorted(item.path for item in items)
    assert stages.chunk_images == 2, "later runs are not sized to what a slab holds"


def test_a_chunk_read_goes_to_the_net_at_once_and_a_cut_runs_rest_is_read_side_by_side(
    tmp_path: Path,
) -> None:
    """Large images (two to a slab) and the shard spread over every slab before any is read
    (runs of 6): every run is cut after 2 images. Each chunk read goes to the net at once, not
    after the images before it that are still unread (a 2-CPU job of 200 images of 1,024² had
    6 of its 8 slabs held so, by chunks waiting for the one slab that read the rest, and made
    83 images/s where one CPU made 67); each rest is asked again in runs that fit (2 images),
    so the slabs that come free read its parts side by side. Every image is segmented once."""
    from pipelines.inference.device import DeviceStage
    from pipelines.inference.stages import Stages

    class Recorded(DeviceStage):
        """The device stage, the images it was given recorded in the order it got them."""

        def submit(self, images: Any, tag: Any) -> None:
            given.extend(entry.index for _, entry in tag)
            super().submit(images, tag)

    given: list[int] = []
    items = _grey_pngs(tmp_path / "batch", 48, (40, 60), seed=7)
    budget = 2 * (40 * 60 * 5) + 1
    with _shard_run(tmp_path / "batch", budget, Recorded) as (workers, committer, device):
        stages = Stages(items, workers, True, 4)
        stages.ahead()  # 48 images over 8 slabs: runs of 6, each cut after 2
        replies: list[tuple[int, Any]] = []
        while len(replies) < 8:  # every slab's chunk read before the net is there
            replies += workers.replies(None)
        for worker, reply in replies:
            stages._reply(worker, reply)
        assert sorted(stages.read) == [(6 * k, task) for k, task in enumerate(range(8))]
        assert sorted(stages.again) == [(6 * k + part, 6 * k + part + 2)
                                        for k in range(8) for part in (2, 4)]  # fmt: skip
        assert stages.run(device, committer, lambda item: []) == []
    # the 8 chunks read went to the net first, none waiting for the rests before it
    assert given[:16] == [6 * k + image for k in range(8) for image in (0, 1)]
    assert sorted(given) == list(range(48))
    assert sorted(committer.rows) == sorted(item.path for item in items)


def test_the_workers_read_the_shard_spread_over_every_slab_before_the_device_is_there(
    tmp_path: Path,
) -> None:
    """While the job's main process imports torch and loads the model, every slab of every
    worker is given a run to read: the shard spread over them all, up to MAX_CHUNK_IMAGES a run,
    in input order. Read so, the shard then goes through the device whole, as without."""
    from pipelines.inference.pool import SLABS_PER_WORKER
    from pipelines.inference.stages import MAX_CHUNK_IMAGES, Stages

    items = _grey_pngs(tmp_path / "batch", 360, (24, 32), seed=5)
    with _shard_run(tmp_path / "batch") as (workers, committer, device):
        # 60 images over 8 slabs: runs of 8; 300: runs of MAX_CHUNK_IMAGES (32)
        for shard, run_images in ((items[:60], 8), (items[60:], MAX_CHUNK_IMAGES)):
            stages = Stages(shard, workers, True, 4)
            stages.ahead()
            runs = sorted((chunk.first, chunk.end) for chunk in stages.tasks.values())
            assert len(runs) == 2 * SLABS_PER_WORKER  # every slab of both workers
            assert runs == [(k * run_images, min((k + 1) * run_images, len(shard)))
                            for k in range(len(runs))]  # fmt: skip
            assert not workers.free[0] and not workers.free[1]
            assert stages.run(device, committer, lambda item: []) == []
    assert sorted(committer.rows) == sorted(item.path for item in items)


def test_runs_are_sized_to_what_a_slab_holds_of_the_last_chunks_largest_image() -> None:
    """Once a chunk is read, runs hold as many images as a worker reads into a slab without a
    cut (it stops after the image that reaches the budget), at most MAX_CHUNK_IMAGES: small
    images in long runs (fewer hand-overs), large ones in runs that are never cut; a chunk
    without pixels (problems, a slide) keeps the size before it."""
    from pipelines.inference.slabs import CHUNK_BYTES, layout
    from pipelines.inference.stages import MAX_CHUNK_IMAGES, images_that_fit

    item = InputFile("images/a.png", "0" * 64)

    def entries(*shapes: tuple[int, ...]) -> list[Entry]:
        return [Entry(k, item, (), "", False, shape, 0, 0) for k, shape in enumerate(shapes)]

    assert images_that_fit(entries((256, 256)), CHUNK_BYTES, 4) == MAX_CHUNK_IMAGES
    assert images_that_fit(entries((256, 256), (1024, 1024)), CHUNK_BYTES, 4) == 4
    assert images_that_fit(entries((4096, 4096)), CHUNK_BYTES, 4) == 1
    assert images_that_fit(entries(()), CHUNK_BYTES, 7) == 7
    one = layout([(40, 60)])[2]
    assert layout([(40, 60)] * 3)[2] == 3 * one  # the third reaches a budget of 3 × one …
    assert images_that_fit(entries((40, 60)), 3 * one, 10) == 3
    assert images_that_fit(entries((40, 60)), 3 * one + 1, 10) == 4  # … the fourth that of more


def _net(tiles: np.ndarray) -> np.ndarray:
    """A stand-in for the net: each window's own pixels as its probabilities."""
    return tiles.copy()


def test_workers_segment_a_large_images_regions_as_this_process_does_and_say_a_changed_file(
    held: Any,
) -> None:
    """Parts of a large image to two workers, after a read one of them has yet to answer: the
    region whose worker finds the file the job checked gives the record that this process's
    segment_region gives (its windows through the net here, in its slab), the other, told of
    another file, says it changed; the read's reply then comes to the stages as it was."""
    items, batch, run = held
    big = next(item for item in items if item.path == "images/big.tif")
    params = inference_params({"tile_size": 48, "tile_overlap": 8, "threshold": 0.5})
    with open_item(batch, big) as handle:
        seen = os.fstat(handle.fileno())
    true = {"size": seen.st_size, "mtime_ns": seen.st_mtime_ns}
    workers = Workers(2, Setup(batch, run, MAX_PIXELS, None, Rules(0, 0.0, False)))
    try:
        workers.read(0, 7, [(0, items[0])])  # its reply waits while the parts run
        with run.folder("masks/images", create=True) as masks:
            masks.mkdir("work")
            with masks.folder("work") as work:
                store, _ = work_array(work, 128, 128)
                store.close()
                made = os.fstat(work.fd)
        held = Held("work", Identity.of(made))
        parts = [RegionPart(big, true, held, 0, 1, params, 4),
                 RegionPart(big, {**true, "size": seen.st_size + 1}, held, 0, 1, params, 4)]  # fmt: skip
        record, problems = workers.parts(parts, _net)
        ((worker, reply),) = workers.replies(None)
    finally:
        workers.close()
    assert (worker, reply[0], reply[1]) == (0, READ, 7)
    assert [p.message for p in problems] == [
        "changed while it was being segmented (a region's read found another size or "
        "modification time)"
    ]
    with run.folder("masks/images") as masks:
        masks.mkdir("here")
        with masks.folder("here") as here, open_item(batch, big) as handle:
            store, ids = work_array(here, 128, 128)
            reader = RegionReader(handle, 48 + 512, None, 0.0, big.path)
            try:
                expected = segment_region(reader, _net, 0.5, ids, 0, 1, 48, 8, 4,
                                          rows_weigh=True)  # fmt: skip
            finally:
                reader.close()
                store.close()
    np.testing.assert_array_equal(record.parents, expected.parents)
    np.testing.assert_array_equal(record.measures, expected.measures)
    assert (record.first, record.end, record.certainty) == (
        expected.first, expected.end, expected.certainty
    )  # fmt: skip
    assert len(record.parents) > 2  # objects found, so the comparison means something
    try:
        assert np.array_equal(*(_ids(run, name) for name in ("work", "here")))
    finally:
        cleanup_resources()  # zarr's threads, which this process started


def _ids(run: HeldFolder, name: str) -> np.ndarray:
    """The provisional ids in the folder ``name`` of the run folder's masks/images."""
    with run.folder(f"masks/images/{name}") as folder:
        store, ids = work_array(folder, 128, 128)
        try:
            return np.asarray(ids[:, :])
        finally:
            store.close()


def test_a_temporary_folder_swapped_under_a_part_fails_it_and_every_worker_is_stopped(
    held: Any,
) -> None:
    """A part finds, under the name of the temporary folder the job made, another folder (its
    owner swapped one in): the worker writes nothing there and the job gets the entry named
    as unsafe, after every worker is killed (none writes on while the job cleans up)."""
    items, batch, run = held
    big = next(item for item in items if item.path == "images/big.tif")
    with run.folder("masks/images", create=True) as masks:
        masks.mkdir("work")
        with masks.folder("work") as work:
            made = os.fstat(work.fd)
    (run.path / "masks" / "images" / "work").rename(run.path / "masks" / "images" / "kept")
    (run.path / "masks" / "images" / "work").mkdir()  # the owner's, under the same name
    swapped = Held("work", Identity.of(made))
    workers = Workers(2, Setup(batch, run, MAX_PIXELS, None, Rules(0, 0.0, False)))
    try:
        with pytest.raises(UnsafeEntry, match="work' was replaced while the job wrote in it"):
            workers.parts([HalvePart(big, swapped, 1, [(0, 0)]),
                           HalvePart(big, swapped, 1, [(0, 1)])])  # fmt: skip
        assert all(process.exitcode is not None for process in workers.processes)
    finally:
        workers.close()
    assert list((run.path / "masks" / "images" / "work").iterdir()) == []
