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
# is left to the parser (it refuses the text before it could recurse past that point).
_TOKENS = re.compile(
    r'"""(?:\\.|[^\\])*?"{3,5}'
    r"|'''[\s\S]*?'{3,5}"
    r'|"(?:\\.|[^"\\\n])*"'
    r"|'[^'\n]*'"
    r"|#[^\n]*"
    r"|[\[{]+|[\]}]+"
)


def text_nests_deeper(text: str, limit: int = MAX_NESTING) -> bool:
    """Whether more than ``limit`` arrays, inline tables and table headers are open at once
    somewhere in ``text``, outside strings and comments."""
    if text.count("[") + text.count("{") <= limit:
        return False  # not enough brackets to nest that deep: not worth the scan
    depth = 0
    for match in _TOKENS.finditer(text):
        token = match.group()
        if token[0] in "[{":
            depth += len(token)
            if depth > limit:
                return True
        elif token[0] in "]}":
            depth = max(0, depth - len(token))
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
