"""From next-token logits to the step's uncertainty signal, a sampled token and logprobs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from policies import Signal


@dataclass(frozen=True)
class Sampling:
    """How the next token is drawn; temperature 0 is greedy (argmax)."""

    temperature: float = 0.0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


TOP_K = 4  # probabilities kept in a detailed Signal.top (learned routers read them)


def signal_of(logits: np.ndarray, position: int, kind_of: Callable[[int], str] | None = None,
              hidden: np.ndarray | None = None) -> Signal:
    """Entropy (nats), top-1 probability and top-1/top-2 margin of softmax(logits); with `kind_of`
    (a detailed signal, for policies that read more) also the top-4 probabilities and the kind of
    the most likely token; `hidden` (the step's last hidden state) is passed through.

    One exp over the vocabulary and one more pass (three when detailed): with x = logits - max, e = exp(x) and
    Z = sum(e), p1 = 1/Z, H = log Z - sum(e * x) / Z.
    """
    best = int(np.argmax(logits))
    shifted = logits - logits[best]
    weights = np.exp(shifted)
    total = float(weights.sum())
    entropy = float(np.log(total) - np.dot(weights, shifted) / total)
    weights[best] = 0.0
    top = [1.0]
    for _ in range((TOP_K if kind_of else 2) - 1):
        following = int(np.argmax(weights))
        top.append(float(weights[following]))
        weights[following] = 0.0
    return Signal(entropy=max(entropy, 0.0), top1=1.0 / total, margin=(1.0 - top[1]) / total, position=position,
                  top=tuple(p / total for p in top), kind=kind_of(best) if kind_of else "", hidden=hidden)


def token_kind(piece: bytes) -> str:
    """newline, digit, punct, word (starts a word) or piece (continues one), from a token's bytes."""
    if b"\n" in piece:
        return "newline"
    text = piece.decode("utf-8", "replace")
    stripped = text.lstrip()
    if not stripped or stripped[0] == "\ufffd":  # blank, or part of a multi-byte character
        return "piece"
    if stripped[0].isdigit():
        return "digit"
    if not stripped[0].isalnum():
        return "punct"
    return "word" if text[0].isspace() else "piece"


def sample(logits: np.ndarray, sampling: Sampling, rng: np.random.Generator) -> int:
    """Greedy argmax at temperature 0; otherwise temperature, then nucleus (top_p) sampling."""
    if sampling.greedy:
        return int(np.argmax(logits))
    # shift before dividing: a tiny temperature then sends the others to -inf, not inf - inf = nan
    shifted = logits.astype(np.float64) - float(logits.max())
    with np.errstate(over="ignore"):  # the overflow to -inf is the point: those tokens get probability 0
        probs = np.exp(shifted / sampling.temperature)
    probs /= probs.sum()
    if sampling.top_p < 1.0:
        order = np.argsort(-probs)
        cumulative = np.cumsum(probs[order])
        keep = order[: int(np.searchsorted(cumulative, sampling.top_p)) + 1]
        kept = probs[keep] / probs[keep].sum()
        return int(rng.choice(keep, p=kept))
    return int(rng.choice(len(probs), p=probs))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max()
    return shifted - np.log(np.exp(shifted).sum())
