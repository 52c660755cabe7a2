"""The collaborative decoder: a small local model writes every token, uncertain steps go upstream.

Per step: local logits -> signal -> policy decision -> token(s) -> piece. A LOCAL step samples
from the local model. An UPSTREAM step hands the partial answer to the large model
(gateway/decoding/handoffs.py), which writes up to `span` tokens of text; that text is re-tokenized
with the local tokenizer and appended (rewinding to the common prefix where the boundary re-merges),
and local decoding carries on. A failed or refused hand-off decodes the step locally instead.
Each request decodes on a sequence of its own in the local model's batched engine; while a greedy
request's hand-off is in flight it guesses ahead (guessing.py), and a held answer may be asked of the
upstream whole (escalation.py).

A request's penalties and logit_bias adjust the local logits before anything reads them. Under a
grammar (`response_format` JSON) every local token is one the grammar allows, an upstream span is
kept only as far as the grammar accepts it (a step whose span it refuses entirely decodes locally),
and the answer ends only where the grammar is complete.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator

import numpy as np

from adapters.engine import Sequence
from adapters.grammar import Grammar
from adapters.local_model import LocalModel
from adapters.upstream import Continuations, Handoff
from gateway.decoding.agreement_samples import AgreementSamples
from gateway.decoding.appending import Appending
from gateway.decoding.escalation import Escalation
from gateway.decoding.guessing import Guessing
from gateway.decoding.handoffs import Gate, HandoffCalls
from gateway.decoding.signals import log_softmax, sample, signal_of, token_kind
from gateway.decoding.text_stream import TextReleaser
from gateway.decoding.values import (
    CACHE,
    GRAMMAR_SPAN,
    GUESS_LIMIT,
    LOCAL,
    UPSTREAM,
    DecodeRequest,
    Guess,
    Piece,
    RoutingUsage,
    TokenLogprob,
)
from policies import LOCAL as LOCAL_STEP
from policies import UPSTREAM as UPSTREAM_STEP
from policies import Decision, RoutingState, Signal
from policies.agreement import AgreementCheck

__all__ = ["GUESS_LIMIT", "DecodeRequest", "Decoding", "Piece", "TokenLogprob"]


class Decoding(Escalation, Guessing, Appending):
    """One request's decoding. Iterate `pieces()` once; then read `finish_reason` and usage."""

    def __init__(self, local: LocalModel, upstream: Continuations | None, gate: Gate,
                 request: DecodeRequest, prompt_tokens: list[int] | None = None) -> None:
        """Blocking (the prompt is rendered and tokenized, unless `prompt_tokens` are given): build
        it off the event loop."""
        self.local, self.upstream, self.gate, self.request = local, upstream, gate, request
        if prompt_tokens is None:
            parts = [(request.prompt, True)] if request.prompt is not None else \
                local.template.render_parts(request.messages, request.continue_final)
            prompt_tokens = local.tokenize_prompt(parts)
        self.prompt_tokens: list[int] = prompt_tokens
        self.limit = min(request.max_tokens, local.n_ctx - len(self.prompt_tokens))  # answer tokens
        self.answer_tokens: list[int] = []
        self.sources: list[str] = []  # where each answer token came from
        self.answer_bytes = bytearray()
        self.text = TextReleaser(request.stop)
        self.usage = RoutingUsage(policy=request.policy.name)
        self.finish_reason: str | None = None
        self._end_token = False  # the answer ended on the model's end-of-generation token, which a direct call bills
        # the upstream's count of the text it wrote for the rest of the answer in one call, less the local
        # tokens that text became: asking directly bills the upstream's count, so the cost ceiling uses it
        self._upstream_count_extra = 0
        # OpenAI's seed is any 64-bit integer; numpy's seeds are non-negative
        self._rng = np.random.default_rng(None if request.seed is None else request.seed % 2**64)
        self._handoff = self._first_handoff(upstream, request, gate.cache_scope)
        self.calls = HandoffCalls(upstream, gate, self.usage, request, closed=self._handoff is None)
        if request.ceiling is not None and self._handoff is not None and not request.ceiling.prompt_tokens:
            request.ceiling.prompt_tokens = upstream.estimate_prompt_tokens(self._handoff)
        self._kind_of = self._token_kind if request.policy.detailed_signal else None
        # the per-step prices are worked out only for a policy that weighs them, and need the ceiling's prompt count
        self._reads_prices = request.policy.reads_prices and request.ceiling is not None
        self._hidden: np.ndarray | None = None  # the latest forward's hidden state
        self._routed_guess: Guess | None = None  # a guessed step the policy routed: the next step, decided already
        self._grammar: Grammar | None = local.grammar(request.grammar) if request.grammar else None
        self._samples = AgreementSamples(request, request.answer_check, self._sampled) \
            if isinstance(request.answer_check, AgreementCheck) else None

    def _sampled(self, request: DecodeRequest) -> "Decoding":
        """A local-only decoding of this prompt for the agreement check (see AgreementSamples)."""
        return Decoding(self.local, None, self.gate, request, self.prompt_tokens)

    @staticmethod
    def _first_handoff(upstream: Continuations | None, request: DecodeRequest, scope: str) -> Handoff | None:
        """The request's hand-off of an empty answer; None without an upstream, or for raw text
        when the upstream continues chats only."""
        if upstream is None:
            return None
        if request.prompt is not None:
            return upstream.text_handoff(request.prompt, scope)
        return upstream.handoff(request.messages, request.continue_final, scope)

    def source_counts(self) -> dict[str, int]:
        return {name: self.sources.count(name) for name in (LOCAL, UPSTREAM, CACHE)}

    @property
    def ended_on_end_token(self) -> bool:
        """Whether the answer ended on the model's end-of-generation token (a direct call bills it)."""
        return self._end_token

    async def pieces(self) -> AsyncIterator[Piece]:
        """The answer, piece by piece; the last piece releases any text still held back.

        Decoding advances as this is iterated; the HTTP layer drains it in a task of its own
        (`gateway.decoding.streams.merged`) so that a slow client never holds up the engine's batch."""
        if self.upstream is not None and not self.gate.allowed:  # settled at admission
            self.calls.closed = True
            self.usage.degrade(self.gate.refusal)
        elif self.upstream is not None and self._handoff is None and self.request.policy.routes:
            self.usage.degrade("upstream_continues_chats_only")  # raw text, and a chat-mode upstream
        if self._may_route() and self.upstream.warms and self.request.policy.wants_warm_up and not self._capped_cost \
                and not self._drafts:
            self.calls.warm_up(self._handoff)
        if self._samples is not None:
            self._samples.start()
        check = self.request.answer_check
        # shown once checked, or once finished when an escalation may replace it
        held: list[Piece] | None = [] if self.request.held and (check or self._escalates_afresh) else None
        signals: list[Signal] = []  # what the check rates
        try:
            while True:
                async with self.local.sequence(self.prompt_tokens, self.gate.cache_scope,
                                               hidden=self.request.policy.reads_hidden,
                                               speculate=self.request.sampling.greedy,
                                               claim=self.request.claim) as sequence:
                    while True:
                        while self.finish_reason is None and not self._rating_due():
                            answered_afresh = self.usage.afresh
                            pieces = await self._step(sequence)
                            if self.usage.afresh and not answered_afresh:  # the step replaced the answer
                                held, signals = [], []
                            for piece in pieces:
                                if check is not None and piece.signal is not None:
                                    signals.append(piece.signal)
                                if held is None:
                                    yield piece
                                else:
                                    held.append(piece)
                        if check is None or self.usage.answer_confidence is not None or self._upstream_finished:
                            break  # no check, rated already, or the upstream's answer: the answer is finished
                        if self._samples is not None and not self._samples.finished:
                            break  # wait for them below, holding no sequence: they may need its slot
                        fresh = await self._checked(sequence, signals, held is not None)
                        if fresh is not None:
                            held = fresh
                        # and round again: an answer rated early decodes on (so does a fresh answer a grammar cut short)
                if self._samples is None or self._samples.finished or self.usage.answer_confidence is not None:
                    break
                await self._samples.wait()  # then rated (and perhaps asked afresh) on a sequence taken anew
            for piece in held or ():
                yield piece
        finally:
            if self.request.ceiling is not None:  # the answer's length as a direct call bills it, for cost_ratio
                self.request.ceiling.note(self.request.choice, self._direct_length + self._end_token)
            if self.request.answer_lengths is not None and self.finish_reason is not None:
                self.request.answer_lengths.add(len(self.answer_tokens))
            await self.calls.end()
            if self._samples is not None:
                await self._samples.end()
            if self._grammar is not None:
                self._grammar.close()
        tail = self.text.finish()
        if tail:
            yield Piece(tail, (), self.sources[-1] if self.sources else LOCAL, None)

    async def _step(self, sequence: Sequence) -> list[Piece]:
        if self._routed_guess is not None:  # decided once: a policy's window must see each step once
            guess, self._routed_guess = self._routed_guess, None
            return await self._upstream_step(sequence, guess.logits, guess.signal, guess.decision)
        logits = await self._forward(sequence, self.answer_tokens)
        signal = self._signal(logits, len(self.answer_tokens))
        decision = self._decide(signal)
        if decision.upstream:
            return await self._upstream_step(sequence, logits, signal, decision)
        return [await self._local_step(logits, signal)]

    async def _forward(self, sequence: Sequence, answer: list[int]) -> np.ndarray:
        """Next-token logits after `answer`, with the request's penalties and logit_bias applied."""
        logits = await sequence.forward(self.prompt_tokens + answer)
        self._hidden = sequence.hidden  # the next _signal's (None unless the policy reads_hidden)
        return self.request.rules.apply(logits, answer) if self.request.rules.active else logits

    def _signal(self, logits: np.ndarray, position: int) -> Signal:
        return signal_of(logits, position, self._kind_of, self._hidden)

    def _token_kind(self, token: int) -> str:
        return token_kind(self.local.token_bytes(token))

    def _may_route(self) -> bool:
        return not self.calls.closed and self.request.policy.routes and self.upstream.available

    # -- one step --

    def _state(self) -> RoutingState:
        answered = len(self.answer_tokens)
        state = RoutingState(
            answer_tokens=answered,
            upstream_tokens=answered - self.sources.count(LOCAL),
            upstream_calls=self.usage.upstream_calls,
            drafted_calls=self.usage.draft_hand_offs,
            budget_tokens_left=self.gate.tokens_left(),
            handoff_cost_tokens=len(self.prompt_tokens) + answered + self.request.span,
        )
        return self._priced(state) if self._reads_prices and not self.calls.closed else state

    def _priced(self, state: RoutingState) -> RoutingState:
        """The state with the next hand-off's predicted prices. The hand-off's prompt is counted as
        the upstream's count of the request's prompt plus the answer's local tokens (no second
        tokenization per step), and at least the previous call's, whose prefix the provider's
        cache may read; a warm-up in flight has paid for reading the prompt into it already (the
        hand-off waits for it), so decisions weigh what is left to pay. The answer is expected to
        run as long as recent answers that ran longer than it has (the limit, before there are any):
        priced at the limit, a short answer's direct price is inflated several times over, and with
        it what a hand-off may cost and how many more the rest of the answer seems to need."""
        prices, prompt = self.upstream.prices, self.request.ceiling.prompt_tokens
        reused = max(self.calls.reusable_tokens, prompt if self.calls.warming is not None else 0)
        call_prompt, rest = max(prompt + state.answer_tokens, reused), self._expected_rest(state.answer_tokens)
        return dataclasses.replace(
            state, rest_tokens=rest,
            handoff_price_usd=prices.predicted(call_prompt, self.request.span, reused),
            direct_price_usd=prices.direct(prompt, state.answer_tokens + rest),
            rest_price_usd=prices.predicted(call_prompt, rest, reused))

    def _expected_rest(self, answered: int) -> int:
        """Answer tokens still to come: on average, what recent answers longer than `answered` wrote
        past it, within the limit; all the limit allows when there are none."""
        allowed = self.limit - answered
        lengths = self.request.answer_lengths
        excess = None if lengths is None else lengths.mean_excess(answered)  # None too while none ran longer
        return allowed if excess is None else min(allowed, max(1, round(excess)))

    def _decide(self, signal: Signal) -> Decision:
        if self.usage.escalated and not self.calls.closed and not self.text.mid_character:
            return UPSTREAM_STEP  # the upstream writes the rest
        wanted = self.request.policy.decide(signal, self._state())
        if wanted.vetoed == "budget" and not self.calls.closed:
            self.usage.degrade("budget_exhausted")
        elif wanted.vetoed == "price" and self._may_route():
            self.usage.price_vetoes += 1
        if not wanted.upstream or self.calls.closed or self.text.mid_character:
            return LOCAL_STEP
        if not self.upstream.available:
            self.usage.degrade("upstream_unavailable")
            return LOCAL_STEP
        if self._drafts and not (wanted.escalate or wanted.decisive):
            self.usage.draft_hand_offs += 1
            if self._reads_prices:  # priced on as if made: the next call would extend this one's prefix
                self.calls.reusable_tokens = self.request.ceiling.prompt_tokens + len(self.answer_tokens)
            return LOCAL_STEP
        return wanted

    async def _local_step(self, logits: np.ndarray, signal: Signal) -> Piece:
        token = sample(logits, self.request.sampling, self._rng)
        if self._grammar is not None and not self._grammar.allows(self.answer_tokens, token):
            # Resampling from the masked logits draws exactly from the grammar's distribution.
            logits = await asyncio.to_thread(self._grammar.mask, self.answer_tokens, logits)
            if not np.isfinite(logits).any():  # the grammar allows nothing more, not even an end
                self.finish_reason = "stop"
                return Piece("", (), LOCAL, signal)
            token = sample(logits, self.request.sampling, self._rng)
        return self._accept(token, logits, signal)

    def _accept(self, token: int, logits: np.ndarray, signal: Signal) -> Piece:
        """Append a local token (or finish on an end-of-generation token)."""
        if self.local.is_end_of_generation(token):
            self.finish_reason, self._end_token = "stop", True
            return Piece("", (), LOCAL, signal)
        logprobs = (self._logprob(logits, token),) if self.request.logprobs else ()
        self.answer_tokens.append(token)
        self.sources.append(LOCAL)
        data = self.local.token_bytes(token)
        self.answer_bytes += data
        text = self.text.feed(data)
        self._check_end()
        return Piece(text, (token,), LOCAL, signal, logprobs)

    async def _upstream_step(self, sequence: Sequence, logits: np.ndarray, signal: Signal,
                             decision: Decision) -> list[Piece]:
        """A hand-off of up to `decision.room` tokens (the caps' headroom; None: the request's
        span), or of the rest of the answer when it escalates."""
        rest = self.limit - len(self.answer_tokens)
        escalating = decision.escalate and not self.usage.escalated
        room = self.request.span if decision.room is None else decision.room
        span = max(1, rest if self.usage.escalated or escalating else min(self.request.span, rest, room))
        if self._grammar is not None:
            span = min(span, GRAMMAR_SPAN)
        if escalating and self._escalates_afresh:
            return await self._escalated_afresh(sequence, logits, signal)
        self._handoff = self.upstream.with_answer(self._handoff, self.text.text)
        held = self._hold_under_ceiling(span)
        if held is None:
            if self.request.on_ceiling != "escalate":
                return [await self._local_step(logits, signal)]
            if self._escalates_afresh:
                return await self._escalated_afresh(sequence, logits, signal)
            escalating = True
            span = max(1, rest if self._grammar is None else min(rest, GRAMMAR_SPAN))
        self.usage.escalated = self.usage.escalated or escalating
        billed_before = self.usage.upstream_cost_usd
        sent = time.monotonic()
        call = asyncio.ensure_future(self.calls.timed(self._handoff, span, self._span_until, sent))
        try:
            guesses = await self._guess(sequence, logits, signal, call, sent)
            got = await call
        except BaseException:
            call.cancel()
            raise
        finally:
            if self.request.ceiling is not None:
                self.request.ceiling.settle(held or 0.0, self.usage.upstream_cost_usd - billed_before)
        before = list(self.answer_tokens)
        if got is not None and self._grammar is not None:
            got = self._grammar_cut(*got)
        if got is None or (not got.text and not got.finished):
            pieces = [await self._local_step(logits, signal)]
        else:
            uncut = self._grammar is None and self._span_until == "tokens"
            pieces = [await self._append_upstream(sequence, *got, signal, to_limit=uncut and span >= rest)]
        return pieces + self._keep_guesses(before, guesses)

    @property
    def _span_until(self) -> str:
        """Where a hand-off's text is cut: the request's boundary, none once escalated (the rest is written whole)."""
        return "tokens" if self.usage.escalated else self.request.span_until

    # -- helpers --

    def _check_end(self) -> None:
        if self.finish_reason is not None:
            return
        if self.text.stopped:
            self.finish_reason = "stop"
        elif len(self.answer_tokens) >= self.limit:
            self.finish_reason = "length"

    def _logprob(self, logits: np.ndarray, token: int) -> TokenLogprob:
        logp = log_softmax(logits)
        k = self.request.top_logprobs
        top = np.argpartition(-logp, k)[:k] if k else np.array([], dtype=int)
        top = top[np.argsort(-logp[top])]
        entries = tuple((int(t), self.local.token_bytes(int(t)), float(logp[t])) for t in top)
        return TokenLogprob(token, self.local.token_bytes(token), float(logp[token]), entries)

    async def _score(self, sequence: Sequence, first: int) -> tuple[TokenLogprob, ...]:
        """The local model's logprobs for answer tokens from `first` on (written upstream)."""
        scored = []
        for index in range(first, len(self.answer_tokens)):
            logits = await self._forward(sequence, self.answer_tokens[:index])
            scored.append(self._logprob(logits, self.answer_tokens[index]))
        return tuple(scored)
