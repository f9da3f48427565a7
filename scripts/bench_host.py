"""Benchmark: the inference job's host side (read, decode, hand-over, threshold, label, encode,
write, make durable, ledger) with the net replaced by a zero-cost stand-in, on 1 CPU and on 2,
the old code against the new, in one run.

Each job is the real ``python -m pipelines.infer`` of its code tree, run by
``scripts/standin_job.py`` (the U-Net swapped for a module that gives back its input: the
forward pass costs nothing, so what is measured is what a GPU node's job spends besides its
GPU). A job on N CPUs is given ``resources.cpus = N`` and bound to N cores (``taskset``); the
old code runs from ``--old`` (a ``git worktree`` of the base commit), the new from this tree,
interleaved, ``--rounds`` times each, on the same images, in reverse order every other round
(this machine's speed drifts), each run's outputs moved aside rather than removed until the end
(:func:`jobrun.set_aside`: on ext4 without a journal, files removed slow the next run down).
Printed per configuration: images/s over the job's whole run (start-up included) and over its
images alone (the job's own ``seconds_per_image``), and the seconds outside them (the
interpreter's start and end), the median of the rounds; then the ratios the issue names, and
whether the two codes' masks and tables agree (every mask compared pixel for pixel).

The new code runs twice: started cold, as a subprocess, and as the local executor starts an
inference job by default, from a warm start (:mod:`daemon.executors.spares`): a launcher
started ahead, pinned to the same cores, whose imports are done before the job is handed to it
(it said so on its socket); its whole run is from the hand-over to the launcher's end. What the
warm start's imports cost is then spent before the job, outside these figures: the daemon
starts a spare while the job before runs (on a busy machine, beside it).

Both codes run with ``split_neck = 0``: the old code had no object step (touching objects cut
apart, :mod:`pipelines.instances`), so at 0 both do the same work and their masks compare.
``--object-step`` adds the new code at the default ``split_neck``, 1 CPU and 2, as rows of
their own (what the step costs on top; not in the ratios).

``--slide SIZE``: instead of the images, one ``SIZE``² slide (a tiled TIFF, 30 % tissue in
islands, as ``bench_gpu.py``'s), segmented window by window by the same stand-in job: what a
GPU node's slide job spends besides its GPU. Printed per code and CPU count: Mpx/s over the
slide's area (the job's whole run, and its image alone), its CPU seconds (of which the main
process's), then new ÷ old and whether the two codes' label images (every level, pixel for
pixel, over the chunks either stores) and object tables are the same. The new code also runs
from a warm start, as the images do (the launcher's imports, the slide code's among them, done
before the hand-over).

    .venv/bin/python scripts/bench_host.py --old ../wt-base [--images 6000] [--rounds 3]
    .venv/bin/python scripts/bench_host.py --old ../wt-base --work /mnt/share/bench  # a share
    .venv/bin/python scripts/bench_host.py --old ../wt-base --slide 12288 --rounds 3
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import jobrun
import synth
from bench_share import _commit
from bench_slide import compare_labels
from jobrun import work_dir_for
from standin_job import SPARE, THRESHOLD

from daemon.contract.jobspec import (
    LOG_FILE,
    RESULT_FILE,
    SPEC_FILE,
    JobResult,
    JobSpec,
    ModelRef,
    Pipeline,
    Resources,
)
from daemon.contract.names import INFERENCE
from daemon.executors import spares
from daemon.executors.local_job import READY
from models import registry
from models.unet import UNet
from pipelines.images import decode

REPO = Path(__file__).resolve().parent.parent
MODEL = "standin"
PARAMS = {"threshold": THRESHOLD, "min_object_area": 16, "split_neck": 0.0}
T = TypeVar("T")
CUT = "new, objects cut"  # the new code with the object step at its default split_neck
WARM = "new, warm start"  # the new code handed to a launcher started ahead, imports done


@dataclass(frozen=True)
class Run:
    code: str
    cpus: int
    images: int
    wall_s: float
    images_s: float  # over the images alone (the job's own seconds_per_image)
    cpu_ms_per_image: float  # the job's and its workers' CPU time, over its images alone
    main_ms_per_image: float | None  # of which the job's main process (None: not reported)

    @property
    def whole_rate(self) -> float:
        return self.images / self.wall_s

    @property
    def outside_s(self) -> float:
        """The job's seconds outside its images: the interpreter's start (imports) and end."""
        return self.wall_s - self.images / self.images_s


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


def _median_of(values: Iterable[float | None]) -> float | None:
    """The median of the values given (None: none was, as the old code does not say all)."""
    known = [value for value in values if value is not None]
    return statistics.median(known) if known else None


def spec_for(code: Path, spec: JobSpec) -> tuple[Path, str]:
    """The job folder where the job of ``code`` reads its spec, and the spec's text as that
    code reads it: a code from before the spool (spec version 1) keeps its job folders in the
    run folder and knows no work folder."""
    source = (code / "daemon" / "contract" / "jobspec.py").read_text(encoding="utf-8")
    if "work_dir" in source:
        return spec.job_dir, spec.to_json()
    data = json.loads(spec.to_json())
    del data["work_dir"]
    found = re.search(r"^SPEC_VERSION = (\d+)", source, re.MULTILINE)
    data["spec_version"] = int(found.group(1)) if found else 1
    return Path(spec.run_dir) / "jobs" / spec.job_name, json.dumps(data)


def _job_folder(
    code: Path, batch_dir: Path, spec: JobSpec, cpus: int, cores: list[int]
) -> tuple[Path, dict[str, str], list[str]]:
    """The job folder of ``code``'s run (spec written, the last run's outputs set aside), its
    environment, and the command prefix that binds a process to ``cores``."""
    jobrun.set_aside(batch_dir)
    job_dir, text = spec_for(code, spec)
    job_dir.mkdir(parents=True)
    (job_dir / SPEC_FILE).write_text(text, encoding="utf-8")
    # the code first, then the caller's path (a GPU node's packages come from a folder on it)
    path = os.pathsep.join(filter(None, [str(code), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": str(cpus),
           "WANDB_MODE": "disabled"}  # fmt: skip
    return job_dir, env, ["taskset", "-c", ",".join(map(str, cores)), sys.executable]


def _result(job_dir: Path, status: int, what: str) -> JobResult:
    """The job's result; its log's end and a stop where it failed."""
    result = JobResult.from_json((job_dir / RESULT_FILE).read_text("utf-8"))
    if status != 0 or not result.ok:
        sys.stderr.write((job_dir / LOG_FILE).read_text("utf-8")[-3000:])
        raise SystemExit(f"the {what} job failed (exit status {status})")
    return result


def run_job(
    code: Path, batch_dir: Path, spec: JobSpec, cpus: int, cores: list[int]
) -> tuple[float, JobResult]:
    """Run the stand-in job of ``code`` on ``cores``: (wall seconds, its result)."""
    job_dir, env, pinned = _job_folder(code, batch_dir, spec, cpus, cores)
    command = [*pinned, str(REPO / "scripts" / "standin_job.py"), str(job_dir)]
    started = time.perf_counter()
    with open(job_dir / LOG_FILE, "wb") as log:
        done = subprocess.run(command, cwd=code, stdout=log, stderr=subprocess.STDOUT,
                              env=env, check=False)  # fmt: skip
    wall = time.perf_counter() - started
    return wall, _result(job_dir, done.returncode, str(code))


def host_rate(
    batch_dir: Path, registry_dir: Path, model: str, cpus: int, params: dict[str, object]
) -> tuple[float, float]:
    """Images/s of one stand-in job of this tree over every image of ``batch_dir`` on its first
    ``cpus`` cores, started cold: (over the job's whole run, over its images alone). The host
    side's limit where the net costs nothing (``bench_gpu.py``, ``bench_batch.py --standin``)."""
    images = sorted(p for p in (batch_dir / "images").iterdir() if p.is_file())
    spec = JobSpec(
        job_id=1, job_name=f"infer-host-{cpus}", pipeline=Pipeline.INFER, attempt=1,
        batch_id=1, batch_revision=1, batch_kind="inference", batch_dir=str(batch_dir),
        run_dir=str(batch_dir / "results"), work_dir=str(work_dir_for(batch_dir)),
        manifest_sha256="0" * 64, inputs=jobrun.inputs_of(batch_dir, images, checksums=True),
        model=ModelRef(model), registry_dir=str(registry_dir), params=params,
        resources=Resources(cpus=cpus), title="host pipeline",
    )  # fmt: skip
    cores = sorted(os.sched_getaffinity(0))[:cpus]
    wall, result = run_job(REPO, batch_dir, spec, cpus, cores)
    jobrun.set_aside(batch_dir)  # its masks and ledger not found by the next run
    segmented = int(result.summary["segmented"])
    return segmented / wall, 1 / float(result.summary["seconds_per_image"])


def run_warm(
    batch_dir: Path, spec: JobSpec, cpus: int, cores: list[int]
) -> tuple[float, JobResult]:
    """Run the new code's stand-in job from a warm start on ``cores``: (wall seconds from the
    hand-over to the launcher's end, its result)."""
    job_dir, env, pinned = _job_folder(REPO, batch_dir, spec, cpus, cores)
    module = Pipeline.INFER.module
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    command = [*pinned, str(REPO / "scripts" / "standin_job.py"), SPARE, module]
    launcher = subprocess.Popen(command, cwd=REPO, stdin=theirs, stdout=subprocess.DEVNULL,
                                env=env, start_new_session=True)  # fmt: skip
    theirs.close()
    ours.settimeout(120)
    if ours.recv(len(READY)) != READY:  # its imports done
        raise SystemExit(f"the warm start did not get ready (exit {launcher.wait()})")
    spare = spares.Spare(launcher.pid, 0, module, env, ours, ready=True)
    log_fd = os.open(job_dir / LOG_FILE, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    started = time.perf_counter()
    spares.hand_over(spare, str(job_dir), 0, 0, [sys.executable, "-m", module, str(job_dir)],
                     env, log_fd)  # fmt: skip
    os.close(log_fd)
    status = launcher.wait()
    wall = time.perf_counter() - started
    return wall, _result(job_dir, status, "warm-started")


def in_turn(round_: int, cpus: Sequence[int], codes: Sequence[T]) -> list[tuple[int, T]]:
    """The runs of one round: every CPU count with every code, in reverse order every other
    round. This machine's speed drifts by 20–40 % over a minute (the same loop, alone), so a
    fixed order would favour the runs that come first."""
    runs = [(count, code) for count in cpus for code in codes]
    return runs if round_ % 2 == 0 else runs[::-1]


def keep(batch_dir: Path, into: Path) -> None:
    """Move the run's masks and table aside, to compare the two codes' after the runs (the
    tables in the spool, or in the run folder before the spool)."""
    shutil.rmtree(into, ignore_errors=True)
    into.mkdir(parents=True)
    shutil.move(batch_dir / "results" / "masks", into / "masks")
    parts = work_dir_for(batch_dir) / "parts"
    shutil.move(parts if parts.exists() else batch_dir / "results" / "parts", into / "parts")


def agreement(old: Path, new: Path) -> str:
    """Whether every mask and every table row (but the code's version and the columns the old
    code did not have) are the same in both codes' outputs."""
    masks = sorted(p.relative_to(old) for p in (old / "masks").rglob("*") if p.is_file())
    differ = [m for m in masks if not np.array_equal(decode((old / m).read_bytes()),
                                                     decode((new / m).read_bytes()))]  # fmt: skip
    rows = {}
    for side in (old, new):
        with open(next((side / "parts").glob("table-*.csv")), newline="") as handle:
            rows[side] = list(csv.DictReader(handle))
    shared = [c for c in rows[old][0] if c in rows[new][0] and c != "code_version"]
    unequal = sum(
        1 for a, b in zip(rows[old], rows[new], strict=True) if any(a[c] != b[c] for c in shared)
    )
    return (f"masks: {len(masks) - len(differ)} of {len(masks)} equal pixel for pixel; table "
            f"rows: {len(rows[old]) - unequal} of {len(rows[old])} equal in {len(shared)} "
            "shared columns (code_version aside)")  # fmt: skip


def slide(old: Path, work: Path, size: int, rounds: int, cores: list[int]) -> int:
    """The ``--slide`` run: one slide, both codes, 1 CPU and 2, ``rounds`` times."""
    batch_dir = work / "batch"
    made = time.perf_counter()
    synth.write_slide(batch_dir / "images" / "slide.tif", size, seed=4, tissue=0.3)
    inputs = jobrun.inputs_of(batch_dir, sorted((batch_dir / "images").iterdir()), checksums=True)
    (batch_dir / "images" / "slide.tif").read_bytes()  # the page cache warm for every run alike
    print(f"old: {old} ({_commit(old)}); new: {REPO} ({_commit(REPO)})")
    print(f"a {size:,}² slide, 30 % tissue, made in {time.perf_counter() - made:.0f} s in {work};"
          f" {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}")  # fmt: skip
    pixels = size * size / 1e6
    found: dict[tuple[str, int], list[tuple[float, float, float, float | None]]] = {}
    for round_ in range(rounds):
        codes = [("old", old), ("new", REPO), (WARM, REPO)]
        for cpus, (name, code) in in_turn(round_, (1, 2), codes):
            spec = JobSpec(
                job_id=1, job_name=f"slide-{name}-{cpus}", pipeline=Pipeline.INFER,
                attempt=1, batch_id=1, batch_revision=1, batch_kind="inference",
                batch_dir=str(batch_dir), run_dir=str(batch_dir / "results"),
                work_dir=str(work_dir_for(batch_dir)), manifest_sha256="0" * 64,
                inputs=inputs, model=ModelRef(MODEL), registry_dir=str(work / "registry"),
                params={"threshold": THRESHOLD, "min_object_area": 16},
                resources=Resources(cpus=cpus), title="host benchmark, a slide",
            )  # fmt: skip
            if name == WARM:
                wall, result = run_warm(batch_dir, spec, cpus, cores[:cpus])
            else:
                wall, result = run_job(code, batch_dir, spec, cpus, cores[:cpus])
            summary = result.summary
            own = summary["seconds_per_image"]
            # the main process's CPU: None where the old code does not say it
            cpu, main_cpu = summary["cpu_seconds_per_image"], summary.get(
                "main_cpu_seconds_per_image")  # fmt: skip
            found.setdefault((name, cpus), []).append((wall, own, cpu, main_cpu))
            print(f"round {round_ + 1}: {name}, {cpus} CPU(s): {wall:.1f} s, "
                  f"{pixels / wall:.1f} Mpx/s whole job, {pixels / own:.1f} over its image, "
                  f"{cpu:.2f} CPU-s ({_ms(main_cpu)} in the main process), "
                  f"load {os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip
            if round_ == 0 and cpus == 2:
                kept = work / ("kept-warm" if name == WARM else f"kept-{name}")
                shutil.rmtree(kept, ignore_errors=True)
                shutil.move(batch_dir / "results", kept)
    print()
    print("| code | CPUs | Mpx/s, whole job | Mpx/s, its image | CPU-s | of which the main one |")
    print("| --- | --- | --- | --- | --- | --- |")
    rate = {}
    for name in ("old", "new", WARM):
        for cpus in (1, 2):
            runs = found[name, cpus]
            whole = statistics.median(pixels / r[0] for r in runs)
            inner = statistics.median(pixels / r[1] for r in runs)
            rate[name, cpus] = (whole, inner)
            print(f"| {name} | {cpus} | {whole:.1f} | {inner:.1f} | "
                  f"{statistics.median(r[2] for r in runs):.2f} | "
                  f"{_ms(_median_of(r[3] for r in runs))} |")  # fmt: skip
    print()
    for label, at in (("whole job", 0), ("its image", 1)):
        for name in ("new", WARM):
            print(f"{label}, {name}: ÷ old {rate[name, 1][at] / rate['old', 1][at]:.2f} on 1 CPU, "
                  f"{rate[name, 2][at] / rate['old', 2][at]:.2f} on 2; 2 CPUs ÷ 1 CPU "
                  f"{rate[name, 2][at] / rate[name, 1][at]:.2f}")  # fmt: skip
    label = Path("masks/images/slide.tif.ome.zarr/labels/segmentation")
    objects = Path("objects/images/slide.tif.csv")
    same = True
    for name, kept in (("new", work / "kept-new"), (WARM, work / "kept-warm")):
        levels = compare_labels(work / "kept-old" / label, kept / label)
        tables = (work / "kept-old" / objects).read_bytes() == (kept / objects).read_bytes()
        same = same and tables and not any(lv.differing for lv in levels)
        print(f"{name} against old, label images (2 CPUs): " + "; ".join(
            f"level {lv.key}: {lv.differing} of {lv.pixels:,} pixels differ, chunks stored "
            f"{lv.stored[0]} / {lv.stored[1]}" for lv in levels))  # fmt: skip
        print(f"{name} against old, object tables: {'the same' if tables else 'DIFFERENT'}")
    print(f"medians of {rounds} round(s); work in {work}")
    jobrun.remove_spent(batch_dir)
    return 0 if same else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", type=Path, required=True, help="a checkout of the old code")
    parser.add_argument("--images", type=int, default=6000)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", type=Path, default=None, help="where the batch lies")
    parser.add_argument("--object-step", action="store_true",
                        help="also the new code with touching objects cut apart")  # fmt: skip
    parser.add_argument("--slide", type=int, default=0, metavar="SIZE",
                        help="one SIZE² slide instead of the images")  # fmt: skip
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("this benchmark needs 2 cores")
    work = Path(tempfile.mkdtemp(prefix="watchd-bench-host-", dir=args.work))
    torch.manual_seed(0)
    net = UNet(depth=3, width=16)
    registry.register(work / "registry", MODEL, net.state_dict(),
                      {"architecture": net.architecture()})  # fmt: skip
    if args.slide:
        return slide(args.old.resolve(), work, args.slide, args.rounds, cores)
    batch_dir = work / "batch"
    made = time.perf_counter()
    files = synth.make_batch(batch_dir, "inference", args.images, args.size, seed=11)
    inputs = jobrun.inputs_of(batch_dir, files, checksums=True)
    for path in files:  # the page cache warm for every run alike
        path.read_bytes()
    print(f"old: {args.old.resolve()} ({_commit(args.old)}); new: {REPO} ({_commit(REPO)})")
    print(f"{args.images:,} PNG images {args.size}² made in {time.perf_counter() - made:.0f} s "
          f"in {work}; {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}")  # fmt: skip
    runs: list[Run] = []
    codes = [("old", args.old.resolve(), PARAMS), ("new", REPO, PARAMS), (WARM, REPO, PARAMS)]
    if args.object_step:
        codes.append((CUT, REPO, {**PARAMS, "split_neck": INFERENCE.split_neck}))
    for round_ in range(args.rounds):
        for cpus, (name, code, params) in in_turn(round_, (1, 2), codes):
            slug = {CUT: "cut", WARM: "warm"}.get(name, name)
            spec = JobSpec(
                job_id=1, job_name=f"infer-{slug}-{cpus}", pipeline=Pipeline.INFER,
                attempt=1, batch_id=1, batch_revision=1, batch_kind="inference",
                batch_dir=str(batch_dir), run_dir=str(batch_dir / "results"),
                work_dir=str(work_dir_for(batch_dir)), manifest_sha256="0" * 64,
                inputs=inputs, model=ModelRef(MODEL),
                registry_dir=str(work / "registry"), params=params,
                resources=Resources(cpus=cpus), title="host benchmark",
            )  # fmt: skip
            if name == WARM:
                wall, result = run_warm(batch_dir, spec, cpus, cores[:cpus])
            else:
                wall, result = run_job(code, batch_dir, spec, cpus, cores[:cpus])
            summary = result.summary
            main_s = summary.get("main_cpu_seconds_per_image")
            run = Run(name, cpus, summary["segmented"], wall, 1 / summary["seconds_per_image"],
                      1000 * summary["cpu_seconds_per_image"],
                      None if main_s is None else 1000 * main_s)  # fmt: skip
            runs.append(run)
            print(f"round {round_ + 1}: {name}, {cpus} CPU(s): {wall:.1f} s, "
                  f"{run.whole_rate:.0f} images/s whole job, {run.images_s:.0f} over its "
                  f"images ({run.outside_s:.1f} s outside them), "
                  f"{run.cpu_ms_per_image:.2f} CPU-ms per image "
                  f"({_ms(run.main_ms_per_image)} in the main process), "
                  f"load {os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip
            if round_ == 0 and cpus == 2 and name != CUT:
                keep(batch_dir, work / f"kept-{slug}")
    print()
    print(
        "| code | CPUs | images/s, whole job | images/s, its images | per CPU (whole job) "
        "| CPU-ms per image | of which the main process | s outside its images |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    rate: dict[tuple[str, int], tuple[float, float]] = {}
    for name, _, _ in codes:
        for cpus in (1, 2):
            mine = [r for r in runs if (r.code, r.cpus) == (name, cpus)]
            whole = statistics.median(r.whole_rate for r in mine)
            inner = statistics.median(r.images_s for r in mine)
            rate[name, cpus] = (whole, inner)
            cpu = statistics.median(r.cpu_ms_per_image for r in mine)
            main_ms_at = _median_of(r.main_ms_per_image for r in mine)
            outside = statistics.median(r.outside_s for r in mine)
            print(f"| {name} | {cpus} | {whole:.0f} | {inner:.0f} | {whole / cpus:.0f} | "
                  f"{cpu:.2f} | {_ms(main_ms_at)} | {outside:.1f} |")  # fmt: skip
    print()
    for new in ("new", WARM):
        for label, at in (("whole job", 0), ("its images", 1)):
            scaling = rate[new, 2][at] / rate[new, 1][at]
            per_cpu = (rate[new, 2][at] / 2) / (rate["old", 2][at] / 2)
            per_cpu_1 = rate[new, 1][at] / rate["old", 1][at]
            print(
                f"{new}, {label}: 2 CPUs / 1 CPU {scaling:.2f} (target >= 1.8); ÷ old per "
                f"CPU {per_cpu:.2f} with 2 CPUs, {per_cpu_1:.2f} with 1 (target >= 1.5)"
            )
    print(f"new: {agreement(work / 'kept-old', work / 'kept-new')}")
    print(f"{WARM}: {agreement(work / 'kept-old', work / 'kept-warm')}")
    print(f"medians of {args.rounds} round(s); work in {work}")
    jobrun.remove_spent(batch_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
