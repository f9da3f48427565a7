"""Expand a manifest's pattern (a glob) inside a batch folder: one bounded walk that never
leaves the folder.

A pattern is matched the way ``pathlib.Path.glob`` matches it (``*``, ``?`` and ``[...]``
within a name, ``**`` for zero or more folders), but by a single walk of the folder tree: the
walk carries the set of pattern positions a folder can be at, so ``**/**/*.png`` costs what
``**/*.png`` costs, not a walk per ``**`` (pathlib's cost grows about tenfold per ``**``).

The walk is bounded: it looks at no more than ``budget`` entries and goes no deeper than
:data:`MAX_DEPTH` folders; past either it stops and says why. It descends only into real
folders, each opened relative to its parent's descriptor with ``O_NOFOLLOW``, so a folder
swapped for a link meanwhile is not entered. A link to a folder is never followed: the walk
reports the links it would have had to enter (``linked``), for the caller to judge where they
lead; a link whose own name matches is a match like a file (the caller judges it too).
"""

from __future__ import annotations

import enum
import fnmatch
import os
import re
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from daemon.contract.heldfolder import DIR_FLAGS

MAX_DEPTH = 64  # folders below the batch folder; PATH_MAX alone would allow some 2 000

_MAGIC = re.compile(r"[*?[]")


class Bound(enum.Enum):
    ENTRIES = "entries"  # looked at more than its budget of entries
    DEPTH = "depth"  # would have gone deeper than MAX_DEPTH folders


@dataclass(frozen=True)
class Part:
    """One component of a pattern: ``**``, a literal name, or a wildcard name."""

    text: str
    recursive: bool
    regex: re.Pattern[str] | None  # None for a literal name

    def matches(self, name: str) -> bool:
        return self.regex.fullmatch(name) is not None if self.regex else name == self.text


@dataclass(frozen=True)
class Expansion:
    """What one walk found: matching names, links to folders it did not enter, the number of
    entries it looked at, and the bound that stopped it early (None when it finished; when it
    did not, it found nothing)."""

    paths: tuple[str, ...]
    linked: tuple[str, ...]
    visited: int
    stopped: Bound | None = None


def compile_glob(glob: str) -> tuple[Part, ...]:
    """The parts of a pattern as :func:`daemon.core.manifest.check_glob` accepts it."""
    parts = []
    for text in glob.split("/"):
        if text == "**":
            parts.append(Part(text, True, None))
        elif _MAGIC.search(text):
            parts.append(Part(text, False, re.compile(fnmatch.translate(text))))
        else:
            parts.append(Part(text, False, None))
    return tuple(parts)


def closure(parts: tuple[Part, ...], states: frozenset[int]) -> frozenset[int]:
    """Add the positions reached by letting a ``**`` match no folder at all."""
    found = set(states)
    for i in sorted(states):
        while i < len(parts) and parts[i].recursive:
            i += 1
            found.add(i)
    return frozenset(found)


def step(
    parts: tuple[Part, ...], states: frozenset[int], name: str, folder: bool
) -> frozenset[int]:
    """The positions after one more name; ``len(parts)`` among them means a match. A ``**``
    goes on through folders only, and one at the end matches only folders (as pathlib's)."""
    after: set[int] = set()
    for i in states:
        if i == len(parts):
            continue
        if parts[i].recursive:
            if folder:
                after.add(i)
        elif parts[i].matches(name):
            after.add(i + 1)
    return closure(parts, frozenset(after))


class _Stop(Exception):
    """The walk reached a bound: ``args[0]``."""


class _Walk:
    """The state of one walk (private: :func:`expand` returns its frozen result)."""

    def __init__(self, parts: tuple[Part, ...], budget: int, skip: Callable[[str], bool]):
        self.parts, self.budget, self.skip = parts, budget, skip
        self.visited = 0
        self.paths: list[str] = []
        self.linked: list[str] = []

    def folder(self, fd: int, prefix: str, states: frozenset[int], depth: int) -> None:
        for name, mode in self._entries(fd, states):
            relative = prefix + name
            if self.skip(relative):
                continue
            real_folder = stat.S_ISDIR(mode)
            after = step(self.parts, states, name, real_folder)
            if len(self.parts) in after and not real_folder and not self.parts[-1].recursive:
                self.paths.append(relative)
            if real_folder and any(i < len(self.parts) for i in after):
                self._descend(fd, name, relative, after, depth + 1)
            elif stat.S_ISLNK(mode) and self._would_enter(states, name, fd):
                self.linked.append(relative)

    def _would_enter(self, states: frozenset[int], name: str, fd: int) -> bool:
        """Whether the walk would go into this link if it were a folder, and it leads to one."""
        after = step(self.parts, states, name, True)
        return any(i < len(self.parts) for i in after) and _leads_to_folder(fd, name)

    def _entries(self, fd: int, states: frozenset[int]) -> Iterator[tuple[str, int]]:
        """(name, file type bits) of the entries that may match: only the named ones when every
        position is a literal name, else all (an entry that vanished meanwhile is left out)."""
        literal = [self.parts[i] for i in states if i < len(self.parts)]
        if all(p.regex is None and not p.recursive for p in literal):
            for name in sorted({p.text for p in literal}):
                self._count()
                try:
                    yield name, os.lstat(name, dir_fd=fd).st_mode
                except OSError:
                    continue
            return
        with os.scandir(fd) as listing:
            for entry in listing:
                self._count()
                try:
                    yield entry.name, entry_type(entry)
                except OSError:
                    continue

    def _count(self) -> None:
        self.visited += 1
        if self.visited > self.budget:
            raise _Stop(Bound.ENTRIES)

    def _descend(
        self, fd: int, name: str, relative: str, states: frozenset[int], depth: int
    ) -> None:
        if depth > MAX_DEPTH:
            raise _Stop(Bound.DEPTH)
        try:
            child = os.open(name, DIR_FLAGS, dir_fd=fd)
        except OSError:
            return  # gone, unreadable, or swapped for a link since it was listed
        try:
            self.folder(child, relative + "/", states, depth)
        finally:
            os.close(child)


def entry_type(entry: os.DirEntry[str]) -> int:
    """The file type bits of a listed entry, from the listing itself where the filesystem
    gives them (no stat; where it does not, Python stats the entry)."""
    if entry.is_symlink():
        return stat.S_IFLNK
    if entry.is_dir(follow_symlinks=False):
        return stat.S_IFDIR
    if entry.is_file(follow_symlinks=False):
        return stat.S_IFREG
    return stat.S_IFMT(entry.stat(follow_symlinks=False).st_mode)  # FIFO, socket, device


def _leads_to_folder(fd: int, name: str) -> bool:
    try:
        return stat.S_ISDIR(os.stat(name, dir_fd=fd).st_mode)
    except OSError:
        return False


def expand(real_folder: str, glob: str, budget: int, skip: Callable[[str], bool]) -> Expansion:
    """Every name in ``real_folder`` that ``glob`` matches, sorted, leaving out those ``skip``
    says to (and what is below them), looking at no more than ``budget`` entries."""
    walk = _Walk(compile_glob(glob), budget, skip)
    stopped = None
    try:
        fd = os.open(real_folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return Expansion((), (), 0)
    try:
        walk.folder(fd, "", closure(walk.parts, frozenset({0})), 0)
    except _Stop as stop:
        stopped = stop.args[0]
    finally:
        os.close(fd)
    if stopped:
        return Expansion((), (), walk.visited, stopped)
    return Expansion(tuple(sorted(walk.paths)), tuple(sorted(walk.linked)), walk.visited)
