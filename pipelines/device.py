"""Where an inference job runs its net: the CPU, or the GPU it was given. Pure.

A job is given GPUs by its spec (``resources.gpus``: the manifest's ``[resources] gpus``, else
the site's ``inference_gpus``). Slurm hands a job its allocation as CUDA_VISIBLE_DEVICES (the
devices are then numbered from 0 inside the job); the local executor leaves the variable as
the daemon has it. The job runs on ``cuda:0`` when it was given a GPU and CUDA shows one, on
the CPU otherwise, and says why.

On a GPU the net takes ``gpu_batch_size`` images at once (default 16: a GPU is fed badly one
image at a time, where the CPU measured fastest at one), from pinned host memory with
asynchronous copies, and in half precision under autocast when ``mixed_precision`` (default
true) and the masks of the first batch equal those of full precision (else full precision).

The CUDA path has not run on a GPU here (the development machines have none); the choice is
tested on the CPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from daemon.contract.names import inference_params

NO_DEVICES = frozenset({"", "-1", "none", "NoDevFiles"})  # what hides every GPU


@dataclass(frozen=True)
class Placement:
    device: str  # "cpu" or "cuda:0"
    batch_size: int
    mixed_precision: bool  # wanted: kept only if the first batch's masks agree
    reason: str

    @property
    def cuda(self) -> bool:
        return self.device != "cpu"


def choose_device(
    gpus_given: int, environ: Mapping[str, str], cuda_devices: int, params: Mapping[str, Any]
) -> Placement:
    """Where the net runs: ``gpus_given`` from the spec, ``environ`` the job's environment,
    ``cuda_devices`` what torch sees (``torch.cuda.device_count()``), ``params`` the job's
    inference parameters (``batch_size``, ``gpu_batch_size``, ``mixed_precision``)."""
    params = inference_params(params)
    cpu_batch = int(params["batch_size"])
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if gpus_given <= 0:
        return Placement("cpu", cpu_batch, False, "no GPU was given to this job")
    if visible is not None and visible.strip() in NO_DEVICES:
        return Placement(
            "cpu", cpu_batch, False, f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU"
        )
    if cuda_devices <= 0:
        return Placement(
            "cpu", cpu_batch, False,
            f"{gpus_given} GPU(s) given, but CUDA shows none (no driver, or a CPU build of torch)",
        )  # fmt: skip
    batch = max(cpu_batch, int(params["gpu_batch_size"]))
    half = bool(params["mixed_precision"])
    where = f"CUDA_VISIBLE_DEVICES={visible}" if visible is not None else "every GPU visible"
    return Placement("cuda:0", batch, half, f"{gpus_given} GPU(s) given, {where}")
