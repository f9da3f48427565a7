"""All subprocess I/O of the daemon: run a command to completion, or start a detached job.

Errors carry the exit code, the command, stdout and stderr (:class:`CommandFailed`), so an
operator sees why without re-running anything by hand. Commands are argument lists, never
shell strings.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from daemon.errors import CommandFailed


def run(
    command: Sequence[str],
    *,
    timeout: float = 60.0,
    env: Mapping[str, str] | None = None,
    input_text: str | None = None,
) -> str:
    """Run ``command`` to completion and return its stdout; raise CommandFailed otherwise."""
    try:
        done = subprocess.run(
            list(command),
            capture_output=True,
            text=True,
            timeout=timeout,
            env=dict(env) if env is not None else None,
            input=input_text,
            check=False,
        )
    except FileNotFoundError as exc:
        raise CommandFailed(command, 127, "", str(exc)) from None
    except subprocess.TimeoutExpired as exc:
        raise CommandFailed(
            command, 124, _text(exc.stdout), f"timed out after {timeout} s"
        ) from None
    if done.returncode != 0:
        raise CommandFailed(command, done.returncode, done.stdout, done.stderr)
    return done.stdout


def _text(data: bytes | str | None) -> str:
    if data is None:
        return ""
    return data if isinstance(data, str) else data.decode("utf-8", "replace")


def spawn(
    command: Sequence[str], *, cwd: Path, log_path: Path, env: Mapping[str, str]
) -> subprocess.Popen[bytes]:
    """Start ``command`` in its own session (it outlives the daemon), output to ``log_path``."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            list(command),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(env),
            start_new_session=True,
        )


def process_start_ticks(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot, or None if it is gone.

    Together with the pid it names one process for good: a pid reused later has another start
    time. A zombie counts as gone.
    """
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    if fields[0] == "Z":
        return None
    return int(fields[19])


def signal_group(pid: int, signum: int) -> bool:
    """Send ``signum`` to the process group led by ``pid``; False if it no longer exists."""
    try:
        os.killpg(pid, signum)
    except ProcessLookupError:
        return False
    return True
