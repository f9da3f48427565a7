"""What the inference tests share (a module of its own: a test module imports no conftest at
run time): masks read back, jobs run behind an audit hook of their main process's imports, and
through the local executor, as the daemon runs them."""

from __future__ import annotations

import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import tifffile
from PIL import Image

from daemon.contract.jobspec import LOG_FILE, JobSpec, Pipeline
from daemon.core.states import Phase
from daemon.executors import Accepted, Submission
from daemon.executors.local import LocalExecutor


def read_mask(path: Path) -> np.ndarray:
    """The stored mask pixels, as written (no conversion)."""
    if path.suffix == ".tif":
        return tifffile.imread(path)
    with Image.open(path) as image:
        return np.asarray(image)


# Runs a job as the executors do, behind an audit hook that writes to the job's log every module
# of these its main process imports (the processes it forks have other pids and say nothing).
WATCHED = ("torch", "PIL", "imagecodecs", "tifffile", "scipy", "skimage")
MAIN_IMPORTS = [sys.executable, "-c", textwrap.dedent(f"""
    import os, runpy, sys
    main, seen = os.getpid(), set()
    def said(event, args):
        top = args[0].split(".")[0] if event == "import" else None
        if top in {WATCHED} and top not in seen and os.getpid() == main:
            seen.add(top)
            os.write(2, f"the main process imports {{args[0]}}\\n".encode())
    sys.addaudithook(said)
    sys.argv = sys.argv[-2:]  # what follows: PYTHON -m MODULE JOB_DIR
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
""")]  # fmt: skip


def through_executor(executor: LocalExecutor, spec: JobSpec, warm: bool) -> str:
    """Run the inference job of ``spec`` (on ``spec.resources.cpus`` CPUs) through the local
    executor, as the daemon does; ``warm``: once a warm start said its imports are done (the
    job is forked from it). Asserts that it succeeded; its log."""
    ready_by = time.monotonic() + 120
    while warm and not any(spare.says_ready() for spare in executor.spares.waiting()):
        assert time.monotonic() < ready_by, "the spare never said its imports were done"
        time.sleep(0.05)
    cpus = spec.resources.cpus
    sub = Submission(1, spec.job_name, Pipeline.INFER.module, spec.job_dir, cpus=cpus)
    (accepted,) = executor.submit([sub])
    assert isinstance(accepted, Accepted), accepted
    deadline = time.monotonic() + 240
    while (status := executor.poll([accepted.handle])[accepted.handle]).phase is Phase.RUNNING:
        assert time.monotonic() < deadline, "the job did not end"
        time.sleep(0.1)
    log = (spec.job_dir / LOG_FILE).read_text()
    assert status.exit_code == 0, log
    return log
