"""How submissions go out to Slurm: grouped into launches (one job, or one job array whose
tasks are the shards of a batch's stage), each with a tasks file and a job script. Pure.

A launch's files live in ``jobs/slurm/`` next to the job folders, in the run's work folder in
the spool (:mod:`daemon.contract.spool`: the service's own, on a share the compute nodes see,
which no data owner can write):

- ``KEY.tasks``: one line per array task, ``<job name>\\t<attempt>``; task *i* runs line *i+1*;
- ``KEY.sh``: the job script, a fixed template whose only values are quoted paths and a module
  name; every Slurm option is an sbatch argument or a pyslurm field, never script text.

Slurm's own output file goes to /dev/null: a task's log is its job folder's (a tasks file names
the job of each task), which the script cannot name to Slurm. The script hands over at once to
:mod:`daemon.executors.slurm_job`, which opens the job's ``log.txt`` and runs the job with its
output there.

KEY is a digest of the job directories and attempts, and the job's comment is
``watchd:<name>:<KEY>``: a restarted daemon, or one whose submit timed out after Slurm accepted
it, finds the launch by its comment and the tasks file, and adopts it instead of submitting
again.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass
from pathlib import Path

from daemon.contract.errors import SubmissionError
from daemon.contract.jobspec import Pipeline, Resources
from daemon.core.owners import Charge
from daemon.executors import Submission
from daemon.executors.resources import Allocation, allocation
from daemon.executors.slurm_api import JobRequest
from daemon.site.config import SlurmExecutorSection

HANDLE_PREFIX = "slurm:"
COMMENT_PREFIX = "watchd:"
LAUNCH_DIR = "slurm"  # beside the job folders, which are named b<batch>-...
SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")

SCRIPT = """\
#!/bin/bash
# watchd job script: a fixed template (daemon/executors/slurm_launch.py). The values put in
# are quoted paths and a module name; every Slurm option was given to sbatch as an argument.
set -euo pipefail
jobs_dir=@JOBS_DIR@
tasks=@TASKS@
python=@PYTHON@
module=@MODULE@
task=${SLURM_ARRAY_TASK_ID:-0}
name=$(sed -n "$((task + 1))p" "$tasks" | cut -f1)
if [ -z "$name" ]; then echo "watchd: no job for task $task in $tasks" >&2; exit 3; fi
job_dir=$jobs_dir/$name
export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}
# log.txt is opened by watchd's launcher (never through a link), not by the shell
exec "$python" -m daemon.executors.slurm_job "$job_dir" -- \\
  @LAUNCHER@"$python" -m "$module" "$job_dir"
"""

# Training runs under srun: one process per task (DDP), with the job's CPUs per task.
SRUN = 'srun --kill-on-bad-exit=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" '


@dataclass(frozen=True)
class Launch:
    """Submissions that go to Slurm together: one job, or one array (task i = submission i)."""

    name: str
    module: str
    jobs_dir: Path
    submissions: tuple[Submission, ...]
    allocation: Allocation

    @property
    def charge(self) -> Charge:
        """The account, QOS and partition of the batch owner the launch's jobs belong to."""
        return self.submissions[0].charge

    @property
    def key(self) -> str:
        lines = "\n".join(f"{s.job_dir}\t{s.attempt}" for s in self.submissions)
        return hashlib.sha256(lines.encode()).hexdigest()[:16]

    @property
    def comment(self) -> str:
        return f"{COMMENT_PREFIX}{self.name}:{self.key}"

    @property
    def is_array(self) -> bool:
        return len(self.submissions) > 1

    @property
    def files(self) -> Path:
        return self.jobs_dir / LAUNCH_DIR

    def handle(self, job_id: str, task: int) -> str:
        return f"{HANDLE_PREFIX}{job_id}_{task}" if self.is_array else f"{HANDLE_PREFIX}{job_id}"


def plan(submissions: Sequence[Submission], site: SlurmExecutorSection) -> list[Launch]:
    """Group submissions into launches: those of one group, folder, program and allocation go
    together as one array (in chunks of ``max_array_tasks``); the rest alone."""
    groups: dict[tuple[str, Path, str, Allocation, Charge, int], list[Submission]] = {}
    for sub in submissions:
        if why := unnameable(sub):
            raise SubmissionError(why)
        given = Resources(cpus=sub.cpus, gpus=sub.gpus, tasks=sub.tasks)
        alloc = allocation(sub.resources, given, site)
        key = (sub.group or sub.name, sub.job_dir.parent, sub.module, alloc, sub.charge,
               sub.throttle)  # fmt: skip
        groups.setdefault(key, []).append(sub)
    launches = []
    size = site.max_array_tasks
    for (group, jobs_dir, module, alloc, *_), subs in groups.items():
        for start in range(0, len(subs), size):
            chunk = tuple(subs[start : start + size])
            name = group if len(chunk) > 1 else chunk[0].name
            launches.append(Launch(name, module, jobs_dir, chunk, alloc))
    return launches


def unnameable(sub: Submission) -> str:
    """Why this job's folder cannot name a line of a tasks file ('' when it can)."""
    if SAFE_NAME.match(sub.job_dir.name):
        return ""
    return f"job name {sub.job_dir.name!r} cannot name a Slurm task"


def tasks_text(launch: Launch) -> str:
    return "".join(f"{s.job_dir.name}\t{s.attempt}\n" for s in launch.submissions)


def parse_tasks(text: str) -> list[tuple[str, int]]:
    """The (job name, attempt) of each task of a tasks file, in task order."""
    found = []
    for line in text.splitlines():
        name, _, attempt = line.partition("\t")
        found.append((name, int(attempt) if attempt.isdigit() else 0))
    return found


def live_tasks(
    tasks: Sequence[tuple[str, int]], array_ids: Sequence[str], live: Set[str]
) -> dict[tuple[str, int], str]:
    """The handle of each task of a tasks file (job name, attempt) that waits or runs in Slurm:
    task *i* of one of ``array_ids`` (the job itself, for a launch of one) among ``live``."""
    found: dict[tuple[str, int], str] = {}
    for array_id in dict.fromkeys(array_ids):
        for i, task in enumerate(tasks):
            slurm_id = f"{array_id}_{i}" if len(tasks) > 1 else array_id
            if slurm_id in live:
                found.setdefault(task, f"{HANDLE_PREFIX}{slurm_id}")
    return found


def job_script(launch: Launch, python: str) -> str:
    filled = {
        "@JOBS_DIR@": shlex.quote(str(launch.jobs_dir)),
        "@TASKS@": shlex.quote(str(launch.files / f"{launch.key}.tasks")),
        "@PYTHON@": shlex.quote(python),
        "@MODULE@": shlex.quote(launch.module),
        "@LAUNCHER@": SRUN if launch.module == Pipeline.TRAIN.module else "",
    }
    text = SCRIPT
    for placeholder, value in filled.items():
        text = text.replace(placeholder, value)
    return text


def request(
    launch: Launch, site: SlurmExecutorSection, script: Path, environment: Mapping[str, str]
) -> JobRequest:
    """The Slurm request of a launch: options from the site's config, the allocation, and the
    batch owner's account, QOS, partition and share of the array throttle."""
    array = None
    if launch.is_array:
        last = len(launch.submissions) - 1
        limit = throttle(site.array_throttle, launch.submissions[0].throttle)
        array = f"0-{last}{f'%{limit}' if limit else ''}"
    charge = launch.charge
    return JobRequest(
        name=launch.name,
        comment=launch.comment,
        script=script,
        work_dir=launch.jobs_dir,
        output=os.devnull,
        time_minutes=launch.allocation.time_minutes,
        memory_mb=launch.allocation.memory_mb,
        cpus_per_task=launch.allocation.cpus,
        ntasks=launch.allocation.tasks,
        gpus=launch.allocation.gpus,
        array=array,
        partition=charge.partition or site.partition,
        account=charge.account or site.account,
        qos=charge.qos,
        constraint=site.constraint,
        environment=environment,
    )


def throttle(site: int, owner: int) -> int:
    """An array's %K: the owner's share of the throttle where it has one below the site's."""
    if owner and (not site or owner < site):
        return owner
    return site


def key_of_comment(comment: str) -> str | None:
    """The launch key in a job's comment, if watchd wrote it."""
    if not comment.startswith(COMMENT_PREFIX):
        return None
    key = comment.rsplit(":", 1)[-1]
    return key if re.fullmatch(r"[0-9a-f]{16}", key) else None
