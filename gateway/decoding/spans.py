"""Where a hand-off's text ends: the span rules a request or alias chooses with `span_until`.

The upstream is asked for up to `span` tokens; a rule then keeps only the text up to the first
boundary in it, so a hand-off writes whole words, lines or sentences and the local model resumes
at a natural point. Text after the boundary is dropped (it was billed: a smaller `span` bills
less of it). Without a boundary in the text, all of it is kept.
"""

from __future__ import annotations

import re

# The first boundary after some text: a word ends before whitespace ("3.5" and "don't" are one
# word); a line at a newline that ends some text (leading blank lines are kept); a sentence at
# . ! ? (with closing quotes or brackets) followed by whitespace, or where a line ends.
BOUNDARIES = {
    "word": re.compile(r"\S(?=\s)"),
    "line": re.compile(r"(?<=[^\n])\n"),
    "sentence": re.compile(r"[.!?][\"')\]]*(?=\s)|(?<=[^\n])\n"),
}


def cut_span(text: str, rule: str) -> tuple[str, bool]:
    """(the text kept under `rule`, whether anything was cut). `tokens` keeps everything."""
    pattern = BOUNDARIES.get(rule)
    match = pattern.search(text) if pattern else None
    if match is None:
        return text, False
    end = match.end()
    return text[:end], end < len(text)
