"""Is a waiting batch ready? Pure: what was seen on disk, the settle record and ``now`` in,
a verdict out.

A batch is ready when every listed input is a regular file inside the folder at its listed size
(patterns: at least ``count`` matches, or one), and nothing has changed for the settle period.
Missing and short files wait, up to the timeout; then the batch fails naming each of them.
Inputs that are all there but keep changing wait up to the same timeout; then it fails naming
the ones still being written. An input that resolves outside the folder or is not a regular
file fails the batch at once, as does a pattern whose walk reached a bound; an input bigger
than listed fails it once the folder has settled. An OME-Zarr store (a folder) is seen as one
input, missing until its metadata is there, its size its files' sum.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace

from daemon.contract.jobspec import InputFile, Problem, summarised
from daemon.contract.names import input_format_problem, is_store
from daemon.contract.safeopen import Presence, describe
from daemon.core.manifest import MANIFEST_NAME, Manifest, Pattern, pairing_problems

# What one look at a batch's inputs saw (taken by :mod:`daemon.loop.inputs`).


@dataclass(frozen=True)
class FileSeen:
    path: str  # relative to the batch folder, posix
    presence: Presence
    size: int = 0
    mtime_ns: int = 0
    detail: str = ""


@dataclass(frozen=True)
class PatternSeen:
    """A pattern's matches; ``stopped`` says which bound stopped its walk (then it has none)."""

    pattern: Pattern
    matches: tuple[FileSeen, ...]
    stopped: str = ""


@dataclass(frozen=True)
class InputsSeen:
    """What was on disk for one batch at one moment."""

    folder_ok: bool
    files: tuple[FileSeen, ...]
    patterns: tuple[PatternSeen, ...]


@dataclass(frozen=True)
class Settle:
    """The fingerprint of what was last seen and since when it has been unchanged; ``changed``
    when that moment is a change seen (not the first look, e.g. after a restart)."""

    fingerprint: str
    since: float
    changed: bool = False


@dataclass(frozen=True)
class Ready:
    inputs: tuple[InputFile, ...]


@dataclass(frozen=True)
class Waiting:
    problems: tuple[Problem, ...]
    settle: Settle


@dataclass(frozen=True)
class NotReady:
    """The batch cannot become ready: fail it with these problems.

    ``watch`` is set when the inputs were merely incomplete at the timeout: the fingerprint of
    what was there, so that a change later (the missing files arriving) revives the batch.
    """

    problems: tuple[Problem, ...]
    reason: str
    watch: str = ""


Verdict = Ready | Waiting | NotReady


@dataclass(frozen=True)
class Timing:
    settle_seconds: float
    timeout_seconds: float


def assess(
    manifest: Manifest,
    seen: InputsSeen,
    previous: Settle | None,
    waiting_since: float,
    now: float,
    timing: Timing,
) -> Verdict:
    """Judge one waiting batch from one observation of its inputs."""
    if not seen.folder_ok:
        return NotReady(
            (Problem("batch folder", "is gone or is not a folder any more"),), "folder removed"
        )
    hard, soft = _file_problems(manifest, seen.files)
    pattern_soft = [p for ps in seen.patterns if (p := _pattern_problem(ps)) is not None]
    hard += [p for ps in seen.patterns for p in _pattern_hard(ps)]
    if hard:
        return NotReady(summarised(hard), "inputs refused")
    settle = _settle(seen, previous, now)
    waiting = summarised(soft + pattern_soft)
    settled = now - settle.since >= timing.settle_seconds
    if waiting:
        if now - waiting_since >= timing.timeout_seconds:
            reason = f"inputs incomplete after {_duration(timing.timeout_seconds)}"
            return NotReady(waiting, reason, watch=settle.fingerprint)
        return Waiting(waiting, settle)
    if not settled:
        if settle.changed and now - waiting_since >= timing.timeout_seconds:
            reason = f"inputs still changing after {_duration(timing.timeout_seconds)}"
            return NotReady(_still_changing(seen, settle, timing), reason)
        return Waiting((), settle)
    return _ready_or_wrong(manifest, seen)


def _still_changing(seen: InputsSeen, settle: Settle, timing: Timing) -> tuple[Problem, ...]:
    """The inputs written to around the last change seen (by their time stamps, so a file
    copied with its original time is not named; then the folder is)."""
    recent = (settle.since - timing.settle_seconds - 1.0) * 1e9
    after = _duration(timing.timeout_seconds)
    hint = "is something still writing it?"
    named = [
        (f"{MANIFEST_NAME}, files[{i}]", f) for i, f in enumerate(seen.files) if f.mtime_ns > recent
    ] + [
        (f"{MANIFEST_NAME}, patterns '{ps.pattern.glob}'", f)
        for ps in seen.patterns
        for f in ps.matches
        if f.mtime_ns > recent
    ]
    found = [
        Problem(where, f"'{f.path}' was still changing after {after}", hint) for where, f in named
    ]
    if not found:
        found = [
            Problem(
                "batch folder",
                f"its inputs were still changing after {after} (files appearing or going)",
                "is something still writing into the folder?",
            )
        ]
    return summarised(found)


def _ready_or_wrong(manifest: Manifest, seen: InputsSeen) -> Verdict:
    wrong = [
        Problem(
            f"{MANIFEST_NAME}, files[{i}]",
            f"'{f.path}' is {_bytes(got.size)}, expected {_bytes(f.size)}",
            "the file differs from the one the manifest lists; copy it again or fix its size",
        )
        for i, (f, got) in enumerate(zip(manifest.files, seen.files, strict=True))
        if f.size is not None and got.size > f.size
    ]
    if wrong:
        return NotReady(summarised(wrong), "inputs differ from the manifest")
    inputs = _resolved(manifest, seen)
    unread = [
        Problem(f"input '{f.path}'", *found)
        for f in inputs
        if (found := input_format_problem(f.path)) is not None
    ]
    if unread:
        return NotReady(summarised(unread), "inputs in a format watchd does not read")
    if manifest.kind.trains and manifest.patterns:
        unpaired = pairing_problems(inputs)
        if unpaired:
            return NotReady(summarised(unpaired), "training images and masks do not pair up")
    return Ready(inputs)


def _file_problems(
    manifest: Manifest, files: Sequence[FileSeen]
) -> tuple[list[Problem], list[Problem]]:
    hard: list[Problem] = []
    soft: list[Problem] = []
    for i, (listed, got) in enumerate(zip(manifest.files, files, strict=True)):
        where = f"{MANIFEST_NAME}, files[{i}]"
        refused = _refused(where, got)
        if refused is not None:
            hard.append(refused)
        elif got.presence is Presence.MISSING:
            why = f" ({got.detail})" if got.detail else ""
            soft.append(Problem(where, f"'{got.path}' is missing{why}", "not copied yet?"))
        elif listed.size is not None and got.size < listed.size:
            soft.append(
                Problem(
                    where,
                    f"'{got.path}' is {_bytes(got.size)}, expected {_bytes(listed.size)}",
                    "still copying?",
                )
            )
    return hard, soft


_REFUSED_HINTS = {
    Presence.OUTSIDE: "copy the file itself into the folder instead of a link to it",
    Presence.SPECIAL: "",
    Presence.UNREADABLE: "check its permissions",
    Presence.INVALID: "copy the OME-Zarr store itself into the batch folder, without links",
}


def _refused(where: str, got: FileSeen) -> Problem | None:
    if got.presence not in _REFUSED_HINTS:
        return None
    message = f"'{got.path}' {describe(got.presence, got.detail)}"
    return Problem(where, message, _REFUSED_HINTS[got.presence])


def _pattern_hard(seen: PatternSeen) -> list[Problem]:
    where = f"{MANIFEST_NAME}, patterns '{seen.pattern.glob}'"
    if seen.stopped:
        hint = "name the folder the inputs are in (e.g. 'images/*.png') instead of '**'"
        return [Problem(where, seen.stopped, hint)]
    return [p for f in seen.matches if (p := _refused(where, f)) is not None]


def _pattern_problem(seen: PatternSeen) -> Problem | None:
    wanted = seen.pattern.count or 1
    have = sum(1 for f in seen.matches if f.presence is Presence.FILE)
    if have >= wanted:
        return None
    return Problem(
        f"{MANIFEST_NAME}, patterns '{seen.pattern.glob}'",
        f"{have} of {wanted} file(s) present",
        "not copied yet?",
    )


def fingerprint(seen: InputsSeen) -> str:
    """A digest of what was seen: any file appearing, growing or changing alters it."""
    digest = hashlib.sha256()
    everything = list(seen.files) + [f for p in seen.patterns for f in p.matches]
    for f in everything:
        digest.update(f"{f.path}\0{f.presence.value}\0{f.size}\0{f.mtime_ns}\n".encode())
    return digest.hexdigest()


def _settle(seen: InputsSeen, previous: Settle | None, now: float) -> Settle:
    current = fingerprint(seen)
    if previous is not None and previous.fingerprint == current:
        return previous
    return Settle(current, now, changed=previous is not None)


def _resolved(manifest: Manifest, seen: InputsSeen) -> tuple[InputFile, ...]:
    """The concrete input list: listed files (by their name on disk, which may differ from the
    manifest's in its Unicode normalisation), then pattern matches not already listed."""
    files = [
        replace(f, path=got.path, size=got.size if is_store(got.path) else f.size)
        for f, got in zip(manifest.files, seen.files, strict=True)
    ]  # (a store's size, its files' sum, is what splits it into regions)
    listed = {f.path for f in files}
    for ps in seen.patterns:
        for f in ps.matches:
            if f.path not in listed:
                listed.add(f.path)
                files.append(InputFile(f.path, f.size, None, ps.pattern.role))
    return tuple(files)


def _bytes(n: int | None) -> str:
    return f"{n:,} bytes".replace(",", " ")


def _duration(seconds: float) -> str:
    if seconds >= 2 * 3600:
        return f"{seconds / 3600:.3g} h"
    if seconds >= 120:
        return f"{seconds / 60:.3g} min"
    return f"{seconds:.3g} s"
