"""A policy that picks its own entropy threshold so that a target share of tokens goes upstream."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from policies.base import LOCAL, UPSTREAM, Decision, PolicyDefaults, RoutingState, Signal


class EntropyWindow:
    """The most recent step entropies of the requests that calibrate one threshold together (the
    gateway keeps one per tenant and alias): the one state a policy carries across requests,
    owned by the caller and handed to each policy it builds."""

    def __init__(self, size: int = 256) -> None:
        self._entropies: deque[float] = deque(maxlen=size)

    def add(self, entropy: float) -> None:
        self._entropies.append(entropy)

    def __len__(self) -> int:
        return len(self._entropies)

    def quantile(self, q: float) -> float:
        return float(np.quantile(np.fromiter(self._entropies, float), q))


@dataclass
class TargetFraction(PolicyDefaults):
    """Route the most uncertain `target` share of steps, calibrating online.

    The threshold is the (1 - target) quantile of the entropies in `window`, so it follows the
    signal when its level shifts. The window is shared by the requests of one tenant on one alias
    (the gateway passes one in), so short answers are judged against a threshold learnt from many
    steps; until it holds `min_history` entropies only the feedback term decides. That term keeps
    the realised share on target: when the answer has fallen behind by more than `slack` tokens
    the step is routed even below the threshold; when it is ahead, the step stays local. Caps that
    wrap this policy can still veto, so under tight budgets the share reached is at most the target.
    """

    target: float
    window: EntropyWindow = field(default_factory=EntropyWindow, repr=False)
    slack: float = 1.0
    min_history: int = 16
    name: str = "target_fraction"

    def decide(self, signal: Signal, state: RoutingState) -> Decision:
        self.window.add(signal.entropy)
        owed = self.target * (state.answer_tokens + 1) - state.upstream_tokens
        if owed > self.slack:
            return UPSTREAM
        if owed < 0 or len(self.window) < self.min_history:
            return LOCAL
        return UPSTREAM if signal.entropy >= self.window.quantile(1.0 - self.target) else LOCAL
