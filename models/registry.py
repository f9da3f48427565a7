"""The model registry on the share: versioned weights with metadata, published atomically.

Layout::

    REGISTRY/<name>/v0001/weights.pt      state_dict of models.unet.UNet (torch.save)
    REGISTRY/<name>/v0001/metadata.json   version, sha256 of weights.pt, metrics, provenance
    REGISTRY/<name>/aliases.json          {"latest": 3, "best": 2}

A version folder is built under a temporary name and renamed into place, so it appears whole
or not at all; a rename onto a version another trainer published first fails, and we take the
next number. ``aliases.json`` is read-modify-written under an exclusive ``flock`` on
``<name>/.lock`` (flock is emulated with POSIX locks on NFS, and GPFS supports it) and written
atomically, so readers need no lock. A new version becomes ``best`` only if its ``val_dice``
beats the current best's.

Loading reads ``weights.pt`` once, checks its sha256 against the metadata, and unpickles with
``torch.load(weights_only=True)`` from those same bytes: nothing else is ever unpickled.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import io
import json
import logging
import os
import re
import secrets
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from daemon.atomicfile import write_bytes, write_text

WEIGHTS_FILE = "weights.pt"
METADATA_FILE = "metadata.json"
ALIASES_FILE = "aliases.json"
ALIASES = ("latest", "best")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
_VERSION_DIR = re.compile(r"v(\d{4,})")
log = logging.getLogger(__name__)


class ModelError(Exception):
    """The named model or version is missing, damaged or refused (job error kind MODEL)."""


@dataclass(frozen=True)
class ModelVersion:
    """One published version of a model, as resolved from the registry."""

    name: str
    version: int
    path: Path
    sha256: str
    metadata: Mapping[str, Any]

    @property
    def weights_path(self) -> Path:
        return self.path / WEIGHTS_FILE

    @property
    def architecture(self) -> dict[str, int]:
        return dict(self.metadata.get("architecture", {}))


def version_dir_name(version: int) -> str:
    return f"v{version:04d}"


def check_name(name: str) -> str:
    """Return ``name`` if it is a safe single path component, else raise ModelError."""
    if not _NAME.fullmatch(name) or ".." in name:
        raise ModelError(
            f"invalid model name {name!r}: use letters, digits, '.', '_' and '-', "
            "starting with a letter or digit"
        )
    return name


def list_models(registry: Path) -> list[str]:
    if not registry.is_dir():
        return []
    return sorted(p.name for p in registry.iterdir() if p.is_dir() and _NAME.fullmatch(p.name))


def list_versions(registry: Path, name: str) -> list[int]:
    """Published version numbers of ``name``, ascending (temporary folders are ignored)."""
    model_dir = registry / check_name(name)
    if not model_dir.is_dir():
        return []
    found = (_VERSION_DIR.fullmatch(p.name) for p in model_dir.iterdir())
    return sorted(int(match.group(1)) for match in found if match)


def read_aliases(registry: Path, name: str) -> dict[str, int]:
    path = registry / check_name(name) / ALIASES_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return {key: int(value) for key, value in data.items() if key in ALIASES}
    except FileNotFoundError:
        return {}
    except (ValueError, TypeError, AttributeError) as exc:
        raise ModelError(f"unreadable {path} ({exc})") from exc


def _describe(registry: Path, name: str) -> str:
    versions = list_versions(registry, name)
    if not versions:
        models = ", ".join(list_models(registry)) or "none"
        return f"no model named {name!r} in the registry {registry}; available models: {models}"
    aliases = read_aliases(registry, name)
    named = ", ".join(f"{key} = {value}" for key, value in sorted(aliases.items()))
    listed = ", ".join(str(v) for v in versions)
    return f"available versions of {name!r}: {listed}" + (f" ({named})" if named else "")


def _parse_version(registry: Path, name: str, version: str) -> int:
    text = str(version).strip().lower()
    if text in ALIASES:
        aliases = read_aliases(registry, name)
        if text in aliases:
            return aliases[text]
        versions = list_versions(registry, name)
        if text == "latest" and versions:  # aliases.json lost or not yet written
            return versions[-1]
        raise ModelError(f"model {name!r} has no version {text!r}; {_describe(registry, name)}")
    match = re.fullmatch(r"v?(\d+)", text)
    if not match:
        raise ModelError(
            f"invalid model version {version!r}: use 'latest', 'best' or a number; "
            + _describe(registry, name)
        )
    return int(match.group(1))


def resolve(registry: Path, name: str, version: str = "latest") -> ModelVersion:
    """Find ``name`` at ``version`` ("latest", "best", "3" or "v0003") and read its metadata."""
    registry = Path(registry)
    number = _parse_version(registry, check_name(name), version)
    path = registry / name / version_dir_name(number)
    if not path.is_dir():
        raise ModelError(f"model {name!r} has no version {number}; {_describe(registry, name)}")
    try:
        metadata = json.loads((path / METADATA_FILE).read_text(encoding="utf-8"))
        sha256 = str(metadata["sha256"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelError(
            f"model {name!r} version {number}: unreadable {METADATA_FILE} in {path} ({exc})"
        ) from exc
    return ModelVersion(name=name, version=number, path=path, sha256=sha256, metadata=metadata)


def find(registry: Path, name: str, origin: Mapping[str, Any]) -> ModelVersion | None:
    """The version whose metadata ``origin`` equals ``origin`` (newest first), if any.

    A training job records where it came from; a retried job finds what an earlier attempt
    published instead of training and publishing the same model twice.
    """
    for version in reversed(list_versions(Path(registry), name)):
        try:
            found = resolve(Path(registry), name, str(version))
        except ModelError:
            continue
        if found.metadata.get("origin") == dict(origin):
            return found
    return None


def load(model: ModelVersion) -> dict[str, torch.Tensor]:
    """Read and verify the weights of ``model``; only tensors are ever unpickled."""
    where = f"model {model.name!r} version {model.version}"
    try:
        data = model.weights_path.read_bytes()
    except OSError as exc:
        raise ModelError(f"{where}: cannot read {model.weights_path} ({exc})") from exc
    actual = hashlib.sha256(data).hexdigest()
    if actual != model.sha256:
        raise ModelError(
            f"{where}: {WEIGHTS_FILE} has sha256 {actual} ({len(data)} bytes), the registry "
            f"recorded {model.sha256}: the file was truncated or changed after publication"
        )
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # any unpickling failure means: refuse this file
        raise ModelError(f"{where}: refused to load {WEIGHTS_FILE} ({exc})") from exc
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise ModelError(f"{where}: {WEIGHTS_FILE} is not a state_dict of tensors")
    return state


def state_bytes(state: Mapping[str, torch.Tensor]) -> bytes:
    buffer = io.BytesIO()
    torch.save(dict(state), buffer)
    return buffer.getvalue()


def register(
    registry: Path,
    name: str,
    state: Mapping[str, torch.Tensor],
    metadata: Mapping[str, Any],
    *,
    val_dice: float | None = None,
) -> ModelVersion:
    """Publish ``state`` as the next version of ``name`` and update the aliases.

    ``metadata`` is stored as given, plus ``name``, ``version``, ``sha256``, ``size`` and
    ``val_dice``; returns the published version.
    """
    registry = Path(registry)
    model_dir = registry / check_name(name)
    model_dir.mkdir(parents=True, exist_ok=True)
    data = state_bytes(state)
    record = {**metadata, "name": name, "val_dice": val_dice}
    record.update(sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    # os.mkdir honours the umask (mkdtemp would make the version private to this user).
    staging = model_dir / f".tmp-version-{secrets.token_hex(8)}"
    staging.mkdir()
    try:
        write_bytes(staging / WEIGHTS_FILE, data)
        version = publish(staging, model_dir, record)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _update_aliases(model_dir, version, val_dice)
    return resolve(registry, name, str(version))


def publish(
    staging: Path, model_dir: Path, record: Mapping[str, Any], first: int | None = None
) -> int:
    """Rename ``staging`` to the first free version folder from ``first``; return its number.

    ``first`` defaults to one past the highest published version. The metadata (with the
    version number) is rewritten before each attempt, so a folder always names itself right.
    """
    if first is None:
        first = max(list_versions(model_dir.parent, model_dir.name), default=0) + 1
    version = first
    while True:
        text = json.dumps({**record, "version": version}, indent=2, sort_keys=True)
        write_text(staging / METADATA_FILE, text + "\n")
        try:
            os.rename(staging, model_dir / version_dir_name(version))
            return version
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            version += 1  # another trainer published this number first


@contextlib.contextmanager
def _locked(model_dir: Path) -> Iterator[None]:
    """Hold an exclusive lock on the model's folder (best effort where locks are unsupported).

    A share mounted without lock support (NFS ``nolock``) must not fail a finished training:
    the version is already published; only a simultaneous alias update could be lost.
    """
    with open(model_dir / ".lock", "a+b") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        except OSError as exc:
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                raise
            log.warning("cannot lock %s (%s); updating aliases unlocked", model_dir, exc)
            yield
            return
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _metric_of(model_dir: Path, version: int) -> float | None:
    try:
        text = (model_dir / version_dir_name(version) / METADATA_FILE).read_text(encoding="utf-8")
        value = json.loads(text).get("val_dice")
    except (OSError, ValueError):
        return None
    return None if value is None else float(value)


def _update_aliases(model_dir: Path, version: int, val_dice: float | None) -> None:
    with _locked(model_dir):
        try:
            aliases = read_aliases(model_dir.parent, model_dir.name)
        except ModelError:
            aliases = {}  # a damaged aliases.json is rebuilt from this version on
        aliases["latest"] = max(version, aliases.get("latest", 0))
        best = aliases.get("best")
        best_dice = None if best is None else _metric_of(model_dir, best)
        if best is None or (val_dice is not None and (best_dice is None or val_dice > best_dice)):
            aliases["best"] = version
        write_text(model_dir / ALIASES_FILE, json.dumps(aliases, indent=2, sort_keys=True) + "\n")
