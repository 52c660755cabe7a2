"""A user's own prompts as evaluation items: the JSONL `python -m gateway tune` reads.

One JSON object per line:

    {"prompt": "What is 17 * 3?", "reference": "51", "format": "number"}
    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."}]}
    {"id": "q-7", "prompt": "Which is a fruit?\\nA. stone\\nB. apple\\nAnswer with the letter.", "reference": "B"}

- `prompt` (one user message) or `messages` (a chat), one of them;
- `id`: optional (default: the line's row number, from 0);
- `reference`: optional; an answer is right when its final answer, read in `format`, is the
  reference's (policies/agreement.py reads final answers: the letter, the number, the code, or the
  words of a text); without one, `tune` labels an answer by agreement with the upstream's answer;
- `format`: `number`, `letter`, `code`, `text` or `auto` (default: read from the reference, else
  from each answer). It also sets the default answer length (FORMAT_MAX_TOKENS).

`python -m gateway tune --convert csqa --data FILE` writes a public dataset's rows in this shape
(`convert`): the prompts eval sends, the gold answer as the reference.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args

from fitting.datasets import Item, load_items, parse_rows
from policies.agreement import AnswerFormat, answer_format, final_answer, same_answer

DATASET = "prompts"  # the dataset name of a user's prompts in run directories and fitting.answers.SCORERS
FORMATS = get_args(AnswerFormat)
# Short answers by default: a letter and a few words; a worked number; a function; a paragraph.
FORMAT_MAX_TOKENS = {"letter": 16, "number": 256, "code": 384, "text": 192, "auto": 192}
CONVERTIBLE = {"csqa": "letter", "gsm8k": "number"}  # datasets whose gold answer is a reference


class PromptsError(ValueError):
    """A prompts file line that is not in the documented shape (the message names the line)."""


def load_prompts(path: Path, rows: str | None = None) -> list[Item]:
    """The items of a prompts JSONL, rows sliced by `rows` ('0:100'); PromptsError for a bad line."""
    items = [_item(index, line, path) for index, line in enumerate(_lines(path))]
    ids = [item.id for item in items]
    if len(set(ids)) != len(ids):
        raise PromptsError(f"{path}: ids repeat; give each line its own id")
    return items[parse_rows(rows)]


def _lines(path: Path) -> Iterator[dict[str, Any]]:
    with Path(path).open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as exc:
                raise PromptsError(f"{path} line {number}: not JSON ({exc.msg})") from exc


def _item(index: int, row: dict[str, Any], path: Path) -> Item:
    where = f"{path} row {index}"
    if not isinstance(row, dict) or ("prompt" in row) == ("messages" in row):
        raise PromptsError(f"{where}: give either 'prompt' (text) or 'messages' (a chat)")
    messages = [{"role": "user", "content": row["prompt"]}] if "prompt" in row else row["messages"]
    if not messages or not all(isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role")
                               for m in messages):
        raise PromptsError(f"{where}: messages are objects with a role and text content")
    fmt = row.get("format", "auto")
    if fmt not in FORMATS:
        raise PromptsError(f"{where}: format is one of {', '.join(FORMATS)}, not {fmt!r}")
    reference = row.get("reference")
    if reference is not None:
        reference = str(reference)
        fmt = answer_format(reference) if fmt == "auto" else fmt
    return Item(str(row.get("id", index)), messages, reference, {"format": fmt}, row=index)


def max_tokens(items: list[Item]) -> int:
    """The answer length for these items: the longest their formats need (FORMAT_MAX_TOKENS)."""
    return max(FORMAT_MAX_TOKENS[item.meta.get("format", "auto")] for item in items)


def labelled(item: Item) -> bool:
    """Whether the item's answers can be scored right or wrong (a reference, or a dataset's scorer)."""
    return item.gold is not None or "format" not in item.meta


def reference_pred(item: Item, text: str) -> tuple[str | None, bool]:
    """The answer's final answer in the item's format, and whether it is the reference's (False
    without a reference: `tune` labels such answers by agreement instead)."""
    fmt = item.meta.get("format", "auto")
    pred = final_answer(text, fmt)
    if item.gold is None:
        return pred, False
    return pred, same_answer(item.gold, text, fmt if fmt != "auto" else answer_format(item.gold))


def convert(dataset: str, data: Path | None = None, rows: str | None = None) -> list[dict[str, Any]]:
    """A public dataset's rows as prompts lines: eval's prompt, the gold answer as reference."""
    if dataset not in CONVERTIBLE:
        raise PromptsError(f"convert takes {', '.join(CONVERTIBLE)}; tune reads other datasets with --dataset")
    source = Path(data).stem if data else dataset  # ids stay apart when several files are joined
    return [{"id": f"{source}/{item.id}", "messages": item.messages, "reference": str(item.gold),
             "format": CONVERTIBLE[dataset]} for item in load_items(dataset, data, rows)]
