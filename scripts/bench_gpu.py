"""Benchmark for a GPU node: the inference job against the bare forward pass of its own model,
measured in one run, on the node's first GPU; one table. Nothing is installed at run time: the
packages the node lacks come as wheels prepared beforehand (scripts/gpu-wheels), unpacked to
a folder on PYTHONPATH. Under 10 minutes with the defaults on an H100 or H200 node.

In order:

1. A U-Net of the demo's shape (depth 3, width 16) trained here for ``--train-steps`` steps on
   synthetic spheroids, and registered: a trained model's masks decide the precision.
2. The limit: its bare forward pass (and sigmoid) over decoded images already on the GPU, fp32
   and fp16 (autocast), 256² in batches of 64 and 128, 1024² in batches of 8 and 16; the best
   (eager, channels-last, torch's default math).
3. Whole batches through the daemon (local executor; the GPU handed out with
   ``--jobs-per-gpu`` jobs on it and as many warm starts, ``--cpus-per-job`` workers each):
   ``--images`` × 256² and ``--big`` × 1024², queued → done, as a share of the fp16 limit
   (targets ≥ 0.5 and ≥ 0.6), and with ``--steady N`` a batch of N × 256² (no target);
   the precision the jobs' first batch decided, with its agreement. Each batch runs again
   with ``resident_device = true`` (:mod:`daemon.executors.resident`: the net kept on the GPU
   across jobs; ``--skip resident`` leaves those rows out). ``--old CHECKOUT`` adds the
   old code's 256² batch (four jobs of one CPU, as it was measured); ``--base CHECKOUT`` a
   baseline code's, run as the new code's is. Before them, how long a warm start
   (``daemon/executors/spares.py``) of the inference job (also as one starts with resident
   devices: no torch) and of the report takes to say its imports are done, twice each, started
   as the daemon starts one.
4. A ``--slide``² slide, 30 % tissue: one job on the GPU, one on 8 CPU threads (targets:
   ≥ 8× faster, ≥ 80 Mpx/s over the slide's area), each started cold (on the H100 a start
   took 4–6 s of the 1.9 s that 80 Mpx/s leaves a 12,288² slide); then the slide dropped as a
   batch into the daemons of step 3, queued → done (its job forked from a warm start, its net
   its own and on the resident device), the report included.
5. The host pipeline alone: the 256² batch and the ``--big-size``² one, each through one job
   whose net is a zero-cost stand-in (scripts/standin_job.py), on ``--cpus-per-job`` CPUs,
   without the object step (the stand-in's masks make it ~14× as costly as a trained net's):
   what the host side can feed, beside the batches' rates of step 3.
6. Last, since a short lease can spare it: the same forward as the job runs it with
   ``gpu_compile`` (:func:`pipelines.inference.device.fast_forward`), at one batch per image
   size (the job's own: about 8 Mpx), in fp32 and fp16: "compile" (torch.compile) and
   "graphs" (a captured CUDA graph), each as a share of eager's rate at that batch, its build
   time apart (not in the rate), fp16 first; once ``--compile-seconds`` of builds are spent
   the rows left say they were skipped. ``--skip compile`` leaves them out. On the CPU
   (``--quick``): torch.compile of the 256² batch in fp32 only; CUDA graphs need a GPU.

``--quick`` runs the same steps at small sizes on whatever device there is: the check that the
script works, on a machine without a GPU (the targets are then not judged).

    PYTHONPATH=/tmp/site:$PWD python3 scripts/bench_gpu.py [--old ../wt-base]
    .venv/bin/python scripts/bench_gpu.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tomli_w
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import jobrun
import synth
from bench_batch import BatchDaemon, one_run
from bench_share import _commit
from standin_job import THRESHOLD

from daemon.contract.jobspec import RESIDENT_DEVICES_ENV, ModelRef, Pipeline
from models import registry
from models.unet import UNet, segmentation_loss
from pipelines.images import decode
from pipelines.inference.device import fast_forward, forward
from pipelines.inference.placement import BATCH_PIXELS, FULL, HALF

REPO = Path(__file__).resolve().parent.parent
MODEL = "bench-unet"
ARCHITECTURE = {"depth": 3, "width": 16}
COMPILE_SECONDS = 180.0  # of gpu_compile builds in step 6, both sizes: the run stays < 10 min


@dataclass
class Table:
    """The one table: (what, value, target, met) rows, printed at the end."""

    rows: list[tuple[str, str, str, str]] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def add(self, what: str, value: str, target: str = "", met: bool | None = None) -> None:
        verdict = "" if met is None else ("met" if met else "NOT met")
        self.rows.append((what, value, target, verdict))
        print(f"[{time.monotonic() - self.started:5.0f} s] {what}: {value}", flush=True)

    def print(self) -> None:
        print("\n| measure | value | target | |\n| --- | --- | --- | --- |")
        for row in self.rows:
            print("| " + " | ".join(row) + " |")


# -- the model ------------------------------------------------------------------------------


def train(device: str, size: int, steps: int) -> UNet:
    """A U-Net trained on synthetic spheroids for ``steps`` steps of 16 images."""
    torch.manual_seed(0)
    pool = [synth.sample(5, i, size) for i in range(64)]
    images = torch.from_numpy(np.stack([s.image for s in pool]).astype(np.float32))[:, None]
    masks = torch.from_numpy(np.stack([s.mask for s in pool]).astype(np.float32))[:, None]
    net = UNet(**ARCHITECTURE).to(device)
    optimiser = torch.optim.Adam(net.parameters(), lr=3e-3)
    images, masks = images.to(device), masks.to(device)
    for step in range(steps):
        pick = torch.arange(step * 16, step * 16 + 16) % len(pool)
        optimiser.zero_grad()
        segmentation_loss(net(images[pick]), masks[pick]).backward()
        optimiser.step()
    return net.eval().cpu()


# -- the limit ------------------------------------------------------------------------------


def _rate(once: Any, images: int, cuda: bool) -> float:
    """Images/s of ``once`` (a batch of ``images``), for about a second after a warm-up."""
    for _ in range(3):
        once()
    if cuda:
        torch.cuda.synchronize()
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < 1.0 or done < 3:
        once()
        done += 1
    if cuda:
        torch.cuda.synchronize()
    return done * images / (time.perf_counter() - started)


def _on(net: UNet, images: np.ndarray, batch: int, device: str) -> tuple[UNet, torch.Tensor]:
    net = net.to(device).to(memory_format=torch.channels_last)
    stack = torch.from_numpy(images[:batch]).to(device)[:, None]
    return net, stack.contiguous(memory_format=torch.channels_last)


@torch.inference_mode()
def bare_rate(net: UNet, images: np.ndarray, batch: int, half: bool, device: str) -> float:
    """Images/s of the bare forward pass (and sigmoid) over ``images`` already on the device,
    in batches of ``batch``, eager (fp16: autocast, on a GPU only)."""
    net, stack = _on(net, images, batch, device)
    precision = HALF if half and device.startswith("cuda") else FULL
    return _rate(lambda: forward(net, stack, precision), batch, device.startswith("cuda"))


@torch.inference_mode()
def fast_rate(
    net: UNet, images: np.ndarray, batch: int, precision: str, mode: str, device: str
) -> tuple[float, float]:
    """Images/s of the job's ``gpu_compile`` forward (``mode``), and the seconds its build
    (compilation or capture, from a clean compiler cache) took."""
    net, stack = _on(net, images, batch, device)
    cuda = device.startswith("cuda")
    torch._dynamo.reset()
    started = time.perf_counter()
    run = fast_forward(net, mode, stack, precision)
    if cuda:
        torch.cuda.synchronize()
    built = time.perf_counter() - started
    return _rate(lambda: run(stack), batch, cuda), built


def compiled_rows(
    table: Table, net: UNet, images: np.ndarray, size: int, device: str, budget: float
) -> float:
    """The ``gpu_compile`` rows of one image size: each mode and precision at the job's batch,
    as a share of eager's rate at that batch; a row is skipped, saying so, once ``budget``
    seconds of builds are spent. The seconds its builds took."""
    cuda = device.startswith("cuda")
    batch = max(1, min(len(images), BATCH_PIXELS // size**2)) if cuda else 8  # as --quick's
    spent = 0.0
    for precision in (HALF, FULL) if cuda else (FULL,):  # fp16 first: the targets' limit
        eager = bare_rate(net, images, batch, precision == HALF, device)
        for mode in ("graphs", "compile"):  # a capture takes a second, a compilation tens
            what = f"bare forward {size}² × {batch}, {precision}, {mode}"
            if mode == "graphs" and not cuda:
                table.add(what, "skipped: CUDA graphs need a GPU")
                continue
            if spent >= budget:
                table.add(what, "skipped: the step's seconds of builds are spent")
                continue
            try:
                rate, built = fast_rate(net, images, batch, precision, mode, device)
            except RuntimeError as exc:  # no compiler here: said, and the run goes on
                table.add(what, f"skipped: {str(exc).strip().splitlines()[0][:160]}")
                continue
            spent += built
            table.add(what, f"{rate:,.0f} images/s = {rate / eager:.2f}× eager "
                      f"({eager:,.0f}); built in {built:.1f} s")  # fmt: skip
    return spent


def limits(
    net: UNet, images: np.ndarray, batches: tuple[int, ...], device: str
) -> dict[str, float]:
    """The best bare rate over ``batches``, in fp32 and in fp16."""
    return {
        precision: max(bare_rate(net, images, b, precision == "fp16", device) for b in batches)
        for precision in ("fp32", "fp16")
    }


# -- data -----------------------------------------------------------------------------------


def _write(args: tuple[Path, int, int, int]) -> None:
    folder, first, end, size = args
    for i in range(first, end):
        pixels = synth.to_integer(synth.sample(11, i, size).image, 8)
        synth.write_image(folder / "images" / f"img_{i:05d}.png", pixels)


def make_batch(folder: Path, count: int, size: int) -> list[Path]:
    """``count`` synthetic spheroid PNGs, written by every CPU, and a manifest beside them."""
    step = max(1, count // (4 * (os.cpu_count() or 1)))
    with ProcessPoolExecutor() as pool:
        list(pool.map(_write, [(folder, i, min(i + step, count), size)
                               for i in range(0, count, step)]))  # fmt: skip
    write_manifest(folder)
    return sorted((folder / "images").iterdir())


def write_manifest(folder: Path, *params: str) -> None:
    """An inference manifest for ``folder``'s images with the model, as an expert writes one;
    ``params``: NAME=VALUE each."""
    subprocess.run(
        [sys.executable, "-m", "daemon.cli.watchctl", "manifest", str(folder), "--kind",
         "inference", "--model", MODEL, "--owner", "Bench",
         *(f"--param={param}" for param in params)],
        check=True, capture_output=True, cwd=REPO,
    )  # fmt: skip


# -- through the daemon ---------------------------------------------------------------------


def spare_ready(
    module: str, cpus: int, times: int = 2, env: dict[str, str] | None = None
) -> list[float]:
    """Seconds from a spare's start to its word that its imports are done, ``times`` in a row
    (on the H100 it took over 4.4 s, on a 2-core VM 1.5: a job waits for one only so long),
    started in this environment and ``env``."""
    from daemon.executors.spares import Spares

    took = []
    for _ in range(times):
        spares = Spares(sys.executable, 1, [module])
        started = time.monotonic()
        spares.top_up(module, {**os.environ, "OMP_NUM_THREADS": str(cpus), **(env or {})})
        (spare,) = spares.waiting()
        while not spare.says_ready():
            if not spare.alive() or time.monotonic() - started > 120:
                raise SystemExit(f"a spare of {module} never said ready")
            time.sleep(0.01)
        took.append(spare.ready_after or time.monotonic() - started)
        spares.close()
    return took


@dataclass
class GpuDaemon(BatchDaemon):
    """A daemon whose local executor hands out the GPU (new code) or lets every job see it
    (old code: four jobs of one CPU, as the issue measured it)."""

    local: dict[str, Any] = field(default_factory=dict)

    def config(self, **intake: object) -> Path:
        path = super().config(**intake)
        document = tomllib.loads(path.read_text())
        document["executor"] = {"local": self.local}
        path.write_text(tomli_w.dumps(document))
        return path


def decided(batch_dir: Path) -> str:
    """The precision the batch's inference jobs decided and the agreement of each precision
    their first batch tried against fp32 (from the report's summary.json)."""
    said = set()
    for found in sorted(batch_dir.glob("results/*/summary.json")):
        for job in json.loads(found.read_text())["inference"].get("precision_checks", []):
            tried = ", ".join(f"{c['precision']} {c['agreement']:.5f}"
                              + ("" if c["counts_equal"] else
                                 f" (counts alike in {c.get('counted_alike', '?')} of "
                                 f"{c['images']})")
                              + ("" if c["kept"] else ", not kept")
                              for c in job["checks"])  # fmt: skip
            decided_by = job.get("resident", {}).get("decided_by")  # a resident device's word
            said.add(
                f"{job['precision']} on {job['device']}"
                + (f" (tried: {tried})" if tried else "")
                + (f" as {decided_by} decided" if decided_by else "")
            )
    return "; ".join(sorted(said)) or "no summary.json"


def stacks(pattern: str) -> str:
    """The Python stacks of the processes whose command line matches ``pattern`` (py-spy, where
    it is on PATH): what a job that never ends is doing, on a node nobody can log in to."""
    spy = shutil.which("py-spy")
    if spy is None:
        return "(py-spy is not on PATH: no stacks)"
    found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout
    return "\n".join(
        subprocess.run([spy, "dump", "--pid", pid], capture_output=True, text=True).stdout
        for pid in found.split()
    )


def through_daemon(
    name: str, code: Path, work: Path, template: Path, count: int, local: dict[str, Any],
    timeout: float,
) -> tuple[float | None, str]:  # fmt: skip
    """Images/s queued → done of one batch through a daemon of ``code`` (None: not done within
    ``timeout`` seconds: the stacks of its jobs are printed); the precision."""
    daemon = GpuDaemon(name, code, work / name, work / name / "drop", work / name / "state",
                       registry=work / "registry", local=local)  # fmt: skip
    daemon.mount.mkdir(parents=True)
    daemon.start()
    try:
        rate = one_run(daemon, template, "batch", count, timeout)["queued_to_done"]
    except SystemExit as exc:  # failed, or not done in time: said, and the run goes on
        print(f"{exc}; the stacks of its jobs:\n{stacks('pipelines')}", flush=True)
        rate = None
    finally:
        daemon.stop()
    return rate, decided(daemon.mount / "batch")


# -- the slide ------------------------------------------------------------------------------


def slide_job(batch_dir: Path, registry_dir: Path, cpus: int, gpus: int, name: str) -> float:
    """Seconds of the inference job over the slide, start to end."""
    jobrun.set_aside(batch_dir)  # else its ledger skips it; not removed: the next job's files
    inputs = jobrun.inputs_of(batch_dir, sorted((batch_dir / "images").iterdir()))
    job = jobrun.run(batch_dir, Pipeline.INFER, inputs, registry_dir, ModelRef(MODEL),
                     {"min_object_area": 16}, name=name, kind="inference", cpus=cpus,
                     gpus=gpus)  # fmt: skip
    if job.returncode != 0:
        raise SystemExit(f"the slide job {name} failed")
    return job.wall_s


def host_pipeline(batch_dir: Path, registry_dir: Path, cpus: int) -> tuple[float, float]:
    """Images/s of one stand-in job (zero-cost net) over the batch: (start to end, over its
    images alone). Without the object step: on the stand-in's masks (every pixel brighter than
    mid-grey) it costs ~10 CPU-ms per 256² image, against ~0.7 on the masks a trained net
    draws (``bench_objects.py``)."""
    from bench_host import host_rate

    params: dict[str, object] = {"threshold": THRESHOLD, "min_object_area": 16, "split_neck": 0.0}
    return host_rate(batch_dir, registry_dir, MODEL, cpus, params)


# -- the run --------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=4096)
    parser.add_argument("--big", type=int, default=512, help="images of --big-size²")
    parser.add_argument("--big-size", type=int, default=1024)
    parser.add_argument("--slide", type=int, default=12288)
    parser.add_argument("--steady", type=int, default=0,
                        help="also a batch of this many 256² images (no target): the rate once "
                             "start-up is spread over tens of thousands")  # fmt: skip
    parser.add_argument("--train-steps", type=int, default=300)
    parser.add_argument("--jobs-per-gpu", type=int, default=2)
    parser.add_argument("--cpus-per-job", type=int, default=7)
    parser.add_argument("--old", type=Path, help="a checkout of the old code")
    parser.add_argument("--base", type=Path,
                        help="a checkout of a baseline code, run as the new one is: its "
                             "--images batch beside the new code's")  # fmt: skip
    parser.add_argument(
        "--skip",
        default="",
        type=lambda text: set(text.split(",")) - {""},
        help="steps left out, by name: small, big, steady, resident, old, slide, host, compile",
    )
    parser.add_argument(
        "--batch-timeout",
        type=float,
        default=3600,
        help="seconds a batch may take before its jobs' stacks are printed",
    )
    parser.add_argument("--compile-seconds", type=float, default=COMPILE_SECONDS,
                        help="the builds step 6 may spend, both sizes together")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="small sizes, any device")
    args = parser.parse_args()
    if args.quick:
        args.images, args.big, args.big_size, args.slide = 48, 4, 512, 2048
        args.train_steps, args.jobs_per_gpu, args.cpus_per_job = 10, 1, 2
    cuda = torch.cuda.is_available()
    if not cuda and not args.quick:
        raise SystemExit("no GPU here: run with --quick to check the script on the CPU")
    device = "cuda:0" if cuda else "cpu"
    work = Path(tempfile.mkdtemp(prefix="watchd-bench-gpu-"))
    table = Table()
    what = torch.cuda.get_device_name(0) if cuda else "no GPU (--quick on the CPU)"
    print(f"{what}; torch {torch.__version__}; {os.cpu_count()} CPUs; code {_commit(REPO)}; "
          f"work in {work}", flush=True)  # fmt: skip

    small, big = work / "small", work / "big"  # written by forked processes, before CUDA
    files = make_batch(small, args.images, 256)
    big_files = make_batch(big, args.big, args.big_size)
    steady = work / "steady"
    if args.steady:
        make_batch(steady, args.steady, 256)
    net = train(device, 128 if args.quick else 256, args.train_steps)
    registry.register(work / "registry", MODEL, net.state_dict(),
                      {"architecture": net.architecture()})  # fmt: skip
    decoded = np.stack([decode(p.read_bytes()) for p in files[:256]])
    decoded_big = np.stack([decode(p.read_bytes()) for p in big_files[:16]])
    limit = limits(net, decoded, (64, 128) if cuda else (8,), device)
    limit_big = limits(net, decoded_big, (8, 16) if cuda else (2,), device)
    for size, found in ((256, limit), (args.big_size, limit_big)):
        table.add(f"bare forward {size}², fp32 / fp16", f"{found['fp32']:,.0f} / "
                  f"{found['fp16']:,.0f} images/s")  # fmt: skip

    resident_spare = {RESIDENT_DEVICES_ENV: "1"}  # with resident devices: no torch in it
    for module, env, said in (("pipelines.infer", None, ""),
                              ("pipelines.infer", resident_spare, " (resident devices)"),
                              ("pipelines.report", None, "")):  # fmt: skip
        took = spare_ready(module, args.cpus_per_job, env=env)
        table.add(f"warm start of {module}{said}, ready after",
                  " / ".join(f"{seconds:.2f} s" for seconds in took))  # fmt: skip

    gpu = cuda and not args.quick
    slots = args.jobs_per_gpu
    local = {"max_parallel": slots + 1, "cpus_per_job": args.cpus_per_job,
             "gpus": 1 if cuda else 0, "jobs_per_gpu": slots, "max_gpus": 1,
             "inference_gpus": 1, "warm_starts": slots}  # fmt: skip
    resident = {**local, "resident_device": True}  # the nets kept on the GPU across jobs
    for label, template, count, fp16, target in (
        (f"{args.images:,} × 256²", small, args.images, limit["fp16"], 0.5),
        (f"{args.big:,} × {args.big_size}²", big, args.big, limit_big["fp16"], 0.6),
        (f"{args.steady:,} × 256²", steady, args.steady, limit["fp16"], None),
    ):
        if template.name in args.skip or not count:
            continue
        for how, settings in (("new", local), ("new, resident device", resident)):
            if how != "new" and "resident" in args.skip:
                continue
            rate, precision = through_daemon(f"{how.split(',')[0]}-{template.name}"
                                             + ("-resident" if how != "new" else ""), REPO,
                                             work, template, count, settings,
                                             args.batch_timeout)  # fmt: skip
            if rate is None:
                table.add(f"{label}, queued → done ({how})",
                          f"not done in {args.batch_timeout:.0f} s",
                          "" if target is None else f"≥ {target}", False)  # fmt: skip
            else:
                share = rate / fp16
                said = f"{rate:,.1f} images/s = {share:.3f} of the fp16 limit"
                table.add(f"{label}, queued → done ({how})", said,
                          "" if target is None else f"≥ {target}",
                          share >= target if gpu and target is not None else None)  # fmt: skip
            table.add(f"{label} ({how}): precision decided", precision)
    if args.base is not None:  # the same daemon set-up: what the changes since it bought
        rate, precision = through_daemon("base-small", args.base.resolve(), work, small,
                                         args.images, local, args.batch_timeout)  # fmt: skip
        table.add(
            f"{args.images:,} × 256², queued → done (base)",
            "not done"
            if rate is None
            else f"{rate:,.1f} images/s = {rate / limit['fp16']:.3f} of the fp16 limit",
        )
        table.add(f"{args.images:,} × 256² (base): precision decided", precision)
    if args.old is not None and "old" not in args.skip:
        old_local = {"max_parallel": 4, "cpus_per_job": 1, "max_gpus": 1, "inference_gpus": 1}
        rate, _ = through_daemon("old-small", args.old.resolve(), work, small, args.images,
                                 old_local, args.batch_timeout)  # fmt: skip
        table.add(
            f"{args.images:,} × 256², queued → done (old, 4 jobs)",
            "not done"
            if rate is None
            else f"{rate:,.1f} images/s = {rate / limit['fp16']:.3f} of the fp16 limit",
        )

    if "slide" not in args.skip:
        settings = {} if "resident" in args.skip else resident
        slide_rows(table, work, args.slide, args.cpus_per_job, device, gpu,
                   (local, settings), args.batch_timeout)  # fmt: skip
    if "host" not in args.skip:
        for size, batch_dir, count in ((256, small, args.images), (args.big_size, big, args.big)):
            if not count:
                continue
            whole, inner = host_pipeline(batch_dir, work / "registry", args.cpus_per_job)
            table.add(
                f"host pipeline alone (stand-in net, no object step), {size}², "
                f"{args.cpus_per_job} CPUs",
                f"{whole:,.0f} images/s start to end, {inner:,.0f} over its images",
            )
    if "compile" not in args.skip:  # last: its builds are the step a short lease can spare
        spent = compiled_rows(table, net, decoded, 256, device, args.compile_seconds)
        if cuda:  # (on the CPU one compilation, 1-2 min here, shows that it works)
            compiled_rows(table, net, decoded_big, args.big_size, device,
                          args.compile_seconds - spent)  # fmt: skip
    table.print()
    print(f"took {time.monotonic() - table.started:.0f} s; logs under {work}")
    return 0


def slide_rows(
    table: Table, work: Path, size: int, cpus: int, device: str, gpu: bool,
    daemons: tuple[dict[str, Any], ...], timeout: float,
) -> None:  # fmt: skip
    """A ``size``² slide, 30 % tissue: one job on the device, one on 8 CPU threads; then the
    slide dropped as a batch into a daemon of each of ``daemons``' settings (none empty), queued
    → done: its job forked from a warm start (with ``resident_device``, its net on the resident
    device), then its report."""
    slide = work / "slide"
    started = time.monotonic()
    synth.write_slide(slide / "images" / "slide.tif", size, seed=4, tissue=0.3)
    print(f"slide written in {time.monotonic() - started:.0f} s", flush=True)
    cuda = device.startswith("cuda")
    on_gpu = slide_job(slide, work / "registry", cpus, 1 if cuda else 0, "gpu")
    on_cpu = slide_job(slide, work / "registry", 8, 0, "cpu8")
    jobrun.remove_spent(slide)
    mpx = size**2 / on_gpu / 1e6
    table.add(f"slide {size:,}², 30 % tissue, on {device}", f"{on_gpu:.1f} s = "
              f"{mpx:.1f} Mpx/s", "≥ 80 Mpx/s", mpx >= 80 if gpu else None)  # fmt: skip
    table.add("the slide on 8 CPU threads", f"{on_cpu:.1f} s: {device} {on_cpu / on_gpu:.1f}× "
              "as fast", "≥ 8×", on_cpu / on_gpu >= 8 if gpu else None)  # fmt: skip
    write_manifest(slide, "min_object_area=16")
    for settings in filter(None, daemons):
        resident = bool(settings.get("resident_device"))
        how = "resident device" if resident else "its own net"
        rate, _ = through_daemon("slide-resident" if resident else "slide-own", REPO, work,
                                 slide, 1, settings, timeout)  # fmt: skip
        label = f"slide {size:,}², queued → done through the daemon (warm, {how})"
        if rate is None:
            table.add(label, f"not done in {timeout:.0f} s", "≥ 80 Mpx/s", False)
            continue
        mpx = size**2 * rate / 1e6
        table.add(label, f"{1 / rate:.1f} s = {mpx:.1f} Mpx/s", "≥ 80 Mpx/s",
                  mpx >= 80 if gpu else None)  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
