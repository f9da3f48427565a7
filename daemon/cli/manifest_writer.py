"""Write a correct manifest for a folder of images: the expert's helper behind
``watchctl manifest``.

Lists the image files (PNG, TIFF; regular files only: never links, FIFOs or devices) with
their sizes and, unless told not to, their sha256; marks files under the masks folder as ground
truth for training; validates the result with the same parser and the same size limit
(``intake.max_manifest_bytes``) as the daemon; writes it to a temporary name and renames it into
place, which is exactly the "manifest last" the daemon waits for.

A folder with too many files to list within that limit (about 120 000 with checksums at the
default 16 MiB) gets one ``[[patterns]]`` entry per folder and file name ending instead, each
with its ``count``: the daemon waits for that many files, without per-file sizes or checksums.
"""

from __future__ import annotations

import glob
import os
import posixpath
import stat
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import tomli_w

from daemon.contract import atomicfile
from daemon.contract.checksums import sha256_of_stream
from daemon.contract.errors import ManifestError, WatchdError
from daemon.contract.jobspec import Role
from daemon.contract.names import IMAGE_SUFFIXES, is_store
from daemon.contract.safeopen import open_input
from daemon.core.manifest import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    RESULTS_DIR,
    STATUS_NAME,
    Manifest,
    parse_manifest,
)
from daemon.core.manifest_schema import FORMAT_VERSION, MAX_INPUTS, MAX_PATTERNS, Kind

ProgressHook = Callable[[int, int], None]  # (files done, files in all), after each file


@dataclass(frozen=True)
class ManifestRequest:
    folder: Path
    kind: Kind
    model: str
    owner: str
    email: str | None = None
    title: str = ""
    version: str | None = None
    masks: str | None = None  # folder (relative) holding the ground-truth masks
    checksums: bool = True
    params: Mapping[str, Any] = field(default_factory=dict)
    sweep: Mapping[str, Any] | None = None  # kind sweep: the [sweep] section (a starter if None)
    max_bytes: int = MAX_MANIFEST_BYTES  # the daemon's intake.max_manifest_bytes


@dataclass(frozen=True)
class Composed:
    text: str
    note: str = ""  # for the expert: why the manifest names patterns instead of files


@dataclass(frozen=True)
class Written:
    path: Path
    note: str = ""


# What `watchctl manifest --kind sweep` proposes: edit [sweep.space] to search what matters.
STARTER_SWEEP = {
    "method": "random",
    "trials": 4,
    "seed": 0,
    "space": {"learning_rate": {"min": 1e-4, "max": 1e-2, "log": True}, "width": [8, 16]},
}


def image_files(folder: Path) -> list[str]:
    """Image files under ``folder`` (relative, posix, sorted), leaving out what watchd writes;
    an OME-Zarr store (a folder ``*.zarr``, not a link) is one, and not looked into."""
    found = []
    for dirpath, dirnames, filenames in os.walk(folder):
        relative_dir = Path(dirpath).relative_to(folder)
        if relative_dir == Path("."):
            dirnames[:] = [d for d in dirnames if d != RESULTS_DIR]
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        here = Path(dirpath)
        stores = [d for d in dirnames if is_store(d)]
        found += [(relative_dir / d).as_posix() for d in stores if _is(here / d, stat.S_ISDIR)]
        dirnames[:] = [d for d in dirnames if d not in stores]
        for name in filenames:
            if name.startswith(".") or name in (MANIFEST_NAME, STATUS_NAME):
                continue
            if Path(name).suffix.lower() in IMAGE_SUFFIXES and _is(here / name, stat.S_ISREG):
                found.append((relative_dir / name).as_posix())
    return sorted(found)


def _is(path: Path, kind: Callable[[int], bool]) -> bool:
    """Whether ``path`` itself, not a link, is of ``kind`` (``stat.S_ISREG``: a regular file,
    as a FIFO named like an image would block the checksum read and a link may lead out of the
    folder; ``stat.S_ISDIR``: an OME-Zarr store's folder)."""
    try:
        return kind(os.lstat(path).st_mode)
    except OSError:
        return False


def build(request: ManifestRequest, progress: ProgressHook | None = None) -> str:
    """The manifest text for the folder; raises WatchdError when it would not be valid.
    ``progress`` hears of each file hashed (hashing 55,000 images takes a while)."""
    return compose(request, progress).text


def compose(request: ManifestRequest, progress: ProgressHook | None = None) -> Composed:
    """The manifest for the folder, and a note when it lists patterns instead of files."""
    folder = request.folder
    if not folder.is_dir():
        raise WatchdError(f"{folder} is not a folder")
    files = image_files(folder)
    if not files:
        raise WatchdError(f"{folder} holds no PNG or TIFF images")
    masks_prefix = (request.masks.strip("/") + "/") if request.masks else None
    document = _document(request)
    # A sha256 is always 64 digits: the listing's size is known before any file is read.
    unread = (lambda _: _UNREAD) if request.checksums else None
    document["files"] = _entries(folder, files, masks_prefix, unread)
    text = tomli_w.dumps(document)
    note = ""
    if len(text.encode("utf-8")) > request.max_bytes or len(files) > MAX_INPUTS:
        # an OME-Zarr store (a folder) no pattern matches: listed still
        document["files"] = [{"path": f} for f in files if is_store(f)]
        document["patterns"] = _patterns([f for f in files if not is_store(f)], masks_prefix)
        if not document["files"]:
            del document["files"]
        note = (
            f"note: listing all {len(files):,} files would make the manifest larger than the "
            f"{request.max_bytes:,} bytes the daemon accepts; it names {len(document['patterns'])} "
            "pattern(s) with their file counts instead (no per-file sizes or checksums)"
        )
    elif request.checksums:
        document["files"] = _entries(
            folder, files, masks_prefix, partial(_sha256, folder), progress
        )
    text = tomli_w.dumps(document)
    _validate(text, request.max_bytes)
    return Composed(text, note)


_UNREAD = "0" * 64  # stands in for a sha256 while the listing is measured


def _document(request: ManifestRequest) -> dict[str, Any]:
    document: dict[str, Any] = {
        "watchd": FORMAT_VERSION,
        "kind": request.kind.value,
        "title": request.title,
        "owner": {"name": request.owner, **({"email": request.email} if request.email else {})},
        "model": {
            "name": request.model,
            **({"version": request.version} if request.version else {}),
        },
        "params": dict(request.params),
    }
    if request.kind is Kind.SWEEP:
        document["sweep"] = dict(request.sweep or STARTER_SWEEP)
    return document


def _entries(
    folder: Path,
    files: list[str],
    masks_prefix: str | None,
    digest: Callable[[str], str] | None,
    progress: ProgressHook | None = None,
) -> list[dict[str, Any]]:
    """``[[files]]`` entries, with ``digest(path)`` as each one's sha256 if given (``progress``
    hears of each one)."""
    entries = []
    for relative in files:
        entry: dict[str, Any] = {"path": relative}
        if is_store(relative):  # a folder: no one size or checksum (readiness waits it out)
            entries.append(entry)
            continue
        entry["size"] = (folder / relative).stat().st_size
        if digest is not None:
            entry["sha256"] = digest(relative)
        if masks_prefix and relative.startswith(masks_prefix):
            entry["role"] = Role.MASK.value
        entries.append(entry)
        if progress is not None:
            progress(len(entries), len(files))
    return entries


def _sha256(folder: Path, relative: str) -> str:
    """By the rule the jobs read inputs by: a file swapped for a FIFO since it was listed must
    not block ``watchctl``, nor a link make it read outside the folder."""
    with open_input(folder, relative) as handle:
        return sha256_of_stream(handle)


def _patterns(files: list[str], masks_prefix: str | None) -> list[dict[str, Any]]:
    """One ``[[patterns]]`` entry per folder and file name ending, with its file count.

    ``[!.]*`` leaves out hidden files (macOS's ``._*`` companions), as the listing does.
    """
    counts = Counter(
        (posixpath.dirname(relative), posixpath.splitext(relative)[1]) for relative in files
    )
    if len(counts) > MAX_PATTERNS:
        raise WatchdError(
            f"the images lie in {len(counts):,} folders: too many to list as patterns "
            f"(at most {MAX_PATTERNS}); split the folder into several batches"
        )
    patterns = []
    for (folder, suffix), count in sorted(counts.items()):
        name = "[!.]*" + glob.escape(suffix)
        entry: dict[str, Any] = {
            "glob": f"{glob.escape(folder)}/{name}" if folder else name,
            "count": count,
        }
        if masks_prefix and f"{folder}/".startswith(masks_prefix):
            entry["role"] = Role.MASK.value
        patterns.append(entry)
    return patterns


def _validate(text: str, max_bytes: int) -> Manifest:
    try:
        return parse_manifest(text.encode("utf-8"), max_bytes=max_bytes)
    except ManifestError as exc:
        listed = "; ".join(p.render() for p in exc.problems[:5])
        raise WatchdError(f"the manifest would not be valid: {listed}") from None


def write(
    request: ManifestRequest, *, overwrite: bool = False, progress: ProgressHook | None = None
) -> Written:
    """Build and write ``FOLDER/manifest.toml`` atomically; refuse to replace one unless told."""
    target = request.folder / MANIFEST_NAME
    if target.exists() and not overwrite:
        raise WatchdError(f"{target} exists; pass --force to replace it (a new revision)")
    composed = compose(request, progress)
    atomicfile.write_text(target, composed.text)
    return Written(target, composed.note)
