"""Escalation (mixed into Decoding): when a held answer is asked of the upstream whole.

An answer nobody has seen yet (`held`: the request does not stream) may be asked afresh: when the
request's answer check (policies/answer_check.py) rates the finished answer's chance of being
correct below `escalate_below`, the answer is thrown away and the upstream writes the whole answer
in one call, as if asked directly; if that call fails, the local answer stands. A check fitted on
answers' first K tokens (`at_tokens`) rates the answer as soon as it has them, so one asked afresh
is not finished locally first. With `escalation: afresh` a held answer that escalates (the price
rule, or the cost ceiling with `on_ceiling: escalate`) is asked afresh the same way instead of
continued: a small model's opening lines can lead the large one astray (on GSM8K the upstream
continuing them was right on 7 of 26 escalated answers, asked afresh on 13); if that call fails,
or would pass the ceiling under `on_ceiling: local`, the answer is finished locally. With
`escalation: draft` a held answer makes no hand-offs before it escalates: the local model drafts it,
each hand-off the policy wants is only counted (`draft_hand_offs`: the price rule's running rate
counts them as calls, the caps do not), and an escalation asks afresh; a hand-off made before a
fresh answer replaces the draft is money spent on text thrown away (on GSM8K 81 of 100 answers
escalated). The exception is a short answer's hand-offs, which a draft makes (policies/price.py):
a draft holding them escalates by continuing, so the text paid for is kept. An answer the upstream
finished by escalating is neither rated by the check nor asked afresh again. Every call is held
against the request's cost ceiling first.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from adapters.engine import Sequence
from gateway.decoding.text_stream import TextReleaser
from gateway.decoding.values import GRAMMAR_SPAN, LOCAL, Piece
from policies import Signal
from policies.agreement import AgreementCheck
from policies.answer_check import AnswerStats


class Escalation:
    """Decoding's escalations and cost-ceiling holds; they read and write its answer state."""

    @property
    def _upstream_finished(self) -> bool:
        """The upstream wrote the answer's end in an escalation (or the whole answer afresh)."""
        return self.usage.escalated and bool(self.sources) and self.sources[-1] != LOCAL

    @property
    def _escalates_afresh(self) -> bool:
        """An escalation asks afresh: the answer is held (nothing shown) and the request says so. A
        draft holding a short answer's hand-offs is continued instead, so text paid for is kept."""
        if not self.request.held:
            return False
        if self.request.escalation == "draft":
            return all(source == LOCAL for source in self.sources)
        return self.request.escalation == "afresh"

    @property
    def _drafts(self) -> bool:
        """The held answer is a local draft until it escalates: no hand-off is made before then."""
        return self.request.held and self.request.escalation == "draft" and not self.usage.escalated

    @property
    def _capped_cost(self) -> bool:
        """A cost ceiling is set: no warm-up call, whose prompt the first hand-off would pay again."""
        return self.request.ceiling is not None and self.request.ceiling.ratio is not None

    def _rating_due(self) -> bool:
        """Whether an unfinished answer has reached the tokens its check rates."""
        check = self.request.answer_check
        return (check is not None and check.at_tokens is not None and self.usage.answer_confidence is None
                and not self.usage.escalated and len(self.answer_tokens) >= check.at_tokens)

    async def _checked(self, sequence: Sequence, signals: list[Signal], held: bool) -> list[Piece] | None:
        """Rate the finished answer; if it is held and below the bar, ask the upstream afresh and
        return the fresh answer's pieces, else those of the sampled answer an agreement check kept
        in its place (answer: majority; None: the answer stands)."""
        check, kept = self.request.answer_check, None
        if isinstance(check, AgreementCheck):
            sampled = await self._samples.answers()
            replaceable = held and not self.request.logprobs  # the samples' tokens carry no logprobs
            index, confidence = check.kept(bytes(self.answer_bytes).decode("utf-8", "replace"),
                                           [text for text, _ in sampled], replaceable)
            if index:
                kept = [self._keep_sample(sampled[index - 1][1])]
            self.usage.samples, self.usage.agreement = check.samples, round(confidence, 4)
            self.usage.sample_tokens = self._samples.tokens
        else:
            confidence = check.confidence(AnswerStats.of(signals, len(self.answer_tokens), self.finish_reason))
        self.usage.answer_confidence = round(confidence, 4)
        below = self.request.escalate_below
        if not held or below is None or confidence >= below or self.calls.closed:
            return kept
        if not self.upstream.available:
            self.usage.degrade("upstream_unavailable")
            return kept
        return await self._afresh(sequence, signals[0] if signals else None) or kept

    def _keep_sample(self, sample: Any) -> Piece:
        """A sampled answer (the majority's) in place of the greedy one, which nobody has seen."""
        self.usage.majority = True
        self.answer_tokens, self.sources = list(sample.answer_tokens), [LOCAL] * len(sample.answer_tokens)
        self.answer_bytes = bytearray(sample.answer_bytes)
        self.finish_reason, self._end_token = sample.finish_reason, sample.ended_on_end_token
        self.text = TextReleaser(self.request.stop)
        return Piece(self.text.feed(bytes(self.answer_bytes)), tuple(self.answer_tokens), LOCAL, None)

    async def _afresh(self, sequence: Sequence, first: Signal | None, bounded: bool = True) -> list[Piece] | None:
        """The upstream's answer to the prompt alone, in one call, replacing the answer so far;
        None (the answer stands) when the call fails, is refused, or, if `bounded`, would pass the
        cost ceiling."""
        handoff = self.upstream.with_answer(self._handoff, "")
        span = self.limit if self._grammar is None else min(self.limit, GRAMMAR_SPAN)
        hold = 0.0
        sequence.pause()  # for the whole answer's call: the engine must not wait for this request
        if self._capped_cost:
            hold = self.request.ceiling.hold(self.request.choice, 0, self.upstream.estimate_prompt_tokens(handoff), span)
            if hold is None:
                self.usage.degrade("cost_ceiling")
                if bounded:
                    self.request.ceiling.note(self.request.choice, self._direct_length)  # the answer stands
                    return None
                hold = 0.0  # past the ceiling, as on_ceiling: escalate allows
        billed_before = self.usage.upstream_cost_usd
        try:
            got = await self.calls.uncut(handoff, span)
        finally:
            if self.request.ceiling is not None:
                self.request.ceiling.settle(hold, self.usage.upstream_cost_usd - billed_before)
        if got is None:
            return None
        self.usage.escalated = self.usage.afresh = True
        self._routed_guess = None  # a step of the answer it replaces
        self.usage.discarded_tokens = len(self.answer_tokens)
        self._handoff = handoff
        self.answer_tokens, self.sources, self.answer_bytes = [], [], bytearray()
        self.text, self.finish_reason, self._end_token = TextReleaser(self.request.stop), None, False
        self._upstream_count_extra = 0
        if self._grammar is not None:
            got = self._grammar_cut(*got)
        return [await self._append_upstream(sequence, *got, first, to_limit=self._grammar is None)]

    async def _escalated_afresh(self, sequence: Sequence, logits: np.ndarray, signal: Signal) -> list[Piece]:
        """The fresh answer that replaces this one, past the cost ceiling only under on_ceiling:
        escalate (as a continued escalation may pass it); where it cannot be had, this step and the
        rest of the answer decode locally, rather than the whole answer being asked again each step."""
        fresh = await self._afresh(sequence, signal, bounded=self.request.on_ceiling != "escalate")
        if fresh is not None:
            return fresh
        self.calls.closed = True
        return [await self._local_step(logits, signal)]

    def _hold_under_ceiling(self, span: int) -> float | None:
        """The worst case of this hand-off, held against the request's cost ceiling (0 with none,
        or once escalated under on_ceiling: escalate, which may pass it); None past it: the answer
        stays local from here (on_ceiling: local) and the reason is reported. An escalation may
        need more than one call (a grammar's shorter span, a call that failed), so the calls after
        it are held too."""
        ceiling = self.request.ceiling
        if not self._capped_cost or (self.usage.escalated and self.request.on_ceiling == "escalate"):
            return 0.0
        held = ceiling.hold(self.request.choice, self._direct_length,
                            self.upstream.estimate_prompt_tokens(self._handoff), span)
        if held is None:
            self.usage.degrade("cost_ceiling")
            if self.request.on_ceiling != "escalate":
                self.calls.closed = True
        return held

    @property
    def _direct_length(self) -> int:
        """The answer's tokens so far as asking the upstream directly would bill them: the upstream's
        own count of what it wrote for the rest of the answer in one call, the local count of the rest
        (a span's count would overstate it where its tokens re-merge with the local ones)."""
        return len(self.answer_tokens) + self._upstream_count_extra
