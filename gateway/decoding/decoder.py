"""The collaborative decoder: a small local model writes every token, uncertain steps go upstream.

Per step: local logits -> signal -> policy decision -> token(s) -> piece. A LOCAL step samples
from the local model. An UPSTREAM step hands the partial answer to the large model, which
writes up to `span` tokens of text; that text is re-tokenized with the local tokenizer and
appended (rewinding to the common prefix where the boundary re-merges), and local decoding
carries on. A failed or refused hand-off decodes the step locally instead.

Each request decodes on a sequence of its own in the local model's batched engine. While a greedy request's hand-off is in flight it keeps decoding
the local model's own greedy guess; if the upstream writes what the guess began with, the rest of
the guess is kept (each kept step still passes the policy, as it would have in turn, and the first
it routes is handed off as decided, with no second forward or decision), otherwise it is dropped
and the next forward rewinds the sequence.

A request's penalties and logit_bias adjust the local logits before anything reads them. Under a
grammar (`response_format` JSON) every local token is one the grammar allows, an upstream span is
kept only as far as the grammar accepts it (a step whose span it refuses entirely decodes locally),
and the answer ends only where the grammar is complete; guessing ahead is off.

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
escalated). An answer the upstream finished by escalating is neither rated by the check nor asked
afresh again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from adapters.engine import Sequence, common_prefix
from adapters.grammar import Grammar
from adapters.local_model import LocalModel
from adapters.store import Billed
from adapters.upstream import (
    Continuation,
    Continuations,
    Handoff,
    UpstreamBusy,
    UpstreamRejected,
    UpstreamUnavailable,
)
from gateway.admission.budget import HandoffGate
from gateway.decoding.cost_ceiling import CostCeiling
from gateway.decoding.logit_rules import LogitRules
from gateway.decoding.signals import Sampling, log_softmax, sample, signal_of, token_kind
from gateway.decoding.spans import cut_span
from gateway.decoding.text_stream import TextReleaser
from policies import LOCAL as LOCAL_STEP
from policies import UPSTREAM as UPSTREAM_STEP
from policies import Decision, Policy, RecentValues, RoutingState, Signal
from policies.answer_check import AnswerCheck, AnswerStats

LOCAL, UPSTREAM, CACHE = "local", "upstream", "cache"
GUESS_LIMIT = 8  # most local tokens guessed ahead while a hand-off is in flight
RETOKENIZED_TAIL = 8  # answer tokens re-tokenized with upstream text: room for a word re-merging at the join
CONTINUATION_BYTES = frozenset(bytes([b]) for b in range(0x80, 0xC0))  # UTF-8 bytes inside a character
# Most tokens one hand-off writes under a grammar: the upstream writes freely and the grammar cuts
# its text at the first break, so a longer span would mostly be generated (and billed) in vain.
GRAMMAR_SPAN = 16
RESERVATION_MARGIN_S = 30.0  # a reservation outlives its call's worst case by this much
log = logging.getLogger("gateway.decoding.decoder")


def billed(continuation: Continuation) -> Billed:
    """What the ledger is told a call billed."""
    return Billed(continuation.prompt_tokens, continuation.completion_tokens, continuation.cost_usd,
                  continuation.cached_tokens, continuation.compute_ms or 0.0)


class Written(NamedTuple):
    """What a hand-off wrote: `finished` if the upstream ended the answer there; `billed_tokens`,
    the completion tokens the upstream billed for exactly this text (None from the cache or once cut)."""

    text: str
    finished: bool
    source: str
    billed_tokens: int | None = None


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    text: bytes
    logprob: float
    top: tuple[tuple[int, bytes, float], ...]


@dataclass(frozen=True)
class Piece:
    """What one step added to the answer: the text now safe to show and where it came from."""

    text: str
    tokens: tuple[int, ...]
    source: str  # local | upstream | cache
    signal: Signal | None
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class DecodeRequest:
    messages: list[dict[str, Any]]  # the chat to answer (unless `prompt` is set)
    max_tokens: int
    policy: Policy
    sampling: Sampling = Sampling()
    seed: int | None = None
    stop: tuple[str, ...] = ()
    span: int = 1
    span_until: str = "tokens"  # word | line | sentence: keep a hand-off's text up to that boundary
    continue_final: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    guess_ahead: int = GUESS_LIMIT  # 0: wait idle during hand-offs
    rules: LogitRules = LogitRules()
    grammar: str | None = None  # GBNF the answer must follow
    prompt: str | None = None  # raw text to continue instead of `messages` (legacy completions), as plain text
    ceiling: CostCeiling | None = None  # shared by the request's choices; None without an upstream
    on_ceiling: str = "local"  # local | escalate: what a hand-off past the ceiling becomes
    escalation: str = "continue"  # continue | afresh | draft: how an escalated held answer is finished
    choice: int = 0
    answer_check: AnswerCheck | None = None  # rates the finished answer (usage.routing.answer_confidence)
    escalate_below: float | None = None  # a held answer rated below this is asked afresh
    held: bool = False  # nothing is shown before the answer is complete (the request does not stream)
    # the lengths of recent answers like this one (the tenant's on the alias): this answer's length
    # joins them, and a priced decision expects as much still to come as those longer than it wrote
    answer_lengths: RecentValues | None = None


@dataclass(frozen=True)
class Guess:
    """A greedy local token decoded while a hand-off was in flight, with what the step saw."""

    token: int
    logits: np.ndarray
    signal: Signal
    decision: Decision | None = None  # once the policy routed the step


@dataclass
class RoutingUsage:
    """Per-request accounting, as returned in `usage.routing`."""

    policy: str
    guess_kept_tokens: int = 0  # local tokens decoded during hand-offs and kept
    # hand-offs whose guess was thrown away whole: the upstream wrote something else first, or the answer ended
    guesses_dropped: int = 0
    upstream_calls: int = 0  # hand-offs answered by the upstream (a warm-up is billed but not counted here)
    upstream_prompt_tokens: int = 0
    upstream_completion_tokens: int = 0
    upstream_cached_tokens: int = 0  # of the prompt tokens, those the upstream read from its cache
    upstream_compute_ms: float = 0.0  # the upstream's own prompt + generation time, where it reports it
    upstream_cost_usd: float = 0.0
    escalated: bool = False  # the upstream was asked for the rest of the answer in one call
    afresh: bool = False  # ... for the whole answer, the local one thrown away (its tokens: discarded_tokens)
    discarded_tokens: int = 0
    answer_confidence: float | None = None  # the answer check's rating of the local answer
    price_vetoes: int = 0  # steps the policy wanted upstream that were not worth their predicted price
    draft_hand_offs: int = 0  # under escalation: draft, hand-offs the policy wanted, counted and not made
    predicted_cost_usd: float = 0.0  # what the calls made were expected to bill (prices and prefix reuse)
    degraded: list[str] = field(default_factory=list)

    def degrade(self, reason: str) -> None:
        if reason not in self.degraded:
            self.degraded.append(reason)

    def bill(self, continuation: Continuation, warm: bool = False) -> None:
        if not warm:
            self.upstream_calls += 1
        self.upstream_prompt_tokens += continuation.prompt_tokens
        self.upstream_completion_tokens += continuation.completion_tokens
        self.upstream_cached_tokens += continuation.cached_tokens
        self.upstream_compute_ms += continuation.compute_ms or 0.0
        self.upstream_cost_usd += continuation.cost_usd


class Decoding:
    """One request's decoding. Iterate `pieces()` once; then read `finish_reason` and usage."""

    def __init__(self, local: LocalModel, upstream: Continuations | None, gate: HandoffGate,
                 request: DecodeRequest) -> None:
        self.local, self.upstream, self.gate, self.request = local, upstream, gate, request
        if request.prompt is None:
            prompt = local.template.render_parts(request.messages, request.continue_final)
        else:
            prompt = [(request.prompt, True)]
        self.prompt_tokens: list[int] = local.tokenize_prompt(prompt)
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
        self._upstream_closed = self._handoff is None
        if request.ceiling is not None and self._handoff is not None and not request.ceiling.prompt_tokens:
            request.ceiling.prompt_tokens = upstream.estimate_prompt_tokens(self._handoff)
        self._warming: asyncio.Future | None = None  # the warm-up call, until the first hand-off waits for it
        self._reusable_tokens = 0  # prompt tokens of this request's previous call, which the next one extends
        self._kind_of = self._token_kind if request.policy.detailed_signal else None
        # the per-step prices are worked out only for a policy that weighs them, and need the ceiling's prompt count
        self._reads_prices = request.policy.reads_prices and request.ceiling is not None
        self._hidden: np.ndarray | None = None  # the latest forward's hidden state
        self._routed_guess: Guess | None = None  # a guessed step the policy routed: the next step, decided already
        self._reply_s: float | None = None  # how long this request's last upstream call took to answer
        self._grammar: Grammar | None = local.grammar(request.grammar) if request.grammar else None

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

    async def pieces(self) -> AsyncIterator[Piece]:
        """The answer, piece by piece; the last piece releases any text still held back.

        Decoding advances as this is iterated; the HTTP layer drains it in a task of its own
        (`gateway.api.streams.merged`) so that a slow client never holds up the engine's batch."""
        if self.upstream is not None and not self.gate.allowed:  # settled at admission
            self._upstream_closed = True
            self.usage.degrade(self.gate.refusal)
        elif self.upstream is not None and self._handoff is None and self.request.policy.routes:
            self.usage.degrade("upstream_continues_chats_only")  # raw text, and a chat-mode upstream
        if self._may_route() and self.upstream.warms and self.request.policy.wants_warm_up and not self._capped_cost \
                and not self._drafts:
            self._warming = asyncio.ensure_future(self._call_upstream(self._handoff, 0))
        check = self.request.answer_check
        # shown once checked, or once finished when an escalation may replace it
        held: list[Piece] | None = [] if self.request.held and (check or self._escalates_afresh) else None
        signals: list[Signal] = []  # what the check rates
        try:
            async with self.local.sequence(self.prompt_tokens, self.gate.cache_scope,
                                           hidden=self.request.policy.reads_hidden,
                                           speculate=self.request.sampling.greedy) as sequence:
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
                    fresh = await self._checked(sequence, signals, held is not None)
                    if fresh is not None:
                        held = fresh
                    # and round again: an answer rated early decodes on (so does a fresh answer the grammar cut short)
                for piece in held or ():
                    yield piece
        finally:
            if self.request.ceiling is not None:  # the answer's length as a direct call bills it, for cost_ratio
                self.request.ceiling.note(self.request.choice, self._direct_length + self._end_token)
            if self.request.answer_lengths is not None and self.finish_reason is not None:
                self.request.answer_lengths.add(len(self.answer_tokens))
            if self._warming is not None:
                self._warming.cancel()
                await asyncio.gather(self._warming, return_exceptions=True)
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

    def _rating_due(self) -> bool:
        """Whether an unfinished answer has reached the tokens its check rates."""
        check = self.request.answer_check
        return (check is not None and check.at_tokens is not None and self.usage.answer_confidence is None
                and not self.usage.escalated and len(self.answer_tokens) >= check.at_tokens)

    async def _checked(self, sequence: Sequence, signals: list[Signal], held: bool) -> list[Piece] | None:
        """Rate the finished answer; if it is held and below the bar, ask the upstream afresh and
        return the fresh answer's pieces (None: the answer stands)."""
        stats = AnswerStats.of(signals, len(self.answer_tokens), self.finish_reason)
        confidence = self.request.answer_check.confidence(stats)
        self.usage.answer_confidence = round(confidence, 4)
        below = self.request.escalate_below
        if not held or below is None or confidence >= below or self._upstream_closed:
            return None
        if not self.upstream.available:
            self.usage.degrade("upstream_unavailable")
            return None
        return await self._afresh(sequence, signals[0] if signals else None)

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
            got = await self._uncut_continuation(handoff, span)
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
        return not self._upstream_closed and self.request.policy.routes and self.upstream.available

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
        return self._priced(state) if self._reads_prices and not self._upstream_closed else state

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
        reused = max(self._reusable_tokens, prompt if self._warming is not None else 0)
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

    @property
    def _upstream_finished(self) -> bool:
        """The upstream wrote the answer's end in an escalation (or the whole answer afresh)."""
        return self.usage.escalated and bool(self.sources) and self.sources[-1] != LOCAL

    @property
    def _escalates_afresh(self) -> bool:
        """An escalation asks afresh: the answer is held (nothing shown) and the request says so."""
        return self.request.held and self.request.escalation in ("afresh", "draft")

    @property
    def _drafts(self) -> bool:
        """The held answer is a local draft until it escalates: no hand-off is made before then."""
        return self.request.held and self.request.escalation == "draft" and not self.usage.escalated

    @property
    def _capped_cost(self) -> bool:
        """A cost ceiling is set: no warm-up call, whose prompt the first hand-off would pay again."""
        return self.request.ceiling is not None and self.request.ceiling.ratio is not None

    def _decide(self, signal: Signal) -> Decision:
        if self.usage.escalated and not self._upstream_closed and not self.text.mid_character:
            return UPSTREAM_STEP  # the upstream writes the rest
        wanted = self.request.policy.decide(signal, self._state())
        if wanted.vetoed == "budget" and not self._upstream_closed:
            self.usage.degrade("budget_exhausted")
        elif wanted.vetoed == "price" and self._may_route():
            self.usage.price_vetoes += 1
        if not wanted.upstream or self._upstream_closed or self.text.mid_character:
            return LOCAL_STEP
        if not self.upstream.available:
            self.usage.degrade("upstream_unavailable")
            return LOCAL_STEP
        if self._drafts and not wanted.escalate:
            self.usage.draft_hand_offs += 1
            if self._reads_prices:  # priced on as if made: the next call would extend this one's prefix
                self._reusable_tokens = self.request.ceiling.prompt_tokens + len(self.answer_tokens)
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
        call = asyncio.ensure_future(self._timed_continuation(self._handoff, span, sent))
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

    async def _escalated_afresh(self, sequence: Sequence, logits: np.ndarray, signal: Signal) -> list[Piece]:
        """The fresh answer that replaces this one, past the cost ceiling only under on_ceiling:
        escalate (as a continued escalation may pass it); where it cannot be had, this step and the
        rest of the answer decode locally, rather than the whole answer being asked again each step."""
        fresh = await self._afresh(sequence, signal, bounded=self.request.on_ceiling != "escalate")
        if fresh is not None:
            return fresh
        self._upstream_closed = True
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
                self._upstream_closed = True
        return held

    @property
    def _direct_length(self) -> int:
        """The answer's tokens so far as asking the upstream directly would bill them: the upstream's
        own count of what it wrote for the rest of the answer in one call, the local count of the rest
        (a span's count would overstate it where its tokens re-merge with the local ones)."""
        return len(self.answer_tokens) + self._upstream_count_extra

    async def _append_upstream(self, sequence: Sequence, text: str, finished: bool, source: str,
                               billed_tokens: int | None, signal: Signal, to_limit: bool = False) -> Piece:
        """Append what a call wrote (a Written, unpacked). `to_limit`: the call was asked for all the
        answer's limit allows, uncut; if it stopped by length, so does the answer, as a direct call
        would have (its text may re-tokenize into fewer local tokens than the upstream counted, and
        another call for the difference would bill the whole prompt again)."""
        length_before = len(self.answer_tokens)
        first_new, added = self._append_text(text, source)
        # kept whole (not cut at the limit), its end token, if any, counted with the answer's end
        if to_limit and billed_tokens is not None and added == text.encode("utf-8"):
            self._upstream_count_extra += billed_tokens - finished - (len(self.answer_tokens) - length_before)
        delta = self.text.feed(added)
        if finished and len(self.answer_tokens) < self.limit:  # else a direct call would have stopped by length
            self.finish_reason, self._end_token = "stop", not self.text.stopped
        elif to_limit and not finished:
            self.finish_reason = "length"
        self._check_end()
        logprobs = await self._score(sequence, first_new) if self.request.logprobs else ()
        return Piece(delta, tuple(self.answer_tokens[first_new:]), source, signal, logprobs)

    def _grammar_cut(self, text: str, finished: bool, source: str, billed_tokens: int | None) -> Written:
        """The upstream's text as far as the grammar accepts it; finished only if all of it was
        accepted and the grammar is complete there. A cut inside a character drops its bytes."""
        tokens = self.local.tokenize_text(text.encode("utf-8"))
        kept = self._grammar.accepted(self.answer_tokens, tokens)
        kept_text = b"".join(self.local.token_bytes(t) for t in tokens[:kept]).decode("utf-8", "ignore")
        whole = kept == len(tokens)
        finished = finished and whole and self._grammar.allows(self.answer_tokens + tokens, self.local.end_token)
        return Written(kept_text, finished, source, billed_tokens if whole else None)

    async def _guess(self, sequence: Sequence, logits: np.ndarray, signal: Signal, call: asyncio.Future,
                     sent: float) -> list[Guess]:
        """Greedy local tokens from this step on, decoded until the hand-off `call` (sent at `sent`)
        is done, or is due before one more step could end: a step cannot be stopped, and the answer
        would wait for it."""
        guessing = self.request.sampling.greedy and self.request.guess_ahead > 0 and self._grammar is None
        guesses = [Guess(int(np.argmax(logits)), logits, signal)] if guessing else []
        while guesses and not call.done() and len(guesses) <= self.request.guess_ahead:
            if self.local.is_end_of_generation(guesses[-1].token) or len(self.answer_tokens) + len(guesses) >= self.limit:
                break
            if self._reply_due_within(self.local.step_s, sent):
                break
            ahead = await self._forward(sequence, self.answer_tokens + [g.token for g in guesses])
            position = len(self.answer_tokens) + len(guesses)
            guesses.append(Guess(int(np.argmax(ahead)), ahead, self._signal(ahead, position)))
        sequence.pause()  # until the hand-off returns: the engine must not wait for this request
        return guesses

    def _reply_due_within(self, step_s: float | None, sent: float) -> bool:
        """Would a call sent at `sent` answer before a step of `step_s` started now ends, going by
        this request's last call? (Unknown before the first: no.)"""
        if step_s is None or self._reply_s is None:
            return False
        return time.monotonic() + step_s > sent + self._reply_s

    def _keep_guesses(self, before: list[int], guesses: list[Guess]) -> list[Piece]:
        """The guessed steps after what the hand-off wrote, if it wrote what the guess began with."""
        written = self.answer_tokens[len(before):]
        guessed = [g.token for g in guesses]
        if self.finish_reason is not None or self.answer_tokens[:len(before)] != before or \
                not written or guessed[:len(written)] != written:
            self.usage.guesses_dropped += bool(guesses)
            return []
        pieces, answered = [], len(self.answer_tokens)
        for guess in guesses[len(written):]:
            if self.finish_reason is not None:
                break
            decision = self._decide(guess.signal)
            if decision.upstream:
                self._routed_guess = dataclasses.replace(guess, decision=decision)
                break
            pieces.append(self._accept(guess.token, guess.logits, guess.signal))
        self.usage.guess_kept_tokens += len(self.answer_tokens) - answered
        return pieces

    @property
    def _span_until(self) -> str:
        """Where a hand-off's text is cut: the request's boundary, none once escalated (the rest is written whole)."""
        return "tokens" if self.usage.escalated else self.request.span_until

    async def _timed_continuation(self, handoff: Handoff, span: int, sent: float) -> Written | None:
        """`_continuation`, noting how long the upstream took to answer (the guesses' deadline)."""
        got = await self._continuation(handoff, span)
        if got is not None and got.source == UPSTREAM:
            self._reply_s = time.monotonic() - sent
        return got

    async def _continuation(self, handoff: Handoff, span: int) -> Written | None:
        """What the cache or the upstream wrote, cut at the request's span boundary; None to decode locally."""
        got = await self._uncut_continuation(handoff, span)
        if got is None:
            return None
        text, cut = cut_span(got.text, self._span_until)
        return Written(text, got.finished and not cut, got.source, None if cut else got.billed_tokens)

    async def _uncut_continuation(self, handoff: Handoff, span: int) -> Written | None:
        deterministic = self.request.sampling.greedy
        key = self.upstream.cache_key(handoff, span, self.gate.cache_scope)
        if deterministic:
            cached = await self.gate.cache_get(key)
            if cached is not None:
                return Written(cached[1:], cached[0] == "1", CACHE)
        continuation = await self._warmed(handoff, span) or await self._call_upstream(handoff, span)
        if continuation is None:
            return None
        if deterministic:
            await self.gate.cache_put(key, ("1" if continuation.finished else "0") + continuation.text)
        return Written(continuation.text, continuation.finished, UPSTREAM, continuation.completion_tokens)

    async def _warmed(self, handoff: Handoff, span: int) -> Continuation | None:
        """Wait for the warm-up (this hand-off extends its sequence). The token it wrote is this
        hand-off's answer when the hand-off is at the first answer token with span 1: then it
        counts as the hand-off and no second call is made."""
        if self._warming is None:
            return None
        warming, self._warming = self._warming, None
        await asyncio.gather(warming, return_exceptions=True)
        if warming.cancelled() or warming.exception() is not None or warming.result() is None:
            return None
        if span != 1 or handoff.answer or handoff.answer_ids:
            return None
        self.usage.upstream_calls += 1
        return warming.result()

    async def _call_upstream(self, handoff: Handoff, span: int) -> Continuation | None:
        """Reserve, call, settle. `span` 0 is a warm-up: the upstream reads the prompt into its cache
        (and writes one token, since servers always sample one); it is billed, and counted as a
        hand-off only if `_warmed` uses that token."""
        warm, span = span == 0, max(1, span)
        estimate = self.upstream.estimate_prompt_tokens(handoff) + span
        reservation = await self.gate.reserve(estimate, self.upstream.estimate_cost(estimate - span, span),
                                              ttl_s=self.upstream.worst_case_s + RESERVATION_MARGIN_S)
        if reservation is None:
            self.usage.degrade(self.gate.refusal)
            if self.gate.refusal != "store_unavailable":  # that one may answer at the next routed step
                self._upstream_closed = True
            return None
        predicted = self.upstream.prices.predicted(estimate - span, span, self._reusable_tokens)
        sampling = self.request.sampling
        call = asyncio.ensure_future(self.upstream.continue_text(
            handoff, span, sampling.temperature, sampling.top_p, self.request.seed, self.request.rules.upstream_params()))
        try:
            continuation = await asyncio.shield(call)  # a request that ends leaves the call running, to be billed
        except UpstreamUnavailable as exc:
            await asyncio.shield(self.gate.release(reservation))
            log.warning("hand-off decoded locally: %s", exc)
            self.usage.degrade(exc.reason)
            if isinstance(exc, (UpstreamRejected, UpstreamBusy)):  # the next call would fare no better
                self._upstream_closed = True
            return None
        except BaseException:
            self.gate.finish_in_background(reservation, call, lambda done: self.gate.settle(reservation, billed(done)))
            raise
        self.usage.bill(continuation, warm)
        self.usage.predicted_cost_usd += predicted
        self._reusable_tokens = continuation.prompt_tokens  # the next call extends this prefix
        await asyncio.shield(self.gate.settle(reservation, billed(continuation)))
        return continuation

    # -- helpers --

    def _append_text(self, text: str, source: str) -> tuple[int, bytes]:
        """Append upstream text, re-tokenized locally; return (first new token index, new bytes).

        The answer's last few tokens are re-tokenized with the text, so a boundary that merges
        ("Par" + "is" -> "Paris") becomes the token the local model would have seen; tokens past
        the common prefix are replaced, and the next forward() rewinds the KV cache to that prefix.
        Earlier tokens stand as written: re-tokenizing the whole answer would undo a split the local
        model chose far back, rewind the cache to it and count every token after it as the
        upstream's. Tokens past the answer's limit are dropped with their text.
        """
        before = len(self.answer_bytes)
        keep = self._retokenized_from()
        # the answer's bytes are its tokens' bytes, so the kept prefix ends where the tail's begin
        kept_bytes = before - sum(len(self.local.token_bytes(t)) for t in self.answer_tokens[keep:])
        self.answer_bytes += text.encode("utf-8")
        tokens = self.answer_tokens[:keep] + self.local.tokenize_text(bytes(self.answer_bytes[kept_bytes:]))
        if len(tokens) > self.limit:
            tokens = tokens[: self.limit]
            self.answer_bytes = bytearray(b"".join(self.local.token_bytes(t) for t in tokens))
        common = common_prefix(self.answer_tokens, tokens)
        self.answer_tokens = tokens
        self.sources = self.sources[:common] + [source] * (len(tokens) - common)
        return common, bytes(self.answer_bytes[before:])

    def _retokenized_from(self) -> int:
        """The first answer token re-tokenized with upstream text: RETOKENIZED_TAIL back, moved to
        the start of a character (a token may end inside one)."""
        start = max(0, len(self.answer_tokens) - RETOKENIZED_TAIL)
        while start > 0 and self.local.token_bytes(self.answer_tokens[start])[:1] in CONTINUATION_BYTES:
            start -= 1
        return start

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
