"""Write files that another party reads so that they appear whole or not at all, by path.

Under a batch folder, every write goes through :mod:`daemon.contract.heldfolder` instead (a name
there may be a planted link or FIFO): this module is for files outside batch folders.

A file written here goes to a temporary name in the same directory, is flushed, and renamed
into place: a reader never sees half a file, and a crash leaves at most a stray ``.tmp-*`` file
that nobody reads. The daemon's writes under batch folders (job specs, launch records,
status files, Slurm launch files) go through :mod:`daemon.contract.heldfolder` instead; this module
serves ``watchctl manifest`` (a folder its caller names; the rename replaces a link at the
name, never follows it) and the pipelines, until they are converted to the same rule.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from daemon.contract.heldfolder import TMP_PREFIX


@contextlib.contextmanager
def atomic_writer(path: Path, *, mode: str = "wb", fsync: bool = True) -> Iterator[IO[bytes]]:
    """Yield a file object whose content replaces ``path`` when the block exits cleanly."""
    path = Path(path)
    fd, tmp_name = tempfile.mkstemp(prefix=TMP_PREFIX + path.name + ".", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; others read what we hand over
        with os.fdopen(fd, mode) as handle:
            yield handle
            handle.flush()
            if fsync:
                os.fsync(handle.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise


def remove_strays(folder: Path) -> list[Path]:
    """Remove the temporaries interrupted writes left anywhere under ``folder`` (regular files
    named ``.tmp-*``; links are neither followed nor removed); the paths removed. Only call it
    when no one else writes under ``folder``: a write in progress has such a file too."""
    removed = []
    for dirpath, _dirnames, filenames in os.walk(folder):
        for name in filenames:
            path = Path(dirpath) / name
            if not name.startswith(TMP_PREFIX):
                continue
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISREG(os.lstat(path).st_mode):
                    path.unlink()
                    removed.append(path)
    return removed


def _umask() -> int:
    """The process umask, read without changing it (os.umask can only be read by setting)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def write_bytes(path: Path, data: bytes, *, fsync: bool = True) -> None:
    """Replace ``path`` with ``data`` atomically."""
    with atomic_writer(path, fsync=fsync) as handle:
        handle.write(data)


def write_text(path: Path, text: str, *, fsync: bool = True) -> None:
    """Replace ``path`` with UTF-8 ``text`` atomically."""
    write_bytes(path, text.encode("utf-8"), fsync=fsync)
