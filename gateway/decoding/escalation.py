"""How a routed step asks the upstream: for how many tokens, held against the cost ceiling, and
whether it continues the answer or asks for the whole answer afresh.

A hand-off asks for up to the request's `span` tokens (the caps' headroom, where smaller); an
escalation (the price rule, or the cost ceiling with `on_ceiling: escalate`) asks for the rest of
the answer in one call, and the upstream writes it to the end. Every call is held against the
request's cost ceiling first: past it, the answer stays local from there (`on_ceiling: local`) or
escalates (`on_ceiling: escalate`, which may pass it).

An answer nobody has seen yet (`held`: the request does not stream) may be asked afresh: the
answer is thrown away and the upstream writes the whole answer in one call, as if asked directly;
if that call fails (or would pass the ceiling under `on_ceiling: local`) the local answer stands.
With `escalation: afresh` a held answer that escalates is asked afresh instead of continued: a small
model's opening lines can lead the large one astray (on GSM8K the upstream continuing them was
right on 7 of 26 escalated answers, asked afresh on 13). With `escalation: draft` a held answer
makes no hand-offs before it escalates (gateway/decoding/routing.py only counts them,
`draft_hand_offs`) and an escalation asks afresh; a hand-off made before a fresh answer replaces the
draft is money spent on text thrown away (on GSM8K 81 of 100 answers escalated). The exception is a
short answer's hand-offs, which a draft makes (policies/price.py): a draft holding them escalates by
continuing, so the text paid for is kept. The answer check asks afresh too (gateway/decoding/review.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from adapters.upstream import Continuations, Handoff
from gateway.decoding.answer import Answer
from gateway.decoding.handoffs import HandoffCalls
from gateway.decoding.values import LOCAL, DecodeRequest, RoutingUsage, Written
from gateway.traced import traced, wrote
from policies import Decision


@dataclass(frozen=True)
class Ask:
    """What a routed step asks of the upstream: `span` tokens, `held` (USD) against the cost ceiling
    until the call is settled; `to_limit`: all the answer's limit allows, uncut. Or instead the
    whole answer `afresh`, or nothing (`local`: past the ceiling, the step decodes locally)."""

    span: int
    held: float = 0.0
    to_limit: bool = False
    afresh: bool = False
    local: bool = False


class Escalation:
    """One request's asks of the upstream; `handoff` is the latest hand-off of its answer (a mode may
    carry what it needs from one hand-off to the next)."""

    def __init__(self, request: DecodeRequest, upstream: Continuations | None, calls: HandoffCalls,
                 usage: RoutingUsage, answer: Answer, handoff: Handoff | None) -> None:
        self._routing, self._choice = request.routing, request.choice
        self._handoffs, self._review = request.routing.handoffs, request.routing.review
        self._upstream, self._calls, self._usage = upstream, calls, usage
        self._answer, self.handoff = answer, handoff

    @property
    def escalates_afresh(self) -> bool:
        """An escalation asks afresh: the answer is held (nothing shown) and the request says so. A
        draft holding a short answer's hand-offs is continued instead, so text paid for is kept."""
        if not self._review.held:
            return False
        if self._review.escalation == "draft":
            return all(source == LOCAL for source in self._answer.sources)
        return self._review.escalation == "afresh"

    @property
    def span_until(self) -> str:
        """Where a hand-off's text is cut: the request's boundary, none once escalated (the rest is written whole)."""
        return "tokens" if self._usage.escalated else self._handoffs.span_until

    def ask(self, decision: Decision) -> Ask:
        """What the routed step `decision` asks: a hand-off of up to `decision.room` tokens (None: the
        request's span), or of the rest of the answer when it escalates (marked in usage)."""
        usage, rest, most = self._usage, self._answer.rest, self._handoffs.span
        escalating = decision.escalate and not usage.escalated
        room = most if decision.room is None else decision.room
        whole = usage.escalated or escalating  # the rest of the answer
        span = self._answer.handoff_span(max(1, rest if whole else min(most, rest, room)))
        if escalating and self.escalates_afresh:
            return Ask(span, afresh=True)
        self.handoff = self._upstream.with_answer(self.handoff, self._answer.text.text)
        held = self._hold(span)
        if held is None:
            if not self._routing.escalates_past_ceiling:
                return Ask(span, local=True)
            if self.escalates_afresh:
                return Ask(span, afresh=True)
            escalating, span, held = True, self._answer.handoff_span(max(1, rest)), 0.0  # held: none, past it
        usage.escalated = usage.escalated or escalating
        uncut = not self._answer.constrained and self.span_until == "tokens"
        return Ask(span, held, to_limit=uncut and span >= rest)

    def settle(self, held: float, billed_before: float) -> None:
        """Replace a call's hold on the cost ceiling by what it billed (usage's cost since `billed_before`)."""
        if self._routing.ceiling is not None:
            self._routing.ceiling.settle(held, self._usage.upstream_cost_usd - billed_before)

    @traced("gateway.escalation", wrote)
    async def afresh(self, bounded: bool = True) -> Written | None:
        """The upstream's answer to the prompt alone, in one call; the answer is emptied for it to be
        appended. None (the answer stands) when the call fails, is refused, or, if `bounded`, would
        pass the cost ceiling."""
        usage = self._usage
        handoff = self._upstream.with_answer(self.handoff, "")
        span = self._answer.handoff_span(self._answer.limit)
        hold = self._hold_afresh(handoff, span, bounded)
        if hold is None:
            return None
        billed_before = usage.upstream_cost_usd
        try:
            got = await self._calls.uncut(handoff, span)
        finally:
            self.settle(hold, billed_before)
        if got is None:
            return None
        usage.escalated = usage.afresh = True
        usage.discarded_tokens = len(self._answer.tokens)
        self.handoff = handoff
        self._answer.restart()
        return self._answer.kept(got)

    def _hold(self, span: int) -> float | None:
        """The worst case of a hand-off of `span`, held against the request's cost ceiling (0 with none,
        or once escalated under on_ceiling: escalate, which may pass it); None past it: the answer
        stays local from here (on_ceiling: local) and the reason is reported. An escalation may
        need more than one call (a grammar's shorter span, a call that failed), so the calls after
        it are held too."""
        routing = self._routing
        if not routing.capped_cost or (self._usage.escalated and routing.escalates_past_ceiling):
            return 0.0
        upstream = self._upstream  # held as if the call reads ahead (not where it writes to the limit or combines)
        unwritten = upstream.estimate_completion_tokens(self.handoff, span + upstream.read_ahead) - span
        held = routing.ceiling.hold(self._choice, self._answer.direct_length,
                                    upstream.estimate_prompt_tokens(self.handoff), span, unwritten)
        if held is None:
            self._usage.degrade("cost_ceiling")
            if not routing.escalates_past_ceiling:
                self._calls.closed = True
        return held

    def _hold_afresh(self, handoff: Handoff, span: int, bounded: bool) -> float | None:
        """The worst case of asking afresh, held against the cost ceiling; None past it if `bounded`
        (the answer stands at its length), else 0: past the ceiling, as on_ceiling: escalate allows."""
        ceiling = self._routing.ceiling
        if not self._routing.capped_cost:
            return 0.0
        hold = ceiling.hold(self._choice, 0, self._upstream.estimate_prompt_tokens(handoff), span)
        if hold is not None:
            return hold
        self._usage.degrade("cost_ceiling")
        if bounded:
            ceiling.note(self._choice, self._answer.direct_length)  # the answer stands
            return None
        return 0.0
