"""An answer check: how likely a finished answer is to be right, judged from the local model's doubt.

Token-level hand-offs help where a few tokens decide (a letter, a number); on long reasoning a
0.5B model's answer can be wrong throughout, and hand-offs that patch single tokens do not rescue
it. An answer nobody has seen yet (a request that does not stream) can instead be thrown away and
asked of the upstream afresh. The check decides when: a logistic model over aggregates of the
answer's steps (AnswerStats) gives the chance that the answer is correct, and the decoder asks
afresh below `escalate_below`.

A check file (JSON, written by `python -m eval answer-check`) holds the feature names, their
standardisation, the weights, the local model's SHA-256 (the signals mean nothing for another
model), and where it came from; `escalate_below` given for shares of escalated answers on the rows
it was fitted on (`shares`), to help choose a threshold. A check with `at_tokens` K was fitted on
the first K steps of answers: the decoder rates an answer once its K-th token is out (or at its
end, if it ends sooner), so an answer asked afresh stops there instead of being finished locally.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from policies.base import Signal
from policies.learned import RouterError, check_header, read_json, standardised_logistic

CHECK_FORMAT = "routing-gateway/answer-check@1"
FEATURES = ("mean_entropy", "max_entropy", "mean_top1", "first_entropy", "log_answer_tokens", "cut_by_length")
CORE_KEYS = ("format", "features", "model_sha256", "weights", "bias", "mean", "scale", "shares", "at_tokens")


@dataclass(frozen=True)
class AnswerStats:
    """Aggregates of one answer's steps (every step the local model scored, routed or not)."""

    mean_entropy: float
    max_entropy: float
    mean_top1: float
    first_entropy: float
    answer_tokens: int
    cut_by_length: bool  # the answer ended at max_tokens, not by itself

    @classmethod
    def of(cls, signals: Iterable[Signal], answer_tokens: int, finish_reason: str | None) -> "AnswerStats":
        signals = list(signals)
        entropies = [s.entropy for s in signals] or [0.0]
        top1 = statistics.fmean(s.top1 for s in signals) if signals else 1.0
        return cls(statistics.fmean(entropies), max(entropies), top1, entropies[0], answer_tokens,
                   finish_reason == "length")

    @classmethod
    def of_record(cls, record: dict[str, Any]) -> "AnswerStats":
        """The stats an evaluation record (fitting/runner.py) keeps."""
        return cls(record["mean_entropy"], record["max_entropy"], record["mean_top1"], record["first_entropy"],
                   record["answer_tokens"], record["finish_reason"] == "length")

    def features(self) -> np.ndarray:
        """FEATURES, in order."""
        return np.array([self.mean_entropy, self.max_entropy, self.mean_top1, self.first_entropy,
                         math.log1p(self.answer_tokens), float(self.cut_by_length)])


@dataclass(frozen=True)
class AnswerCheck:
    """P(correct) = sigmoid(w . (x - mean) / scale + b) over the answer's FEATURES."""

    weights: np.ndarray
    bias: float
    mean: np.ndarray
    scale: np.ndarray
    shares: dict[float, float]  # share of fit answers escalated -> the escalate_below that escalates it
    model_sha256: str
    meta: dict[str, Any]
    at_tokens: int | None = None  # rate after this many answer tokens (None: when the answer ends)

    def confidence(self, stats: AnswerStats) -> float:
        """The chance that the answer is correct, in [0, 1]."""
        z = float(np.dot(self.weights, (stats.features() - self.mean) / self.scale)) + self.bias
        return 1.0 / (1.0 + math.exp(-z)) if z > -700 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"format": CHECK_FORMAT, "features": list(FEATURES), "model_sha256": self.model_sha256,
                "weights": self.weights.tolist(), "bias": self.bias, "mean": self.mean.tolist(),
                "scale": self.scale.tolist(), "shares": {str(k): v for k, v in sorted(self.shares.items())},
                **({"at_tokens": self.at_tokens} if self.at_tokens is not None else {}),
                **{k: v for k, v in self.meta.items() if k not in CORE_KEYS}}

    @classmethod
    def load(cls, path: str | Path, model_sha256: str | None = None) -> "AnswerCheck":
        """Read a check file; RouterError if it is not one, or was fitted for another local model."""
        return cls.of_json(read_json(path, "answer check"), path, model_sha256)

    @classmethod
    def of_json(cls, data: Any, path: str | Path, model_sha256: str | None = None) -> "AnswerCheck":
        """A check from its JSON (`to_json`'s shape; `path` names where it came from in errors)."""
        if not isinstance(data, dict):
            raise RouterError(f"{path} is not an answer check file ({CHECK_FORMAT})")
        check_header(data, path, CHECK_FORMAT, model_sha256, FEATURES)
        weights, bias, mean, scale = standardised_logistic(data, path, len(FEATURES), "answer check")
        try:
            shares = {float(k): float(v) for k, v in data.get("shares", {}).items()}
        except (TypeError, ValueError, AttributeError) as exc:
            raise RouterError(f"{path} is not a complete answer check file: {exc!r}") from exc
        at_tokens = data.get("at_tokens")
        if at_tokens is not None and (type(at_tokens) is not int or at_tokens < 1):
            raise RouterError(f"{path}: at_tokens must be a positive whole number of tokens, not {at_tokens!r}")
        return cls(weights, bias, mean, scale, shares, str(data["model_sha256"]),
                   {k: v for k, v in data.items() if k not in CORE_KEYS}, at_tokens)
