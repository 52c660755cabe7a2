"""OpenAI's presence and frequency penalties and logit_bias, applied to the local model's logits."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LogitRules:
    """What a request adds to every step's logits, as OpenAI defines it:
    logit[t] += bias[t] - frequency * count(t) - presence * (count(t) > 0), counts over the answer so far."""

    presence: float = 0.0
    frequency: float = 0.0
    bias_ids: tuple[int, ...] = ()
    bias_values: tuple[float, ...] = ()

    @classmethod
    def of(cls, presence: float, frequency: float, bias: Mapping[str, float] | None) -> "LogitRules":
        pairs = sorted((int(token), float(value)) for token, value in (bias or {}).items())
        return cls(presence, frequency, tuple(t for t, _ in pairs), tuple(v for _, v in pairs))

    @property
    def active(self) -> bool:
        return bool(self.presence or self.frequency or self.bias_ids)

    def apply(self, logits: np.ndarray, answer: Sequence[int]) -> np.ndarray:
        """The adjusted logits (`logits` itself, changed in place: the engine hands out copies)."""
        if self.bias_ids:
            logits[list(self.bias_ids)] += np.asarray(self.bias_values, dtype=logits.dtype)
        if answer and (self.presence or self.frequency):
            tokens, counts = np.unique(np.asarray(answer), return_counts=True)
            logits[tokens] -= (counts * self.frequency + self.presence).astype(logits.dtype)
        return logits

    def upstream_params(self) -> dict[str, float]:
        """The penalties as sampling parameters of a hand-off (token ids mean nothing to another vocabulary)."""
        return {name: value for name, value in (("presence_penalty", self.presence),
                                                ("frequency_penalty", self.frequency)) if value}
