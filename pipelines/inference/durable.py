"""Making many written masks durable at once, before the ledger records them.

A mask is written to a fresh name and renamed into place without an fsync of its own; every
so often (:class:`pipelines.inference.pool.Committer`) the masks written since are made durable
together by one ``syncfs`` of the run folder's filesystem, and only then do their ledger lines
go in: a ledger line still stands only for a mask on disk. One syncfs is one journal commit for
any number of masks where an fsync per mask was one each (0.4 ms on the GPU node, 1–4 ms on the
shared development machine).

A FUSE filesystem (sshfs, and most network filesystems mounted through FUSE) does not pass a
syncfs on to its server: there each mask is fsynced as it is written (:func:`each_file`), in
the worker that wrote it, as before. NFS, GPFS and local filesystems flush and commit every
dirty file of the filesystem on syncfs.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os

FUSE_SUPER_MAGIC = 0x65735546
_STATFS_BYTES = 256  # more than struct statfs takes; f_type is its first field, a long


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def filesystem_type(fd: int) -> int:
    """The type (``f_type`` of fstatfs) of the filesystem ``fd`` lies on."""
    buffer = ctypes.create_string_buffer(_STATFS_BYTES)
    if _libc().fstatfs(fd, buffer) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return ctypes.c_long.from_buffer(buffer).value


def each_file(fd: int) -> bool:
    """Whether files under ``fd`` must be fsynced one by one to be durable (FUSE), rather
    than together by :func:`sync_filesystem`."""
    return filesystem_type(fd) == FUSE_SUPER_MAGIC


def sync_filesystem(fd: int) -> None:
    """Write and commit everything written to the filesystem ``fd`` lies on (``syncfs``)."""
    if _libc().syncfs(fd) != 0:
        code = ctypes.get_errno() or errno.EIO
        raise OSError(code, f"syncfs: {os.strerror(code)}")
