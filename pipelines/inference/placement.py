"""Where an inference job runs its net, how many images at once, and in what precision. Pure.

A job is given GPUs by its spec (``resources.gpus``: the manifest's ``[resources] gpus``, else
the site's ``inference_gpus``). Slurm hands a job its allocation as CUDA_VISIBLE_DEVICES, and so
does the local executor (each job its own GPUs); the devices are then numbered from 0 inside
the job. The job runs on ``cuda:0`` when it was given a GPU and CUDA shows one, on the CPU
otherwise, and says why.

**How many at once.** On the CPU, ``batch_size`` images (1 measured fastest). On a GPU,
``gpu_batch_size`` when the manifest sets it, else :func:`sized_batch`: as many images of the
batch's size as make about :data:`BATCH_PIXELS` pixels (a GPU is fed badly by a few small
images; the figures in docs/benchmarks.md peak near 4–8 Mpx per batch), never more than
:data:`MEMORY_SHARE` of the GPU's free memory holds at the bytes per pixel the first image's
forward pass measured.

**In what precision.** On a GPU, with ``mixed_precision`` (the default), the first batch is run
in full precision (IEEE fp32) and in each faster candidate, half (fp16) first, then bfloat16,
then TF32; the first whose masks agree with full precision's on at least :data:`AGREEMENT` of
their pixels, with as many objects as full precision's in at least :data:`COUNT_AGREEMENT` of the
images, is kept for the job (:func:`precision_verdict`); none: full precision. (The counts'
tolerance lets up to 1 % of a first batch's images differ, one in a batch of 100 to 199, by
specks that a pixel made or split: no real net gives every image the same count in every
precision, and fp32 on a GPU itself differs from the CPU's by a few pixels in a million.
Below 100 images every count must be the same.) Without ``mixed_precision``, TF32 alone is
tried. The decision and its measured agreement are in the job's log, its summary, each table
row (``precision``) and the report.

**Compiled.** ``gpu_compile`` (off by default) runs a GPU's full batches of one image size
through ``torch.compile`` ("compile") or as a CUDA graph captured once per size ("graphs"); the
last, smaller batch of a size, and a slide's windows, run eager. The first full batch of each
size is held to the precision rule against full precision's eager masks and goes back to eager
if it fails (:mod:`pipelines.inference.device`). On the CPU the setting is ignored, with a line
in the job's log (:func:`compile_plan`): a manifest written for a GPU node runs unchanged on a
machine without one, as ``mixed_precision`` does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, get_args

import numpy as np

from daemon.contract.names import GpuCompile, inference_params

NO_DEVICES = frozenset({"", "-1", "none", "NoDevFiles"})  # what hides every GPU
FULL = "fp32"  # IEEE single precision: the reference every other precision is held to
HALF, BFLOAT, TF32 = "fp16", "bf16", "tf32"
AGREEMENT = 0.999  # of the first batch's pixels, for a faster precision to be kept
COUNT_AGREEMENT = 0.99  # of its images with as many objects as in full precision, likewise
BATCH_PIXELS = 2**23  # pixels of one GPU batch when its size is not given (8 Mpx)
MEMORY_SHARE = 0.5  # of the GPU's free memory one batch's forward pass may take
MOST_AT_ONCE = 1024
# batches on their way to a GPU at once: one copied in, one running, one copied out (the job's
# own device stage's pinned buffers, pipelines/inference/device.py, or its transfer slabs to a
# resident device, pipelines/inference/remote.py)
IN_FLIGHT = 3
EAGER = "off"
COMPILE_MODES: tuple[str, ...] = get_args(GpuCompile)  # off, compile, graphs


@dataclass(frozen=True)
class Placement:
    device: str  # "cpu" or "cuda:0"
    batch_size: int  # 0: sized by the images and the GPU's memory (sized_batch)
    mixed_precision: bool  # fp16 and bf16 wanted: kept only if the first batch agrees
    reason: str
    compile: str = EAGER  # gpu_compile as asked: "off", "compile" or "graphs"

    @property
    def cuda(self) -> bool:
        return self.device != "cpu"

    def candidates(self) -> tuple[str, ...]:
        """The precisions tried on the first batch against full precision, fastest first."""
        if not self.cuda:
            return ()
        return (HALF, BFLOAT, TF32) if self.mixed_precision else (TF32,)


def choose_device(
    gpus_given: int, environ: Mapping[str, str], cuda_devices: int, params: Mapping[str, Any]
) -> Placement:
    """Where the net runs: ``gpus_given`` from the spec, ``environ`` the job's environment,
    ``cuda_devices`` what torch sees (``torch.cuda.device_count()``), ``params`` the job's
    inference parameters (``batch_size``, ``gpu_batch_size``, ``mixed_precision``,
    ``gpu_compile``: a value other than those the manifest allows is a ValueError)."""
    params = inference_params(params)
    cpu_batch, compiled = int(params["batch_size"]), str(params["gpu_compile"])
    if compiled not in COMPILE_MODES:  # the manifest refuses it: a spec written by hand
        raise ValueError(f"gpu_compile {compiled!r}: must be one of {', '.join(COMPILE_MODES)}")
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if gpus_given <= 0:
        return Placement("cpu", cpu_batch, False, "no GPU was given to this job", compiled)
    if visible is not None and visible.strip() in NO_DEVICES:
        return Placement("cpu", cpu_batch, False,
                         f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU", compiled)  # fmt: skip
    if cuda_devices <= 0:
        return Placement(
            "cpu", cpu_batch, False,
            f"{gpus_given} GPU(s) given, but CUDA shows none (no driver, or a CPU build of torch)",
            compiled,
        )  # fmt: skip
    half = bool(params["mixed_precision"])
    where = f"CUDA_VISIBLE_DEVICES={visible}" if visible is not None else "every GPU visible"
    return Placement("cuda:0", int(params["gpu_batch_size"]), half,
                     f"{gpus_given} GPU(s) given, {where}", compiled)  # fmt: skip


def compile_plan(where: Placement) -> tuple[str, str]:
    """The compilation the job uses (``gpu_compile`` on a GPU, "off" on the CPU) and the log
    line that says so."""
    if where.compile == EAGER:
        return EAGER, "gpu_compile: off, the net runs eager"
    if not where.cuda:
        return EAGER, f"gpu_compile {where.compile!r} ignored: the net runs on the CPU, eager"
    how = "through torch.compile" if where.compile == "compile" else "as a captured CUDA graph"
    return where.compile, (
        f"gpu_compile {where.compile!r}: full batches of one size run {how} once their first "
        "agrees with full precision's eager masks; the last, smaller one of a size runs eager"
    )


def sized_batch(pixels: int, bytes_per_pixel: float, free_bytes: int, given: int = 0) -> int:
    """Images of ``pixels`` pixels each that go through the net at once on a GPU: ``given``
    when set (the manifest's ``gpu_batch_size``), else about :data:`BATCH_PIXELS` pixels'
    worth, within :data:`MEMORY_SHARE` of ``free_bytes`` at ``bytes_per_pixel`` (what one
    image's forward pass took, per pixel); at least 1, at most :data:`MOST_AT_ONCE`."""
    if given > 0:
        return given
    by_work = BATCH_PIXELS // max(pixels, 1)
    by_memory = int(free_bytes * MEMORY_SHARE // max(bytes_per_pixel * pixels, 1.0))
    return max(1, min(by_work, by_memory, MOST_AT_ONCE))


@dataclass(frozen=True)
class Verdict:
    """How the masks of one batch in ``precision`` compared with full precision's."""

    precision: str
    agreement: float  # the share of pixels whose mask value is the same in both
    counted_alike: int  # images with as many objects in both
    images: int
    need: float = AGREEMENT
    need_counts: float = COUNT_AGREEMENT

    @property
    def counts_equal(self) -> bool:
        """Every image has as many objects in both."""
        return self.counted_alike == self.images

    @property
    def count_agreement(self) -> float:
        return self.counted_alike / max(self.images, 1)

    @property
    def accepted(self) -> bool:
        return self.count_agreement >= self.need_counts and self.agreement >= self.need

    def said(self) -> str:
        kept = "kept" if self.accepted else "not kept"
        return (f"{self.precision}: the first {self.images} mask(s) agree with full "
                f"precision's on {self.agreement:.5f} of pixels (need {self.need}), with as "
                f"many objects in {self.counted_alike} of {self.images} images (need "
                f"{self.need_counts}): {kept}")  # fmt: skip


def precision_verdict(
    precision: str,
    full: Sequence[np.ndarray],
    faster: Sequence[np.ndarray],
    count: Callable[[np.ndarray], int],
) -> Verdict:
    """Compare the masks of one batch made in full precision and in ``precision``: the share
    of pixels that agree over the whole batch, and the images for which ``count`` (objects in a
    mask) is the same."""
    if len(full) != len(faster) or not full:
        raise ValueError(f"{len(full)} masks in full precision against {len(faster)}")
    pixels = sum(mask.size for mask in full)
    agree = sum(int(np.count_nonzero(a == b)) for a, b in zip(full, faster, strict=True))
    alike = sum(count(a) == count(b) for a, b in zip(full, faster, strict=True))
    return Verdict(precision, agree / pixels, alike, len(full))


def decided(verdicts: Sequence[Verdict]) -> str:
    """The precision kept: the first verdict accepted, else full precision."""
    return next((v.precision for v in verdicts if v.accepted), FULL)
