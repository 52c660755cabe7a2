"""A policy that picks its own entropy threshold so that a target share of tokens goes upstream."""

from __future__ import annotations

from dataclasses import dataclass, field

from policies.base import (
    LOCAL,
    UPSTREAM,
    Decision,
    Needs,
    PolicyArgs,
    PolicyDefaults,
    PolicyEntry,
    RoutingState,
    Signal,
)
from policies.window import RecentValues, SharedWindows


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
    window: RecentValues = field(default_factory=RecentValues, repr=False)
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


def build(args: PolicyArgs) -> TargetFraction:
    """target_fraction's share, calibrated on the entropies of the tenant's window."""
    return TargetFraction(args.target_fraction, (args.windows or SharedWindows()).entropies)


ENTRIES = (PolicyEntry("target_fraction", build, (Needs(("target_fraction",), "target_fraction"),)),)
