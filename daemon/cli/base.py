"""What every command line of watchd starts from: the config file found, the store opened, a
drop root named, the shared options, the consoles, and the exit codes they end with."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import Annotated, Any

import click
import typer
from rich.console import Console
from rich.markup import escape

from daemon.cli import overview
from daemon.contract.errors import WatchdError
from daemon.core.records import Heartbeat
from daemon.core.visible import visible
from daemon.site.access import denied
from daemon.site.config import Config, RootSection, load_config
from daemon.site.subprocesses import process_start_ticks
from daemon.store import Store

ConfigOption = Annotated[
    Path | None, typer.Option("--config", "-c", help="config.toml to use", show_default=False)
]
JsonOption = Annotated[bool, typer.Option("--json", help="print JSON instead of tables")]

# Tables piped into a file or grep are not cut to a terminal's 80 columns. No emoji codes: an
# owner's ":warning:" is shown as written.
console = Console(
    highlight=False, soft_wrap=True, emoji=False, width=None if sys.stdout.isatty() else 240
)
# Progress bars go to stderr, and only to a terminal: stdout stays what a script reads.
progress_console = Console(stderr=True, highlight=False)

EXIT_CODES = "\n\n".join(
    (
        "Exit status: 0 done; 1 an error, printed as one line 'Error: …' on stderr; "
        "2 a usage error (an unknown option, a bad value); 3 watchctl doctor found a problem.",
        "watchctl reads the database itself, so it works while the daemon is down. What it "
        "changes (retry, cancel, requeue, pause, resume) it records as an intent that the daemon "
        "applies at its next tick, through its state machine. Every command that reads takes "
        "--json. Times are UTC.",
    )
)


def shown(value: object) -> str:
    """A value from the database (an owner's name, a title, a path, a reason) as console markup
    that shows it literally: rich's markup escaped, control characters made visible."""
    return escape(visible("" if value is None else str(value)))


def find_config(explicit: Path | None) -> Path:
    """``--config``, else ``$WATCHD_CONFIG``, else ``./config.toml``, else
    ``/etc/watchd/config.toml``."""
    if explicit is not None:
        return explicit
    for candidate in (os.environ.get("WATCHD_CONFIG"), "config.toml", "/etc/watchd/config.toml"):
        if candidate and _is_file(Path(candidate), "the configuration"):
            return Path(candidate)
    raise WatchdError("no config.toml here or in /etc/watchd; pass --config PATH")


def _is_file(path: Path, what: str) -> bool:
    """Whether ``path`` is a file; a file this user may not even look at is an AccessDenied
    that names the group to join (not a PermissionError's traceback)."""
    try:
        return path.is_file()
    except PermissionError:
        raise denied(path, what) from None


def open_store(config: Path | None) -> tuple[Config, Store]:
    """The config and its database, which must exist already (never created by watchctl)."""
    cfg = load_config(find_config(config))
    database = cfg.daemon.database
    if _is_file(database, "the database") and not os.access(database, os.R_OK):
        raise denied(database, "the database")
    return cfg, Store.open_existing(database)


def find_root(cfg: Config, named: str) -> RootSection:
    """A configured drop root, by its path or by its index (as ``watchctl status`` lists it)."""
    if named.isdigit() and int(named) < len(cfg.roots):
        return cfg.roots[int(named)]
    wanted = {Path(os.path.abspath(named)), Path(named).resolve()}
    for root in cfg.roots:
        if root.path in wanted or root.path.resolve() in wanted:
            return root
    listed = ", ".join(f"[{i}] {r.path}" for i, r in enumerate(cfg.roots))
    raise WatchdError(f"{named!r} is not a drop root of {cfg.source} (its roots: {listed})")


def liveness(beat: Heartbeat | None, now: float, heartbeat_seconds: float) -> dict[str, Any]:
    """What the heartbeat says of the daemon (for watchctl), with whether its process is still
    there when it runs on this host."""
    alive = None
    if beat is not None and beat.host == socket.gethostname():
        alive = process_start_ticks(beat.pid) is not None
    return overview.liveness(beat, now, heartbeat_seconds, alive)


# -- entry ---------------------------------------------------------------------------


# Typer 0.29 raises the exceptions of the click it carries inside (typer._click), which are not
# click's own: usage errors and aborts are caught as either.
USAGE_ERRORS: tuple[type[Exception], ...] = (
    click.ClickException, getattr(typer, "TyperException", click.ClickException)
)  # fmt: skip
ABORTS: tuple[type[BaseException], ...] = (click.exceptions.Abort, typer.Abort)


def entry(app: typer.Typer, name: str) -> None:
    """Run ``app`` as the command ``name`` (so named in its usage also when started as
    ``python -m``); expected errors end it with ``Error: …`` and their exit status."""
    command = typer.main.get_command(app)
    try:
        command.main(prog_name=name, standalone_mode=False)
    except WatchdError as exc:
        # Line by line: a message may list problems, one a line; each line shown literally.
        print("Error: " + "\n".join(map(visible, str(exc).split("\n"))), file=sys.stderr)
        sys.exit(exc.exit_code)
    except USAGE_ERRORS as exc:
        if hasattr(exc, "show"):
            exc.show()
        else:
            print(f"Error: {exc}", file=sys.stderr)
        sys.exit(getattr(exc, "exit_code", 2))
    except ABORTS:
        print("Aborted.", file=sys.stderr)
        sys.exit(1)
