"""Routing policies: small values with no I/O that decide, per decoding step, where it goes (a Decision)."""

from __future__ import annotations

from policies.base import LOCAL, UPSTREAM, Decision, Needs, Policy, PolicyArgs, PolicyEntry, Route, RoutingState, Signal
from policies.caps import Capped
from policies.learned import Router
from policies.price import PriceAware
from policies.registry import POLICIES
from policies.thresholds import EntropyAbove, MarginBelow, Top1Below
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
    """A fresh policy for one request: the one registered as `name` (policies.registry; ValueError
    for a name none is), price-aware with `answer_value` (policies.price; None leaves decisions
    blind to price), wrapped in its caps.

    `windows` hold the recent values that target_fraction (entropies) and learned with
    `threshold_from` "traffic" (router scores) calibrate on; pass the same ones to every request of
    a tenant on an alias so thresholds are calibrated on more than one short answer. What a policy
    reads of `threshold`, `target_fraction`, `threshold_from` and `router` is said beside its
    entry (learned: policies.learned.build_learned; `first` routes the first `threshold` tokens).
    """
    entry = POLICIES.get(name)
    if entry is None:
        raise ValueError(f"unknown routing policy {name!r}")
    inner = entry.build(PolicyArgs(threshold, target_fraction, threshold_from, router, windows))
    if answer_value is not None:
        inner = PriceAware(inner, answer_value, escalate=early_escalation)
    return Capped(inner, max_upstream_tokens, max_upstream_share, max_upstream_calls)


__all__ = ["LOCAL", "UPSTREAM", "Decision", "Needs", "POLICIES", "Policy", "PolicyArgs", "PolicyEntry", "RecentValues",
           "Route", "Router", "RoutingState", "Signal", "SharedWindows", "build_policy", "THRESHOLD_POLICIES"]
