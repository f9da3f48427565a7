"""Throwaway batch owners for tests and benchmarks: real unprivileged users, each in a group of
its own (groupadd, useradd; root only), and batch folders handed over to one of them as an
expert's copy onto the share leaves them (every entry theirs, chown without following links).

    with owners.made("wdq", 2) as (ann, bob):
        owners.hand_over(folder, ann)
        owners.drop(staged, drop_root, "plate 1", bob)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Person:
    user: str
    group: str
    uid: int
    gid: int


def available() -> bool:
    """Whether throwaway users can be made here (root, with useradd and groupadd)."""
    return os.geteuid() == 0 and all(shutil.which(t) for t in ("useradd", "groupadd", "userdel"))


def _run(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True)


def _ids(user: str) -> tuple[int, int]:
    out = subprocess.run(["id", "-u", user], check=True, capture_output=True, text=True).stdout
    group = subprocess.run(["id", "-g", user], check=True, capture_output=True, text=True).stdout
    return int(out), int(group)


@contextlib.contextmanager
def made(prefix: str, count: int) -> Iterator[list[Person]]:
    """``count`` users ``<prefix><pid>a``, ``…b``, each with a group of the same name plus
    ``g``; removed afterwards."""
    tag = f"{prefix}{os.getpid() % 100000}"
    people: list[Person] = []
    try:
        for letter in "abcdefghij"[:count]:
            user, group = f"{tag}{letter}", f"{tag}{letter}g"
            _run("groupadd", group)
            _run("useradd", "-M", "-N", "-g", group, "-s", "/usr/sbin/nologin", user)
            people.append(Person(user, group, *_ids(user)))
        yield people
    finally:
        for person in people:
            subprocess.run(["userdel", person.user], capture_output=True)
            subprocess.run(["groupdel", person.group], capture_output=True)


def hand_over(folder: Path, person: Person) -> None:
    """Make ``folder`` and everything in it ``person``'s (links themselves, never followed)."""
    for path in [folder, *folder.rglob("*")]:
        os.chown(path, person.uid, person.gid, follow_symlinks=False)


def drop(staged: Path, root: Path, name: str, person: Person) -> Path:
    """Copy a staged batch folder in as ``person``'s (the manifest renamed in last): the
    folder."""
    folder = root / name
    shutil.copytree(staged, folder, ignore=shutil.ignore_patterns("manifest.toml"))
    shutil.copy(staged / "manifest.toml", folder / ".manifest.part")
    hand_over(folder, person)
    os.rename(folder / ".manifest.part", folder / "manifest.toml")
    return folder


def as_person(person: Person, *command: str) -> subprocess.CompletedProcess[str]:
    """Run ``command`` as ``person`` (setpriv: no login, no PAM), its output captured."""
    ids = [f"--reuid={person.uid}", f"--regid={person.gid}", "--clear-groups"]
    return subprocess.run(
        ["setpriv", *ids, "--", *command], capture_output=True, text=True, timeout=60
    )
