"""The model catalogue on the share: names, versions, metadata and aliases; torch-free.

Layout::

    REGISTRY/<name>/v0001/weights.pt      state_dict of models.unet.UNet (torch.save)
    REGISTRY/<name>/v0001/metadata.json   version, sha256 of weights.pt, metrics, provenance
    REGISTRY/<name>/aliases.json          {"latest": 3, "best": 2}
    REGISTRY/<name>/history.jsonl         one line per alias change (who, when, from, to, why)

A version folder is built under a temporary name and renamed into place, so it appears whole
or not at all; a rename onto a version another trainer published first fails, and we take the
next number. ``aliases.json`` is read-modify-written under an exclusive ``flock`` on
``<name>/.lock`` (flock is emulated with POSIX locks on NFS, and GPFS supports it) and written
atomically, so readers need no lock.

A new version becomes ``best`` only if its score (``metrics[<metric>]``, ``val_dice`` unless the
training asked for ``val_iou``) beats the current best's by more than a margin (0 by default):
see :class:`BestRule`. An operator can move an alias by hand (:func:`promote`); that checks the
weights' sha256 first, so a damaged version is never promoted.

This module reads and writes JSON only (no torch), so ``watchctl models`` can run it as
``python -m models.catalog REGISTRY list|promote ...`` in the pipelines' interpreter, while the
daemon itself never imports models/. Loading and publishing weights is :mod:`models.registry`.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from daemon.contract.atomicfile import write_text
from daemon.contract.checksums import sha256_of
from daemon.contract.names import (
    ALIASES,
    ALIASES_FILE,
    VERSION_DIR,
    model_name_problem,
    model_names,
)

WEIGHTS_FILE = "weights.pt"
METADATA_FILE = "metadata.json"
HISTORY_FILE = "history.jsonl"
METRICS = ("val_dice", "val_iou", "val_object_f1")
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
    if problem := model_name_problem(name):
        raise ModelError(f"invalid model name {name!r}: {problem}")
    return name


def list_versions(registry: Path, name: str) -> list[int]:
    """Published version numbers of ``name``, ascending (temporary folders are ignored)."""
    model_dir = registry / check_name(name)
    if not model_dir.is_dir():
        return []
    found = (VERSION_DIR.fullmatch(p.name) for p in model_dir.iterdir())
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
        models = ", ".join(model_names(registry)) or "none"
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


@dataclass(frozen=True)
class BestRule:
    """A new version takes ``best`` when its ``metric`` beats the best's by more than ``margin``."""

    metric: str = "val_dice"
    margin: float = 0.0

    def score(self, metadata: Mapping[str, Any]) -> float | None:
        value = dict(metadata.get("metrics") or {}).get(self.metric)
        if value is None and self.metric == "val_dice":
            value = metadata.get("val_dice")  # versions published before metrics were nested
        try:
            return None if value is None else float(value)
        except (TypeError, ValueError):
            return None

    def beats(self, new: float | None, best: float | None) -> bool:
        if new is None:
            return False
        return best is None or new > best + self.margin


def _metadata_of(model_dir: Path, version: int) -> dict[str, Any]:
    try:
        text = (model_dir / version_dir_name(version) / METADATA_FILE).read_text(encoding="utf-8")
        data = json.loads(text)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_aliases(model_dir: Path, aliases: Mapping[str, int]) -> None:
    write_text(model_dir / ALIASES_FILE, json.dumps(dict(aliases), indent=2, sort_keys=True) + "\n")


def _record(model_dir: Path, entry: Mapping[str, Any]) -> None:
    """Append one alias change to the model's history (under the model's lock)."""
    line = json.dumps({"at": datetime.now(UTC).isoformat(timespec="seconds"), **entry})
    with open(model_dir / HISTORY_FILE, "a", encoding="utf-8") as handle:
        handle.write(line + "\n")


def update_aliases(model_dir: Path, version: int, rule: BestRule) -> dict[str, int]:
    """After publishing ``version``: move ``latest`` to it, and ``best`` if ``rule`` says so."""
    with _locked(model_dir):
        try:
            aliases = read_aliases(model_dir.parent, model_dir.name)
        except ModelError:
            aliases = {}  # a damaged aliases.json is rebuilt from this version on
        before = dict(aliases)
        aliases["latest"] = max(version, aliases.get("latest", 0))
        best = aliases.get("best")
        new_score = rule.score(_metadata_of(model_dir, version))
        best_score = None if best is None else rule.score(_metadata_of(model_dir, best))
        if best is None or rule.beats(new_score, best_score):
            aliases["best"] = version
        _write_aliases(model_dir, aliases)
        for alias in ALIASES:
            if aliases.get(alias) != before.get(alias):
                why = f"published; {rule.metric} {new_score} vs best {best_score}"
                change = {"alias": alias, "from": before.get(alias), "to": aliases[alias]}
                _record(model_dir, {**change, "by": "registration", "why": why})
        return aliases


def verify(model: ModelVersion) -> None:
    """Check the weights' sha256 against the metadata without loading them (no torch)."""
    try:
        digest = sha256_of(model.weights_path)
    except OSError as exc:
        raise ModelError(
            f"model {model.name!r} version {model.version}: "
            f"cannot read {model.weights_path} ({exc})"
        ) from exc
    if digest != model.sha256:
        raise ModelError(
            f"model {model.name!r} version {model.version}: {WEIGHTS_FILE} has sha256 "
            f"{digest}, the registry recorded {model.sha256}: the file was truncated "
            "or changed after publication"
        )


def promote(
    registry: Path, name: str, version: str, alias: str = "best", by: str = ""
) -> dict[str, int]:
    """Point ``alias`` of ``name`` at ``version`` (checked whole first); the new aliases."""
    if alias not in ALIASES:
        raise ModelError(f"unknown alias {alias!r}: use one of {', '.join(ALIASES)}")
    target = resolve(Path(registry), name, version)
    verify(target)
    model_dir = Path(registry) / name
    with _locked(model_dir):
        aliases = read_aliases(Path(registry), name)
        previous = aliases.get(alias)
        aliases[alias] = target.version
        _write_aliases(model_dir, aliases)
        change = {"alias": alias, "from": previous, "to": target.version}
        _record(model_dir, {**change, "by": by or "operator", "why": "promoted by hand"})
    return aliases


def describe_model(registry: Path, name: str) -> dict[str, Any]:
    """A model's versions (newest first) with their metrics and aliases, for listing."""
    aliases = read_aliases(registry, name)
    versions = []
    for number in reversed(list_versions(registry, name)):
        try:
            found = resolve(registry, name, str(number))
        except ModelError as exc:
            versions.append({"version": number, "error": str(exc)})
            continue
        meta = found.metadata
        metrics = dict(meta.get("metrics") or {})
        versions.append(
            {
                "version": number,
                "aliases": sorted(a for a, v in aliases.items() if v == number),
                "created_at": meta.get("created_at"),
                "val_dice": metrics.get("val_dice", meta.get("val_dice")),
                "val_iou": metrics.get("val_iou"),
                # objects of the validation images (pipelines/validation.py); none from
                # versions trained before they were scored
                "val_object_f1": metrics.get("val_object_f1"),
                "val_matched_iou": metrics.get("val_matched_iou"),
                "val_count_error": metrics.get("val_count_error"),
                "sha256": found.sha256,
                "size": meta.get("size"),
                "manifest_sha256": meta.get("manifest_sha256"),
                "origin": meta.get("origin"),
            }
        )
    return {"name": name, "aliases": aliases, "versions": versions}


def _main(argv: Sequence[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m models.catalog", description=__doc__)
    parser.add_argument("registry", type=Path)
    commands = parser.add_subparsers(dest="command", required=True)
    listing = commands.add_parser("list", help="models, versions, metrics and aliases")
    listing.add_argument("name", nargs="?")
    promoting = commands.add_parser("promote", help="point an alias at a version")
    promoting.add_argument("name")
    promoting.add_argument("version")
    promoting.add_argument("--alias", default="best", choices=ALIASES)
    promoting.add_argument("--by", default="")
    args = parser.parse_args(argv)
    if args.command == "promote":
        aliases = promote(args.registry, args.name, args.version, args.alias, args.by)
        return {"name": args.name, "aliases": aliases}
    names = [check_name(args.name)] if args.name else model_names(args.registry)
    if args.name and not list_versions(args.registry, args.name):
        raise ModelError(_describe(args.registry, args.name))
    models = [describe_model(args.registry, n) for n in names]
    return {"registry": str(args.registry), "models": models}


def main(argv: Sequence[str] | None = None) -> int:
    """JSON on stdout; ``Error: …`` on stderr and exit status 1 for a refused request."""
    try:
        result = _main(sys.argv[1:] if argv is None else argv)
    except (ModelError, OSError) as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
