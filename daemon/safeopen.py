"""Find and open a batch's inputs without ever leaving the batch folder.

One rule for everything that touches an input (readiness, the jobs, ``watchctl manifest``): an
input is a regular file whose real path, after every symbolic link in its last component and in
any folder above it, lies inside the real path of the batch folder. Links are followed only
while they stay inside. FIFOs, devices, sockets and folders are never opened: a FIFO would block
its reader forever, and opening a device may act on it.

:func:`locate` only stats (readiness looks at thousands of files every few seconds).
:func:`open_input` opens, and then checks what it opened, because the file may have been
swapped since it was located (a job runs hours after readiness looked): it opens the resolved
path with ``O_NOFOLLOW | O_NONBLOCK`` (a link swapped into the last component fails to open, a
FIFO opens without waiting for a writer), checks with ``fstat`` that it holds a regular file,
and asks the kernel (``/proc/self/fd``) where the opened file really is, which catches a folder
above it swapped for a link.
"""

from __future__ import annotations

import enum
import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from daemon.errors import WatchdError

_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class Presence(enum.Enum):
    FILE = "file"  # a regular file inside the batch folder
    MISSING = "missing"
    OUTSIDE = "outside"  # resolves (through a symlink) outside the batch folder
    SPECIAL = "special"  # a FIFO, device, socket or folder: never read
    UNREADABLE = "unreadable"  # stat failed for another reason (permissions, loop, I/O error)


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
        return Located(Presence.SPECIAL, real, detail=kind(st.st_mode))
    return Located(Presence.FILE, real, st.st_size, st.st_mtime_ns)


def _unreadable(exc: OSError) -> Located:
    return Located(Presence.UNREADABLE, detail=exc.strerror or str(exc), errno=exc.errno or 0)


def kind(mode: int) -> str:
    """What a non-regular file is, for a message ("a FIFO")."""
    for test, name in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISLNK, "a symbolic link"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def open_input(folder: Path | str, relative: str) -> BinaryIO:
    """Open input ``relative`` of ``folder`` for reading, by the rule above.

    Raises :class:`RefusedInput` for an input that leads outside or is not a regular file,
    FileNotFoundError for a missing one, and OSError for any other failure (the share failing:
    worth trying again later).
    """
    inside = real_folder(folder)
    for _ in range(2):  # once more if the last component changed into a link meanwhile
        located = locate(inside, relative)
        if located.presence is Presence.MISSING:
            raise FileNotFoundError(errno.ENOENT, "no such input", relative)
        if located.presence is Presence.UNREADABLE:
            raise OSError(located.errno, located.detail, relative)
        if located.presence is not Presence.FILE:
            raise RefusedInput(relative, located)
        try:
            fd = os.open(located.real, _OPEN_FLAGS)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                continue
            raise
        return _checked(fd, inside, relative)
    raise RefusedInput(relative, Located(Presence.SPECIAL, detail=kind(stat.S_IFLNK)))


def _checked(fd: int, inside: str, relative: str) -> BinaryIO:
    """``fd`` as a file object if it holds a regular file inside the folder; else closed."""
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise RefusedInput(relative, Located(Presence.SPECIAL, detail=kind(mode)))
        opened = _opened_path(fd)
        if opened is not None and not is_inside(inside, opened):
            raise RefusedInput(relative, Located(Presence.OUTSIDE, opened, detail=opened))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _opened_path(fd: int) -> str | None:
    """Where the file open as ``fd`` really is, from the kernel (Linux); None if it cannot say
    (then the checks before opening stand alone)."""
    try:
        path = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    return path.removesuffix(" (deleted)")
