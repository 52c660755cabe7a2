"""Span rules: where a hand-off's text is cut."""

from __future__ import annotations

import pytest

from gateway.decoding.spans import cut_span


@pytest.mark.parametrize("text, rule, kept", [
    (" Paris is big", "word", " Paris"),
    (" 3.5 apples", "word", " 3.5"),
    (" Paris", "word", " Paris"),
    ("Step 1: add\nStep 2", "line", "Step 1: add\n"),
    ("\n\nStep 1: add\nStep 2", "line", "\n\nStep 1: add\n"),
    ("It is 3.5 m. Then", "sentence", "It is 3.5 m."),
    ('He said "no!" Then', "sentence", 'He said "no!"'),
    ("no boundary here", "sentence", "no boundary here"),
    (" Paris is big", "tokens", " Paris is big"),
])
def test_cut_span(text, rule, kept):
    got, cut = cut_span(text, rule)
    assert got == kept and cut == (kept != text)
