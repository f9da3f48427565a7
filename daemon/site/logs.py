"""structlog set-up: the one place that holds logging's global state.

JSON lines on stdout for journald and log shippers; a readable console rendering on a terminal.
Events carry ``batch_id`` and ``job_id`` where they concern one.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog

from daemon.core import visible

LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


def configure(fmt: str = "auto", level: str = "info", stream: TextIO | None = None) -> None:
    """Configure structlog once, at the edge (the CLI)."""
    stream = stream or sys.stdout
    use_json = fmt == "json" or (fmt == "auto" and not stream.isatty())
    # Values from batch folders (titles, names, paths) may hold control characters: shown as
    # escapes, never raw (a JSON line stays faithful; see daemon.core.visible).
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer(serializer=visible.to_json)
        if use_json
        else structlog.dev.ConsoleRenderer(colors=stream.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info if use_json else _visible_values,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=False,
    )


def _visible_values(
    logger: object, name: str, event: structlog.typing.EventDict
) -> structlog.typing.EventDict:
    """For the console: text values with their control characters escaped (other values are
    shown by their repr, which escapes them already; a traceback is rendered after this)."""
    return {k: visible.visible(v) if isinstance(v, str) else v for k, v in event.items()}
