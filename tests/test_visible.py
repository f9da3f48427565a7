"""Owner-controlled text shown safely: control and formatting characters become visible escapes
in text, and ``\\u`` escapes in JSON that still decodes to the original."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from daemon.core.visible import hidden_characters, to_json, visible


def test_control_and_formatting_characters_are_shown_as_their_escapes() -> None:
    text = "a\nb\rc\td\x1b[31me\x07f\x7fg\x9bh\u200bi\u202ej\u2028k\U000e0041l\udcff"
    assert visible(text) == (
        "a\\nb\\rc\\td\\x1b[31me\\x07f\\x7fg\\x9bh\\u200bi\\u202ej\\u2028k\\U000e0041l\\udcff"
    )
    assert hidden_characters("x\n\x1b\ny") == ["\\n", "\\x1b"]


def test_printable_text_of_any_script_is_left_as_it_is() -> None:
    for text in ("Zellkern Übersicht", "山田 [/] [bold] :warning:", "a\u00a0b", "C:\\data"):
        assert visible(text) == text and hidden_characters(text) == []


@given(st.text())
def test_visible_text_is_one_line_without_control_characters(text: str) -> None:
    shown = visible(text)
    assert hidden_characters(shown) == [] and len(shown.splitlines()) <= 1


@given(
    st.recursive(
        st.text() | st.integers(), lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner)
    )
)
def test_json_decodes_to_the_original_and_holds_no_control_character(data: object) -> None:
    text = to_json(data, indent=2)
    assert json.loads(text) == data
    assert all(hidden_characters(line) == [] for line in text.split("\n"))
