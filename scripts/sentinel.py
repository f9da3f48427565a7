"""Trees outside the drop root that no batch may read, list or write, and how to tell.

A sentinel tree is made beside the drop root (hostile batch folders link into it), looked at
once, then armed: every entry's atime is set far in the past. On a filesystem mounted with
``relatime`` (Linux's default) the next read of a file or listing of a folder then moves its
atime to now, so a read or a listing leaves a trace, not only a write. The check lstats every
known entry first (an lstat moves no atime), and only then reads contents and lists folders to
compare them byte for byte with what they were.

The model registry is compared the same way but without atimes: inference jobs read it.
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

PAST_NS = 946_684_800 * 10**9  # 2000-01-01: older than any mtime, and than relatime's day

SECRET_FILES = {
    "id_rsa": b"-----BEGIN OPENSSH PRIVATE KEY-----\nnot a real key\n",
    "secret.png": b"\x89PNG\r\n\x1a\n not an image, and not yours",
    "weights.pt": b"PK\x03\x04 another lab's model",
    "notes/plan.txt": b"the other lab's plans\n",
    "notes/deeper/still/deeper.txt": b"far down\n",
}


@dataclass(frozen=True)
class Entry:
    """What a tree's entry is, atime left out: kind, size, mtime and what it holds (a file's
    sha256, a folder's sorted names, a link's target)."""

    kind: str
    size: int
    mtime_ns: int
    holds: str


def make(root: Path) -> Path:
    """The sentinel tree: files, folders and a nested folder, no links (following a link moves
    the link's own atime, which would blur the check)."""
    for relative, data in SECRET_FILES.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    (root / "empty folder").mkdir()
    return root


class Watched:
    """A tree whose every entry must stay as it was; with ``atimes``, also unread and unlisted."""

    def __init__(self, root: Path, *, atimes: bool) -> None:
        self.root = root
        self.atimes = atimes
        self.paths = [root, *sorted(root.rglob("*"))]
        self.before = footprint(self.paths)
        if atimes:
            arm(self.paths)

    def violations(self, label: str) -> list[str]:
        """What happened to the tree since it was made or last checked, one line each (empty:
        nothing)."""
        found = []
        if self.atimes:  # before anything below reads a file or lists a folder
            found += [f"{label}: {where(p, self.root)} read or listed" for p in touched(self.paths)]
        after = footprint(self.paths)
        for path in self.paths:
            was, now = self.before[path], after[path]
            if was != now:
                found.append(f"{label}: {where(path, self.root)} changed: {was} -> {now}")
        self.before = after  # the next check sees only what happens from now on
        if self.atimes:
            arm(self.paths)
        return found


def arm(paths: list[Path]) -> None:
    for path in paths:
        st = _lstat(path)
        if st is not None:
            os.utime(path, ns=(PAST_NS, st.st_mtime_ns), follow_symlinks=False)


def touched(paths: list[Path]) -> list[Path]:
    """The entries whose atime moved (lstat only: looking reads nothing); one that is gone is
    reported by the comparison of contents."""
    stats = {p: _lstat(p) for p in paths}
    return [p for p, st in stats.items() if st is not None and st.st_atime_ns != PAST_NS]


def footprint(paths: list[Path]) -> dict[Path, Entry | None]:
    return {path: entry(path) for path in paths}


def entry(path: Path) -> Entry | None:
    st = _lstat(path)
    if st is None:
        return None
    if stat.S_ISDIR(st.st_mode):
        holds = "\0".join(sorted(os.listdir(path)))
        return Entry("folder", 0, st.st_mtime_ns, holds)  # a folder's size says nothing more
    if stat.S_ISREG(st.st_mode):
        holds = hashlib.sha256(path.read_bytes()).hexdigest()
        return Entry("file", st.st_size, st.st_mtime_ns, holds)
    if stat.S_ISLNK(st.st_mode):
        return Entry("link", st.st_size, st.st_mtime_ns, os.readlink(path))
    return Entry(f"other ({stat.S_IFMT(st.st_mode):o})", st.st_size, st.st_mtime_ns, "")


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def where(path: Path, root: Path) -> str:
    return str(path.relative_to(root)) if path != root else f"{root.name}/"
