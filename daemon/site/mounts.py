"""Which filesystem holds a path, and whether inotify can be trusted there.

Network filesystems (NFS, GPFS/Spectrum Scale, Lustre, SMB, CephFS, …) deliver no inotify
events for writes made on other hosts, so a drop root on one is polled.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from daemon.site.config import ObserverMode

NETWORK_FILESYSTEMS = frozenset(
    {
        "nfs", "nfs4", "cifs", "smb3", "smbfs", "gpfs", "lustre", "beegfs", "ceph",
        "glusterfs", "afs", "panfs", "wekafs", "9p", "virtiofs", "davfs", "ncpfs", "orangefs",
    }
)  # fmt: skip
LOCAL_FUSE = frozenset({"fuse.lxcfs", "fuse.portal", "fuse.gvfsd-fuse"})


@dataclass(frozen=True)
class Mount:
    mountpoint: str
    fstype: str


def parse_mounts(data: bytes) -> list[Mount]:
    """The entries of /proc/self/mounts: raw bytes, with space, tab, newline and backslash in
    paths escaped as octal (\\040); anything else (UTF-8 names) comes as it is."""
    mounts = []
    for line in data.splitlines():
        fields = line.split()
        if len(fields) >= 3:
            point = re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), fields[1])
            mounts.append(Mount(os.fsdecode(point), os.fsdecode(fields[2])))
    return mounts


def mount_of(path: str, mounts: Iterable[Mount]) -> Mount | None:
    """The mount holding ``path`` (an absolute, resolved path): the longest matching point."""
    best: Mount | None = None
    for mount in mounts:
        point = mount.mountpoint.rstrip("/") or "/"
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best.mountpoint.rstrip("/") or "/")):
            best = mount
    return best


def is_network(fstype: str) -> bool:
    return fstype in NETWORK_FILESYSTEMS or (
        fstype.startswith("fuse.") and fstype not in LOCAL_FUSE
    )


def choose_mode(configured: ObserverMode, fstype: str | None) -> ObserverMode:
    """``auto`` polls on network filesystems (and where the type is unknown), else inotify."""
    if configured is not ObserverMode.AUTO:
        return configured
    if fstype is None or is_network(fstype):
        return ObserverMode.POLLING
    return ObserverMode.INOTIFY


def filesystem_type(path: Path) -> str | None:
    """The type of the filesystem holding ``path``, from this process's mount table."""
    try:
        data = Path("/proc/self/mounts").read_bytes()
    except OSError:
        return None
    mount = mount_of(os.path.realpath(path), parse_mounts(data))
    return mount.fstype if mount else None
