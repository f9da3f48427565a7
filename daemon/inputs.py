"""Look at a batch's inputs on disk: the I/O half of readiness (the judgement is pure, in
:mod:`daemon.readiness`).

Only the files a manifest names (or its patterns match) are looked at, and only while the batch
waits. The rule is :mod:`daemon.safeopen`'s, the one the jobs open inputs by: symlinks are
followed only while they stay inside the batch folder; anything that resolves outside it, or is
not a regular file (FIFO, device, folder), is reported as such and never opened.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from daemon.manifest import MANIFEST_NAME, RESULTS_DIR, STATUS_NAME, Manifest, Pattern
from daemon.safeopen import Presence, locate

__all__ = ["FileSeen", "InputsSeen", "PatternSeen", "Presence", "look", "observe"]


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
    """Stat one input by the rule of :mod:`daemon.safeopen` (the one the jobs open it by)."""
    found = locate(real_folder, relative)
    return FileSeen(relative, found.presence, found.size, found.mtime_ns, found.detail)


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
