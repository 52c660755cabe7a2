"""The collaborative decoder: a small local model writes every token, uncertain steps go upstream.

Per step: local logits -> signal -> policy decision -> token(s) -> piece. A LOCAL step samples
from the local model (local_steps.py) and appends the token to the answer (answer.py). An UPSTREAM
step (routing.py decides) hands the partial answer to the large model (handoffs.py), which writes up
to `span` tokens of text (escalation.py says how many, and whether to ask for the whole answer
afresh); that text is re-tokenized with the local tokenizer and appended (rewinding to the common
prefix where the boundary re-merges), and local decoding carries on. A failed or refused hand-off
decodes the step locally instead. Each request decodes on a sequence of its own in the local
model's batched engine; while a greedy request's hand-off is in flight it guesses ahead
(guessing.py). A held answer is shown once finished, rated by its check first (review.py). A routed
step's token is the upstream's, or chosen from both models' distributions (routing.py, `Combining`).

A request's penalties and logit_bias adjust the local logits before anything reads them. Under a
grammar (`response_format` JSON) every local token is one the grammar allows, an
upstream span is kept only as far as the grammar accepts it (a step whose span it refuses entirely
decodes locally), and the answer ends only where the grammar is complete.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator

import numpy as np

from adapters.engine import Sequence
from adapters.local_model import LocalModel
from adapters.upstream import Continuations, Handoff
from gateway.decoding.agreement_samples import AgreementSamples
from gateway.decoding.answer import Answer
from gateway.decoding.escalation import Ask, Escalation
from gateway.decoding.guessing import Guessing
from gateway.decoding.handoffs import Gate, HandoffCalls
from gateway.decoding.local_steps import LocalSteps
from gateway.decoding.review import Review
from gateway.decoding.routing import Combining, Routing
from gateway.decoding.text_stream import TextReleaser
from gateway.decoding.values import GUESS_LIMIT, LOCAL, DecodeRequest, Guess, Piece, RoutingUsage, TokenLogprob, Written
from policies import Decision, Signal
from policies.agreement import AgreementCheck
from policies.answer_check import AnswerStats

__all__ = ["GUESS_LIMIT", "DecodeRequest", "Decoding", "Piece", "TokenLogprob"]


class Decoding:
    """One request's decoding. Iterate `pieces()` once; then read the answer (`answer`, and the
    fields below that read it), `finish_reason` and `usage`."""

    def __init__(self, local: LocalModel, upstream: Continuations | None, gate: Gate,
                 request: DecodeRequest, prompt_tokens: list[int] | None = None) -> None:
        """Blocking (the prompt is rendered and tokenized, unless `prompt_tokens` are given; a grammar
        is parsed): build it off the event loop."""
        self.local, self.upstream, self.gate, self.request = local, upstream, gate, request
        self.prompt_tokens: list[int] = _prompt_tokens(local, request) if prompt_tokens is None else prompt_tokens
        routing = request.routing
        self.usage = RoutingUsage(policy=routing.policy.name)
        handoff = _first_handoff(upstream, request, gate.cache_scope)
        self.calls = HandoffCalls(upstream, gate, self.usage, request, closed=handoff is None)
        if routing.ceiling is not None and handoff is not None and not routing.ceiling.prompt_tokens:
            routing.ceiling.prompt_tokens = upstream.estimate_prompt_tokens(handoff)
        grammar = local.grammar(request.grammar) if request.grammar else None
        limit = min(request.max_tokens, local.n_ctx - len(self.prompt_tokens))  # answer tokens
        self.answer = Answer(local, limit, request.stop, grammar)
        self._steps = LocalSteps(local, self.prompt_tokens, request, self.answer)
        self._routing = Routing(request, upstream, gate, self.calls, self.usage, self.answer, len(self.prompt_tokens))
        self._combining = Combining(routing.combine, local, self.usage)
        self._escalation = Escalation(request, upstream, self.calls, self.usage, self.answer, handoff)
        self._guessing = Guessing(request, local, self._steps, self.calls, self.usage, self.answer)
        check = routing.review.answer_check
        self._samples = AgreementSamples(request, check, self._sampled) if isinstance(check, AgreementCheck) else None
        held = routing.review.held and (check is not None or self._escalation.escalates_afresh)
        self._review = Review(request, upstream, self.calls, self.usage, self.answer, self._samples, held,
                              len(self.prompt_tokens))
        self._routed: Guess | None = None  # a guessed step the policy routed: the next step, decided already

    # the answer, as the API, the evaluation and the metrics read it

    @property
    def limit(self) -> int:
        """The most answer tokens: max_tokens, within what the context leaves after the prompt."""
        return self.answer.limit

    @property
    def answer_tokens(self) -> list[int]:
        """The answer's local tokens (live: read while decoding, they are the answer so far)."""
        return self.answer.tokens

    @property
    def sources(self) -> list[str]:
        """Where each answer token came from: local, upstream or cache."""
        return self.answer.sources

    @property
    def answer_bytes(self) -> bytearray:
        """The answer's tokens' bytes."""
        return self.answer.data

    @property
    def text(self) -> TextReleaser:
        """The answer's text (`.text`), as released so far."""
        return self.answer.text

    @property
    def finish_reason(self) -> str | None:
        """stop or length once the answer ended; None before (or when its request ended first)."""
        return self.answer.finish_reason

    @property
    def rated(self) -> tuple[AnswerStats, str] | None:
        """The local answer's stats and text as its check rated them, before any escalation (None:
        not rated); what a learning alias's shadow example reads."""
        return self._review.rated

    def source_counts(self) -> dict[str, int]:
        """Answer tokens per source: local, upstream, cache."""
        return self.answer.source_counts()

    async def pieces(self) -> AsyncIterator[Piece]:
        """The answer, piece by piece; the last piece releases any text still held back.

        Decoding advances as this is iterated; the HTTP layer drains it in a task of its own
        (`gateway.decoding.streams.merged`) so that a slow client never holds up the engine's batch."""
        self._begin()
        try:
            while True:
                async with self.local.sequence(self.prompt_tokens, self.gate.cache_scope,
                                               hidden=self.request.routing.policy.reads_hidden,
                                               speculate=self.request.sampling.greedy,
                                               claim=self.request.claim) as sequence:
                    async for piece in self._decoded(sequence):
                        yield piece
                if not self._review.awaits_samples:
                    break
                await self._samples.wait()  # then rated (and perhaps asked afresh) on a sequence taken anew
            for piece in self._review.release():
                yield piece
        finally:
            await self._end()
        tail = self.answer.text.finish()
        if tail:
            yield Piece(tail, (), self.answer.sources[-1] if self.answer.sources else LOCAL, None)

    async def _decoded(self, sequence: Sequence) -> AsyncIterator[Piece]:
        """Step until the answer ends, rating it where its check is due (an answer rated early decodes
        on, and so does a fresh answer a grammar cut short), or until it waits for its samples."""
        while True:
            while self.answer.finish_reason is None and not self._review.due:
                for piece in self._review.shown(await self._step(sequence)):
                    yield piece
            if not self._review.rates_now:
                return
            if await self._review.rate():  # below the bar: asked afresh
                fresh = await self._afresh(sequence, self._review.first_signal)
                if fresh is not None:
                    self._review.replace(fresh)

    async def _step(self, sequence: Sequence) -> list[Piece]:
        """One step: logits -> signal -> decision -> token(s) -> piece(s)."""
        if self._routed is not None:  # decided once: a policy's window must see each step once
            guess, self._routed = self._routed, None
            return await self._upstream_step(sequence, guess.logits, guess.signal, guess.decision)
        logits = await self._steps.forward(sequence, self.answer.tokens)
        signal = self._steps.signal(logits, len(self.answer.tokens))
        decision = self._routing.decide(signal)
        if decision.upstream:
            return await self._upstream_step(sequence, logits, signal, decision)
        return [await self._local_step(logits, signal)]

    async def _local_step(self, logits: np.ndarray, signal: Signal) -> Piece:
        """A token sampled from the local `logits`, appended."""
        token, logits = await self._steps.pick(logits)
        if token is None:  # the grammar allows nothing more, not even an end
            self.answer.finish_reason = "stop"
            return Piece("", (), LOCAL, signal)
        return self._accept(token, logits, signal)

    def _accept(self, token: int, logits: np.ndarray, signal: Signal) -> Piece:
        """Append a local token (or finish on an end-of-generation token)."""
        text = self.answer.accept(token)
        if text is None:
            return Piece("", (), LOCAL, signal)
        logprobs = (self._steps.logprob(logits, token),) if self.request.logprobs is not None else ()
        return Piece(text, (token,), LOCAL, signal, logprobs)

    async def _upstream_step(self, sequence: Sequence, logits: np.ndarray, signal: Signal,
                             decision: Decision) -> list[Piece]:
        """The routed step: a hand-off (with the guesses made meanwhile that it kept), the whole
        answer afresh, or, where neither can be had, the step decoded locally."""
        ask = self._escalation.ask(decision)
        if ask.afresh:  # past the ceiling only under on_ceiling: escalate, as a continued escalation may pass it
            fresh = await self._afresh(sequence, signal, bounded=not self.request.routing.escalates_past_ceiling)
            if fresh is not None:
                return fresh
            self.calls.closed = True  # the rest decodes locally, rather than asking afresh each step
        if ask.afresh or ask.local:
            return [await self._local_step(logits, signal)]
        got, guesses = await self._handed_off(sequence, ask, logits, signal)
        before = list(self.answer.tokens)
        got = self.answer.kept(await self._combining.written(got, logits))
        if got is None or (not got.text and not got.finished):
            pieces = [await self._local_step(logits, signal)]
        else:
            pieces = [await self._append_upstream(sequence, got, signal, to_limit=ask.to_limit)]
        return pieces + self._replayed(self._guessing.kept(before, guesses))

    async def _handed_off(self, sequence: Sequence, ask: Ask, logits: np.ndarray,
                          signal: Signal) -> tuple[Written | None, list[Guess]]:
        """What the hand-off wrote (None: nothing), and the guesses made while it was in flight."""
        billed_before, sent = self.usage.upstream_cost_usd, time.monotonic()
        handoff, until = self._escalation.handoff, self._escalation.span_until
        call = asyncio.ensure_future(self.calls.timed(handoff, ask.span, until, sent, read_ahead=not ask.to_limit))
        try:
            guesses = await self._guessing.guess(sequence, logits, signal, call, sent)
            return await call, guesses
        except BaseException:
            call.cancel()
            raise
        finally:
            self._escalation.settle(ask.held, billed_before)

    def _replayed(self, guesses: list[Guess]) -> list[Piece]:
        """Kept guesses, each passed to the policy as it would have been in turn; the first it routes
        is the next step, decided already."""
        pieces, answered = [], len(self.answer.tokens)
        for guess in guesses:
            if self.answer.finish_reason is not None:
                break
            decision = self._routing.decide(guess.signal)
            if decision.upstream:
                self._routed = dataclasses.replace(guess, decision=decision)
                break
            pieces.append(self._accept(guess.token, guess.logits, guess.signal))
        self.usage.guess_kept_tokens += len(self.answer.tokens) - answered
        return pieces

    async def _append_upstream(self, sequence: Sequence, written: Written, signal: Signal | None,
                               to_limit: bool = False) -> Piece:
        """What a call wrote, appended (see Answer.append_upstream), scored locally for logprobs."""
        first, text = self.answer.append_upstream(written, to_limit)
        logprobs = await self._steps.score(sequence, self.answer.tokens, first) \
            if self.request.logprobs is not None else ()
        return Piece(text, tuple(self.answer.tokens[first:]), written.source, signal, logprobs)

    async def _afresh(self, sequence: Sequence, signal: Signal | None, bounded: bool = True) -> list[Piece] | None:
        """The upstream's whole answer in place of this one (Escalation.afresh); None: this one stands."""
        sequence.pause()  # for the whole answer's call: the engine must not wait for this request
        got = await self._escalation.afresh(bounded)
        if got is None:
            return None
        self._routed = None  # a step of the answer it replaces
        self._review.restart()
        return [await self._append_upstream(sequence, got, signal, to_limit=not self.answer.constrained)]

    def _sampled(self, request: DecodeRequest) -> Decoding:
        """A local-only decoding of this prompt for the agreement check (see AgreementSamples)."""
        return Decoding(self.local, None, self.gate, request, self.prompt_tokens)

    def _begin(self) -> None:
        """Before the first step: refusals settled at admission, the warm-up, the samples."""
        if self.upstream is not None and not self.gate.allowed:  # settled at admission
            self.calls.closed = True
            self.usage.degrade(self.gate.refusal)
        elif self.upstream is not None and self._escalation.handoff is None and self.request.routing.policy.routes:
            self.usage.degrade("upstream_continues_chats_only")  # raw text, and a chat-mode upstream
        if self._routing.warms_up:
            self.calls.warm_up(self._escalation.handoff)
        if self._samples is not None:
            self._samples.start()

    async def _end(self) -> None:
        """After the last step (or when the request ends): the answer's length noted, calls and samples ended."""
        routing = self.request.routing
        if routing.ceiling is not None:  # the answer's length as a direct call bills it, for cost_ratio
            routing.ceiling.note(self.request.choice, self.answer.direct_length + self.answer.end_token)
        if routing.answer_lengths is not None and self.answer.finish_reason is not None:
            routing.answer_lengths.add(len(self.answer.tokens))
        await self.calls.end()
        if self._samples is not None:
            await self._samples.end()
        self.answer.close()


def _prompt_tokens(local: LocalModel, request: DecodeRequest) -> list[int]:
    """The request's prompt as local tokens: raw text as plain text, else its chat rendered."""
    parts = [(request.prompt, True)] if request.prompt is not None else \
        local.template.render_parts(request.messages, request.continue_final)
    return local.tokenize_prompt(parts)


def _first_handoff(upstream: Continuations | None, request: DecodeRequest, scope: str) -> Handoff | None:
    """The request's hand-off of an empty answer; None without an upstream, or for raw text when the
    upstream continues chats only."""
    if upstream is None:
        return None
    if request.prompt is not None:
        handoff = upstream.text_handoff(request.prompt, scope)
    else:
        handoff = upstream.handoff(request.messages, request.continue_final, scope)
    alternatives = request.routing.combine.alternatives  # asked of every call: hand-offs extend this one
    return dataclasses.replace(handoff, alternatives=alternatives) if handoff is not None and alternatives else handoff
