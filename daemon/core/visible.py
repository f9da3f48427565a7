"""Text from a batch folder, made safe to show: its control characters written out visibly.

A title, an owner's name, a file name or a job's log line reaches the operator's terminal
(``watchctl``, the log) and the owner's status file. A newline there would forge a line, an
escape code would act on the terminal, a right-to-left override would reverse what follows.
Every such character (Unicode categories Cc, Cf, Zl, Zp, and the lone surrogates that an
undecodable file name becomes) is shown as its escape: ``\\n``, ``\\x1b``, ``\\u202e``. Pure.
"""

from __future__ import annotations

import json
import re
import unicodedata
from typing import Any

HIDDEN = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
_NOT_ASCII_TEXT = re.compile(r"[^\x20-\x7e\n]")


def visible(text: str) -> str:
    """``text`` with each control or formatting character replaced by its escape."""
    if text.isprintable():  # the common case, and fast: no such character in it
        return text
    return "".join(escape(c) if unicodedata.category(c) in HIDDEN else c for c in text)


def hidden_characters(text: str) -> list[str]:
    """The escapes of the control or formatting characters in ``text``, each once, in order."""
    found = (escape(c) for c in text if unicodedata.category(c) in HIDDEN)
    return list(dict.fromkeys(found))


def escape(char: str) -> str:
    """One character as Python writes it in a string literal: ``\\n``, ``\\x1b``, ``\\u202e``."""
    code = ord(char)
    if char in _NAMED:
        return _NAMED[char]
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def to_json(data: Any, **options: Any) -> str:
    """``data`` as JSON that is safe on a terminal and decodes to exactly ``data``: text stays
    readable (not ASCII-escaped), but control and formatting characters are ``\\u`` escapes."""
    return _NOT_ASCII_TEXT.sub(_json_escape, json.dumps(data, ensure_ascii=False, **options))


def _json_escape(match: re.Match[str]) -> str:
    char = match.group()
    if unicodedata.category(char) not in HIDDEN:
        return char
    code = ord(char)
    if code < 0x10000:
        return f"\\u{code:04x}"
    high, low = divmod(code - 0x10000, 0x400)  # JSON writes these as a surrogate pair
    return f"\\u{0xD800 + high:04x}\\u{0xDC00 + low:04x}"
