"""Look at a batch's inputs on disk: the I/O half of readiness (the judgement is pure, in
:mod:`daemon.readiness`).

Only the files a manifest names (or its patterns match) are looked at, and only while the batch
waits. The rule is :mod:`daemon.safeopen`'s, the one the jobs open inputs by: symlinks are
followed only while they stay inside the batch folder; anything that resolves outside it, or is
not a regular file (FIFO, device, folder), is reported as such and never opened. Patterns are
expanded by :mod:`daemon.patterns`: one walk per pattern, bounded in depth and in the entries
it looks at, that never enters a link to a folder.
"""

from __future__ import annotations

import os
import unicodedata
from dataclasses import dataclass
from pathlib import Path

from daemon import patterns
from daemon.manifest import MANIFEST_NAME, RESULTS_DIR, STATUS_NAME, Manifest, Pattern
from daemon.safeopen import Presence, locate

MAX_PATTERN_ENTRIES = 200_000  # the default of the daemon's intake.max_pattern_entries

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
    """A pattern's matches; ``stopped`` says which bound stopped its walk (then it has none)."""

    pattern: Pattern
    matches: tuple[FileSeen, ...]
    stopped: str = ""


@dataclass(frozen=True)
class InputsSeen:
    """What was on disk for one batch at one moment."""

    folder_ok: bool
    files: tuple[FileSeen, ...]
    patterns: tuple[PatternSeen, ...]


def observe(folder: Path, manifest: Manifest, max_entries: int = MAX_PATTERN_ENTRIES) -> InputsSeen:
    """Stat every listed input and expand every pattern, without reading any file's content;
    the patterns together look at no more than ``max_entries`` entries of the folder."""
    try:
        real_folder = os.path.realpath(folder)
        if not os.path.isdir(real_folder):
            return InputsSeen(False, (), ())
    except OSError:
        return InputsSeen(False, (), ())
    files = tuple(look(real_folder, f.path) for f in manifest.files)
    expanded, budget = [], max_entries
    for p in manifest.patterns:
        seen = _expand(real_folder, p, budget)
        budget -= seen.visited
        expanded.append(PatternSeen(p, seen.matches, _stopped(seen.stopped, max_entries)))
    return InputsSeen(True, files, tuple(expanded))


def look(real_folder: str, relative: str) -> FileSeen:
    """Stat one input by the rule of :mod:`daemon.safeopen` (the one the jobs open it by).

    A name not found is looked for under the other Unicode normalisation too: a manifest
    written on a Mac may spell 'ä' as 'a' and a combining mark (NFD) where the file on the
    share was named with the one character 'ä' (NFC), or the other way round. Then what is
    seen carries the name on disk, which is the one the jobs open.
    """
    found = locate(real_folder, relative)
    if found.presence is Presence.MISSING and not found.detail:  # not a dangling link
        for other in {unicodedata.normalize(form, relative) for form in ("NFC", "NFD")}:
            there = locate(real_folder, other)
            if other != relative and there.presence is not Presence.MISSING:
                relative, found = other, there
                break
    return FileSeen(relative, found.presence, found.size, found.mtime_ns, found.detail)


@dataclass(frozen=True)
class _Expanded:
    matches: tuple[FileSeen, ...]
    visited: int
    stopped: patterns.Bound | None


def _expand(real_folder: str, pattern: Pattern, budget: int) -> _Expanded:
    """The inputs a pattern matches, leaving out what watchd writes into the folder; a link
    to a folder that the pattern would have to enter is among them if it leads outside the
    folder (so that the batch is refused for it), and left out otherwise."""
    found = patterns.expand(real_folder, pattern.glob, max(budget, 0), _watchd_writes)
    matches = [look(real_folder, relative) for relative in found.paths]
    for relative in found.linked:
        link = look(real_folder, relative)
        if link.presence is Presence.OUTSIDE:
            matches.append(link)
    return _Expanded(tuple(matches), found.visited, found.stopped)


def _stopped(bound: patterns.Bound | None, max_entries: int) -> str:
    """Why a pattern's walk stopped, as the end of a sentence naming the pattern ("" if not)."""
    if bound is patterns.Bound.ENTRIES:
        most = f"{max_entries:,}".replace(",", " ")
        return (
            f"looks at more than {most} entries of the folder, the most one check may "
            "(intake.max_pattern_entries)"
        )
    if bound is patterns.Bound.DEPTH:
        return f"goes deeper than {patterns.MAX_DEPTH} folders, the most a pattern may"
    return ""


def _watchd_writes(relative: str) -> bool:
    """Whether a name in the batch folder is one that watchd writes (never an input)."""
    top = relative.partition("/")[0]
    return (
        top == RESULTS_DIR
        or relative in (STATUS_NAME, MANIFEST_NAME)
        or relative.rpartition("/")[2].startswith(".tmp-")
    )
