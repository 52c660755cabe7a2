"""Contrast prompt pairs: a JSONL file of {"positive": ..., "negative": ...}, one pair a line.

Each side is a user message (a string) or a list of chat messages ({"role", "content"}). It is
rendered with the model's own chat template: up to the assistant turn's start, or, when the last
message is the assistant's, up to the end of its content (the answer continues it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # llama.cpp loads only when a model is opened: `steer --help` reads this module
    from adapters.hidden_states import HiddenStates

Side = str | list[dict[str, Any]]


class PairsError(Exception):
    """A pairs file is unusable; the message is one line naming the line."""


@dataclass(frozen=True)
class Pair:
    positive: Side
    negative: Side


def read_pairs(path: str | Path) -> list[Pair]:
    """The pairs in `path`, in order. Raises PairsError."""
    pairs = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise PairsError(f"cannot read pairs file {path}: {exc.strerror}") from exc
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            pairs.append(Pair(_side(row["positive"]), _side(row["negative"])))
        except (ValueError, KeyError, TypeError) as exc:
            raise PairsError(f"{path}:{number}: not a {{\"positive\", \"negative\"}} pair ({exc})") from exc
    if len(pairs) < 2:
        raise PairsError(f"{path}: {len(pairs)} pairs; fitting needs at least 2")
    return pairs


def _side(value: Any) -> Side:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m and "content" in m
                                                 for m in value):
        return value
    raise TypeError("each side is a string or a list of {role, content} messages")


def prompt_tokens(model: HiddenStates, side: Side) -> list[int]:
    """`side` rendered with the model's chat template and tokenized as the gateway tokenizes prompts."""
    messages = [{"role": "user", "content": side}] if isinstance(side, str) else side
    continues = messages[-1]["role"] == "assistant"
    return model.tokenize_prompt(model.template.render_parts(messages, continue_final=continues))
