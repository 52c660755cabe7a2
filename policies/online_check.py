"""The math of an answer check learned online (docs/routing.md, "Routing that learns"): pure values,
no I/O, no clock. The gateway (gateway/shadow/learning.py) keeps the examples and the promoted check
in the Store and calls these.

An example is one shadow sample of an answer the alias's own routing produced: the local answer's
FEATURES (policies/answer_check.py, what the fitted file's check reads), its prompt's length, the
agreement share where samples ran and its format (`AnswerInputs`), and whether that answer, before
any escalation, agrees with the upstream's direct answer. A learned check (`LearnedCheck`) reads a
named subset of LEARNED_FEATURES, kept with it, so a check fitted on fewer (an older version's six
FEATURES) still loads and rates with its own. Each example's id decides once and
for all whether it is held out (`is_held_out`): a check is fitted on the others, and its ranking
(AUC) and its bar are measured on held-out examples only, which no version was ever fitted on.

The bar (`escalate_below`) is the lowest one whose agreement with upstream-only on the held-out
examples holds the quality target by the lower bound of its Wilson 95% interval, not by the point
estimate: an answer rated below the bar is asked of the upstream afresh and counted as agreeing, one
at or above it agrees as its label says.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from policies.agreement import answer_format
from policies.answer_check import CHECK_FORMAT, CORE_KEYS, FEATURES, AnswerStats
from policies.learned import RouterError, check_header, standardised_logistic

Z95 = 1.959963984540054  # the normal quantile of a two-sided 95% interval
CHANCE_AUC = 0.5  # the ranking a cold start (no check) counts as: a new check must beat it
FORMATS = ("code", "letter", "number", "text")  # the formats answers are compared in (policies/agreement.py)
AGREEMENT_FEATURES = ("agreement", "has_agreement")
CONTEXT_FEATURES = ("log_prompt_tokens", *AGREEMENT_FEATURES, *(f"format_{fmt}" for fmt in FORMATS))
LEARNED_FEATURES = (*FEATURES, *CONTEXT_FEATURES)  # FEATURES holds log_answer_tokens already


def wilson(successes: float, n: float, z: float = Z95) -> tuple[float, float] | None:
    """The Wilson score interval of a proportion (None with no trials): unlike the normal
    approximation it stays inside [0, 1] and is honest at 0/n and n/n with few samples."""
    if n <= 0:
        return None
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    low = 0.0 if successes <= 0 else max(0.0, centre - half)  # exact at the ends, not 1 - 1e-16
    return low, 1.0 if successes >= n else min(1.0, centre + half)


def fit_logistic(x: np.ndarray, y: np.ndarray, l2: float = 1.0, iterations: int = 30
                 ) -> tuple[np.ndarray, float, np.ndarray, np.ndarray]:
    """(weights, bias, mean, scale) of an L2-regularised logistic regression on standardised x,
    fitted by Newton's method (a handful of features need no more)."""
    mean = x.mean(axis=0)
    scale = x.std(axis=0)
    scale[scale == 0] = 1.0
    z = np.hstack([(x - mean) / scale, np.ones((len(x), 1))])
    w = np.zeros(z.shape[1])
    penalty = np.full(z.shape[1], l2)
    penalty[-1] = 0.0  # the bias is not shrunk
    for _ in range(iterations):
        p = 1.0 / (1.0 + np.exp(-np.clip(z @ w, -30, 30)))
        gradient = z.T @ (p - y) + penalty * w
        hessian = (z * (p * (1 - p))[:, None]).T @ z + np.diag(penalty)
        step = np.linalg.solve(hessian, gradient)
        w -= step
        if np.abs(step).max() < 1e-8:
            break
    return w[:-1], float(w[-1]), mean, scale


def auc(scores: Sequence[float], labels: Sequence[bool]) -> float | None:
    """The chance that a positive (agreeing) example scores above a negative one, ties counting
    half (Mann-Whitney); None unless both kinds are present."""
    s, y = np.asarray(scores, dtype=float), np.asarray(labels, dtype=bool)
    positives, negatives = int(y.sum()), int((~y).sum())
    if not positives or not negatives:
        return None
    order = np.argsort(s, kind="mergesort")
    ranks = np.empty(len(s))
    sorted_s = s[order]
    start = 0
    while start < len(s):  # average ranks over ties
        end = start
        while end + 1 < len(s) and sorted_s[end + 1] == sorted_s[start]:
            end += 1
        ranks[order[start:end + 1]] = (start + end) / 2 + 1
        start = end + 1
    return float((ranks[y].sum() - positives * (positives + 1) / 2) / (positives * negatives))


def is_held_out(example_id: str, share: float) -> bool:
    """Whether the example `example_id` is held out (never fitted on): a fixed function of its id,
    so every fit and every replica agrees."""
    digest = hashlib.sha256(example_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < share


@dataclass(frozen=True)
class Bar:
    """An escalate_below and what the held-out examples say it gives."""

    value: float
    escalated_share: float  # of answers asked afresh
    agreement: float  # predicted agreement with upstream-only (point estimate)
    agreement_low: float  # ... its Wilson 95% lower bound, which the target is held by
    n: int


def choose_bar(scores: Sequence[float], labels: Sequence[bool], target: float) -> Bar:
    """The lowest escalate_below whose agreement's Wilson lower bound on (`scores`, `labels`) is at
    least `target` (see the module docstring); 1.0 (ask everything afresh) when none holds it."""
    s, y = np.asarray(scores, dtype=float), np.asarray(labels, dtype=bool)
    n = len(s)
    for bar in [0.0, *np.unique(s).tolist(), 1.0]:
        below = s < bar
        agreed = int(below.sum() + (y & ~below).sum())
        interval = wilson(agreed, n)
        if interval is not None and interval[0] >= target or bar == 1.0:
            low = interval[0] if interval else 0.0
            return Bar(float(bar), float(below.mean()) if n else 1.0, agreed / n if n else 0.0, low, n)
    raise AssertionError("unreachable: bar 1.0 always returns")


@dataclass(frozen=True)
class AnswerInputs:
    """What a learned check may read of one answer: its AnswerStats FEATURES (in order), its prompt's
    length in tokens (None: not known where it is rated), the agreement check's share of agreeing
    samples (None: no samples ran) and its format as `auto` reads the local answer (None: unknown)."""

    features: tuple[float, ...]
    prompt_tokens: int | None = None
    agreement: float | None = None
    format: str | None = None

    @classmethod
    def of(cls, stats: AnswerStats, text: str | None = None, prompt_tokens: int | None = None,
           agreement: float | None = None) -> "AnswerInputs":
        """The inputs of the answer `text` whose steps gave `stats`."""
        fmt = None if text is None else answer_format(text)
        return cls(tuple(float(v) for v in stats.features()), prompt_tokens, agreement, fmt)

    def vector(self, names: Sequence[str]) -> np.ndarray:
        """The values of `names` (each one of LEARNED_FEATURES), NaN where unknown: log1p of the
        prompt's tokens; the agreement share, 0 with `has_agreement` 0 where no samples ran; one
        0/1 column per format of FORMATS."""
        values = dict(zip(FEATURES, self.features))
        values["log_prompt_tokens"] = math.nan if self.prompt_tokens is None else math.log1p(self.prompt_tokens)
        values["agreement"] = 0.0 if self.agreement is None else float(self.agreement)
        values["has_agreement"] = float(self.agreement is not None)
        for fmt in FORMATS:
            values[f"format_{fmt}"] = math.nan if self.format is None else float(self.format == fmt)
        return np.array([values[name] for name in names], dtype=float)


@dataclass(frozen=True)
class LearnedCheck:
    """P(agrees) = sigmoid(w . (x - mean) / scale + b) over the answer's `features` (a subset of
    LEARNED_FEATURES, in that order). An input unknown where it is rated is read at its fitted mean.
    Its JSON is an answer check file's (policies/answer_check.py) naming its features: one fitted on
    FEATURES alone is a file an alias may name as `routing.answer_check`."""

    features: tuple[str, ...]
    weights: np.ndarray
    bias: float
    mean: np.ndarray
    scale: np.ndarray
    model_sha256: str
    meta: dict[str, Any]

    def confidence(self, answer: AnswerStats | AnswerInputs) -> float:
        """The chance, in [0, 1], that the answer agrees with upstream-only's (`answer`'s stats alone:
        every other input unknown)."""
        inputs = answer if isinstance(answer, AnswerInputs) else AnswerInputs.of(answer)
        return float(self.scores(inputs.vector(self.features)[None, :])[0])

    def scores(self, x: np.ndarray) -> np.ndarray:
        """The confidence of each row of `x` (rows of `features`' values, NaN where unknown)."""
        z = np.nan_to_num((x - self.mean) / self.scale, nan=0.0)
        return 1.0 / (1.0 + np.exp(-np.clip(z @ self.weights + self.bias, -500, 500)))

    def to_json(self) -> dict[str, Any]:
        return {"format": CHECK_FORMAT, "features": list(self.features), "model_sha256": self.model_sha256,
                "weights": self.weights.tolist(), "bias": self.bias, "mean": self.mean.tolist(),
                "scale": self.scale.tolist(), "shares": {},
                **{k: v for k, v in self.meta.items() if k not in CORE_KEYS}}

    @classmethod
    def of_json(cls, data: Any, path: str, model_sha256: str | None = None) -> "LearnedCheck":
        """A check from its JSON (`to_json`'s shape, or an older version's six FEATURES); RouterError
        if it is not one, reads a feature this gateway does not compute, or is for another model."""
        names = data.get("features") if isinstance(data, dict) else None
        if not isinstance(names, list) or not names or len(set(names)) != len(names) \
                or not set(names) <= set(LEARNED_FEATURES):
            raise RouterError(f"{path} reads features {names}, not some of {list(LEARNED_FEATURES)}")
        check_header(data, path, CHECK_FORMAT, model_sha256, tuple(names))
        weights, bias, mean, scale = standardised_logistic(data, path, len(names), "answer check")
        return cls(tuple(names), weights, bias, mean, scale, str(data["model_sha256"]),
                   {k: v for k, v in data.items() if k not in CORE_KEYS})


@dataclass(frozen=True)
class Example:
    """One labelled shadow sample (see the module docstring); `extra`: what is kept beside the
    features for reports and `tune` (agreement share, prompt tokens, answer length, format, tenant)."""

    id: str
    features: tuple[float, ...]
    agreed: bool
    extra: Mapping[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "features": list(self.features), "agreed": self.agreed, **self.extra}

    def inputs(self) -> AnswerInputs:
        """What a learned check reads of this example; an example kept before `answer_format` was
        (an older version's) gives the format its answers were compared in."""
        prompt, agreement = self.extra.get("prompt_tokens"), self.extra.get("agreement")
        fmt = self.extra.get("answer_format", self.extra.get("format"))
        return AnswerInputs(self.features, int(prompt) if isinstance(prompt, (int, float)) else None,
                            float(agreement) if isinstance(agreement, (int, float)) else None,
                            fmt if isinstance(fmt, str) else None)

    @classmethod
    def of_json(cls, data: Mapping[str, Any]) -> "Example":
        extra = {k: v for k, v in data.items() if k not in ("id", "features", "agreed")}
        return cls(str(data["id"]), tuple(float(v) for v in data["features"]), bool(data["agreed"]), extra)


@dataclass(frozen=True)
class Candidate:
    """A check fitted on the non-held-out examples, with its held-out figures."""

    check: LearnedCheck
    auc: float | None  # on the held-out examples
    bar: Bar
    fitted_on: int
    held_out: int


def split(examples: Sequence[Example], share: float) -> tuple[list[Example], list[Example]]:
    """(fit, held out): `examples` in their order, parted by `is_held_out` at `share` (0 to 1), so
    the same example lands on the same side in every call and on every replica."""
    fit, held = [], []
    for example in examples:
        (held if is_held_out(example.id, share) else fit).append(example)
    return fit, held


def fit_candidate(examples: Sequence[Example], share: float, target: float, model_sha256: str,
                  meta: Mapping[str, Any], features: Sequence[str] = FEATURES) -> Candidate | None:
    """A check over `features` (some of LEARNED_FEATURES) fitted on `examples`' fit part, rated and
    given its bar on their held-out part; None while either part lacks an agreeing or a disagreeing
    example. An input an example does not hold is fitted at the others' mean."""
    fit, held = split(examples, share)
    if len({e.agreed for e in fit}) < 2 or len({e.agreed for e in held}) < 2:
        return None
    weights, bias, mean, scale = fit_logistic(_filled(matrix(fit, features)), np.array([float(e.agreed) for e in fit]))
    check = LearnedCheck(tuple(features), weights, bias, mean, scale, model_sha256, dict(meta))
    scores, labels = rate(check, held)
    return Candidate(check, auc(scores, labels), choose_bar(scores, labels, target), len(fit), len(held))


def matrix(examples: Sequence[Example], features: Sequence[str]) -> np.ndarray:
    """One row of `features`' values per example (NaN where an example does not hold one)."""
    return np.array([e.inputs().vector(features) for e in examples]).reshape(-1, len(features))


def _filled(x: np.ndarray) -> np.ndarray:
    """`x` with each NaN replaced by its column's mean of known values (0 where none is known)."""
    known = ~np.isnan(x)
    means = np.where(known, x, 0.0).sum(axis=0) / np.maximum(known.sum(axis=0), 1)
    return np.where(known, x, means)


def rate(check: LearnedCheck, examples: Sequence[Example]) -> tuple[list[float], list[bool]]:
    """`check`'s confidence in each example (in order), read with the check's own features, and the
    examples' labels."""
    if not examples:
        return [], []
    return check.scores(matrix(examples, check.features)).tolist(), [e.agreed for e in examples]


def promotes(candidate_auc: float | None, current_auc: float | None, fitted_on_more: bool = True) -> bool:
    """Whether a candidate replaces the current check: its held-out ranking is at least the
    current one's on the same examples. A tie promotes only a candidate `fitted_on_more` examples
    than the current check (the same ranking from more evidence; one fitted on no more would only
    bump the version). A cold start (`current_auc` None) counts as chance, CHANCE_AUC, and a tie at
    chance does not promote: it would rank nothing. None for the candidate: it could not be ranked."""
    if candidate_auc is None:
        return False
    if current_auc is None:
        return candidate_auc > CHANCE_AUC
    return candidate_auc > current_auc or (candidate_auc == current_auc and fitted_on_more)
