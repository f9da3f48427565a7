"""The spool: the service's own folder, where the daemon and its jobs exchange what they must
trust, out of the data owners' reach.

A batch folder and its drop root belong to their owners, who may plant, swap or forge anything
in them at any moment. So nothing the daemon and the jobs hand each other lies there: job specs,
job scripts and task lists, launch records, results, progress, logs, the shard tables and
ledgers, a slide's work arrays, training's and a sweep's intermediate files, and the drop
roots' leases all live in the spool (``[daemon] spool_dir``)::

    leases/<root key>.json                  a drop root's lease (daemon.site.claims)
    runs/b<batch id>/<run name>/            a run's work folder (JobSpec.work_dir):
        jobs/<job name>/                    spec.json, result.json, progress.json, log.txt,
                                            launch.json
        jobs/slurm/<key>.sh, <key>.tasks    a Slurm launch's script and tasks
        parts/, ledger/, regions/, training/, trials/, sweep/   (pipelines/layout.py)

The owner's ``results/<run name>/`` gets only what is meant for the owner (masks, tables, the
report, copies of the jobs' logs).

The spool is private when no one but the service's user (and root) can change what a path in
it leads to: it is a real folder owned by the service's user, writable by no group and no
other, and every folder above it is owned by root or that user and writable by no one else
(unless it has the sticky bit, as /tmp: then no one else can rename or remove what is the
service's). :func:`private_problem` tells; the daemon refuses to start on a spool that is not
private, and a job refuses a spec that does not lie in one.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath

RUNS_DIR = "runs"
LEASES_DIR = "leases"
FOLDER_MODE = 0o750  # the service writes, its group (operators) reads, no one else


def work_dir(spool: Path | str, batch_id: int, run_dir: Path | str) -> Path:
    """The work folder in the spool of a batch's run ``run_dir`` (its results folder in the
    batch folder): named by the batch and the run, so a new revision has a new one."""
    return Path(spool) / RUNS_DIR / f"b{batch_id:06d}" / PurePosixPath(run_dir).name


def private_problem(path: Path | str, user: int | None = None) -> str:
    """What makes ``path`` not a private folder of ``user`` (the effective user by default):
    '' when it is one. See the module's docstring for what private means. A link on the way is
    looked through: the folders on both ways, the named and the real, are checked."""
    user = os.geteuid() if user is None else user
    path = Path(os.path.abspath(path))
    try:
        own = os.stat(path)
    except OSError as exc:
        return f"{path} cannot be looked at: {exc.strerror}"
    if not stat.S_ISDIR(own.st_mode):
        return f"{path} is not a folder"
    if own.st_uid != user:
        return f"{path} is owned by uid {own.st_uid}, not by the service's user (uid {user})"
    if own.st_mode & 0o022:
        return (
            f"{path} is writable by its group or by others (mode {stat.filemode(own.st_mode)}): "
            "only the service's user may write it (chmod go-w)"
        )
    real = Path(os.path.realpath(path))
    for above in dict.fromkeys([*path.parents, *real.parents]):
        problem = _above_problem(above, user)
        if problem:
            return f"{problem}: someone else could move {path} away and put another in its place"
    return ""


def _above_problem(folder: Path, user: int) -> str:
    try:
        st = os.lstat(folder)
    except OSError as exc:
        return f"{folder} cannot be looked at ({exc.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return ""  # who may change it is the folder holding it's owner: checked in its turn
    if st.st_uid not in (0, user):
        return f"{folder} is owned by uid {st.st_uid}, neither root nor the service's user"
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        return (
            f"{folder} is writable by its group or by others without the sticky bit "
            f"(mode {stat.filemode(st.st_mode)})"
        )
    return ""


def make_private(path: Path | str) -> None:
    """Make the folder ``path`` (and those missing above it) with the spool's mode, never more
    open than the umask allows; an existing folder is left as it is."""
    path = Path(path)
    missing = []
    for folder in (path, *path.parents):
        if os.path.lexists(folder):
            break
        missing.append(folder)
    for folder in reversed(missing):
        try:
            os.mkdir(folder, FOLDER_MODE)
        except FileExistsError:
            continue
