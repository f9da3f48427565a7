"""The job shell's allocator setting: freed memory is reused, not faulted in again."""

from __future__ import annotations

import subprocess
import sys
import textwrap

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
