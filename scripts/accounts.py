"""Real users for the checks that act as an unprivileged service and an unprivileged expert
(scripts/fuzz_campaign.py, tests/test_access.py): accounts made with groupadd and useradd when
missing and never removed (runs side by side, and the next run, share them), commands that run
as them through setpriv, and the POSIX ACLs of docs/install.md, step 3.

A command run as another user needs the interpreter, which may lie below a folder only root may
enter (pyenv's in /root), and maybe the test share (below scripts/netshare's 0700 folder): it
runs in a private mount namespace where such a folder is covered by an empty tmpfs and the one
entry on the way bound back (:func:`opening`); the rest of the machine is as it is.
"""

from __future__ import annotations

import grp
import os
import pwd
import shlex
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

TOOLS = ("useradd", "groupadd", "usermod", "unshare", "setpriv", "mount")
# What root without these capabilities is: a user the kernel checks file permissions for,
# who owns what root owns (the test share's files, all made by its root SFTP server).
WITHOUT_DAC = "--bounding-set=-dac_override,-dac_read_search,-fowner"


def unavailable() -> str:
    """Why real users cannot be had here ('' when they can)."""
    if os.geteuid() != 0:
        return "making users (useradd) and switching to them (setpriv) needs root"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    return f"{', '.join(missing)} not found" if missing else ""


@dataclass(frozen=True)
class Account:
    name: str
    uid: int
    gid: int


def group(name: str) -> int:
    """The gid of group ``name``, made if missing."""
    return _found_or_made(lambda: grp.getgrnam(name).gr_gid, ["groupadd", name])


def user(name: str, primary: str, groups: Sequence[str] = ()) -> Account:
    """User ``name`` (no home, no login shell) in group ``primary`` and ``groups``, made if
    missing, added to ``groups`` if not in them."""
    gid = group(primary)
    for extra in groups:
        group(extra)
    command = ["useradd", "-M", "-N", "-g", primary, "-s", "/usr/sbin/nologin", name]
    uid = _found_or_made(lambda: pwd.getpwnam(name).pw_uid, command)
    missing = [g for g in groups if name not in grp.getgrnam(g).gr_mem]
    if missing:
        subprocess.run(["usermod", "-a", "-G", ",".join(missing), name], check=True,
                       capture_output=True)  # fmt: skip
    return Account(name, uid, gid)


def _found_or_made(lookup: Callable[[], int], command: list[str]) -> int:
    """What ``lookup`` finds; if it finds nothing, after ``command`` made it (which fails
    where another run made it meanwhile: then it is found all the same)."""
    try:
        return lookup()
    except KeyError:
        done = subprocess.run(command, capture_output=True, text=True)
    try:
        return lookup()
    except KeyError:
        raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip()}") from None


@dataclass(frozen=True)
class Identity:
    """Who a command runs as: ``account`` (through setpriv, with its groups and no
    capabilities); root without the capabilities that override file permissions
    (``without_dac``), in root's group and ``groups``; or, with neither, this process's user
    unchanged."""

    account: Account | None = None
    without_dac: bool = False
    groups: tuple[int, ...] = ()  # root without DAC: its supplementary groups besides root's

    @property
    def uid(self) -> int:
        return self.account.uid if self.account else os.geteuid()

    @property
    def gid(self) -> int:
        return self.account.gid if self.account else os.getegid()

    @property
    def changes(self) -> bool:
        return self.account is not None or self.without_dac

    def command(
        self, argv: Sequence[str], *, env: Mapping[str, str], stash: Path,
        ways: Iterable[Path] = (), umask: str = "007",
    ) -> list[str]:  # fmt: skip
        """``argv`` as this identity, with only ``env`` in its environment and ``umask``, in a
        private mount namespace where ``ways``, ``argv[0]`` and this interpreter can be
        reached (:func:`opening`; ``stash``: an empty folder of root's for it, kept while
        the command runs). Unchanged when the identity changes nothing."""
        if not self.changes:
            return list(argv)
        if self.account is None:  # root without DAC: the ways are root's, it reaches them
            who, mounts = [WITHOUT_DAC, f"--groups={','.join(map(str, (0, *self.groups)))}"], []
        else:
            who = [f"--reuid={self.account.uid}", f"--regid={self.account.gid}", "--init-groups",
                   "--inh-caps=-all"]  # fmt: skip
            here = (sys.executable, shutil.which(argv[0]) or argv[0])
            mounts = opening([*(Path(os.path.realpath(p)) for p in here), *ways], stash)
        script = " && ".join([*mounts, f"umask {umask}", 'exec "$@"'])
        inner = ["setpriv", *who, "--", "env", "-i", *(f"{k}={v}" for k, v in env.items())]
        return ["unshare", "-m", "sh", "-c", script, "sh", *inner, *argv]


def opening(paths: Iterable[Path], stash: Path) -> list[str]:
    """Shell commands (run as root in a private mount namespace) that let everyone reach
    ``paths``: the first folder on each path's way that others may not enter is covered by an
    empty 0755 tmpfs, and the entries on the ways to the paths are bound back (recursively: a
    mount below one, such as the test share's, comes along)."""
    barriers: dict[Path, set[str]] = {}
    for path in paths:
        for barrier in reversed(path.parents):
            if not barrier.stat().st_mode & 0o001:
                barriers.setdefault(barrier, set()).add(path.relative_to(barrier).parts[0])
                break
    lines = []
    for i, (barrier, entries) in enumerate(sorted(barriers.items())):
        held = stash / str(i)
        lines += [f"mkdir -p {_q(held)}", f"mount --rbind {_q(barrier)} {_q(held)}",
                  f"mount -t tmpfs -o mode=0755 tmpfs {_q(barrier)}"]  # fmt: skip
        for entry in sorted(entries):
            lines += [f"mkdir {_q(barrier / entry)}",
                      f"mount --rbind {_q(held / entry)} {_q(barrier / entry)}"]  # fmt: skip
    return lines


def _q(path: Path) -> str:
    return shlex.quote(str(path))


# -- POSIX ACLs, as setfacl -m and -dm set them ---------------------------------------------------

_ACL_VERSION = 2
_USER_OBJ, _USER, _GROUP_OBJ, _GROUP, _MASK, _OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
_UNDEFINED = 0xFFFFFFFF


def grant(folder: Path, users: Sequence[int], groups: Sequence[int]) -> None:
    """``setfacl -m u:U:rwx,g:G:rwx,o::---`` and the same with ``-dm`` (inherited by what is
    made inside) for each of ``users`` and ``groups``: written as the kernel's extended
    attributes, so no acl package is needed (docs/install.md, step 3)."""
    mode = os.stat(folder).st_mode
    entries = [(_USER_OBJ, (mode >> 6) & 7, _UNDEFINED)]
    entries += [(_USER, 7, uid) for uid in sorted(users)]
    entries += [(_GROUP_OBJ, (mode >> 3) & 7, _UNDEFINED)]
    entries += [(_GROUP, 7, gid) for gid in sorted(groups)]
    entries += [(_MASK, 7, _UNDEFINED), (_OTHER, 0, _UNDEFINED)]
    data = struct.pack("<I", _ACL_VERSION) + b"".join(struct.pack("<HHI", *e) for e in entries)
    os.setxattr(folder, "system.posix_acl_access", data)
    os.setxattr(folder, "system.posix_acl_default", data)
