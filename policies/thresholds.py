"""Fixed-rule policies: never, always, and a threshold on one uncertainty signal."""

from __future__ import annotations

from dataclasses import dataclass

from policies.base import Route, RoutingState, Signal


@dataclass
class Never:
    """Local only: the small-model baseline."""

    name: str = "never"

    def decide(self, signal: Signal, state: RoutingState) -> Route:
        return Route.LOCAL


@dataclass
class Always:
    """Every step upstream: the large-model baseline through the same path."""

    name: str = "always"

    def decide(self, signal: Signal, state: RoutingState) -> Route:
        return Route.UPSTREAM


@dataclass
class EntropyAbove:
    """Route when the next-token entropy (nats) exceeds the threshold."""

    threshold: float
    name: str = "entropy"

    def decide(self, signal: Signal, state: RoutingState) -> Route:
        return Route.UPSTREAM if signal.entropy > self.threshold else Route.LOCAL


@dataclass
class Top1Below:
    """Route when the top-1 probability is below the threshold."""

    threshold: float
    name: str = "top1"

    def decide(self, signal: Signal, state: RoutingState) -> Route:
        return Route.UPSTREAM if signal.top1 < self.threshold else Route.LOCAL


@dataclass
class MarginBelow:
    """Route when p1 - p2 is below the threshold."""

    threshold: float
    name: str = "margin"

    def decide(self, signal: Signal, state: RoutingState) -> Route:
        return Route.UPSTREAM if signal.margin < self.threshold else Route.LOCAL
