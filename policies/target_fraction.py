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
    follows the signal when its level shifts. The window may be shared by the requests of one
    alias (the gateway passes one in), so short answers are judged against a threshold learnt
    from many steps; until it holds `min_history` entropies only the feedback term decides. That
    term keeps the realised share on target: when the answer has fallen behind by more than
    `slack` tokens the step is routed even below the threshold; when it is ahead, the step stays
    local. Caps that wrap this policy can still veto, so under tight budgets the share reached is
    at most the target.
    """

    target: float
    window: int = 256
    slack: float = 1.0
    min_history: int = 16
    name: str = "target_fraction"
    history: deque[float] = field(default_factory=deque, repr=False)

    def decide(self, signal: Signal, state: RoutingState) -> Route:
        self.history.append(signal.entropy)
        while len(self.history) > self.window:
            self.history.popleft()
        owed = self.target * (state.answer_tokens + 1) - state.upstream_tokens
        if owed > self.slack:
            return Route.UPSTREAM
        if owed < 0 or len(self.history) < self.min_history:
            return Route.LOCAL
        threshold = float(np.quantile(np.fromiter(self.history, float), 1.0 - self.target))
        return Route.UPSTREAM if signal.entropy >= threshold else Route.LOCAL
