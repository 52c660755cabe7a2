"""Answer extraction and scoring, one function per dataset: `score(item, text) -> Scored`.

The rules, in the order they are tried (the first that matches wins):

CommonsenseQA (the prompt asks for the letter first):
  1. a choice letter A-E at the start of the answer, after optional markdown, '(' or a lead-in
     ("Answer:", "The answer is", "Option"), followed by punctuation, a line end or the end:
     "B. library", "(B)", "**B**", "Answer: B" -> B. A bare "A " is not taken, since "A bank
     is..." starts with the article. When the letter is followed by exactly the text of another
     choice ("A. library" where library is B) the answer contradicts itself and is scored wrong;
  2. an explicit statement anywhere: "answer is (C)", "answer: C", "option C", "choice C";
  3. exactly one choice's text appears in the first line (whole words, case-insensitive);
  otherwise no answer (scored wrong).
GSM8K (the prompt asks for a last line "Answer: <number>"):
  1. the last "Answer: N" / "answer is N", else the last "#### N", else the last \\boxed{...}:
     its content if that is a number or a plain \\frac{a}{b}, else no answer ("\\boxed{L - 8}"
     is not a number, even though it contains one);
  2. otherwise the last number anywhere in the answer (lm-eval's "flexible extract"); this also
     reads answers cut off by the token limit, which are then usually wrong;
  numbers are compared as values after dropping '$', ',' and a trailing '.' or '%'.
HumanEval: the first ```python (or bare ```) block, else the whole answer; if it does not define
  the entry point, it is appended to the prompt as the body. The program plus the dataset's
  `check()` runs in a fresh `python -I` subprocess with a time limit; exit status 0 is a pass.
MBPP: the code found as for HumanEval, then the dataset's setup (the sanitized set's `test_imports`,
  the full set's `test_setup_code`) and its asserts, run the same way; exit status 0 is a pass.
IFEval: the `if-verifiable` checkers (strict: the answer as is); an item passes when every
  instruction passes. Two checkers need NLTK's punkt data, which cannot be downloaded here:
  length_constraints:number_sentences and change_case:capital_word_frequency (26 of the 318
  instructions of the 200 dev prompts). They are reported as unverifiable in the record's
  `rule` and the item is scored on its other instructions.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

import jsonschema

from fitting.datasets import Item


@dataclass(frozen=True)
class Scored:
    """What the extractor found, whether it is right, and which rule found it."""

    pred: Any
    correct: bool
    rule: str


# -- CommonsenseQA --

_LEAD = r"(?:\*\*|__|#+\s*)?(?:(?:the\s+)?(?:correct\s+)?(?:answer|option|choice)(?:\s+is)?\s*[:\-]?\s*)?"
_CSQA_START = re.compile(r"^\s*" + _LEAD + r"[\*\(\[]*([A-E])(?:[\)\]\.:,\*]|\s*$|\s*\n|\s+-\s)", re.IGNORECASE)
_CSQA_STATED = re.compile(
    r"(?:answer\s+is|answer\s*:|option|choice)\s*[\*\(\[]*([A-E])(?![A-Za-z])", re.IGNORECASE)


def extract_choice(text: str, choices: dict[str, str]) -> tuple[str | None, str]:
    """The chosen letter and the rule that found it (see the module docstring)."""
    match = _CSQA_START.match(text)
    if match and match.group(1).isupper():
        letter = match.group(1)
        if _names_other_choice(text[match.end():], letter, choices):
            return None, "conflict"
        return letter, "leading_letter"
    for match in _CSQA_STATED.finditer(text):
        if match.group(1).isupper():
            return match.group(1), "stated_letter"
    first_line = text.strip().split("\n", 1)[0].lower()
    named = [label for label, choice in choices.items()
             if re.search(r"\b" + re.escape(choice.lower()) + r"\b", first_line)]
    if len(named) == 1:
        return named[0], "choice_text"
    return None, "none"


def _names_other_choice(rest: str, letter: str, choices: dict[str, str]) -> bool:
    """True for "A. library" when library is choice B: the letter and its text disagree."""
    named = re.sub(r"[\s\*\.]+$", "", rest.strip().split("\n", 1)[0].strip(" *")).lower()
    own = choices.get(letter, "").lower()
    if not named or named.startswith(own):
        return False
    return any(named == text.lower() for label, text in choices.items() if label != letter)


def score_csqa(item: Item, text: str) -> Scored:
    pred, rule = extract_choice(text, item.meta["choices"])
    return Scored(pred, pred == item.gold, rule)


# -- GSM8K --

_NUMBER = r"-?(?:\$\s?)?\d[\d,]*(?:\.\d+)?"
_ANSWER_LINE = re.compile(r"answer(?:\s+is)?\s*[:=]?\s*\**\s*(" + _NUMBER + ")", re.IGNORECASE)
_HASHES = re.compile(r"####\s*(" + _NUMBER + ")")
_BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")
_FRACTION = re.compile(r"^(-?)\\d?frac\{(\d+)\}\{(\d+)\}$")
_ANY_NUMBER = re.compile(_NUMBER)


def parse_number(text: str) -> float | None:
    """'$1,234.50' -> 1234.5; None if it is not a number."""
    cleaned = text.replace("$", "").replace(",", "").replace(" ", "").rstrip(".%")
    try:
        return float(cleaned)
    except ValueError:
        return None


def _boxed_value(content: str) -> float | None:
    """The value of a \\boxed{} answer: a number or a plain fraction; None for anything else."""
    content = content.strip().replace("\\$", "").replace("\\%", "").replace("\\,", "").strip()
    fraction = _FRACTION.match(content)
    if fraction:
        sign, top, bottom = fraction.groups()
        return (-1 if sign else 1) * int(top) / int(bottom) if int(bottom) else None
    return parse_number(content) if re.fullmatch(_NUMBER + r"\s*%?", content) else None


def extract_number(text: str) -> tuple[float | None, str]:
    """The final numeric answer and the rule that found it (see the module docstring)."""
    for rule, pattern in (("answer_line", _ANSWER_LINE), ("hashes", _HASHES)):
        found = pattern.findall(text)
        if found:
            return parse_number(found[-1]), rule
    boxed = _BOXED.findall(text)
    if boxed:  # the model's own final answer: if it is not a number, it is not a numeric answer
        value = _boxed_value(boxed[-1])
        return value, "boxed" if value is not None else "boxed_not_a_number"
    found = _ANY_NUMBER.findall(text)
    return (parse_number(found[-1]), "last_number") if found else (None, "none")


def score_gsm8k(item: Item, text: str) -> Scored:
    pred, rule = extract_number(text)
    gold = parse_number(item.gold)
    correct = pred is not None and gold is not None and abs(pred - gold) < 1e-6
    return Scored(pred, correct, rule)


# -- HumanEval --

_CODE_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)(?:```|$)", re.DOTALL)


def humaneval_program(item: Item, text: str) -> str:
    """The program to run: the answer's code (completed from the prompt if needed) plus the tests."""
    block = _CODE_BLOCK.search(text)
    code = block.group(1) if block else text
    entry = item.meta["entry_point"]
    defines = re.compile(r"^def\s+" + re.escape(entry) + r"\s*\(", re.MULTILINE)
    if defines.search(code):
        prompt = item.meta["prompt"]
        found = defines.search(prompt)
        code = (prompt[: found.start()] if found else "") + code  # the prompt's imports and helpers
    else:
        code = item.meta["prompt"] + code  # the answer is the function's body
    return f"{code}\n\n{item.meta['test']}\n\ncheck({entry})\n"


def run_program(program: str, timeout_s: float = 10.0) -> bool:
    """True if `program` exits 0 within the time limit, run isolated in a scratch directory."""
    with tempfile.TemporaryDirectory(prefix="humaneval-") as scratch:
        try:
            result = subprocess.run(
                [sys.executable, "-I", "-c", program], cwd=scratch, timeout=timeout_s,
                capture_output=True, env={"PATH": os.environ.get("PATH", "")},
            )
        except subprocess.TimeoutExpired:
            return False
    return result.returncode == 0


def score_humaneval(item: Item, text: str) -> Scored:
    passed = run_program(humaneval_program(item, text))
    return Scored("pass" if passed else "fail", passed, "code_block" if _CODE_BLOCK.search(text) else "raw")


# -- MBPP --

def mbpp_program(item: Item, text: str) -> str:
    """The program to run: the answer's code, then the dataset's setup code and its asserts."""
    block = _CODE_BLOCK.search(text)
    code = block.group(1) if block else text
    tests = "\n".join(item.meta["tests"])
    return f"{code}\n\n{item.meta['setup']}\n{tests}\n"


def score_mbpp(item: Item, text: str, timeout_s: float = 10.0) -> Scored:
    """Pass when the answer's code passes every assert of the problem within `timeout_s`."""
    passed = run_program(mbpp_program(item, text), timeout_s)
    return Scored("pass" if passed else "fail", passed, "code_block" if _CODE_BLOCK.search(text) else "raw")


# -- IFEval --

def score_ifeval(item: Item, text: str) -> Scored:
    from fitting.ifeval_check import check_instructions

    results = check_instructions(text, item.meta["instruction_id_list"], item.meta["kwargs"], item.meta["prompt"])
    checked = {name: ok for name, ok in results.items() if ok is not None}
    passed = bool(checked) and all(checked.values())
    rule = "all_checked" if len(checked) == len(results) else "skipped:" + ",".join(
        name for name, ok in results.items() if ok is None)
    return Scored(sum(checked.values()), passed, rule)


def score_gsm8k_json(item: Item, text: str) -> Scored:
    """The `answer` of a JSON reply; rule says how far the reply got: invalid_json, schema_invalid, json."""
    try:
        reply = json.loads(text)
    except ValueError:
        return Scored(None, False, "invalid_json")
    try:
        jsonschema.validate(reply, item.meta["schema"])
    except jsonschema.ValidationError:
        return Scored(None, False, "schema_invalid")
    gold = parse_number(item.gold)
    return Scored(reply["answer"], gold is not None and abs(reply["answer"] - gold) < 1e-6, "json")


# -- a user's prompts (fitting/prompts.py) --

def score_prompt(item: Item, text: str) -> Scored:
    """Right when the answer's final answer, read in the item's format, is its reference's."""
    from fitting.prompts import reference_pred

    pred, correct = reference_pred(item, text)
    return Scored(pred, correct, "reference" if item.gold is not None else "no_reference")


SCORERS = {"csqa": score_csqa, "gsm8k": score_gsm8k, "gsm8k_json": score_gsm8k_json, "humaneval": score_humaneval,
           "ifeval": score_ifeval, "mbpp": score_mbpp, "prompts": score_prompt}


def score(dataset: str, item: Item, text: str) -> Scored:
    """Extract the answer from `text` and score it against the item's gold answer."""
    return SCORERS[dataset](item, text)
