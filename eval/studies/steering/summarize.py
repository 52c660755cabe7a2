"""Format compliance, accuracy and length of CommonsenseQA local-only records, plain and steered.

    .venv/bin/python -m eval.studies.steering.summarize results/steering/runs/<run>/csqa__local.jsonl ...
    .venv/bin/python -m eval.studies.steering.summarize --paired PLAIN.jsonl STEERED.jsonl

--paired: both on the ids both hold, and the accuracy difference with a paired bootstrap 95% interval.

compliance: the answer starts with the option letter (fitting/answers.py's leading_letter rule, the
format the prompt asks for); letter_stop: the answer is the letter, optionally followed by its
choice's text, and nothing more (the "answer with the option letter, then stop" concept);
explains: it starts with the letter and goes on past the choice's text by at least 4 words (the
second half of the prompt's "Answer with the letter, then explain in one sentence.").
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np

from fitting.records import read_records

LETTER_ONLY = re.compile(r"^\W*\(?\**([A-E])\**[.):]?\s*(.*?)\W*$", re.DOTALL)


def letter_stop(text: str) -> bool:
    match = LETTER_ONLY.match(text.strip())
    if not match:
        return False
    rest = match.group(2).strip().lower()
    return rest == "" or "\n" not in rest and len(rest.split()) <= 6 and not re.search(r"[.!?]\s", rest)


def explains(row: dict, choices: dict[str, str]) -> bool:
    if row["rule"] != "leading_letter":
        return False
    own = choices.get(row["pred"] or "", "")
    return len(row["text"].split()) >= 1 + len(own.split()) + 4


def records(path: str) -> dict[str, dict]:
    return {row["id"]: row for row in read_records(Path(path))}  # the last record per id wins


def summary(path: str, choices: dict[str, dict[str, str]], ids: list[str] | None = None) -> dict:
    held = records(path)
    rows = [held[i] for i in ids] if ids is not None else list(held.values())
    correct = np.array([row["correct"] for row in rows], dtype=float)
    leading = np.array([row["rule"] == "leading_letter" for row in rows], dtype=float)
    stop = np.array([letter_stop(row["text"]) for row in rows], dtype=float)
    explained = np.array([explains(row, choices.get(row["id"], {})) for row in rows], dtype=float)
    tokens = np.array([row["answer_tokens"] for row in rows], dtype=float)
    return {"run": path, "items": len(rows), "accuracy": round(correct.mean(), 4),
            "compliance_leading_letter": round(leading.mean(), 4), "letter_stop": round(stop.mean(), 4),
            "explains": round(explained.mean(), 4),
            "answer_tokens": round(tokens.mean(), 2)}


def choices_of(paths: list[str]) -> dict[str, dict[str, str]]:
    out = {}
    for path in paths:
        for line in open(path):
            row = json.loads(line)
            out[row["id"]] = dict(zip(row["choices"]["label"], row["choices"]["text"]))
    return out


def paired(plain: str, steered: str, choices: dict[str, dict[str, str]]) -> None:
    a, b = records(plain), records(steered)
    ids = [i for i in a if i in b]
    for path in (plain, steered):
        print(json.dumps(summary(path, choices, ids)))
    diff = np.array([float(b[i]["correct"]) - float(a[i]["correct"]) for i in ids])
    boot = np.random.default_rng(0).choice(diff, size=(10_000, len(diff))).mean(axis=1)
    print(json.dumps({"paired_items": len(ids), "accuracy_difference": round(diff.mean(), 4),
                      "bootstrap_95": [round(float(q), 4) for q in np.quantile(boot, [0.025, 0.975])]}))


if __name__ == "__main__":
    known = choices_of(["data/commonsenseqa_dev300.jsonl", "data/commonsenseqa_dev300_rows922-1221.jsonl"])
    if sys.argv[1] == "--paired":
        paired(sys.argv[2], sys.argv[3], known)
    else:
        for path in sys.argv[1:]:
            print(json.dumps(summary(path, known)))
