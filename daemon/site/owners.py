"""A batch folder's owner, as the share reports it: the uid and gid of the held folder's
``fstat``, with the names this host's user and group databases give them (a number with no
name here is kept as ``uid 1234``: it matches no rule by name in the site's table)."""

from __future__ import annotations

import grp
import os
import pwd
from collections.abc import Callable

from daemon.contract.jobspec import Problem
from daemon.core.owners import Accounts, Owner, refusal_text


def owner_of(st: os.stat_result) -> Owner:
    return Owner(st.st_uid, st.st_gid, user_name(st.st_uid), group_name(st.st_gid))


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return f"gid {gid}"


def admission(accounts: Accounts) -> Callable[[Owner], Problem | None]:
    """What intake asks of a folder's owner: the status line that refuses one the site does
    not know (when ``[accounts] unknown = "refuse"``), or None."""

    def admits(owner: Owner) -> Problem | None:
        if accounts.admits(owner):
            return None
        what, step = refusal_text(owner)
        return Problem("batch folder", what, step)

    return admits
