"""The job shell's allocator settings and its peak memory: freed memory is reused, not
faulted in again; handed back where it lies between live blocks; a peak is the job's own. And
what it trusts: a spec only in a private spool, and only the spec of its own folder."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from daemon.contract.jobspec import ModelRef, Pipeline

# Four 8 MiB blocks allocated, written and freed, 20 times: the pattern of a forward pass's
# activations. Prints the minor page faults of the 20 rounds (after 3 to settle).
CYCLES = textwrap.dedent(
    """
    import sys
    import numpy as np
    from pipelines.job import keep_freed_memory
    if sys.argv[1] == "kept":
        assert keep_freed_memory()
    def faults():
        return int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[7])
    for _ in range(3):
        blocks = [np.ones(2**20) for _ in range(4)]
        del blocks
    before = faults()
    for _ in range(20):
        blocks = [np.ones(2**20) for _ in range(4)]
        del blocks
    print(faults() - before)
    """
)


def _faults(mode: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", CYCLES, mode], capture_output=True, text=True, check=True
    )
    return int(done.stdout)


def test_a_job_process_reuses_the_memory_it_freed() -> None:
    default, kept = _faults("default"), _faults("kept")
    assert default > 10 * 2048, "glibc's default no longer returns such blocks"  # 8 MiB: 2048
    assert kept < default / 100


# Blocks of 1 MiB (served from the heap once freed memory is kept), each followed by a small
# block that stays: the pattern of a slide's rows of windows around its long-lived arrays.
# Frees the large ones; prints the resident MiB then, and after give_back_freed_memory.
HOLES = textwrap.dedent(
    """
    import ctypes
    from pipelines.job import give_back_freed_memory, keep_freed_memory
    assert keep_freed_memory()
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    def resident():
        return int(open("/proc/self/statm").read().split()[1]) * 4096 // 2**20
    large, small = [], []
    for _ in range(400):
        block = libc.malloc(2**20)
        ctypes.memset(block, 1, 2**20)
        large.append(block)
        small.append(libc.malloc(64))
    for block in large:
        libc.free(block)
    held = resident()
    give_back_freed_memory()
    print(held, resident())
    """
)


def test_freed_heap_memory_between_live_blocks_is_given_back() -> None:
    done = subprocess.run([sys.executable, "-c", HOLES], capture_output=True, text=True, check=True)
    held, after = map(int, done.stdout.split())
    assert held > 400, "400 MiB freed between live blocks stays resident until given back"
    assert after < held - 350


# A parent that touched 600 MiB starts a child python: the child's peak is its own.
PARENT = textwrap.dedent(
    """
    import resource, subprocess, sys
    import numpy as np
    kept = np.ones(600 * 2**17)  # 600 MiB, written
    child = "from pipelines.job import _peak_rss_mb; print(_peak_rss_mb())"
    said = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                          check=True).stdout
    print(float(said), resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)
    """
)


def test_a_job_s_peak_memory_is_its_own_not_its_parent_s() -> None:
    done = subprocess.run(
        [sys.executable, "-c", PARENT], capture_output=True, text=True, check=True
    )
    own, getrusage = map(float, done.stdout.split())
    assert getrusage > 600, "getrusage counts the parent's memory at the fork"
    assert own < 400


def test_a_job_refuses_a_spec_that_is_not_in_a_private_spool(
    tmp_path: Path, job_spec: Callable[..., Any], run: Callable[..., Any]
) -> None:
    """A job trusts only a spec in the service's spool: one in a folder that someone else could
    write (or whose parent someone else could change) is not read, and no result is written
    (nothing there would be trusted either). Made private, the same spec runs."""
    batch_dir = tmp_path / "batch"
    batch_dir.mkdir()
    spec = job_spec(batch_dir, Pipeline.REPORT, (), registry=tmp_path / "registry",
                    model=ModelRef("m"), params={}, job_name="report")  # fmt: skip
    work = Path(spec.work_dir)
    work.chmod(0o777)  # the folder above the job folders: anyone may rename them
    refused = run(spec)
    assert refused.returncode == 2 and refused.result is None
    assert "the job folder is not the service's alone, its spec is not read" in refused.log
    assert "writable by its group or by others without the sticky bit" in refused.log
    work.chmod(0o755)
    again = run(spec)
    assert again.result is not None  # read and run (it fails: nothing to report)
    assert "nothing to report" in again.result.error.message  # type: ignore[union-attr]


def test_a_spec_that_names_another_job_folder_is_refused(
    tmp_path: Path, job_spec: Callable[..., Any], run: Callable[..., Any]
) -> None:
    """A spec copied into another job's folder still names its own: the job refuses it."""
    batch_dir = tmp_path / "batch"
    batch_dir.mkdir()
    spec = job_spec(batch_dir, Pipeline.REPORT, (), registry=tmp_path / "registry",
                    model=ModelRef("m"), params={}, job_name="report")  # fmt: skip
    other = spec.job_dir.parent / "other"
    other.mkdir()
    (other / "spec.json").write_text(spec.to_json())
    refused = run(dataclasses.replace(spec, job_name="other"))  # runs other/, reads its spec
    assert refused.returncode == 2 and refused.result is None
    assert f"is the spec of {spec.job_dir}" in refused.log


def test_a_job_imports_with_the_collector_off_and_freezes_what_it_imported(
    tmp_path: Path, job_spec: Callable[..., Any], run: Callable[..., Any]
) -> None:
    """Started as ``python -m pipelines.<name>``, a job imports with the cyclic garbage
    collector off, freezes what it imported and turns the collector on again; imported any
    other way, the package leaves the collector as it was."""
    batch_dir = tmp_path / "batch"
    batch_dir.mkdir()
    spec = job_spec(batch_dir, Pipeline.REPORT, (), registry=tmp_path / "registry",
                    model=ModelRef("m"), params={}, job_name="report")  # fmt: skip
    done = run(spec)
    assert done.result is not None  # it ran (and failed: nothing to report)
    frozen = re.search(r"imports done: (\d+) objects frozen", done.log)
    assert frozen is not None and int(frozen.group(1)) > 10_000
    probe = textwrap.dedent(
        """
        import gc
        import pipelines.job
        print(gc.isenabled(), pipelines.job.settle_collector(), gc.get_freeze_count())
        """
    )
    imported = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                              check=True)  # fmt: skip
    assert imported.stdout.split() == ["True", "0", "0"]


def test_every_module_run_with_m_turns_the_collector_on_again() -> None:
    """``python -m pipelines.<name>`` imports with the collector off (pipelines/__init__.py):
    every module of the package that can be run so is a job that goes through ``run_job``
    (itself, or :func:`pipelines.job.main`, which ends the process after it), or turns it on
    itself (the resident device: :func:`pipelines.job.settle_collector`)."""
    package = Path(__file__).resolve().parents[2] / "pipelines"
    runnable = [
        path for path in package.rglob("*.py") if '__name__ == "__main__"' in path.read_text()
    ]
    assert len(runnable) >= 5  # infer, report, assemble, train, sweep
    through = re.compile(r"\b(run_job|main)\(Pipeline\.|\bsettle_collector\(\)")
    assert [path.name for path in runnable if not through.search(path.read_text())] == []


@pytest.mark.parametrize("module", ["pipelines.infer", "pipelines.report", "pipelines.assemble"])
def test_a_job_that_ends_at_once_ends_with_its_status_and_its_whole_log(
    module: str, tmp_path: Path
) -> None:
    """The jobs that end the process right after their work (:func:`pipelines.job.main`) exit
    with the status :func:`pipelines.job.run_job` gave (here a job folder that is not there:
    refused, 2), its last log line written."""
    done = subprocess.run([sys.executable, "-m", module, str(tmp_path / "gone")],
                          cwd=Path(__file__).resolve().parents[2], capture_output=True,
                          text=True, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 2, done.stderr
    last = done.stdout.splitlines()[-1]
    assert "ERROR" in last and "its spec is not read" in last and "gone" in last
