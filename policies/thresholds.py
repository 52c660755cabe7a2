"""Fixed-rule policies: never, always, and a threshold on one uncertainty signal."""

from __future__ import annotations

from dataclasses import dataclass

from policies.base import LOCAL, UPSTREAM, Decision, Needs, PolicyDefaults, PolicyEntry, RoutingState, Signal


@dataclass
class Never(PolicyDefaults):
    """Local only: the small-model baseline."""

    name: str = "never"
    routes = False

    def decide(self, signal: Signal, state: RoutingState) -> Decision:
        return LOCAL


@dataclass
class Always(PolicyDefaults):
    """Every step upstream: the large-model baseline through the same path."""

    name: str = "always"
    wants_warm_up = False

    def decide(self, signal: Signal, state: RoutingState) -> Decision:
        return UPSTREAM


@dataclass
class EntropyAbove(PolicyDefaults):
    """Route when the next-token entropy (nats) exceeds the threshold."""

    threshold: float
    name: str = "entropy"

    def decide(self, signal: Signal, state: RoutingState) -> Decision:
        return UPSTREAM if signal.entropy > self.threshold else LOCAL


@dataclass
class Top1Below(PolicyDefaults):
    """Route when the top-1 probability is below the threshold."""

    threshold: float
    name: str = "top1"

    def decide(self, signal: Signal, state: RoutingState) -> Decision:
        return UPSTREAM if signal.top1 < self.threshold else LOCAL


@dataclass
class MarginBelow(PolicyDefaults):
    """Route when p1 - p2 is below the threshold."""

    threshold: float
    name: str = "margin"

    def decide(self, signal: Signal, state: RoutingState) -> Decision:
        return UPSTREAM if signal.margin < self.threshold else LOCAL


THRESHOLD = Needs(("threshold",), "a threshold")
ENTRIES = (
    PolicyEntry("never", lambda args: Never()),
    PolicyEntry("always", lambda args: Always()),
    PolicyEntry("entropy", lambda args: EntropyAbove(args.threshold), (THRESHOLD,), defaults={"threshold": 2.0}),
    PolicyEntry("top1", lambda args: Top1Below(args.threshold), (THRESHOLD,)),
    PolicyEntry("margin", lambda args: MarginBelow(args.threshold), (THRESHOLD,)),
)
