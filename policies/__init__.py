"""Routing policies: small values with no I/O that decide, per decoding step, where it goes (a Decision)."""

from __future__ import annotations

from policies.base import LOCAL, UPSTREAM, Decision, Policy, Route, RoutingState, Signal
from policies.caps import Capped
from policies.learned import FirstTokens, LearnedAbove, Router
from policies.price import PriceAware
from policies.target_fraction import EntropyWindow, TargetFraction
from policies.thresholds import Always, EntropyAbove, MarginBelow, Never, Top1Below

THRESHOLD_POLICIES = {"entropy": EntropyAbove, "top1": Top1Below, "margin": MarginBelow}


def build_policy(
    name: str,
    threshold: float | None = None,
    target_fraction: float | None = None,
    max_upstream_tokens: int | None = None,
    max_upstream_share: float | None = None,
    max_upstream_calls: int | None = None,
    window: EntropyWindow | None = None,
    router: Router | None = None,
    answer_value: float | None = None,
    early_escalation: bool = True,
) -> Policy:
    """A fresh policy for one request, wrapped in its caps.

    `window` is target_fraction's window of recent entropies; pass the same one to every request
    of a tenant on an alias so its threshold is calibrated on more than one short answer. `learned`
    needs `router` and a score `threshold`, or a `target_fraction` that the router's fitted
    share thresholds turn into one; `first` routes the first `threshold` answer tokens.
    `answer_value` makes it price-aware (policies.price); None leaves decisions blind to price.
    """
    inner: Policy
    if name == "never":
        inner = Never()
    elif name == "always":
        inner = Always()
    elif name in THRESHOLD_POLICIES:
        inner = THRESHOLD_POLICIES[name](threshold)
    elif name == "learned":
        if router is None:
            raise ValueError("policy 'learned' needs a router")
        inner = LearnedAbove(router, threshold if threshold is not None else router.threshold_for_share(target_fraction))
    elif name == "first":
        inner = FirstTokens(int(threshold))
    elif name == "target_fraction":
        inner = TargetFraction(target_fraction, EntropyWindow() if window is None else window)
    else:
        raise ValueError(f"unknown routing policy {name!r}")
    if answer_value is not None:
        inner = PriceAware(inner, answer_value, escalate=early_escalation)
    return Capped(inner, max_upstream_tokens, max_upstream_share, max_upstream_calls)


__all__ = ["LOCAL", "UPSTREAM", "Decision", "EntropyWindow", "Policy", "Route", "Router", "RoutingState", "Signal", "build_policy",
           "THRESHOLD_POLICIES"]
