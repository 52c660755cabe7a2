"""From next-token logits to the step's uncertainty signal, a sampled token and logprobs."""

from __future__ import annotations

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


def signal_of(logits: np.ndarray, position: int) -> Signal:
    """Entropy (nats), top-1 probability and top-1/top-2 margin of softmax(logits).

    One exp over the vocabulary and two max passes: with x = logits - max, e = exp(x) and
    Z = sum(e), p1 = 1/Z, H = log Z - sum(e * x) / Z.
    """
    top = int(np.argmax(logits))
    shifted = logits - logits[top]
    weights = np.exp(shifted)
    total = float(weights.sum())
    entropy = float(np.log(total) - np.dot(weights, shifted) / total)
    weights[top] = 0.0
    second = float(weights.max())
    return Signal(entropy=max(entropy, 0.0), top1=1.0 / total, margin=(1.0 - second) / total, position=position)


def sample(logits: np.ndarray, sampling: Sampling, rng: np.random.Generator) -> int:
    """Greedy argmax at temperature 0; otherwise temperature, then nucleus (top_p) sampling."""
    if sampling.greedy:
        return int(np.argmax(logits))
    # shift before dividing: a tiny temperature then sends the others to -inf, not inf - inf = nan
    shifted = logits.astype(np.float64) - float(logits.max())
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
