"""What Slurm's accounting says of the jobs watchd submitted: ``sacct``, where the cluster keeps
accounting (slurmdbd). ``watchctl usage`` sets it beside what the jobs measured themselves.

Slurm's figures are the allocation's: CPU time as ``CPUTimeRAW`` (elapsed seconds × CPUs
allocated), GPU time as elapsed × the GPUs in ``AllocTRES``, charged to the job's account. A
cluster without accounting says so (``sacct`` exits non-zero): its words are returned as a note,
and the jobs' own figures stand alone. The text is read by pure functions, tested with strings.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from daemon.contract.errors import CommandFailed
from daemon.site.subprocesses import run

SACCT_FORMAT = "JobID,Account,CPUTimeRAW,ElapsedRaw,AllocTRES"
CHUNK = 500  # job ids per sacct call
HANDLE_PREFIX = "slurm:"


@dataclass(frozen=True)
class SacctLine:
    job: str  # "123" or "123_4"
    account: str
    cpu_s: float
    gpu_s: float


def sacct_args(job_ids: Sequence[str]) -> list[str]:
    return ["sacct", "--noheader", "--parsable2", "--allocations",
            f"--jobs={','.join(job_ids)}", f"--format={SACCT_FORMAT}"]  # fmt: skip


def parse_sacct(text: str) -> list[SacctLine]:
    """Lines of ``sacct --parsable2`` in :data:`SACCT_FORMAT`; lines that do not fit are
    skipped."""
    found = []
    for line in text.splitlines():
        parts = line.split("|")
        if len(parts) != 5 or not parts[0].strip():
            continue
        job, account, cpu, elapsed, tres = (p.strip() for p in parts)
        if not (cpu.isdigit() and elapsed.isdigit()):
            continue
        gpus = re.search(r"gres/gpu=(\d+)", tres)
        gpu_s = float(elapsed) * int(gpus.group(1)) if gpus else 0.0
        found.append(SacctLine(job, account, float(cpu), gpu_s))
    return found


def sacct_usage(
    handles: Sequence[str], timeout: float, env: Mapping[str, str] | None = None
) -> tuple[list[SacctLine], str]:
    """What sacct says of these watchd handles (``slurm:123_4``), and a note when it said
    nothing (accounting off, the tool missing, or no Slurm job among the handles)."""
    ids = list(dict.fromkeys(h.removeprefix(HANDLE_PREFIX) for h in handles
                             if h.startswith(HANDLE_PREFIX)))  # fmt: skip
    if not ids:
        return [], "no Slurm job ended in the period"
    found: list[SacctLine] = []
    for start in range(0, len(ids), CHUNK):
        try:
            said = run(sacct_args(ids[start : start + CHUNK]), timeout=timeout, env=env)
            found += parse_sacct(said)
        except CommandFailed as exc:
            words = (exc.stderr or exc.stdout).strip().splitlines()
            return [], f"{words[-1] if words else 'sacct failed'}; the figures are the jobs' own"
        except OSError as exc:
            return [], f"sacct cannot be run ({exc.strerror or exc}); the figures are the jobs' own"
    return found, ""
