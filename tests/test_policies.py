"""Routing policies: small values with no I/O, tested on synthetic signal streams."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from pydantic import ValidationError

from gateway.settings import RoutingOverride, RoutingSettings
from gateway.tenancy.routing import policy_of, resolve_routing
from gateway.wire.errors import InvalidRequest
from policies import (
    LOCAL,
    POLICIES,
    UPSTREAM,
    Decision,
    Needs,
    PolicyEntry,
    Route,
    RoutingState,
    SharedWindows,
    Signal,
    build_policy,
)
from policies.base import PolicyDefaults


def signal(entropy: float = 1.0, top1: float = 0.5, margin: float = 0.2, position: int = 0) -> Signal:
    return Signal(entropy=entropy, top1=top1, margin=margin, position=position)


@pytest.mark.parametrize(
    ("name", "threshold", "routed", "kept"),
    [
        ("entropy", 1.0, signal(entropy=1.5), signal(entropy=0.5)),
        ("top1", 0.6, signal(top1=0.4), signal(top1=0.9)),
        ("margin", 0.3, signal(margin=0.1), signal(margin=0.8)),
    ],
)
def test_threshold_policies_route_on_their_signal(name, threshold, routed, kept):
    policy = build_policy(name, threshold=threshold)
    assert policy.decide(routed, RoutingState()).upstream
    assert policy.decide(kept, RoutingState()).route is Route.LOCAL


@dataclass
class EveryNth(PolicyDefaults):
    """A policy a test registers: route every `n`-th answer token."""

    n: int
    name: str = "every_nth"

    def decide(self, signal: Signal, state: RoutingState) -> Decision:
        return UPSTREAM if signal.position % self.n == 0 else LOCAL


def test_a_policy_registered_in_one_place_is_usable_by_name(monkeypatch):
    entry = PolicyEntry("every_nth", lambda args: EveryNth(int(args.threshold)), (Needs(("threshold",), "threshold"),))
    monkeypatch.setitem(POLICIES, entry.name, entry)
    policy = build_policy("every_nth", threshold=3, max_upstream_calls=1)
    assert [policy.decide(signal(position=p), RoutingState()).upstream for p in range(4)] == [True, False, False, True]
    assert policy.decide(signal(position=3), RoutingState(upstream_calls=1)).vetoed == "cap"  # wrapped in its caps
    with pytest.raises(ValidationError, match="policy 'every_nth' needs threshold"):
        RoutingSettings(policy="every_nth")
    alias = RoutingSettings(policy="never")
    with pytest.raises(InvalidRequest) as refused:
        resolve_routing(alias, RoutingOverride(policy="every_nth"))
    assert refused.value.param == "routing.threshold"
    routing = resolve_routing(alias, RoutingOverride(policy="every_nth", threshold=2))
    assert policy_of(routing, None, SharedWindows()).decide(signal(position=2), RoutingState()).upstream
    monkeypatch.delitem(POLICIES, "every_nth")
    with pytest.raises(ValueError, match="unknown routing policy 'every_nth'"):
        build_policy("every_nth", threshold=2)
    with pytest.raises(ValidationError):
        RoutingOverride(policy="every_nth")


def test_never_and_always_ignore_the_signal():
    for value in (0.0, 5.0):
        assert build_policy("never").decide(signal(entropy=value), RoutingState()).route is Route.LOCAL
        assert build_policy("always").decide(signal(entropy=value), RoutingState()).upstream


def test_caps_veto_upstream():
    state = RoutingState(answer_tokens=10, upstream_tokens=3, upstream_calls=3)
    assert build_policy("always", max_upstream_tokens=3).decide(signal(), state).route is Route.LOCAL
    assert build_policy("always", max_upstream_tokens=4).decide(signal(), state).upstream
    assert build_policy("always", max_upstream_share=0.3).decide(signal(), state).route is Route.LOCAL  # 4/11 > 0.3
    assert build_policy("always", max_upstream_share=0.4).decide(signal(), state).upstream
    assert build_policy("always", max_upstream_calls=3).decide(signal(), state).route is Route.LOCAL


@pytest.mark.parametrize("answer, upstream", [(0, 0), (10, 3), (37, 5), (100, 40)])
@pytest.mark.parametrize("share", [0.1, 0.25, 0.5])
def test_room_is_the_most_tokens_the_share_cap_allows(answer, upstream, share):
    room = build_policy("always", max_upstream_share=share).room(RoutingState(answer, upstream))
    assert (upstream + room) / (answer + room or 1) <= share + 1e-12 or room == 0
    assert (upstream + room + 1) / (answer + room + 1) > share  # one more would break it


def test_room_takes_the_tightest_cap_and_none_without_token_caps():
    state = RoutingState(answer_tokens=10, upstream_tokens=3)
    assert build_policy("always", max_upstream_tokens=5, max_upstream_share=0.9).room(state) == 2
    assert build_policy("always", max_upstream_calls=2).room(state) is None


def test_a_capped_decision_says_why_it_was_vetoed_and_how_far_it_may_go():
    broke = RoutingState(answer_tokens=10, upstream_tokens=3, budget_tokens_left=99, handoff_cost_tokens=100)
    assert build_policy("always").decide(signal(), broke).vetoed == "budget"
    assert build_policy("always", max_upstream_tokens=3).decide(signal(), broke).vetoed == "cap"
    granted = build_policy("always", max_upstream_tokens=5).decide(signal(), RoutingState(10, 3))
    assert granted.upstream and granted.room == 2 and granted.vetoed is None
    assert build_policy("always").decide(signal(), RoutingState(10, 3)).room is None  # no token cap: the span


def test_policies_declare_what_the_decoder_needs():
    assert not build_policy("never").routes and build_policy("entropy", threshold=1.0).routes
    assert not build_policy("always").wants_warm_up and build_policy("top1", threshold=0.5).wants_warm_up
    assert not build_policy("margin", threshold=0.1).detailed_signal


def test_budget_left_is_a_hard_cap():
    policy = build_policy("always")
    assert policy.decide(signal(), RoutingState(budget_tokens_left=99, handoff_cost_tokens=100)).route is Route.LOCAL
    assert policy.decide(signal(), RoutingState(budget_tokens_left=100, handoff_cost_tokens=100)).upstream
    assert policy.decide(signal(), RoutingState(budget_tokens_left=None, handoff_cost_tokens=10**9)).upstream


def run_target(target: float, entropies: np.ndarray) -> tuple[float, list[float], list[float]]:
    """Feed a stream to target_fraction as the decoder would; return share, routed and kept."""
    policy = build_policy("target_fraction", target_fraction=target)
    upstream, routed, kept = 0, [], []
    for position, value in enumerate(entropies):
        state = RoutingState(answer_tokens=position, upstream_tokens=upstream)
        if policy.decide(signal(entropy=float(value), position=position), state).upstream:
            upstream += 1
            routed.append(value)
        else:
            kept.append(value)
    return upstream / len(entropies), routed, kept


@pytest.mark.parametrize("target", [0.05, 0.2, 0.5])
def test_target_fraction_tracks_target_through_a_level_shift(target):
    rng = np.random.default_rng(7)
    calm = rng.gamma(shape=2.0, scale=0.3, size=600)  # mean entropy 0.6 nats
    stormy = rng.gamma(shape=2.0, scale=1.2, size=600) + 1.0  # mean 3.4 nats
    share, routed, kept = run_target(target, np.concatenate([calm, stormy]))
    assert abs(share - target) <= 0.03, share
    assert np.mean(routed) > np.mean(kept)
    # within each regime too, what it routes is more uncertain than what it keeps
    half_share, half_routed, half_kept = run_target(target, calm)
    assert abs(half_share - target) <= 0.03 and np.mean(half_routed) > np.mean(half_kept)


@pytest.mark.parametrize("target", [0.1, 0.25])
def test_target_fraction_holds_over_many_short_answers_with_a_shared_window(target):
    """Short answers (CommonsenseQA-like, 6 tokens) each get a fresh policy but share the window."""
    rng = np.random.default_rng(3)
    windows = SharedWindows()
    routed = total = 0
    for _ in range(300):
        policy = build_policy("target_fraction", target_fraction=target, windows=windows)
        upstream = 0
        for position, value in enumerate(rng.gamma(2.0, 0.6, size=6)):
            state = RoutingState(answer_tokens=position, upstream_tokens=upstream)
            if policy.decide(signal(entropy=float(value), position=position), state).upstream:
                upstream += 1
        routed, total = routed + upstream, total + 6
    assert abs(routed / total - target) <= 0.03, routed / total
