"""The inference job with its net replaced by a zero-cost stand-in: for benchmarks of the job's
host side only (scripts/bench_host.py, scripts/bench_gpu.py), never for real work.

    PYTHONPATH=CODE python scripts/standin_job.py JOB_DIR

runs ``python -m pipelines.infer JOB_DIR`` of the code tree first on the path (the new code or
a checkout of the old one), with ``models.unet.UNet`` swapped for :class:`StandIn` before the
job's modules are imported: the registry's model is resolved, read and checked as always, but
the "net" gives back its input as the logits. With the threshold at sigmoid(0.5) (0.6225) a
synthetic spheroid image's mask is then its pixels brighter than mid-grey: real masks, real
objects, for the labelling, encoding and writing that follow; the forward pass costs nothing.
"""

from __future__ import annotations

import sys

# The code tree's pipelines package first, as ``python -m pipelines.infer`` imports it: while
# that locates the module, sys.argv[0] is "-m" (pipelines/__init__.py: imports with the
# garbage collector off, where the code tree does that).
_script, sys.argv[0] = sys.argv[0], "-m"
import pipelines  # noqa: E402, F401

sys.argv[0] = _script

from collections.abc import Mapping  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

import models.unet  # noqa: E402

THRESHOLD = 0.6225  # sigmoid(0.5): the stand-in's mask is its image above mid-grey


class StandIn(torch.nn.Module):
    """Takes the U-Net's arguments and weights, and gives back its input as the logits."""

    def __init__(self, **architecture: Any) -> None:
        super().__init__()
        self.shape = architecture

    def load_state_dict(self, state_dict: Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
        return torch.nn.modules.module._IncompatibleKeys([], [])  # nothing to load

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return images


def main() -> int:
    models.unet.UNet = StandIn  # type: ignore[misc, assignment]
    from daemon.contract.jobspec import Pipeline
    from pipelines.infer import infer
    from pipelines.job import run_job

    return run_job(Pipeline.INFER, infer, sys.argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
