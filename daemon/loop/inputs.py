"""Look at a batch's inputs on disk: the I/O half of readiness (the judgement is pure, in
:mod:`daemon.core.readiness`).

Only the files a manifest names (or its patterns match) are looked at, and only while the batch
waits. The rule is :mod:`daemon.contract.safeopen`'s, the one the jobs open inputs by: symlinks are
followed only while they stay inside the batch folder; anything that resolves outside it, or is
not a regular file (FIFO, device, folder), is reported as such and never opened. An OME-Zarr
store (a listed input named ``*.zarr``) is a folder: it is walked without entering a link, and
holds only folders and regular files; its size is its files' sum. Patterns are
expanded by :mod:`daemon.loop.patterns`: one walk per pattern, bounded in depth and in the entries
it looks at, that never enters a link to a folder.
"""

from __future__ import annotations

import errno
import os
import posixpath
import stat
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from daemon.contract.heldfolder import DIR_FLAGS
from daemon.contract.jobspec import InputFile
from daemon.contract.names import is_store
from daemon.contract.safeopen import Presence, locate
from daemon.contract.stores import walk_store
from daemon.core.manifest import MANIFEST_NAME, RESULTS_DIR, STATUS_NAME, Manifest, Pattern
from daemon.core.readiness import FileSeen, InputsSeen, PatternSeen
from daemon.loop import patterns

MAX_PATTERN_ENTRIES = 200_000  # the default of the daemon's intake.max_pattern_entries

__all__ = ["Memory", "check", "input_folders", "look", "observe"]
_WILDCARDS = frozenset("*?[")


@dataclass(frozen=True)
class Memory:
    """What the earlier checks of one batch learnt, so that the next looks only at what may
    have changed: each input's last stat and the inputs seen complete (at their listed size,
    or unchanged between two looks where no size is listed: not stat'ed again). The folders
    are listed at every check: a listing is one call per some hundred names, and a folder's
    mtime cannot say whether a listing is still true where the client caches both (NFS,
    sshfs: a listing kept for an mtime may be older than it)."""

    last: Mapping[str, FileSeen] = field(default_factory=dict)
    complete: frozenset[str] = frozenset()


def input_folders(manifest: Manifest) -> set[str]:
    """The folders below the batch folder that its inputs land in: those of its listed files,
    its OME-Zarr stores themselves, and where each pattern starts (its folders before the
    first wildcard); the batch folder itself ('') is not among them."""
    found = {f.path if is_store(f.path) else posixpath.dirname(f.path) for f in manifest.files}
    for pattern in manifest.patterns:
        fixed = []
        for part in pattern.glob.split("/")[:-1]:
            if _WILDCARDS & set(part):
                break
            fixed.append(part)
        found.add("/".join(fixed))
    found.discard("")
    return found


def observe(folder: Path, manifest: Manifest, max_entries: int = MAX_PATTERN_ENTRIES) -> InputsSeen:
    """Stat every listed input and expand every pattern, without reading any file's content;
    the patterns together look at no more than ``max_entries`` entries of the folder."""
    return check(folder, manifest, max_entries, None)[0]


def check(
    folder: Path, manifest: Manifest, max_entries: int, memory: Memory | None
) -> tuple[InputsSeen, Memory]:
    """Like :func:`observe`, metadata-light: one listing per folder of listed inputs and one
    stat per input not yet seen complete; ``memory``
    None looks at everything again (the verification before a batch is queued). What is
    seen, and what the next check may take from it."""
    try:
        real_folder = os.path.realpath(folder)
        if not os.path.isdir(real_folder):
            return InputsSeen(False, (), ()), Memory()
    except OSError:
        return InputsSeen(False, (), ()), Memory()
    looker = _Looker(real_folder, memory or Memory(), verify=memory is None,
                     max_entries=max_entries)  # fmt: skip
    files = looker.listed(manifest.files)
    expanded, budget = [], max_entries
    for p in manifest.patterns:
        seen = _expand(looker, p, budget)
        budget -= seen.visited
        expanded.append(PatternSeen(p, seen.matches, _stopped(seen.stopped, max_entries)))
    return InputsSeen(True, files, tuple(expanded)), looker.learnt()


class _Looker:
    """One check's looking (private: :func:`check` returns what it saw and learnt)."""

    def __init__(self, real_folder: str, memory: Memory, *, verify: bool, max_entries: int) -> None:
        self.real_folder, self.memory, self.verify = real_folder, memory, verify
        self.max_entries = max_entries  # of one OME-Zarr store
        self.last: dict[str, FileSeen] = {}
        self.complete: set[str] = set()

    def learnt(self) -> Memory:
        return Memory(dict(self.last), frozenset(self.complete))

    def listed(self, files: Sequence[InputFile]) -> tuple[FileSeen, ...]:
        by_folder: dict[str, list[int]] = {}
        for i, f in enumerate(files):
            by_folder.setdefault(posixpath.dirname(f.path), []).append(i)
        seen: list[FileSeen | None] = [None] * len(files)
        for parent, indices in by_folder.items():
            spelt, names = self._spelt_names(parent)
            for i in indices:
                seen[i] = self._one(files[i], spelt, names)
        return tuple(s for s in seen if s is not None)

    def _one(self, listed: InputFile, parent: str, names: frozenset[str] | None) -> FileSeen:
        if is_store(listed.path):
            name = None if names is None else _spelt(posixpath.basename(listed.path), names)
            return self.store(listed.path if name is None else posixpath.join(parent, name))
        if names is None:  # a folder on the way is a link, or cannot be listed: the full rule
            return self.remember(look(self.real_folder, listed.path), listed.size)
        name = _spelt(posixpath.basename(listed.path), names)
        if name is None:
            return FileSeen(listed.path, Presence.MISSING)
        return self.stat(posixpath.join(parent, name), listed.size)

    def stat(self, relative: str, size: int | None) -> FileSeen:
        """One input found by a listing: its stat, unless it was seen complete (a link or
        anything but a regular file: the full rule judges it)."""
        if not self.verify and relative in self.memory.complete:
            return self.remember(self.memory.last[relative], size)
        try:
            st = os.lstat(os.path.join(self.real_folder, relative))
        except OSError:
            return self.remember(look(self.real_folder, relative), size)  # gone or swapped
        if not stat.S_ISREG(st.st_mode):
            return self.remember(look(self.real_folder, relative), size)
        if is_store(relative):  # a pattern's match named like a store
            return _not_a_store(relative, "is a file")
        return self.remember(FileSeen(relative, Presence.FILE, st.st_size, st.st_mtime_ns), size)

    def store(self, relative: str) -> FileSeen:
        """An OME-Zarr store: walked (one listing per folder of it, one stat per entry) until
        it is seen complete, unchanged between two looks; then not again. Seen as a file whose
        size is the sum of its files' and whose time is the latest of its entries' (a chunk
        added, grown or removed changes one of them); missing while its metadata is not there."""
        if not self.verify and relative in self.memory.complete:
            return self.remember(self.memory.last[relative], None)
        try:
            fd = _open_below(self.real_folder, relative)
        except FileNotFoundError:
            return FileSeen(relative, Presence.MISSING)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                return FileSeen(relative, Presence.UNREADABLE, detail=exc.strerror or str(exc))
            found = look(self.real_folder, relative)  # a link, or a file: which, and where to
            if found.presence in (Presence.FILE, Presence.SPECIAL):
                return _not_a_store(relative, "is a file" if found.presence is Presence.FILE
                                    else "is a link or lies behind one")  # fmt: skip
            return found
        try:
            walked = walk_store(fd, self.max_entries)
        except OSError as exc:
            return FileSeen(relative, Presence.UNREADABLE, detail=exc.strerror or str(exc))
        finally:
            os.close(fd)
        if walked.problem:
            return FileSeen(relative, Presence.INVALID, detail=walked.problem)
        if not walked.metadata:
            return FileSeen(relative, Presence.MISSING, detail="no .zattrs or zarr.json in it yet")
        return self.remember(FileSeen(relative, Presence.FILE, walked.size, walked.latest), None)

    def remember(self, seen: FileSeen, size: int | None) -> FileSeen:
        if seen.presence is Presence.FILE:
            before = self.memory.last.get(seen.path)
            if seen.size == size or (size is None and before == seen):
                self.complete.add(seen.path)
            self.last[seen.path] = seen
        return seen

    def _spelt_names(self, parent: str) -> tuple[str, frozenset[str] | None]:
        """The folder's name as spelt on disk (the manifest's, or its other Unicode
        normalisation) and its names, as :meth:`_names` gives them."""
        for spelling in _spellings(parent):
            names = self._names(spelling)
            if names != frozenset():
                return spelling, names
        return parent, frozenset()

    def _names(self, parent: str) -> frozenset[str] | None:
        """The names in one folder of the batch folder (``""``: itself), or None where a
        folder on the way is a link or cannot be read; none if it does not exist."""
        try:
            fd = _open_below(self.real_folder, parent)
        except FileNotFoundError:
            return frozenset()
        except OSError:
            return None
        try:
            return frozenset(os.listdir(fd))
        except OSError:
            return None
        finally:
            os.close(fd)


def _open_below(real_folder: str, relative: str) -> int:
    """A descriptor of a folder below the batch folder, opened one component at a time without
    following a link (ELOOP or ENOTDIR for one on the way)."""
    fd = os.open(real_folder, DIR_FLAGS)
    for part in [p for p in relative.split("/") if p]:
        try:
            child = os.open(part, DIR_FLAGS, dir_fd=fd)
        finally:
            os.close(fd)
        fd = child
    return fd


def _not_a_store(relative: str, what: str) -> FileSeen:
    return FileSeen(relative, Presence.INVALID, detail=(
        f"{what}: an input named '*.zarr' is an OME-Zarr store, a folder in the batch folder"
    ))  # fmt: skip


def _spelt(name: str, names: frozenset[str]) -> str | None:
    """The name as it is spelt in the folder: itself, or its other Unicode normalisation."""
    return next((n for n in _spellings(name) if n in names), None)


def _spellings(name: str) -> list[str]:
    """A name, then its other Unicode normalisations (a manifest written on a Mac may spell
    'ä' as 'a' and a combining mark where the share's name has the one character)."""
    others = {unicodedata.normalize(form, name) for form in ("NFC", "NFD")} - {name}
    return [name, *sorted(others)]


def look(real_folder: str, relative: str) -> FileSeen:
    """Stat one input by the rule of :mod:`daemon.contract.safeopen` (the one the jobs open it by).

    A name not found is looked for under the other Unicode normalisation too: a manifest
    written on a Mac may spell 'ä' as 'a' and a combining mark (NFD) where the file on the
    share was named with the one character 'ä' (NFC), or the other way round. Then what is
    seen carries the name on disk, which is the one the jobs open.
    """
    found = locate(real_folder, relative)
    if found.presence is Presence.MISSING and not found.detail:  # not a dangling link
        for other in _spellings(relative)[1:]:
            there = locate(real_folder, other)
            if there.presence is not Presence.MISSING:
                relative, found = other, there
                break
    return FileSeen(relative, found.presence, found.size, found.mtime_ns, found.detail)


@dataclass(frozen=True)
class _Expanded:
    matches: tuple[FileSeen, ...]
    visited: int
    stopped: patterns.Bound | None


def _expand(looker: _Looker, pattern: Pattern, budget: int) -> _Expanded:
    """The inputs a pattern matches, leaving out what watchd writes into the folder; a link
    to a folder that the pattern would have to enter is among them if it leads outside the
    folder (so that the batch is refused for it), and left out otherwise. The walk enters no
    link, so a match needs one stat (none once seen complete)."""
    real_folder = looker.real_folder
    found = patterns.expand(real_folder, pattern.glob, max(budget, 0), _watchd_writes)
    matches = [looker.stat(relative, None) for relative in found.paths]
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
