"""How deeply a manifest nests, measured without recursing. Pure.

Python's TOML parser recurses once per nested array or inline table, so a value nested some
thousands deep raises RecursionError instead of a syntax error; and what reads the document
afterwards (validation, a value's ``repr`` in a message) recurses too, also through tables made
by dotted keys (``a.a.a.a = 1``), which the parser builds without recursing. So the text's
bracket nesting is measured before it is parsed, and the document's nesting before anything
walks it; past :data:`MAX_NESTING` the manifest is refused.
"""

from __future__ import annotations

import re
from typing import Any

MAX_NESTING = 32  # a real manifest nests 4 deep at most: [sweep.space] name = { values = [...] }

# What may hide a bracket: strings of the four kinds, and comments. A string that does not end
# is left to the parser (it refuses the text before it could recurse past that point). A table
# header of bare keys is one token: it nests no value (and a long list of [[files]] is mostly
# headers: so the scan costs less than a tenth of what the parse does).
_TOKENS = re.compile(
    r"^[ \t]*\[\[?[A-Za-z0-9_.\- \t]*\]\]?"
    r'|"""(?:\\.|[^\\])*?"{3,5}'
    r"|'''[\s\S]*?'{3,5}"
    r'|"(?:\\.|[^"\\\n])*"'
    r"|'[^'\n]*'"
    r"|#[^\n]*"
    r"|(?P<open>[\[{]+)|(?P<close>[\]}]+)",
    re.MULTILINE,
)


def text_nests_deeper(text: str, limit: int = MAX_NESTING) -> bool:
    """Whether more than ``limit`` arrays and inline tables are open at once somewhere in
    ``text``, outside strings and comments."""
    if text.count("[") + text.count("{") <= limit:
        return False  # not enough brackets to nest that deep: not worth the scan
    depth = 0
    for match in _TOKENS.finditer(text):
        if match.lastgroup == "open":
            depth += len(match.group())
            if depth > limit:
                return True
        elif match.lastgroup == "close":
            depth = max(0, depth - len(match.group()))
    return False


def document_nests_deeper(document: Any, limit: int = MAX_NESTING) -> bool:
    """Whether a parsed document holds tables and arrays more than ``limit`` deep (the
    document itself is at depth 0)."""
    stack: list[tuple[Any, int]] = [(document, 0)]
    while stack:
        value, depth = stack.pop()
        if depth > limit:
            return True
        children = value.values() if isinstance(value, dict) else value
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return False
