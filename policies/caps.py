"""Caps that wrap any policy: they can only turn an UPSTREAM decision into LOCAL."""

from __future__ import annotations

from dataclasses import dataclass

from policies.base import Policy, Route, RoutingState, Signal


@dataclass
class Capped:
    """Per-request caps on upstream answer tokens, upstream share and calls, and the budget left.

    `max_share` is checked against the share the answer would have if this step went upstream,
    so the cap holds at every point of the answer, not just at its end.
    """

    inner: Policy
    max_tokens: int | None = None
    max_share: float | None = None
    max_calls: int | None = None

    @property
    def name(self) -> str:
        return self.inner.name

    def decide(self, signal: Signal, state: RoutingState) -> Route:
        wanted = self.inner.decide(signal, state)
        if wanted is Route.UPSTREAM and self._allows(state):
            return Route.UPSTREAM
        return Route.LOCAL

    def _allows(self, state: RoutingState) -> bool:
        if self.max_tokens is not None and state.upstream_tokens >= self.max_tokens:
            return False
        if self.max_calls is not None and state.upstream_calls >= self.max_calls:
            return False
        if self.max_share is not None:
            share_after = (state.upstream_tokens + 1) / (state.answer_tokens + 1)
            if share_after > self.max_share:
                return False
        if state.budget_tokens_left is not None and state.handoff_cost_tokens > state.budget_tokens_left:
            return False
        return True
