"""The inference job with its net replaced by a zero-cost stand-in: for benchmarks of the job's
host side only (scripts/bench_host.py, scripts/bench_gpu.py, scripts/bench_batch.py), never for
real work.

    PYTHONPATH=CODE python scripts/standin_job.py JOB_DIR

runs ``python -m pipelines.infer JOB_DIR`` of the code tree first on the path (the new code or
a checkout of the old one), with ``models.unet.UNet`` swapped for a stand-in as that module is
imported, whenever the job imports it (a job may import torch late: :mod:`pipelines.infer`):
the registry's model is resolved, read and checked as always, but the "net" gives back its
input as the logits. With the threshold at sigmoid(0.5) (0.6225) a synthetic spheroid image's
mask is then its pixels brighter than mid-grey: real masks, real objects, for the labelling,
encoding and writing that follow; the forward pass costs nothing.

    PYTHONPATH=CODE python scripts/standin_job.py --spare pipelines.infer

is the same job's warm start (:mod:`daemon.executors.local_job`): a launcher that imports the
job's code, the stand-in swapped in, and waits on its stdin for the job handed to it.
:func:`site_folder` puts the same swap into every process of a whole daemon instead.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

THRESHOLD = 0.6225  # sigmoid(0.5): the stand-in's mask is its image above mid-grey
SPARE = "--spare"  # as daemon.executors.local_job's: imported there only when asked for
NET_MODULE = "models.unet"


def stand_in(torch: Any) -> type:
    """The stand-in's class: takes the U-Net's arguments and weights, and gives back its input
    as the logits (made once torch is imported, by the net's module)."""

    class StandIn(torch.nn.Module):  # type: ignore[misc, name-defined]
        def __init__(self, **architecture: Any) -> None:
            super().__init__()
            self.shape = architecture

        def load_state_dict(self, state_dict: Mapping[str, Any], *args: Any, **kwargs: Any
                            ) -> Any:  # fmt: skip
            return torch.nn.modules.module._IncompatibleKeys([], [])  # nothing to load

        def forward(self, images: Any) -> Any:
            return images

    return StandIn


class _SwapNet(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the net's module as Python would, runs it, then puts the stand-in in its place."""

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name != NET_MODULE:
            return None
        sys.meta_path.remove(self)
        found = importlib.util.find_spec(name)
        assert found is not None and found.loader is not None, f"{name} not found"
        self.real = found.loader
        found.loader = self
        return found

    def exec_module(self, module: ModuleType) -> None:
        self.real.exec_module(module)  # type: ignore[attr-defined]
        module.UNet = stand_in(module.torch)  # type: ignore[attr-defined]


def site_folder(folder: Path) -> Path:
    """``folder`` made to hold a ``sitecustomize`` that swaps the stand-in in for the net in
    every Python process that has it first on PYTHONPATH: a whole daemon's jobs, warm starts
    and resident devices (``bench_batch.py --standin``), of whichever code tree they run."""
    folder.mkdir(parents=True, exist_ok=True)
    scripts = str(Path(__file__).resolve().parent)
    (folder / "sitecustomize.py").write_text(
        "import sys\n"
        f"sys.path.insert(0, {scripts!r})\n"
        "from standin_job import _SwapNet\n"
        f"sys.path.remove({scripts!r})\n"
        "sys.meta_path.insert(0, _SwapNet())\n",
        encoding="utf-8",
    )
    return folder


def main() -> int:
    if sys.argv[1:2] == [SPARE]:  # a warm start of the stand-in job (bench_host.py)
        sys.meta_path.insert(0, _SwapNet())
        from daemon.executors import local_job

        return local_job.main(sys.argv[1:])
    # The code tree's pipelines package first, as ``python -m pipelines.infer`` imports it:
    # while that locates the module, sys.argv[0] is "-m" (pipelines/__init__.py: imports with
    # the garbage collector off, where the code tree does that).
    script, sys.argv[0] = sys.argv[0], "-m"
    import pipelines  # noqa: F401

    sys.argv[0] = script
    sys.meta_path.insert(0, _SwapNet())
    from daemon.contract.jobspec import Pipeline
    from pipelines import job
    from pipelines.infer import infer

    if hasattr(job, "main"):  # the job ends as the code tree's own does (older trees: below)
        job.main(Pipeline.INFER, infer)
    return job.run_job(Pipeline.INFER, infer, sys.argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
