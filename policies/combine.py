"""Combining a routed step's two distributions into one token: pure values, no I/O.

At a routed step the gateway holds the local model's whole next-token distribution and the
upstream's top alternatives for the same position (their texts, as bytes, and log-probabilities).
`combine` picks the step's token by one of three rules:

- take:        the upstream's token (what every routed step did before combining existed).
- contrastive: among the tokens the upstream finds plausible (probability at least `alpha` times
               its top one), the one maximising log p_upstream - beta * log p_local (contrastive
               decoding, Li et al. 2023; O'Brien and Lewis 2023): what the large model believes and
               the small one does not.
- fuse:        the argmax of (1 - weight) * log p_local + weight * log p_upstream over the union of
               both top-k (k: as many as the upstream returned). A local candidate the upstream did
               not list is given the upstream's lowest listed log-probability, an upper bound of its
               own (it ranked below every listed one).

The models may tokenize differently: an upstream alternative is scored locally only where its
bytes are exactly one local token's (`TokenIndex.align`; an end token, which servers send with
empty bytes, aligns with the local end token); models of one tokenizer family align every
alternative. A chosen token with empty bytes is the end of the answer. Where the upstream's own
token has no local counterpart the step falls back to take (`Combined.how == "fell_back"`), as it
does when the upstream listed no alternatives.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

COMBINES = ("take", "contrastive", "fuse")

Alternative = tuple[bytes, float]  # an upstream token's bytes and its log-probability


@dataclass(frozen=True)
class CombineParams:
    """A combine rule and its parameters: `alpha` and `beta` (contrastive), `weight` (fuse)."""

    combine: str = "take"
    alpha: float = 0.1
    beta: float = 0.5
    weight: float = 0.5


@dataclass(frozen=True)
class Combined:
    """What a routed step keeps: `how` it was decided (taken, agreed: the rule chose the upstream's
    token, changed: it chose another, fell_back: no alignment, the upstream's token taken) and the
    chosen token's bytes (`text`, the upstream's own token unless changed)."""

    how: str
    text: bytes

    @property
    def changed(self) -> bool:
        return self.how == "changed"


class TokenIndex:
    """A local vocabulary as bytes -> token id (the first id of equal bytes wins). Built once per
    local model: tokens with empty bytes (control tokens) are left out, except that empty bytes
    stand for the local `end` token where one is given (servers send an end token's bytes empty)."""

    def __init__(self, pieces: Iterable[bytes], end: int | None = None) -> None:
        self._ids: dict[bytes, int] = {}
        for token, piece in enumerate(pieces):
            if piece:
                self._ids.setdefault(piece, token)
        if end is not None:
            self._ids[b""] = end

    @property
    def end(self) -> int | None:
        """The local end token, which empty bytes align with (None: they align with nothing)."""
        return self._ids.get(b"")

    def id_of(self, piece: bytes) -> int | None:
        """The local token whose bytes are exactly `piece`; None where there is none."""
        return self._ids.get(piece)

    def align(self, alternatives: Sequence[Alternative]) -> list[tuple[int, bytes, float]]:
        """The upstream alternatives that are one local token each, as (local id, bytes, upstream logprob)."""
        aligned = ((self._ids.get(piece), piece, logprob) for piece, logprob in alternatives)
        return [(token, piece, logprob) for token, piece, logprob in aligned if token is not None]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities of `logits` (any -inf entries stay -inf)."""
    values = np.asarray(logits, dtype=np.float64)
    top = np.max(values)
    return values - (top + math.log(float(np.sum(np.exp(values - top)))))


def combine(params: CombineParams, chosen: bytes, alternatives: Sequence[Alternative], local_logprobs: np.ndarray,
            index: TokenIndex, local_bytes: Sequence[bytes] | None = None) -> Combined:
    """The routed step's token under `params`: `chosen` is the upstream's own token, `alternatives`
    its top list, `local_logprobs` the local model's log-probabilities over its whole vocabulary
    (`log_softmax` of its logits), `index` the local vocabulary; fuse's local candidates take their
    text from `local_bytes` (the local vocabulary's bytes by id). Never raises for data it cannot
    align: that falls back to take."""
    if params.combine == "take":
        return Combined("taken", chosen)
    own = index.id_of(chosen)
    aligned = index.align(alternatives)
    if own is None or not aligned:
        return Combined("fell_back", chosen)
    if params.combine == "contrastive":
        token, text = contrastive(aligned, local_logprobs, params.alpha, params.beta, own, chosen)
    else:
        token, text = fuse(aligned, local_logprobs, params.weight, own, chosen, local_bytes, index.end)
    return Combined("agreed" if token == own else "changed", text)


def contrastive(aligned: Sequence[tuple[int, bytes, float]], local_logprobs: np.ndarray, alpha: float, beta: float,
                own: int, chosen: bytes) -> tuple[int, bytes]:
    """Among the plausible aligned alternatives (upstream probability at least `alpha` times the top
    one's), the (local id, bytes) maximising log p_upstream - beta * log p_local; the upstream's own
    token wins a tie."""
    floor = max(logprob for _, _, logprob in aligned) + math.log(alpha)
    best, best_score = (own, chosen), -math.inf
    for token, piece, logprob in _own_first(aligned, own):
        if logprob < floor:
            continue
        score = logprob - beta * float(local_logprobs[token])
        if score > best_score:
            best, best_score = (token, piece), score
    return best


def fuse(aligned: Sequence[tuple[int, bytes, float]], local_logprobs: np.ndarray, weight: float, own: int,
         chosen: bytes, local_bytes: Sequence[bytes] | None, index_end: int | None = None) -> tuple[int, bytes]:
    """The (local id, bytes) maximising (1 - weight) log p_local + weight log p_upstream over the
    aligned alternatives and the local top-k (k = len(aligned); control tokens other than the end
    `index_end` left out); a local candidate the upstream did not list scores at the upstream's
    lowest listed log-probability. The upstream's token wins a tie."""
    upstream = {token: (piece, logprob) for token, piece, logprob in _own_first(aligned, own)}
    unlisted = min(logprob for _, logprob in upstream.values())
    candidates = dict(upstream)
    if local_bytes is not None:
        for token in np.argpartition(-local_logprobs, len(aligned))[:len(aligned)]:
            token = int(token)
            if token not in candidates and (local_bytes[token] or token == index_end):
                candidates[token] = (local_bytes[token], unlisted)
    best, best_score = (own, chosen), -math.inf
    for token, (piece, logprob) in candidates.items():
        score = (1 - weight) * float(local_logprobs[token]) + weight * logprob
        if score > best_score:
            best, best_score = (token, piece), score
    return best


def _own_first(aligned: Sequence[tuple[int, bytes, float]], own: int) -> list[tuple[int, bytes, float]]:
    """`aligned` with the upstream's own token first (so it wins ties under a strict comparison)."""
    return sorted(aligned, key=lambda entry: entry[0] != own)
