"""Write a correct manifest for a folder of images: the expert's helper behind
``watchctl manifest``.

Lists the image files (PNG, TIFF; regular files only: never links, FIFOs or devices) with
their sizes and, unless told not to, their sha256; marks
files under the masks folder as ground truth for training; validates the result with the same
parser the daemon uses; writes it to a temporary name and renames it into place, which is
exactly the "manifest last" the daemon waits for.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from daemon import atomicfile
from daemon.errors import ManifestError, WatchdError
from daemon.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    RESULTS_DIR,
    STATUS_NAME,
    Kind,
    Manifest,
    parse_manifest,
)

IMAGE_SUFFIXES = frozenset({".png", ".tif", ".tiff"})

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


# What `watchctl manifest --kind sweep` proposes: edit [sweep.space] to search what matters.
STARTER_SWEEP = {
    "method": "random",
    "trials": 4,
    "seed": 0,
    "space": {"learning_rate": {"min": 1e-4, "max": 1e-2, "log": True}, "width": [8, 16]},
}


def image_files(folder: Path) -> list[str]:
    """Image files under ``folder`` (relative, posix, sorted), leaving out what watchd writes."""
    found = []
    for dirpath, dirnames, filenames in os.walk(folder):
        relative_dir = Path(dirpath).relative_to(folder)
        if relative_dir == Path("."):
            dirnames[:] = [d for d in dirnames if d != RESULTS_DIR]
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if name.startswith(".") or name in (MANIFEST_NAME, STATUS_NAME):
                continue
            if Path(name).suffix.lower() in IMAGE_SUFFIXES and _regular(Path(dirpath) / name):
                found.append((relative_dir / name).as_posix())
    return sorted(found)


def _regular(path: Path) -> bool:
    """A regular file, not a link: a FIFO named like an image would block the checksum read,
    and a link may lead out of the folder."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def build(request: ManifestRequest, progress: ProgressHook | None = None) -> str:
    """The manifest text for the folder; raises WatchdError when it would not be valid.
    ``progress`` hears of each file listed (hashing 55,000 images takes a while)."""
    folder = request.folder
    if not folder.is_dir():
        raise WatchdError(f"{folder} is not a folder")
    files = image_files(folder)
    if not files:
        raise WatchdError(f"{folder} holds no PNG or TIFF images")
    masks_prefix = (request.masks.strip("/") + "/") if request.masks else None
    entries = []
    for relative in files:
        entry: dict[str, Any] = {"path": relative, "size": (folder / relative).stat().st_size}
        if request.checksums:
            entry["sha256"] = sha256_of(folder / relative)
        if masks_prefix and relative.startswith(masks_prefix):
            entry["role"] = "mask"
        entries.append(entry)
        if progress is not None:
            progress(len(entries), len(files))
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
        "files": entries,
    }
    if request.kind is Kind.SWEEP:
        document["sweep"] = dict(request.sweep or STARTER_SWEEP)
    text = tomli_w.dumps(document)
    _validate(text)
    return text


def _validate(text: str) -> Manifest:
    try:
        return parse_manifest(text.encode("utf-8"), max_bytes=1 << 30)
    except ManifestError as exc:
        listed = "; ".join(p.render() for p in exc.problems[:5])
        raise WatchdError(f"the manifest would not be valid: {listed}") from None


def write(
    request: ManifestRequest, *, overwrite: bool = False, progress: ProgressHook | None = None
) -> Path:
    """Build and write ``FOLDER/manifest.toml`` atomically; refuse to replace one unless told."""
    target = request.folder / MANIFEST_NAME
    if target.exists() and not overwrite:
        raise WatchdError(f"{target} exists; pass --force to replace it (a new revision)")
    atomicfile.write_text(target, build(request, progress))
    return target
