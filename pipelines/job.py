"""The shell every pipeline runs in: ``python -m pipelines.<name> JOB_DIR``.

:func:`run_job` reads ``JOB_DIR/spec.json`` (only where ``JOB_DIR`` lies in a private spool,
:func:`daemon.contract.spool.private_problem`: a spec someone else could have written is never
trusted), sets the thread count and the allocator
(:func:`keep_freed_memory`), calls the pipeline's work function, and as its last act writes
``JOB_DIR/result.json`` atomically:

- the work function returned a summary → ``ok``, exit status 0;
- it raised :class:`InputError` (bad data, every problem listed) → kind INPUT, exit status 2;
- it raised :class:`models.registry.ModelError` → kind MODEL, exit status 2;
- anything else → kind INTERNAL with the traceback (the daemon may retry), exit status 1.

The inference, assembly and report jobs then end the process at once (:func:`main`), without
Python's own ending (~0.1 s a job with torch loaded).

In a job of several processes (DDP ranks, see :mod:`pipelines.fitting`) only rank 0 writes
result.json; the work function returns None on the other ranks.

Every write a job makes under the batch folder goes through :func:`run_folder`, the run folder
held from the batch folder down (:mod:`daemon.contract.heldfolder`): a link, FIFO or file that the
owner planted where the job needs a folder is refused (:class:`UnsafeEntry`, kind INPUT, naming the
entry), never followed; one planted at a file name the job writes is replaced by the job's own
file (the link itself, never its target). Only what is meant for the owner goes there (masks,
tables, the report). What jobs hand each other (shard tables, ledgers, a slide's work arrays,
training's files, trials) goes into the run's work folder in the spool (:func:`work_folder`),
and result.json into the job folder: the owner can neither read nor swap any of it.

Progress goes to stdout as plain timestamped lines; the executor sends it to ``log.txt``.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import logging
import os
import platform
import resource
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NoReturn

from daemon.contract.heldfolder import (
    FOLDER_REPLACED,
    FolderReplaced,
    HeldFolder,
    NotWritable,
    UnsafeEntry,
    unwritable_problem,
)
from daemon.contract.jobspec import (
    RESULT_FILE,
    SPEC_FILE,
    ErrorKind,
    JobError,
    JobResult,
    JobSpec,
    Pipeline,
    Problem,
)
from daemon.contract.spool import make_private, private_problem
from daemon.contract.usage import USAGE_KEY, Meter
from daemon.contract.version import code_version
from models.catalog import ModelError

log = logging.getLogger("pipelines")

# The work gets the batch folder held (:func:`hold_batch`): its inputs are read through it.
Work = Callable[[JobSpec, Path, HeldFolder], Mapping[str, Any] | None]

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_REFUSED = 2  # INPUT or MODEL: running it again cannot help

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters, glibc's malloc.h
MAX_SPEC_BYTES = 256 << 20  # a spec lists its inputs: 55,000 of them take some 10 MB
_KEEP_FREED_BYTES = 512 * 2**20
_HEAP_BLOCKS_UP_TO = 32 * 2**20  # glibc's largest mmap threshold on 64-bit
_imports_frozen = False  # this process froze the imports it made with the collector off


class InputError(Exception):
    """The batch's data is wrong; carries every problem found, each with its location."""

    def __init__(self, message: str, problems: Iterable[Problem] = ()) -> None:
        super().__init__(message)
        self.message = message
        self.problems = tuple(problems)


def configure_logging() -> None:
    """Timestamped lines on stdout; warnings go through logging; Lightning's chatter is muted."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%Y-%m-%dT%H:%M:%S")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    logging.getLogger("lightning").setLevel(logging.WARNING)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.captureWarnings(True)


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to keep up to 512 MiB of freed memory and to serve blocks up to
    32 MiB from the heap; False where that is not glibc. By default it hands a forward pass's
    freed activations back to the system and the next pass page-faults them in again: on the
    development machine the bare U-Net forward pass ran ~50 % faster with this (1.5 M page
    faults over 288 images without it, at most a few thousand with it; docs/benchmarks.md).
    Memory a job frees stays its own until it ends (but see :func:`give_back_freed_memory`)."""
    libc = _glibc()
    if libc is None:
        return False
    kept = libc.mallopt(_M_TRIM_THRESHOLD, _KEEP_FREED_BYTES)
    return bool(kept and libc.mallopt(_M_MMAP_THRESHOLD, _HEAP_BLOCKS_UP_TO))


def settle_collector() -> int:
    """Where the job's imports ran with the cyclic garbage collector off (:mod:`pipelines`),
    freeze what they made (the collector never goes over it again, not at the job's end
    either) and turn the collector back on: how many objects were frozen (0: nothing done)."""
    return gc.get_freeze_count() if _freeze() else 0


def _freeze() -> bool:
    """Freeze what was made with the collector off and turn it on: whether it was off. Never
    counts what is frozen: ``gc.get_freeze_count`` walks every frozen object (15–30 ms once
    torch is imported, on the development machine)."""
    global _imports_frozen
    if gc.isenabled():
        return False
    gc.freeze()
    gc.enable()
    _imports_frozen = True
    return True


@contextlib.contextmanager
def importing_late() -> Iterator[None]:
    """Imports a job makes after it started, made as its first were: where those ran with the
    collector off and were frozen (:func:`settle_collector`), these too, and what they made is
    frozen after them. The inference job imports torch so, once its workers, which never need
    it, are forked; and each worker the code of its stages (:mod:`pipelines.inference.pool`).
    Imported any other way (tests, benchmarks, a job forked from a warm start, whose launcher
    imported its code: nothing frozen here), nothing changes."""
    if not _imports_frozen:
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        _freeze()


def give_back_freed_memory() -> None:
    """Hand the free pages inside the heap back to the system (glibc's ``malloc_trim``).
    Segmenting a whole-slide image, each row of windows allocates and frees blocks of many
    sizes around long-lived ones, and the heap's free memory is neither handed back nor all
    reused: on a strip 100,000 pixels wide the one-task job's resident set grew from 1.4 to
    6.4 GB over 4,096 rows (with or without :func:`keep_freed_memory`), and stayed near
    1.6 GB trimmed every two seconds. Called once per row of windows (hundreds of windows at
    that width), the next forward pass faults back in only what it needs."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def process_rank(environ: Mapping[str, str]) -> int:
    """This process's rank in a multi-process job: 0 unless Lightning or Slurm says otherwise."""
    ranks = (environ.get(key, "0") for key in ("RANK", "SLURM_PROCID", "LOCAL_RANK", "NODE_RANK"))
    return max((int(value) for value in ranks if value.isdigit()), default=0)


class UntrustedSpec(Exception):
    """The job folder is not in a private spool: its spec may be anyone's."""


def read_spec(job_dir: Path) -> JobSpec:
    """The spec in ``job_dir``, which must be a private folder of this user; the spec must be
    this very folder's (its work folder and job name lead here)."""
    problem = private_problem(job_dir)
    if problem:
        raise UntrustedSpec(f"the job folder is not the service's alone, its spec is not read: "
                            f"{problem}")  # fmt: skip
    with HeldFolder.open(job_dir) as held, held.open_read(SPEC_FILE) as handle:
        spec = JobSpec.from_json(handle.read(MAX_SPEC_BYTES).decode("utf-8"))
    if Path(os.path.abspath(spec.job_dir)) != Path(os.path.abspath(job_dir)):
        raise UntrustedSpec(f"the spec in {job_dir} is the spec of {spec.job_dir}")
    return spec


def hold_batch(spec: JobSpec) -> HeldFolder:
    """The batch folder, held for the job's life if it is still the folder the batch was taken
    in from: one moved away and replaced under the same name is never read (an INPUT problem)."""
    try:
        return HeldFolder.open(spec.batch_dir, spec.batch_identity)
    except FolderReplaced:
        hint = "the new folder is taken in as a batch of its own; this one cannot go on"
        problem = Problem("batch folder", "was replaced by another folder of the same name", hint)
        raise InputError(FOLDER_REPLACED, [problem]) from None
    except FileNotFoundError:
        problem = Problem("batch folder", "is gone", "put it back, then retry the batch")
        raise InputError("the batch folder is gone", [problem]) from None


def run_folder(spec: JobSpec, batch: HeldFolder | None = None) -> HeldFolder:
    """The job's run folder (made if missing), held from its batch folder down: every write
    the job makes under the batch folder goes through it. ``batch`` is the batch folder the job
    holds; without it, the batch folder is held anew, checked against its identity. Close the
    run folder when done."""
    relative = Path(spec.run_dir).relative_to(spec.batch_dir).as_posix()
    if batch is not None:
        return batch.folder(relative, create=True)
    with hold_batch(spec) as held:
        return held.folder(relative, create=True)


def work_folder(spec: JobSpec) -> HeldFolder:
    """The run's work folder in the spool (made if missing), held: where the jobs of a run
    hand each other what the next ones read. Close it when done."""
    make_private(spec.work_dir)
    return HeldFolder.open(spec.work_dir)


def planted_problem(spec: JobSpec, exc: UnsafeEntry) -> Problem:
    """An entry planted under the batch folder where the job writes, said for its owner."""
    path = exc.path or Path(spec.run_dir) / exc.relative
    with contextlib.suppress(ValueError):
        path = path.relative_to(spec.batch_dir)
    hint = "results/ is written by watchd: remove what was put there, then retry the batch"
    return Problem(f"'{path}'", f"{exc.what}; the job does not write through it", hint)


def _torch_threads(count: int) -> None:
    """Give torch the job's threads, where the pipeline uses it (its module imported it): the
    report and the assembly never load torch (2–7 s of a job's start)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(count)


def _failure(kind: ErrorKind, message: str, problems: Sequence[Problem] = ()) -> JobError:
    text = traceback.format_exc() if kind is ErrorKind.INTERNAL else ""
    return JobError(kind=kind, message=message, problems=tuple(problems), traceback=text)


def _attempt(pipeline: Pipeline, work: Work, job_dir: Path, given: list[int]) -> tuple[int, Any]:
    """Run the work; return (exit status, summary dict or JobError). ``given`` gets the GPUs
    the job holds (all its tasks'), once its spec is read."""
    spec = None
    try:
        spec = read_spec(job_dir)
        given.append(spec.resources.gpus * spec.resources.tasks)
        if spec.pipeline is not pipeline:
            raise ValueError(
                f"spec is for pipeline {spec.pipeline.value!r}, not {pipeline.value!r}"
            )
        _torch_threads(max(1, spec.resources.cpus))
        keep_freed_memory()
        log.info("job %s (%s) attempt %d started", spec.job_name, pipeline.value, spec.attempt)
        with hold_batch(spec) as batch:
            summary = work(spec, job_dir, batch)
        return EXIT_OK, None if summary is None else dict(summary)
    except UntrustedSpec:
        raise  # the caller refuses the job: nothing is written where nothing is trusted
    except (InputError, UnsafeEntry, NotWritable) as exc:
        if isinstance(exc, NotWritable) and not _owners(spec, exc.folder):
            log.exception("the spool cannot be written")  # the service's: retried
            return EXIT_INTERNAL, _failure(ErrorKind.INTERNAL, str(exc))
        if isinstance(exc, NotWritable):
            exc = InputError("the results folder cannot be written", [unwritable_problem(exc)])
        if isinstance(exc, UnsafeEntry):
            assert spec is not None  # nothing is written under the batch folder before
            exc = InputError("an entry planted under results/", [planted_problem(spec, exc)])
        for problem in exc.problems:
            log.error("input problem: %s", problem.render())
        return EXIT_REFUSED, _failure(ErrorKind.INPUT, exc.message, exc.problems)
    except ModelError as exc:
        log.error("model error: %s", exc)
        return EXIT_REFUSED, _failure(ErrorKind.MODEL, str(exc))
    except Exception as exc:
        log.exception("internal error")
        message = f"{type(exc).__name__}: {exc}"
        return EXIT_INTERNAL, _failure(ErrorKind.INTERNAL, message)


def _owners(spec: JobSpec | None, folder: Path) -> bool:
    """Whether ``folder`` is in the batch folder (its owner's), not in the spool."""
    return spec is not None and folder.is_relative_to(spec.batch_dir)


def write_result(job_dir: Path, result: JobResult) -> None:
    """Write result.json into the job folder (in the spool), whole or not at all."""
    with HeldFolder.open(job_dir) as folder:
        folder.write_text(RESULT_FILE, result.to_json() + "\n")


def _peak_rss_mb() -> float:
    """This process's largest resident set so far: what the job needed. Linux's VmHWM, of this
    program alone (getrusage's maximum also counts what the parent held when it forked the
    job: a benchmark of 3 GB made every job it ran look 3 GB); getrusage's where there is no
    /proc (both in KiB)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_job(pipeline: Pipeline, work: Work, argv: Sequence[str] | None = None) -> int:
    """Run ``work`` on the job directory named by ``argv``; write result.json; return the status."""
    frozen = settle_collector()
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print(f"usage: python -m {pipeline.module} JOB_DIR", file=sys.stderr)
        return EXIT_INTERNAL
    configure_logging()
    if frozen:
        log.info("imports done: %d objects frozen, out of the garbage collector's way", frozen)
    job_dir = Path(args[0]).resolve()
    started, meter = time.monotonic(), Meter()
    gpus: list[int] = []
    try:
        status, outcome = _attempt(pipeline, work, job_dir, gpus)
    except UntrustedSpec as exc:
        log.error("%s", exc)  # no result where the spec is not trusted: none is trusted either
        return EXIT_REFUSED
    if process_rank(os.environ) != 0:
        log.info("rank %d finished: rank 0 writes the result", process_rank(os.environ))
        return status
    elapsed = round(time.monotonic() - started, 3)
    finished = datetime.now(UTC).isoformat(timespec="seconds")
    used = {USAGE_KEY: meter.read(sum(gpus)).to_dict()}  # charged to the batch's owner
    if status == EXIT_OK:
        summary = {**(outcome or {}), "elapsed_s": elapsed, "host": platform.node(),
                   "peak_rss_mb": round(_peak_rss_mb(), 1), **used}  # fmt: skip
        summary["code_version"] = code_version()
        result = JobResult(ok=True, pipeline=pipeline.value, finished_at=finished, summary=summary)
    else:
        result = JobResult(
            ok=False, pipeline=pipeline.value, finished_at=finished, summary=used, error=outcome
        )
    try:
        write_result(job_dir, result)
    except OSError as exc:  # UnsafeEntry too: the run folder was swapped for a link meanwhile
        log.error("result.json not written: %s", exc)
        return EXIT_INTERNAL
    log.info("finished in %.1f s: %s", elapsed, "ok" if status == EXIT_OK else outcome.message)
    return status


def main(pipeline: Pipeline, work: Work) -> NoReturn:
    """``python -m pipelines.<name> JOB_DIR`` for a job whose work leaves nothing behind to
    finish (inference, assembly, report): :func:`run_job`, then the process ends at once with
    its status, its log flushed. Python's own ending, every module and object torn down
    (torch's among them), took ~0.12 s after result.json in every inference job of the
    development machine (docs/benchmarks.md): what the job made is written and closed by then,
    its workers and threads ended. Training and the sweep end as Python does: wandb and
    Lightning finish what they started in exit handlers."""
    status = run_job(pipeline, work)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
