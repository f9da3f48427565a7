"""A folder held open: the one rule for every open, write and listing under a batch folder.

A batch folder belongs to its data owner, ``results/`` included: any name in it can become a
symbolic link, a FIFO or another folder at any moment. So nothing under it is opened by a path
that such a swap could redirect. A :class:`HeldFolder` is a directory descriptor; everything
below it is reached one component at a time relative to it (``dir_fd``), each component opened
with ``O_NOFOLLOW`` (a planted link fails with ELOOP instead of being followed), folders with
``O_DIRECTORY``, files with ``O_NONBLOCK`` (a FIFO never blocks the opener) and checked with
``fstat`` to be regular files with one link (a hard link to a file elsewhere is refused too).
New names are made with ``O_EXCL`` and renamed into place relative to the same descriptor, so
a file appears whole or not at all.

The drop root itself is the operator's (from the configuration); a batch folder is held from
there, by its one name, and may be checked against the identity (device, inode) it was accepted
with: a folder swapped for another under the same name is refused (:class:`FolderReplaced`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import IO, BinaryIO

from daemon.contract.errors import WatchdError
from daemon.contract.jobspec import Identity, Problem

TMP_PREFIX = ".tmp-"
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_NEW_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_APPEND_FLAGS = (
    os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
)


class UnsafeEntry(WatchdError, OSError):
    """A name under a held folder that may not be opened as asked: a link, a FIFO, a device, a
    file with other hard links, or a file where a folder was expected (and the reverse). It is
    an OSError too (errno ELOOP, ENOTDIR, EISDIR or EMLINK), so callers that treat "cannot be
    written" alike need no second except clause."""

    def __init__(self, code: int, relative: str, what: str) -> None:
        self.relative = relative
        self.what = what
        self.folder: Path | None = None  # the held folder ``relative`` is relative to
        super().__init__(code, f"'{relative}' {what}")

    @property
    def path(self) -> Path | None:
        """The entry's whole path, where the folder it was met in is known."""
        return None if self.folder is None else self.folder / self.relative

    def __str__(self) -> str:
        return f"'{self.relative}' {self.what}"


# A write the filesystem refuses for want of room or of permission: said as such, not a crash.
WRITE_REFUSED = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EPERM, errno.EACCES})


class NotWritable(WatchdError, OSError):
    """A write below a held folder that the filesystem refused (:data:`WRITE_REFUSED`): full,
    over quota, read-only, or not permitted. ``folder`` is the held folder written in."""

    def __init__(self, code: int, strerror: str, folder: Path) -> None:
        self.folder = folder
        super().__init__(code, strerror)

    def __str__(self) -> str:
        return f"{self.folder} cannot be written: {self.strerror}"


def unwritable_problem(exc: OSError) -> Problem:
    """A batch's results folder that cannot be written, said for its owner."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        hint = "the share is full (or over quota): free space, then ask for a retry"
    elif exc.errno in (errno.ELOOP, errno.ENOTDIR):
        hint = "remove it: watchd writes its results only inside the batch folder"
    else:
        hint = "make the batch folder writable for the watchd service, then ask for a retry"
    return Problem("results folder", f"cannot be written: {exc.strerror or exc}", hint)


# What a job says when it refuses a batch folder replaced under its name
# (pipelines.job.hold_batch): its batch is then cancelled, not failed (daemon.core.planner):
# nothing in it is wrong, and the new folder is taken in as a batch of its own (intake says the
# same when it supersedes the old revision).
FOLDER_REPLACED = "the batch folder was replaced"


class FolderReplaced(WatchdError, OSError):
    """The batch folder's name now leads to another folder than the one accepted."""

    def __init__(self, path: Path | str) -> None:
        self.path = str(path)
        super().__init__(errno.ESTALE, f"the batch folder {path} was replaced by another folder")

    def __str__(self) -> str:
        return f"the batch folder {self.path} was replaced by another folder"


def what_it_is(mode: int) -> str:
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


def parts_of(relative: str | PurePosixPath) -> tuple[str, ...]:
    """The components of a relative path, refusing '..', absolute paths and empty ones."""
    parts = tuple(p for p in PurePosixPath(relative).parts if p not in ("", "."))
    if not parts or PurePosixPath(relative).is_absolute() or ".." in parts:
        raise ValueError(f"not a path inside a folder: {str(relative)!r}")
    return parts


class HeldFolder:
    """A folder open as a directory descriptor; close it (or use ``with``) when done."""

    def __init__(self, fd: int, path: Path) -> None:
        self.fd = fd
        self.path = Path(path)

    # -- opening -------------------------------------------------------------------------
    @classmethod
    def open(cls, path: Path | str, identity: Identity | None = None) -> HeldFolder:
        """Hold ``path`` (its last component must be a real folder, not a link); with
        ``identity``, it must still be the folder accepted under that name."""
        fd = os.open(path, DIR_FLAGS)
        held = cls(fd, Path(path))
        if identity is not None and not held.identity().same(identity):
            held.close()
            raise FolderReplaced(path)
        return held

    @classmethod
    def batch(cls, root: Path | str, folder: str, identity: Identity | None = None) -> HeldFolder:
        """Hold the batch folder ``folder`` (one name) of drop root ``root``."""
        with cls.open(root) as held_root:
            held = held_root.folder(folder)
        if identity is not None and not held.identity().same(identity):
            held.close()
            raise FolderReplaced(Path(root) / folder)
        return held

    def identity(self) -> Identity:
        """The folder's identity, with its parent's inode (the drop root's, for a batch
        folder: see :meth:`Identity.same`)."""
        parent = os.stat(self.path.parent, follow_symlinks=False) if self.path.name else None
        return Identity.of(os.fstat(self.fd), parent)

    def folder(self, relative: str | PurePosixPath, *, create: bool = False) -> HeldFolder:
        """Hold a folder below this one, made component by component when ``create``; a link,
        FIFO or file on the way raises :class:`UnsafeEntry`."""
        fd = os.dup(self.fd)
        walked: list[str] = []
        try:
            for part in parts_of(relative):
                walked.append(part)
                parent, fd = fd, -1
                with self._located(), self._writing():
                    fd = _step(parent, part, "/".join(walked), create)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            raise
        return HeldFolder(fd, self.path.joinpath(*walked))

    # -- reading ---------------------------------------------------------------------------
    def open_read(self, relative: str | PurePosixPath, *, sole: bool = False) -> BinaryIO:
        """Open a regular file below this folder for reading (FileNotFoundError if missing).
        ``sole``: only if it has no other hard link, for a file the service wrote where its
        owner may write: one with another link was put there, and may be a file elsewhere
        (where the kernel does not keep users from linking what they may not read: an NFS
        server's, fs.protected_hardlinks = 0)."""
        *above, name = parts_of(relative)
        with self._parent(above) as parent, self._located():
            fd = _open_file(name, _READ_FLAGS, parent.fd, str(relative), links_ok=not sole)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")

    def lstat(self, relative: str | PurePosixPath) -> os.stat_result:
        """Stat a name below this folder without following a link anywhere on the way."""
        *above, name = parts_of(relative)
        with self._parent(above) as parent:
            return os.stat(name, dir_fd=parent.fd, follow_symlinks=False)

    def exists(self, relative: str | PurePosixPath) -> bool:
        """Whether anything (a link too) has the name ``relative`` below this folder."""
        try:
            self.lstat(relative)
        except FileNotFoundError:
            return False
        return True

    def entries(self) -> list[os.DirEntry[str]]:
        """This folder's entries, each knowing what it is (``is_file``, ``is_dir`` and
        ``is_symlink`` without following a link) also once this folder is closed. Most
        filesystems say an entry's type in the listing; sshfs does not when it answers from
        its cache, nor do some NFS servers, and an entry then looks through this folder's
        descriptor: an lstat made here, while it is open, and kept by the entry."""
        with os.scandir(self.fd) as listing:
            entries = list(listing)
        for entry in entries:
            entry.is_symlink()  # no system call where the listing gave the type
        return entries

    def proc_path(self) -> str:
        """A path to this very folder for a library that takes only paths (W&B): through
        ``/proc/<pid>/fd``, so it stays this folder whatever becomes of the names above it,
        for as long as this process holds it; its child processes can use it too (Linux)."""
        return f"/proc/{os.getpid()}/fd/{self.fd}"

    # -- writing ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def writer(self, relative: str | PurePosixPath, *, fsync: bool = True) -> Iterator[IO[bytes]]:
        """Yield a file whose content replaces ``relative`` when the block exits cleanly; the
        folders on the way are made. A link or FIFO planted at the name is replaced, never
        followed or opened; a folder planted there is refused (:class:`UnsafeEntry`), and is
        looked for only when the rename onto it fails: a write asks the filesystem for no more
        than its create and its rename."""
        *above, name = parts_of(relative)
        with self._writing(), self._parent(above, create=True) as parent:
            tmp = temporary_name()
            fd = os.open(tmp, _NEW_FLAGS, 0o666, dir_fd=parent.fd)
            try:
                with os.fdopen(fd, "wb") as handle:
                    yield handle
                    handle.flush()
                    if fsync:
                        os.fsync(handle.fileno())
                try:
                    os.rename(tmp, name, src_dir_fd=parent.fd, dst_dir_fd=parent.fd)
                except OSError:  # EISDIR (sshfs too), or what another filesystem says
                    existing = _lstat_or_none(name, parent.fd)
                    if existing is not None and stat.S_ISDIR(existing.st_mode):
                        with self._located():
                            raise UnsafeEntry(
                                errno.EISDIR, str(relative), "is a folder, not a file"
                            ) from None
                    raise
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp, dir_fd=parent.fd)
                raise

    def write_bytes(
        self, relative: str | PurePosixPath, data: bytes, *, fsync: bool = True
    ) -> None:
        with self.writer(relative, fsync=fsync) as handle:
            handle.write(data)

    def write_text(self, relative: str | PurePosixPath, text: str, *, fsync: bool = True) -> None:
        self.write_bytes(relative, text.encode("utf-8"), fsync=fsync)

    def rename(self, old: str | PurePosixPath, new: str | PurePosixPath) -> None:
        """Rename ``old`` to ``new`` (replacing a file or link there, never following one), both
        below this folder; the folders on the way to ``new`` are made."""
        *above_old, old_name = parts_of(old)
        *above_new, new_name = parts_of(new)
        with (
            self._writing(),
            self._parent(above_old) as source,
            self._parent(above_new, create=True) as target,
        ):
            os.rename(old_name, new_name, src_dir_fd=source.fd, dst_dir_fd=target.fd)

    def open_append(self, relative: str | PurePosixPath) -> int:
        """A descriptor appending to a regular file below this folder (made if missing); a
        link, FIFO or hard-linked file planted there is refused, never opened for writing."""
        *above, name = parts_of(relative)
        with self._writing(), self._parent(above, create=True) as parent, self._located():
            fd = _open_file(name, _APPEND_FLAGS, parent.fd, str(relative), mode=0o666)
        os.set_blocking(fd, True)
        return fd

    def unlink(self, relative: str | PurePosixPath) -> bool:
        """Remove a name (never a folder) below this folder; False if it was not there."""
        *above, name = parts_of(relative)
        try:
            with self._parent(above) as parent:
                os.unlink(name, dir_fd=parent.fd)
        except FileNotFoundError:
            return False
        return True

    def remove_tree(self, relative: str | PurePosixPath) -> bool:
        """Remove what is at ``relative``: a folder with all it holds, anything else (a link,
        a FIFO, a file) as the one name, never followed; False if nothing is there. A folder's
        content is removed through held descriptors, a link in it as a link."""
        *above, name = parts_of(relative)
        with self._parent(above) as parent:
            found = _lstat_or_none(name, parent.fd)
            if found is None:
                return False
            if not stat.S_ISDIR(found.st_mode):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=parent.fd)
                return True
            with parent.folder(name) as held:
                for entry in held.entries():
                    held.remove_tree(entry.name)
            os.rmdir(name, dir_fd=parent.fd)
        return True

    def mkdir(self, name: str) -> None:
        """Make a new folder ``name`` in this one; FileExistsError if anything has that name
        (so a name planted in advance is never taken for ours)."""
        with self._writing():
            os.mkdir(_one_name(name), 0o777, dir_fd=self.fd)

    def remove_strays(self, *, below: bool = True) -> list[str]:
        """Remove the temporaries interrupted writes left here, and anywhere below when
        ``below`` (regular files named like :func:`temporary_name`, and below, folders so
        named: a label image a crash left half built, with all they hold); the relative
        paths removed. Only where no one else writes: a write in progress has such a file
        too. Links are neither followed nor removed."""
        removed: list[str] = []
        for entry in self.entries():
            if entry.is_dir(follow_symlinks=False) and below and is_temporary(entry.name):
                self.remove_tree(entry.name)
                removed.append(f"{entry.name}/")
            elif entry.is_dir(follow_symlinks=False) and below:
                with contextlib.suppress(OSError), self.folder(entry.name) as inner:
                    removed += [f"{entry.name}/{r}" for r in inner.remove_strays()]
            elif is_temporary(entry.name) and entry.is_file(follow_symlinks=False):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.name, dir_fd=self.fd)
                    removed.append(entry.name)
        return removed

    # -- plumbing --------------------------------------------------------------------------
    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """Say a write the filesystem refused (:data:`WRITE_REFUSED`) as :class:`NotWritable`,
        naming this folder."""
        try:
            yield
        except (NotWritable, UnsafeEntry):
            raise
        except OSError as exc:
            if exc.errno in WRITE_REFUSED:
                raise NotWritable(exc.errno, exc.strerror or str(exc), self.path) from exc
            raise

    @contextlib.contextmanager
    def _located(self) -> Iterator[None]:
        """Say in an :class:`UnsafeEntry` raised in the block which folder it is relative to."""
        try:
            yield
        except UnsafeEntry as exc:
            if exc.folder is None:
                exc.folder = self.path
            raise

    def _parent(self, above: list[str], *, create: bool = False) -> HeldFolder:
        if not above:
            return HeldFolder(os.dup(self.fd), self.path)
        return self.folder("/".join(above), create=create)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> HeldFolder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def temporary_name() -> str:
    """A fresh temporary name, short whatever the final name's length (a name may take the
    filesystem's whole 255 bytes), and shaped so that no input can be mistaken for one."""
    return f"{TMP_PREFIX}watchd-{secrets.token_hex(8)}"


def is_temporary(name: str) -> bool:
    """Whether ``name`` is exactly the shape :func:`temporary_name` makes."""
    prefix = f"{TMP_PREFIX}watchd-"
    tail = name[len(prefix) :]
    return (
        name.startswith(prefix) and len(tail) == 16 and all(c in "0123456789abcdef" for c in tail)
    )


def _one_name(name: str) -> str:
    if parts_of(name) != (name,):
        raise ValueError(f"not one name: {name!r}")
    return name


def _step(parent: int, name: str, shown: str, create: bool) -> int:
    """Open ``name`` in folder ``parent`` as a folder, made first when ``create``; ``parent``
    is closed either way."""
    try:
        if create:
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o777, dir_fd=parent)
        return _open_dir(name, parent, shown)
    finally:
        os.close(parent)


def _open_dir(name: str, parent: int, shown: str) -> int:
    try:
        return os.open(name, DIR_FLAGS, dir_fd=parent)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            st = _lstat_or_none(name, parent)
            what = what_it_is(st.st_mode) if st else "not a folder"
            raise UnsafeEntry(exc.errno, shown, f"is {what}, not a folder") from None
        raise


def _open_file(
    name: str, flags: int, parent: int, shown: str, *, mode: int = 0, links_ok: bool = False
) -> int:
    """Open ``name`` in ``parent`` with ``flags``; it must be a regular file (with one link,
    unless ``links_ok``), else the descriptor is closed and :class:`UnsafeEntry` raised."""
    try:
        fd = os.open(name, flags, mode, dir_fd=parent)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):  # link; FIFO with no reader
            st = _lstat_or_none(name, parent)
            what = what_it_is(st.st_mode) if st else "not a regular file"
            raise UnsafeEntry(exc.errno, shown, f"is {what}, not a regular file") from None
        raise
    st = os.fstat(fd)
    problem = ""
    if not stat.S_ISREG(st.st_mode):
        problem = f"is {what_it_is(st.st_mode)}, not a regular file"
    elif st.st_nlink > 1 and not links_ok:
        problem = "has other hard links: it may be a file outside the folder"
    if problem:
        os.close(fd)
        raise UnsafeEntry(errno.EMLINK if "links" in problem else errno.ELOOP, shown, problem)
    return fd


def _lstat_or_none(name: str, parent: int) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=parent, follow_symlinks=False)
    except OSError:
        return None
