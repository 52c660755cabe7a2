"""The local model's part of a step: next-token logits (the request's penalties and logit_bias
applied before anything reads them), the step's signal, a sampled token the answer's grammar allows,
and logprobs.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from adapters.engine import Sequence
from gateway.decoding.answer import Answer
from gateway.decoding.signals import log_softmax, sample, signal_of, token_kind
from gateway.decoding.values import DecodeRequest, TokenLogprob
from policies import Signal


class TokenBytes(Protocol):
    """The local model's tokens as bytes (adapters.local_model.LocalModel)."""

    def token_bytes(self, token: int) -> bytes: ...


class LocalSteps:
    """One request's reads of the local model, after `prompt_tokens`; sampling draws from its own
    generator, seeded by the request's seed, what `answer`'s grammar allows next."""

    def __init__(self, local: TokenBytes, prompt_tokens: list[int], request: DecodeRequest, answer: Answer) -> None:
        self._local, self._prompt, self._answer = local, prompt_tokens, answer
        self._rules, self._sampling, self._top_logprobs = request.rules, request.sampling, request.logprobs or 0
        self._kind_of = self._token_kind if request.routing.policy.detailed_signal else None
        # OpenAI's seed is any 64-bit integer; numpy's seeds are non-negative
        self._rng = np.random.default_rng(None if request.seed is None else request.seed % 2**64)
        self._hidden: np.ndarray | None = None  # the latest forward's hidden state

    async def forward(self, sequence: Sequence, answer: list[int]) -> np.ndarray:
        """Next-token logits after `answer`, with the request's penalties and logit_bias applied."""
        logits = await sequence.forward(self._prompt + answer)
        self._hidden = sequence.hidden  # the next signal's (None unless the policy reads_hidden)
        return self._rules.apply(logits, answer) if self._rules.active else logits

    def signal(self, logits: np.ndarray, position: int) -> Signal:
        """The step's signal at answer `position`, from the latest forward's `logits`."""
        return signal_of(logits, position, self._kind_of, self._hidden)

    async def pick(self, logits: np.ndarray) -> tuple[int | None, np.ndarray]:
        """A token sampled from the next-token `logits` that the answer's grammar allows, and the logits
        it was drawn from; None when the grammar allows nothing more, not even an end."""
        token = sample(logits, self._sampling, self._rng)
        if self._answer.allows(token):
            return token, logits
        # Resampling from the masked logits draws exactly from the grammar's distribution.
        logits = await self._answer.masked(logits)
        if not np.isfinite(logits).any():
            return None, logits
        return sample(logits, self._sampling, self._rng), logits

    def logprob(self, logits: np.ndarray, token: int) -> TokenLogprob:
        """`token`'s logprob under `logits`, with the request's `top_logprobs` alternatives."""
        logp = log_softmax(logits)
        k = self._top_logprobs
        top = np.argpartition(-logp, k)[:k] if k else np.array([], dtype=int)
        top = top[np.argsort(-logp[top])]
        entries = tuple((int(t), self._local.token_bytes(int(t)), float(logp[t])) for t in top)
        return TokenLogprob(token, self._local.token_bytes(token), float(logp[token]), entries)

    async def score(self, sequence: Sequence, answer: list[int], first: int) -> tuple[TokenLogprob, ...]:
        """The local model's logprobs for `answer`'s tokens from `first` on (written upstream)."""
        scored = []
        for index in range(first, len(answer)):
            logits = await self.forward(sequence, answer[:index])
            scored.append(self.logprob(logits, answer[index]))
        return tuple(scored)

    def _token_kind(self, token: int) -> str:
        return token_kind(self._local.token_bytes(token))
