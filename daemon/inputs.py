"""Look at a batch's inputs on disk: the I/O half of readiness (the judgement is pure, in
:mod:`daemon.readiness`).

Only the files a manifest names (or its patterns match) are looked at, and only while the batch
waits. Symlinks are followed only while they stay inside the batch folder; anything that
resolves outside it, or is not a regular file (FIFO, device, folder), is reported as such and
never opened.
"""

from __future__ import annotations

import enum
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from daemon.manifest import MANIFEST_NAME, RESULTS_DIR, STATUS_NAME, Manifest, Pattern


class Presence(enum.Enum):
    FILE = "file"  # a regular file inside the batch folder
    MISSING = "missing"
    OUTSIDE = "outside"  # resolves (through a symlink) outside the batch folder
    SPECIAL = "special"  # a FIFO, device, socket or folder: never read
    UNREADABLE = "unreadable"  # stat failed for another reason (permissions, loop, I/O error)


@dataclass(frozen=True)
class FileSeen:
    path: str  # relative to the batch folder, posix
    presence: Presence
    size: int = 0
    mtime_ns: int = 0
    detail: str = ""


@dataclass(frozen=True)
class PatternSeen:
    pattern: Pattern
    matches: tuple[FileSeen, ...]


@dataclass(frozen=True)
class InputsSeen:
    """What was on disk for one batch at one moment."""

    folder_ok: bool
    files: tuple[FileSeen, ...]
    patterns: tuple[PatternSeen, ...]


def observe(folder: Path, manifest: Manifest) -> InputsSeen:
    """Stat every listed input and expand every pattern, without reading any file's content."""
    try:
        real_folder = os.path.realpath(folder)
        if not os.path.isdir(real_folder):
            return InputsSeen(False, (), ())
    except OSError:
        return InputsSeen(False, (), ())
    files = tuple(look(real_folder, f.path) for f in manifest.files)
    patterns = tuple(
        PatternSeen(p, tuple(look(real_folder, rel) for rel in _expand(real_folder, p)))
        for p in manifest.patterns
    )
    return InputsSeen(True, files, patterns)


def look(real_folder: str, relative: str) -> FileSeen:
    """Stat one input, following symlinks only while they stay inside ``real_folder``."""
    full = os.path.join(real_folder, relative)
    try:
        os.lstat(full)
    except FileNotFoundError:
        return FileSeen(relative, Presence.MISSING)
    except OSError as exc:
        return FileSeen(relative, Presence.UNREADABLE, detail=exc.strerror or str(exc))
    real = os.path.realpath(full)
    if os.path.commonpath([real, real_folder]) != real_folder:
        return FileSeen(relative, Presence.OUTSIDE, detail=real)
    try:
        st = os.stat(real)
    except FileNotFoundError:
        return FileSeen(relative, Presence.MISSING, detail="dangling symlink")
    except OSError as exc:
        return FileSeen(relative, Presence.UNREADABLE, detail=exc.strerror or str(exc))
    if not stat.S_ISREG(st.st_mode):
        return FileSeen(relative, Presence.SPECIAL, detail=_kind(st.st_mode))
    return FileSeen(relative, Presence.FILE, st.st_size, st.st_mtime_ns)


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _expand(real_folder: str, pattern: Pattern) -> list[str]:
    """Relative paths matching a pattern, leaving out what watchd writes into the folder."""
    base = Path(real_folder)
    found = []
    for match in sorted(base.glob(pattern.glob)):
        relative = match.relative_to(base).as_posix()
        top = relative.split("/")[0]
        if (
            top == RESULTS_DIR
            or relative in (STATUS_NAME, MANIFEST_NAME)
            or match.name.startswith(".tmp-")
        ):
            continue
        if match.is_dir() and not match.is_symlink():
            continue
        found.append(relative)
    return found
