"""Caps that wrap any policy: they can only turn an UPSTREAM decision into LOCAL."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from policies.base import Decision, Policy, Route, RoutingState, Signal, Wrapping


@dataclass(frozen=True)
class Capped(Wrapping):
    """Per-request caps on upstream answer tokens, upstream share and calls, and the budget left.

    `max_share` is checked against the share the answer would have if this step went upstream,
    so the cap holds at every point of the answer, not just at its end. An upstream decision
    carries `room`, how many tokens the hand-off may write under the caps (a span does not
    overshoot them either); a vetoed one says which kind of cap turned it local ("cap" or
    "budget"), so the caller can report a budget that ran out.
    """

    inner: Policy
    max_tokens: int | None = None
    max_share: float | None = None
    max_calls: int | None = None

    def decide(self, signal: Signal, state: RoutingState) -> Decision:
        wanted = self.inner.decide(signal, state)
        if not wanted.upstream:
            return wanted
        vetoed = self._veto(state)
        if vetoed:
            return Decision(Route.LOCAL, vetoed=vetoed)
        room = self.room(state)  # an escalation past a token or share cap is one hand-off up to it
        return dataclasses.replace(wanted, room=room, escalate=wanted.escalate and room is None)

    def room(self, state: RoutingState) -> int | None:
        """How many upstream tokens the token and share caps allow from this step on, counting each
        as an answer token too (None: no such cap)."""
        rooms = []
        if self.max_tokens is not None:
            rooms.append(self.max_tokens - state.upstream_tokens)
        if self.max_share is not None and self.max_share < 1:
            # largest k with (upstream + k) / (answer + k) <= max_share
            rooms.append(math.floor((self.max_share * state.answer_tokens - state.upstream_tokens)
                                    / (1 - self.max_share) + 1e-9))
        return max(0, min(rooms)) if rooms else None

    def _veto(self, state: RoutingState) -> str | None:
        if self.max_tokens is not None and state.upstream_tokens >= self.max_tokens:
            return "cap"
        if self.max_calls is not None and state.upstream_calls >= self.max_calls:
            return "cap"
        if self.max_share is not None and (state.upstream_tokens + 1) / (state.answer_tokens + 1) > self.max_share:
            return "cap"
        if state.budget_tokens_left is not None and state.handoff_cost_tokens > state.budget_tokens_left:
            return "budget"
        return None
