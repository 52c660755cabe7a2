"""What every routing policy sees and says."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol


class Route(enum.Enum):
    LOCAL = "local"
    UPSTREAM = "upstream"


@dataclass(frozen=True)
class Signal:
    """The local model's uncertainty at one decoding step."""

    entropy: float  # nats
    top1: float  # probability of the most likely token
    margin: float  # top-1 minus top-2 probability
    position: int  # index of this token in the answer
    top: tuple[float, ...] = ()  # the largest probabilities, largest first (four in a detailed signal)
    kind: str = ""  # detailed: what the most likely token is (word, piece, digit, punct, newline)


@dataclass(frozen=True)
class RoutingState:
    """What the decoder knows about the answer so far, handed to the policy as plain values."""

    answer_tokens: int = 0
    upstream_tokens: int = 0
    upstream_calls: int = 0
    budget_tokens_left: int | None = None  # None: no token budget applies
    handoff_cost_tokens: int = 0  # estimated billed tokens of the next hand-off


class Policy(Protocol):
    """A small object with no I/O: given a step's signal and state, say where the step goes.

    A policy that reads `Signal.top` beyond two entries or `Signal.kind` sets `detailed_signal`;
    the decoder computes them only then (they cost a pass over the vocabulary every step)."""

    name: str

    def decide(self, signal: Signal, state: RoutingState) -> Route: ...
