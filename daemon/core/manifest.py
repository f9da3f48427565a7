"""The batch manifest: parse and validate its text. Pure: bytes in, a Manifest or every problem out.

The format is documented in docs/manifest.md, with a JSON schema beside it
(docs/manifest.schema.json, generated from the models in daemon/core/manifest_schema.py by
``watchctl manifest --schema``).
A manifest can never make the daemon read or write outside its batch folder: every path is
relative, has no ``..``, and stays out of what watchd itself writes there.
"""

from __future__ import annotations

import hashlib
import posixpath
import re
import tomllib
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pydantic

from daemon.contract.errors import ManifestError
from daemon.contract.jobspec import InputFile, ModelRef, Problem, Role
from daemon.contract.names import ALIASES, LATEST, input_format_problem, is_store
from daemon.core.manifest_schema import (
    PARAMS_BY_KIND,
    FileEntry,
    Kind,
    ManifestModel,
    TrainingParams,
)
from daemon.core.nesting import MAX_NESTING, document_nests_deeper, text_nests_deeper
from daemon.core.sweep import SweepPlan, check_space, expand
from daemon.core.validation import problems

MANIFEST_NAME = "manifest.toml"
STATUS_NAME = "watchd-status.txt"
CANCEL_NAME = "watchd-cancel"  # a file of this name, made by the folder's owner, cancels its batch
RESULTS_DIR = "results"
MAX_MANIFEST_BYTES = 16 << 20  # the default of the daemon's intake.max_manifest_bytes


@dataclass(frozen=True)
class ResourceRequest:
    """A manifest's ``[resources]``: None where the site's default applies."""

    time_minutes: int | None = None
    memory_mb: int | None = None
    gpus: int | None = None
    tasks: int | None = None


@dataclass(frozen=True)
class Pattern:
    glob: str
    role: Role
    count: int | None


@dataclass(frozen=True)
class Manifest:
    """A valid manifest: what the planner and the jobs need, with defaults filled in."""

    sha256: str
    kind: Kind
    title: str
    owner_name: str
    owner_email: str | None
    model: ModelRef
    params: Mapping[str, Any]
    files: tuple[InputFile, ...]
    patterns: tuple[Pattern, ...] = ()
    resources: ResourceRequest = ResourceRequest()
    raw: str = field(default="", repr=False, compare=False)
    sweep: SweepPlan | None = None

    @property
    def images(self) -> tuple[InputFile, ...]:
        return tuple(f for f in self.files if f.role is Role.IMAGE)


def manifest_sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def parse_manifest(data: bytes, *, max_bytes: int = MAX_MANIFEST_BYTES) -> Manifest:
    """Parse and validate a manifest; raise ManifestError carrying every problem found (the
    first few listed, the rest counted)."""
    text = _decode(data, max_bytes)
    try:
        document = _load(text)
    except RecursionError:  # deeper than the stack, in a way the nesting checks did not see
        raise ManifestError([_TOO_DEEP]) from None
    found = _path_problems(document)
    try:
        model = ManifestModel.model_validate(document)
    except pydantic.ValidationError as exc:
        raise ManifestError(_located(problems(exc, ManifestModel), document) + found) from None
    found += _check_semantics(model)
    params, param_problems = _params(model)
    found.extend(param_problems)
    plan, sweep_problems = _sweep(model)
    found.extend(sweep_problems)
    if found:
        raise ManifestError(found)
    return _to_manifest(model, params, manifest_sha256(data), text, plan)


_HINT_DOCS = "see docs/manifest.md, or let `watchctl manifest FOLDER` write one"
_TOO_DEEP = Problem(
    MANIFEST_NAME,
    f"is nested more than {MAX_NESTING} levels deep",
    "a manifest's tables and lists nest a few levels at most; see docs/manifest.md",
)


def _load(text: str) -> dict[str, Any]:
    """The TOML document, its nesting bounded before the parser and the validation recurse."""
    if text_nests_deeper(text):
        raise ManifestError([_TOO_DEEP])
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ManifestError(
            [Problem(MANIFEST_NAME, f"not valid TOML: {exc}", "fix the syntax at that line")]
        ) from None
    if not document:
        raise ManifestError([Problem(MANIFEST_NAME, "is empty", _HINT_DOCS)])
    if document_nests_deeper(document):
        raise ManifestError([_TOO_DEEP])
    return document


def _decode(data: bytes, max_bytes: int) -> str:
    if len(data) > max_bytes:
        raise ManifestError(
            [
                Problem(
                    MANIFEST_NAME,
                    f"is {_spaced(len(data))} bytes, more than the {_spaced(max_bytes)} allowed",
                    "list the inputs with [[patterns]] instead of one [[files]] entry each",
                )
            ]
        )
    if not data.strip():
        raise ManifestError([Problem(MANIFEST_NAME, "is empty", _HINT_DOCS)])
    try:
        return data.decode("utf-8").removeprefix(_BOM)
    except UnicodeDecodeError as exc:
        raise ManifestError(
            [
                Problem(
                    MANIFEST_NAME,
                    f"is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})",
                    "save the manifest as UTF-8",
                )
            ]
        ) from None


_BOM = "\ufeff"  # Windows editors start UTF-8 files with one; TOML does not allow it


def _spaced(n: int) -> str:
    return f"{n:,}".replace(",", " ")


def _located(found: Sequence[tuple[str, str]], document: Mapping[str, Any]) -> list[Problem]:
    result = []
    for where, message in found:
        hint = _HINT_DOCS if "unknown key" in message or "required" in message else ""
        result.append(_file_problem(where, message, hint, document))
    return result


def _file_problem(where: str, message: str, hint: str, document: Mapping[str, Any]) -> Problem:
    """For ``files[3].size`` say ``files[3] 'img.png'`` then ``size: ...``: the owner sees which."""
    match = re.match(r"^files\[(\d+)\](?:\.(.+))?$", where)
    files = document.get("files")
    if not match or not isinstance(files, list):
        return Problem(f"{MANIFEST_NAME}, {where}", message, hint)
    index = int(match.group(1))
    entry = files[index] if index < len(files) else None
    path = entry.get("path") if isinstance(entry, dict) else None
    named = f"{MANIFEST_NAME}, files[{index}]" + (f" '{path}'" if isinstance(path, str) else "")
    return Problem(named, f"{match.group(2)}: {message}" if match.group(2) else message, hint)


def check_relative_path(path: str) -> str | None:
    """Why ``path`` may not name an input inside a batch folder, or None if it may."""
    if "\x00" in path:
        return "contains a NUL character"
    if "\\" in path:
        return "contains a backslash; use / between folders"
    if path.startswith("/") or re.match(r"^[A-Za-z]:", path):
        return "is an absolute path; name files relative to the batch folder"
    parts = path.split("/")
    if ".." in parts:
        return "goes up with '..'; inputs must be inside the batch folder"
    normal = posixpath.normpath(path)
    if normal in (".", "") or path.endswith("/"):
        return "does not name a file"
    top = normal.split("/")[0]
    if top == RESULTS_DIR:
        return f"is inside '{RESULTS_DIR}/', which watchd writes"
    if normal in (MANIFEST_NAME, STATUS_NAME):
        return "is a file of watchd's, not an input"
    return None


def check_glob(glob: str) -> str | None:
    """Why a pattern cannot be used as a glob, or None ('**' only as a whole component, as
    Python's Path.glob demands; a pattern it refused would fail the batch's every check)."""
    for part in glob.split("/"):
        if "**" in part and part != "**":
            return "uses '**' inside a name; '**' may only stand alone between slashes"
        if part == "":
            return "has an empty folder name ('//')"
    if glob.split("/")[-1] == "**":
        return "ends with '**', which matches folders only; end it with '**/*' for every file"
    return None


def _entries(document: Mapping[str, Any], key: str, field_name: str) -> list[tuple[int, str]]:
    items = document.get(key)
    if not isinstance(items, list):
        return []
    return [
        (i, item[field_name])
        for i, item in enumerate(items)
        if isinstance(item, dict) and isinstance(item.get(field_name), str)
    ]


def _path_problems(document: Mapping[str, Any]) -> list[Problem]:
    """Unsafe, duplicate or reserved paths; run on the raw document so it reports even when
    other keys are wrong."""
    found: list[Problem] = []
    seen: dict[str, int] = {}
    for i, path in _entries(document, "files", "path"):
        where = f"{MANIFEST_NAME}, files[{i}] '{path}'"
        reason = check_relative_path(path)
        if reason:
            found.append(Problem(where, f"path {reason}"))
            continue
        normal = unicodedata.normalize("NFC", posixpath.normpath(path))  # as readiness finds it
        if normal in seen:
            found.append(Problem(where, f"is listed twice (also files[{seen[normal]}])"))
        seen.setdefault(normal, i)
    for i, glob in _entries(document, "patterns", "glob"):
        reason = check_relative_path(glob) or check_glob(glob)
        if reason:
            found.append(Problem(f"{MANIFEST_NAME}, patterns[{i}] '{glob}'", f"glob {reason}"))
    return found


def _store_problems(model: ManifestModel, index: int, entry: FileEntry) -> list[Problem]:
    """What an OME-Zarr store (a folder) may not have: one file's size or sha256; and it is
    segmented by inference only."""
    where = f"{MANIFEST_NAME}, files[{index}] '{entry.path}'"
    what = "is an OME-Zarr store, a folder"
    unsettled = "(the batch waits until it stops changing)"
    found = [
        Problem(where, f"{what}: it has no one {key} {unsettled}", f"remove {key} from this entry")
        for key, value in (("size", entry.size), ("sha256", entry.sha256))
        if value is not None
    ]
    if model.kind.trains:
        hint = "train on PNG or TIFF images (export the store's image as TIFF)"
        found.append(Problem(where, f"{what}: it is segmented by inference only", hint))
    return found


def _check_semantics(model: ManifestModel) -> list[Problem]:
    found: list[Problem] = []
    for i, entry in enumerate(model.files):
        if (unread := input_format_problem(entry.path)) is not None:
            found.append(Problem(f"{MANIFEST_NAME}, files[{i}] '{entry.path}'", *unread))
        if is_store(entry.path):
            found.extend(_store_problems(model, i, entry))
        if entry.size == 0:
            found.append(
                Problem(
                    f"{MANIFEST_NAME}, files[{i}] '{entry.path}'",
                    "has size 0: an empty file is not an image",
                )
            )
    if not model.files and not model.patterns:
        found.append(
            Problem(f"{MANIFEST_NAME}", "lists no inputs", "add [[files]] or [[patterns]] entries")
        )
    found.extend(_check_model(model))
    if model.kind.trains and not model.patterns:
        found.extend(pairing_problems(_inputs(model)))
    if not model.kind.trains and model.resources.tasks not in (None, 1):
        found.append(
            Problem(
                f"{MANIFEST_NAME}, resources.tasks",
                "only training (and a sweep's trials) runs several tasks (DDP)",
                "remove it",
            )
        )
    return found


def _check_model(model: ManifestModel) -> list[Problem]:
    where = f"{MANIFEST_NAME}, model.version"
    version = model.model.version
    if model.kind.trains:
        if version is not None:
            return [Problem(where, "is chosen by the registry for a training batch", "remove it")]
        return []
    if version is None or version in ALIASES:
        return []
    text = str(version)
    if not text.isdigit() or int(text) < 1:
        return [Problem(where, f"'{version}' is not 'latest', 'best' or a version number")]
    return []


def pairing_problems(inputs: Sequence[InputFile]) -> list[Problem]:
    """Training needs a mask for every image and an image for every mask, paired by file stem."""
    images = {_stem(f.path): f for f in inputs if f.role is Role.IMAGE}
    masks = {_stem(f.path): f for f in inputs if f.role is Role.MASK}
    found = [
        Problem(f"{MANIFEST_NAME}, image '{f.path}'", "has no mask with the same file name")
        for stem, f in images.items()
        if stem not in masks
    ]
    found += [
        Problem(f"{MANIFEST_NAME}, mask '{f.path}'", "has no image with the same file name")
        for stem, f in masks.items()
        if stem not in images
    ]
    if not images:
        found.append(Problem(MANIFEST_NAME, "lists no images", 'add files with role = "image"'))
    return found


def _stem(path: str) -> str:
    return posixpath.splitext(posixpath.basename(path))[0]


def _params(model: ManifestModel) -> tuple[dict[str, Any], list[Problem]]:
    schema = PARAMS_BY_KIND[model.kind]
    try:
        return schema.model_validate(model.params).model_dump(), []
    except pydantic.ValidationError as exc:
        return {}, [
            Problem(f"{MANIFEST_NAME}, params.{where}", message)
            for where, message in problems(exc, schema)
        ]


def _check_training_value(name: str, value: Any) -> str | None:
    try:
        TrainingParams.model_validate({name: value})
    except pydantic.ValidationError as exc:
        return "; ".join(message for _, message in problems(exc, TrainingParams))
    return None


def _sweep(model: ManifestModel) -> tuple[SweepPlan | None, list[Problem]]:
    """The trials of a sweep batch; a [sweep] section belongs to sweep batches only."""
    where = f"{MANIFEST_NAME}, sweep"
    if model.kind is not Kind.SWEEP:
        if model.sweep is not None:
            return None, [Problem(where, f'is for kind = "sweep", not {model.kind.value!r}')]
        return None, []
    if model.sweep is None:
        hint = "add [sweep] with method, trials and a [sweep.space] (see docs/manifest.md)"
        return None, [Problem(where, "is missing", hint)]
    fields = {name: info.annotation for name, info in TrainingParams.model_fields.items()}
    found, integer = check_space(model.sweep, _check_training_value, fields)
    return (None, found) if found else (expand(model.sweep, integer), [])


def _inputs(model: ManifestModel) -> tuple[InputFile, ...]:
    return tuple(
        InputFile(
            path=posixpath.normpath(f.path),
            size=f.size,
            sha256=f.sha256,
            role=f.role,
        )
        for f in model.files
    )


def _to_manifest(
    model: ManifestModel, params: dict[str, Any], sha: str, text: str, plan: SweepPlan | None
) -> Manifest:
    version = model.model.version
    return Manifest(
        sha256=sha,
        kind=model.kind,
        title=model.title,
        owner_name=model.owner.name,
        owner_email=model.owner.email,
        model=ModelRef(model.model.name, LATEST if version is None else str(version)),
        params=params,
        files=_inputs(model),
        patterns=tuple(
            Pattern(posixpath.normpath(p.glob), p.role, p.count) for p in model.patterns
        ),
        resources=ResourceRequest(**model.resources.model_dump()),
        raw=text,
        sweep=plan,
    )
