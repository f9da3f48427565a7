"""An OME-Zarr store as an input: a folder of the batch folder, walked as a whole.

The daemon walks a listed store while its batch waits (is it all there, has it stopped
changing?) and the jobs walk it again before and after they read it (did it change in
between?), by the one rule here: every folder of the store opened below the one above it
without following a link, listed once, each entry lstat'ed once; only folders and regular
files may be in it, and no metadata file (``.zarray``, ``.zattrs``, ``.zgroup``, ``zarr.json``)
larger than MAX_METADATA_BYTES: the walk's own lstat tells, before anyone reads it (the jobs
bound what they read of a store further; they read no consolidated ``.zmetadata``). What the
walk gives: the files' bytes, the entries' latest modification time, whether the store's top
holds Zarr metadata, and a digest of every file's name, size and time (the store's state: a
chunk added, grown, rewritten or removed changes it).
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass

from daemon.contract.heldfolder import DIR_FLAGS, HeldFolder, what_it_is

MAX_STORE_ENTRIES = 10_000_000  # for the jobs: the daemon bounded the store when it took it in
METADATA = frozenset({".zattrs", ".zgroup", "zarr.json"})  # a Zarr v2 or v3 group's top
METADATA_NAMES = METADATA | {".zarray"}  # every file of Zarr metadata the jobs read
MAX_METADATA_BYTES = 2**20  # a Zarr library writes a few kB of it per group or array


@dataclass(frozen=True)
class Walked:
    """What a walk of a store found; ``problem``: what it holds that no store may (then the
    rest is empty)."""

    size: int = 0
    latest: int = 0
    metadata: bool = False
    state: str = ""
    problem: str = ""


def walk_store(fd: int, max_entries: int) -> Walked:
    """Walk the store open as the folder ``fd`` (left open); OSError where the share fails.
    More than ``max_entries`` entries is a problem: the walk stops there."""
    size = latest = seen = 0
    metadata = False
    digest = hashlib.sha256()
    todo = [(os.dup(fd), "")]
    try:
        while todo:
            here, prefix = todo.pop()
            try:
                latest = max(latest, os.fstat(here).st_mtime_ns)
                with os.scandir(here) as listing:
                    entries = sorted(listing, key=lambda e: e.name)
                for entry in entries:
                    seen += 1
                    if seen > max_entries:
                        return Walked(problem=(
                            f"holds more than {max_entries:,} entries, the most one store may "
                            "(intake.max_pattern_entries)"
                        ))  # fmt: skip
                    st = entry.stat(follow_symlinks=False)
                    if stat.S_ISDIR(st.st_mode):
                        inner = os.open(entry.name, DIR_FLAGS, dir_fd=here)
                        todo.append((inner, f"{prefix}{entry.name}/"))
                    elif stat.S_ISREG(st.st_mode):
                        if entry.name in METADATA_NAMES and st.st_size > MAX_METADATA_BYTES:
                            return Walked(problem=_oversized(f"{prefix}{entry.name}", st.st_size))
                        size += st.st_size
                        latest = max(latest, st.st_mtime_ns)
                        metadata = metadata or (not prefix and entry.name in METADATA)
                        digest.update(f"{prefix}{entry.name}\0{st.st_size}\0{st.st_mtime_ns}\n"
                                      .encode("utf-8", "surrogateescape"))  # fmt: skip
                    else:
                        return Walked(problem=(
                            f"holds {what_it_is(st.st_mode)} at '{prefix}{entry.name}': an "
                            "OME-Zarr store may hold only folders and regular files"
                        ))  # fmt: skip
            finally:
                os.close(here)
    finally:
        for left, _ in todo:
            os.close(left)
    return Walked(size, latest, metadata, digest.hexdigest())


def _oversized(key: str, size: int) -> str:
    spaced = [f"{n:,}".replace(",", " ") for n in (size, MAX_METADATA_BYTES)]
    return (f"holds Zarr metadata '{key}' of {spaced[0]} bytes, more than the {spaced[1]} a "
            "metadata file may take: no Zarr library writes that much")  # fmt: skip


def store_state(folder: HeldFolder, relative: str, max_entries: int) -> Walked:
    """:func:`walk_store` of the store ``relative`` of the held ``folder`` (reached without
    following a link: UnsafeEntry, an OSError, where one is on the way)."""
    with folder.folder(relative) as store:
        return walk_store(store.fd, max_entries)
