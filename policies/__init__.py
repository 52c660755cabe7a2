"""Routing policies: small values with no I/O that decide, per decoding step, where it goes (a Decision)."""

from __future__ import annotations

from policies.base import LOCAL, UPSTREAM, Decision, Policy, Route, RoutingState, Signal
from policies.caps import Capped
from policies.learned import FirstTokens, LearnedAbove, LearnedShare, Router
from policies.price import PriceAware
from policies.target_fraction import TargetFraction
from policies.thresholds import Always, EntropyAbove, MarginBelow, Never, Top1Below
from policies.window import RecentValues, SharedWindows

THRESHOLD_POLICIES = {"entropy": EntropyAbove, "top1": Top1Below, "margin": MarginBelow}


def build_policy(
    name: str,
    threshold: float | None = None,
    target_fraction: float | None = None,
    max_upstream_tokens: int | None = None,
    max_upstream_share: float | None = None,
    max_upstream_calls: int | None = None,
    windows: SharedWindows | None = None,
    router: Router | None = None,
    threshold_from: str = "router",
    answer_value: float | None = None,
    early_escalation: bool = True,
) -> Policy:
    """A fresh policy for one request, wrapped in its caps.

    `windows` hold the recent values that target_fraction (entropies) and learned with
    `threshold_from` "traffic" (router scores) calibrate on; pass the same ones to every request of
    a tenant on an alias so thresholds are calibrated on more than one short answer. `learned`
    needs `router` and a score `threshold`, or a `target_fraction`: `threshold_from` "router" turns
    it into the router's threshold fitted for that share (RouterError outside the fitted shares),
    "traffic" into the quantile of the scores in the window (policies.learned.LearnedShare).
    `first` routes the first `threshold` answer tokens.
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
        if threshold_from not in ("router", "traffic"):
            raise ValueError(f"threshold_from is 'router' or 'traffic', not {threshold_from!r}")
        if threshold is not None:
            inner = LearnedAbove(router, threshold)
        elif threshold_from == "traffic":
            fitted = sorted(router.shares)  # until the window fills: the nearest fitted share's threshold
            start = router.threshold_for_share(min(max(target_fraction, fitted[0]), fitted[-1]))
            inner = LearnedShare(router, target_fraction, (windows or SharedWindows()).scores, start)
        else:
            inner = LearnedAbove(router, router.threshold_for_share(target_fraction))
    elif name == "first":
        inner = FirstTokens(int(threshold))
    elif name == "target_fraction":
        inner = TargetFraction(target_fraction, (windows or SharedWindows()).entropies)
    else:
        raise ValueError(f"unknown routing policy {name!r}")
    if answer_value is not None:
        inner = PriceAware(inner, answer_value, escalate=early_escalation)
    return Capped(inner, max_upstream_tokens, max_upstream_share, max_upstream_calls)


__all__ = ["LOCAL", "UPSTREAM", "Decision", "Policy", "RecentValues", "Route", "Router", "RoutingState", "Signal",
           "SharedWindows", "build_policy", "THRESHOLD_POLICIES"]
