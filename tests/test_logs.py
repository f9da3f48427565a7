"""The operator's log: values from a batch folder never put a control character on the terminal
or in the journal; a JSON line still decodes to what was logged."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator

import pytest
import structlog

from daemon.site import logs

TITLE = 'Plate\n{"level": "error"}\x1b]0;owned\x07\u202e'


@pytest.fixture(autouse=True)
def _default_structlog() -> Iterator[None]:
    yield
    structlog.reset_defaults()


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_json_log_line_escapes_control_characters_and_decodes_to_the_value() -> None:
    out = io.StringIO()
    logs.configure("json", "info", out)
    structlog.get_logger("t").info("batch recorded", title=TITLE, owner="Jürgen")
    line = out.getvalue()
    assert line.count("\n") == 1 and "\x1b" not in line and "\u202e" not in line
    assert "Jürgen" in line  # readable, not ASCII-escaped
    assert json.loads(line)["title"] == TITLE


def test_the_console_log_shows_control_characters_as_escapes() -> None:
    out = Terminal()
    logs.configure("console", "info", out)
    structlog.get_logger("t").info("batch recorded", folder="plate\n\x1b]0;owned\x07\u202e")
    line = out.getvalue()
    assert "\x1b]0" not in line and "\x07" not in line and "\u202e" not in line
    assert "plate\\n\\x1b]0;owned\\x07\\u202e" in line
