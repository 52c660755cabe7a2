"""A policy that picks its own entropy threshold so that a target share of tokens goes upstream."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from policies.base import Route, RoutingState, Signal


@dataclass
class TargetFraction:
    """Route the most uncertain `target` share of steps, calibrating online.

    The threshold is the (1 - target) quantile of the entropies seen in a sliding window, so it
    follows the signal when its level shifts. A feedback term keeps the realised share on target:
    when the answer has fallen behind by more than `slack` tokens, the step is routed even if it
    is below the threshold; when it is ahead, the step stays local. Caps that wrap this policy
    can still veto, so the share reached is "at most target" under tight budgets.
    """

    target: float
    window: int = 64
    slack: float = 1.0
    name: str = "target_fraction"
    _recent: deque[float] = field(default_factory=deque, repr=False)

    def decide(self, signal: Signal, state: RoutingState) -> Route:
        self._recent.append(signal.entropy)
        if len(self._recent) > self.window:
            self._recent.popleft()
        owed = self.target * (state.answer_tokens + 1) - state.upstream_tokens
        if owed > self.slack:
            return Route.UPSTREAM
        if owed < 0:
            return Route.LOCAL
        threshold = float(np.quantile(np.fromiter(self._recent, float), 1.0 - self.target))
        return Route.UPSTREAM if signal.entropy >= threshold else Route.LOCAL
