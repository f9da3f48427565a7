"""Why this user may not open a file of watchd's, said as the group to join.

The guide installs the configuration as root:watchd 0640 in /etc/watchd (0750) and the
database in /var/lib/watchd (2770): whoever is not in the group watchd meets EACCES on the way
to them. The group that opens the way is the one of the first folder on the path that this
user cannot enter, or of the file itself.
"""

from __future__ import annotations

import grp
import os
from pathlib import Path

from daemon.contract.errors import AccessDenied


def denied(path: Path, what: str) -> AccessDenied:
    """The one-line error for ``path`` (``what`` it is: "the configuration", "the database")."""
    group = _gatekeeper_group(Path(os.path.abspath(path)))
    join = f"join the group {group} (ask an operator)" if group else "ask an operator"
    return AccessDenied(
        f"{what} {path} cannot be read by {user_name()} (permission denied): {join}"
    )


def _gatekeeper_group(path: Path) -> str | None:
    barrier = next((p for p in reversed(path.parents) if not os.access(p, os.X_OK)), path)
    try:
        gid = barrier.stat().st_gid  # its own folder is open to us, or it would be the barrier
    except OSError:
        return None
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def user_name() -> str:
    """Who runs this process, by name when the system knows one."""
    import getpass

    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return f"uid {os.getuid()}"
