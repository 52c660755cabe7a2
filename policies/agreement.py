"""Do two answers say the same thing? Final answers by format, and the agreement check.

An answer's final answer is read by its format (`auto` picks one from the answer itself):
- `code`: the first fenced block (else the whole answer), without comment lines, blank lines and
  trailing spaces: two programs agree when they are the same code up to those;
- `letter`: a capital option letter A-E at the answer's start after an optional lead-in ("Answer:",
  "(", "**"), or stated anywhere ("the answer is (C)", "option C");
- `number`: the last "Answer: N" / "answer is N" / "#### N" / \\boxed{N}, else the last number in the
  answer; compared as values ('$', ',' and a trailing '%' dropped: "1,000.0" agrees with "1000");
- `text`: the words, lower-cased without punctuation; two texts agree when their word sets overlap
  by at least TEXT_JACCARD (Jaccard), a loose rule for free text that says nothing about meaning.
`auto` takes `code` where the answer holds a fence, `letter` where it opens with or states a letter,
`number` where it holds a number, else `text`.

The agreement check (`AgreementCheck`) needs no fitted file, so it serves any local model: the local
model decodes its greedy answer and `samples - 1` sampled ones together in the batched engine, and
the answer's agreement is the share of sampled answers whose final answer is the greedy one's. An
answer whose agreement is below `escalate_below` is asked of the upstream afresh (as the fitted
check's rating is). With `answer: majority` the answer kept is the majority's instead: the first of
the answers (the greedy one first) that most of the others agree with, rated by the share of the
others that agree with it; the greedy answer wins a tie. Published cascades escalate on exactly
this signal (agreement among one model's own samples: mixture-of-thought and semantic-agreement
cascades).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Literal

AnswerFormat = Literal["auto", "code", "letter", "number", "text"]
KeptAnswer = Literal["greedy", "majority"]
TEXT_JACCARD = 0.6  # free texts agree when this share of their distinct words is common to both

_FENCE = re.compile(r"```[\w+-]*\n?(.*?)(?:```|$)", re.DOTALL)
_LEAD = r"(?:\*\*|__|#+\s*)?(?:(?:the\s+)?(?:correct\s+)?(?:answer|option|choice)(?:\s+is)?\s*[:\-]?\s*)?"
_LEADING_LETTER = re.compile(r"^\s*" + _LEAD + r"[\*\(\[]*([A-E])(?:[\)\]\.:,\*]|\s*$|\s*\n|\s+-\s)")
_STATED_LETTER = re.compile(r"(?i:answer\s+is|answer\s*:|option|choice)\s*[\*\(\[]*([A-E])(?![A-Za-z])")
_NUMBER = r"-?\$?\d[\d,]*(?:\.\d+)?%?"
_STATED_NUMBER = re.compile(r"(?:answer\s*(?:is|:)\s*|####\s*|\\boxed\{\s*)(" + _NUMBER + r")", re.IGNORECASE)
_ANY_NUMBER = re.compile(_NUMBER)
_WORD = re.compile(r"[a-z0-9]+")


def answer_format(text: str) -> AnswerFormat:
    """The format `auto` reads `text` in (see the module docstring)."""
    if "```" in text:
        return "code"
    if _LEADING_LETTER.match(text) or _STATED_LETTER.search(text):
        return "letter"
    if _ANY_NUMBER.search(text):
        return "number"
    return "text"


def final_answer(text: str, fmt: AnswerFormat = "auto") -> str | None:
    """The answer's final answer in `fmt`, normalised for comparison; None if it holds none."""
    fmt = answer_format(text) if fmt == "auto" else fmt
    if fmt == "code":
        fence = _FENCE.search(text)
        code = fence.group(1) if fence else text
        lines = [line.rstrip() for line in code.splitlines()]
        return "\n".join(line for line in lines if line.strip() and not line.lstrip().startswith("#")) or None
    if fmt == "letter":
        match = _LEADING_LETTER.match(text) or _STATED_LETTER.search(text)
        return match.group(1) if match else None
    if fmt == "number":
        stated = _STATED_NUMBER.findall(text)
        found = stated[-1] if stated else (_ANY_NUMBER.findall(text) or [None])[-1]
        return _number(found) if found else None
    words = _WORD.findall(text.lower())
    return " ".join(words) or None


def same_answer(a: str, b: str, fmt: AnswerFormat = "auto") -> bool:
    """Whether answers `a` and `b` give the same final answer, both read in the format `a` reads in
    (an answer without one agrees with nothing)."""
    fmt = answer_format(a) if fmt == "auto" else fmt
    first, second = final_answer(a, fmt), final_answer(b, fmt)
    if first is None or second is None:
        return False
    if fmt != "text":
        return first == second
    words_a, words_b = set(first.split()), set(second.split())
    return len(words_a & words_b) / len(words_a | words_b) >= TEXT_JACCARD


def agreement(answer: str, samples: Sequence[str], fmt: AnswerFormat = "auto") -> float:
    """The share of `samples` whose final answer is `answer`'s (1.0 with no samples)."""
    if not samples:
        return 1.0
    return sum(same_answer(answer, sample, fmt) for sample in samples) / len(samples)


def majority(answers: Sequence[str], fmt: AnswerFormat = "auto") -> tuple[int, float]:
    """The index of the first of `answers` that most of the others agree with, and the share of
    the others that do (an earlier answer wins a tie)."""
    if len(answers) < 2:
        return 0, 1.0
    shares = [agreement(answer, [*answers[:i], *answers[i + 1:]], fmt) for i, answer in enumerate(answers)]
    best = max(range(len(answers)), key=lambda i: (shares[i], -i))
    return best, shares[best]


@dataclass(frozen=True)
class AgreementCheck:
    """Rates an answer by the share of `samples - 1` sampled answers (at `temperature`) that agree
    with it; `answer` says which answer is kept and rated, the greedy one or the majority's (a held
    answer only: a streamed one has been shown); `at_tokens` is None: it rates finished answers only."""

    samples: int = 4
    temperature: float = 0.7
    format: AnswerFormat = "auto"
    answer: KeptAnswer = "greedy"
    at_tokens: None = None

    def confidence(self, answer: str, sampled: Sequence[str]) -> float:
        return agreement(answer, sampled, self.format)

    def kept(self, answer: str, sampled: Sequence[str], held: bool) -> tuple[int, float]:
        """Which answer is kept (0: the greedy `answer`, i: `sampled[i - 1]`) and its rating."""
        if self.answer == "majority" and held:
            return majority([answer, *sampled], self.format)
        return 0, self.confidence(answer, sampled)


def _number(raw: str) -> str | None:
    cleaned = raw.replace("$", "").replace(",", "").rstrip("%").rstrip(".")
    try:
        return format(Decimal(cleaned).normalize(), "f")
    except InvalidOperation:
        return None
