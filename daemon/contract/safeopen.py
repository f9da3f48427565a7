"""Find and open a batch's inputs without ever leaving the batch folder.

One rule for everything that touches an input (readiness, the jobs, ``watchctl manifest``): an
input is a regular file whose real path, after every symbolic link in its last component and in
any folder above it, lies inside the real path of the batch folder. Links are followed only
while they stay inside. FIFOs, devices, sockets and folders are never opened: a FIFO would block
its reader forever, and opening a device may act on it.

:func:`locate` only stats (readiness looks at thousands of files every few seconds).
:func:`open_input` opens, and by another road, because the file may have been swapped since it
was located (a job runs hours after readiness looked): relative to the batch folder held as a
directory descriptor (:class:`daemon.contract.heldfolder.HeldFolder`; a job holds the very folder
its batch was accepted from), one component at a time with ``O_NOFOLLOW``, so no path that a swap
could redirect is ever opened. A link on the way is read and its target walked the same way,
within the held folder; one that leads above it or to an absolute place elsewhere is refused
before anything there is opened. The file itself is opened with ``O_NONBLOCK`` (a FIFO swapped
in opens without waiting for a writer) and checked with ``fstat`` to hold a regular file.
"""

from __future__ import annotations

import enum
import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, NoReturn

from daemon.contract.errors import WatchdError
from daemon.contract.heldfolder import DIR_FLAGS, HeldFolder, what_it_is

_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
MAX_LINK_HOPS = 40  # as Linux's own path walk (MAXSYMLINKS)


# A batch folder as the readers take it: held (a job holds its own for its whole life), or a
# path held for each open.
Folder = HeldFolder | Path | str


class Presence(enum.Enum):
    FILE = "file"  # a regular file inside the batch folder
    MISSING = "missing"
    OUTSIDE = "outside"  # resolves (through a symlink) outside the batch folder
    SPECIAL = "special"  # a FIFO, device, socket or folder: never read
    UNREADABLE = "unreadable"  # stat failed for another reason (permissions, loop, I/O error)
    INVALID = "invalid"  # an OME-Zarr store that is not one (a file, or holding a link): why


@dataclass(frozen=True)
class Located:
    """Where one input is: for FILE, its resolved path, size and mtime; for OUTSIDE, ``detail``
    is where it leads; for SPECIAL, what it is ("a FIFO"); otherwise why it cannot be read."""

    presence: Presence
    real: str = ""
    size: int = 0
    mtime_ns: int = 0
    detail: str = ""
    errno: int = 0  # UNREADABLE: the error number of the failed stat


class RefusedInput(WatchdError):
    """An input that may not be read: it leads outside the batch folder, or is not a regular
    file. ``reason`` says which, for the data owner (e.g. "is a FIFO, not a regular file")."""

    def __init__(self, relative: str, located: Located) -> None:
        self.relative = relative
        self.located = located
        self.reason = describe(located.presence, located.detail)
        super().__init__(f"'{relative}' {self.reason}")


def describe(presence: Presence, detail: str) -> str:
    """Why an input found so is refused, as the end of a sentence naming it."""
    if presence is Presence.OUTSIDE:
        return f"leads outside the batch folder (to {detail})"
    if presence is Presence.SPECIAL:
        return f"is {detail}, not a regular file"
    if presence is Presence.INVALID:
        return detail
    return f"cannot be read: {detail}"


def real_folder(folder: Path | str) -> str:
    """The batch folder's real path: the reference that every input is checked against."""
    return os.path.realpath(folder)


def is_inside(real_folder: str, real: str) -> bool:
    return os.path.commonpath([real, real_folder]) == real_folder


def locate(real_folder: str, relative: str) -> Located:
    """Stat one input of the folder whose real path is ``real_folder``, following symlinks only
    while they stay inside it; nothing is opened."""
    full = os.path.join(real_folder, relative)
    try:
        os.lstat(full)
    except FileNotFoundError:
        return Located(Presence.MISSING)
    except OSError as exc:
        return _unreadable(exc)
    real = os.path.realpath(full)
    if not is_inside(real_folder, real):
        return Located(Presence.OUTSIDE, real, detail=real)
    try:
        st = os.stat(real)
    except FileNotFoundError:
        return Located(Presence.MISSING, detail="dangling symlink")
    except OSError as exc:
        return _unreadable(exc)
    if not stat.S_ISREG(st.st_mode):
        return Located(Presence.SPECIAL, real, detail=what_it_is(st.st_mode))
    return Located(Presence.FILE, real, st.st_size, st.st_mtime_ns)


def _unreadable(exc: OSError) -> Located:
    return Located(Presence.UNREADABLE, detail=exc.strerror or str(exc), errno=exc.errno or 0)


def open_input(folder: Folder, relative: str) -> BinaryIO:
    """Open input ``relative`` of ``folder`` (held, or a path held for this one open) for reading.

    Raises :class:`RefusedInput` for an input that leads outside or is not a regular file,
    FileNotFoundError for a missing one, and OSError for any other failure (the share failing:
    worth trying again later).
    """
    if isinstance(folder, HeldFolder):
        return _Walk(folder, relative).open()
    with HeldFolder.open(real_folder(folder)) as held:
        return _Walk(held, relative).open()


class _Walk:
    """One input reached from a held folder a component at a time, like openat2's
    RESOLVE_IN_ROOT but refusing instead of clamping: each component opened relative to the one
    above with ``O_NOFOLLOW``; a link met on the way is read (``readlink``) and its target walked
    the same way, from the held folder when it is absolute and names a place inside it, at most
    :data:`MAX_LINK_HOPS` times. A ``..`` above the held folder, or an absolute target
    elsewhere, leads outside: refused before anything there is opened."""

    def __init__(self, held: HeldFolder, relative: str) -> None:
        self.held, self.relative = held, relative
        self.fds: list[int] = []  # the folders walked into below the held one, innermost last
        self.hops = 0

    def open(self) -> BinaryIO:
        todo = _components(self.relative)[::-1]  # a stack: the next component last
        try:
            while todo:
                name = todo.pop()
                if name == "..":
                    self._up(todo)
                elif not todo:
                    fd = self._last(name, todo)
                    if fd >= 0:
                        return _checked(fd, self.relative)
                else:
                    self._down(name, todo)
            raise RefusedInput(
                self.relative, Located(Presence.SPECIAL, detail=what_it_is(stat.S_IFDIR))
            )
        finally:
            for fd in self.fds:
                os.close(fd)

    @property
    def _here(self) -> int:
        return self.fds[-1] if self.fds else self.held.fd

    def _up(self, todo: list[str]) -> None:
        if not self.fds:
            self._outside(os.path.join(self.held.path, "..", *todo[::-1]))
        os.close(self.fds.pop())

    def _down(self, name: str, todo: list[str]) -> None:
        try:
            fd = os.open(name, DIR_FLAGS, dir_fd=self._here)
        except OSError as exc:
            # A link opened so fails with ENOTDIR (O_DIRECTORY is checked first) or ELOOP.
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR) or not self._follow(name, todo):
                raise
            return
        self.fds.append(fd)

    def _last(self, name: str, todo: list[str]) -> int:
        """The descriptor of the input's own file, or -1 when it was a link (now in ``todo``)."""
        st = os.stat(name, dir_fd=self._here, follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            if self._follow(name, todo):
                return -1
        elif not stat.S_ISREG(st.st_mode):  # never opened: a device may act on an open
            raise RefusedInput(
                self.relative, Located(Presence.SPECIAL, detail=what_it_is(st.st_mode))
            )
        return os.open(name, _OPEN_FLAGS, dir_fd=self._here)  # a link swapped in: ELOOP

    def _follow(self, name: str, todo: list[str]) -> bool:
        """Put link ``name``'s target on ``todo``; False if it is no longer a link."""
        try:
            target = os.readlink(name, dir_fd=self._here)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                return False
            raise
        self.hops += 1
        if self.hops > MAX_LINK_HOPS:
            raise OSError(errno.ELOOP, "too many levels of symbolic links", self.relative)
        if os.path.isabs(target):
            target = self._from_top(target, todo)
        todo.extend(_components(target)[::-1])
        return True

    def _from_top(self, target: str, todo: list[str]) -> str:
        """An absolute link target as a path relative to the held folder (walked from there)."""
        for top in (str(self.held.path), real_folder(self.held.path)):
            if is_inside(top, os.path.normpath(target)):
                while self.fds:
                    os.close(self.fds.pop())
                return os.path.relpath(os.path.normpath(target), top)
        self._outside(os.path.join(os.path.normpath(target), *todo[::-1]))
        raise AssertionError  # not reached: _outside raises

    def _outside(self, where: str) -> NoReturn:
        real = os.path.normpath(where)
        raise RefusedInput(self.relative, Located(Presence.OUTSIDE, real, detail=real))


def _components(relative: str) -> list[str]:
    return [part for part in relative.split("/") if part not in ("", ".")]


def _checked(fd: int, relative: str) -> BinaryIO:
    """``fd`` as a file object if it holds a regular file (it may have been swapped for a FIFO
    since it was looked at); else it is closed and the input refused."""
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise RefusedInput(relative, Located(Presence.SPECIAL, detail=what_it_is(mode)))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
