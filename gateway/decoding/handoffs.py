"""One request's calls to the upstream: reserve -> call -> settle, the continuation cache, the warm-up.

`HandoffCalls.continuation(handoff, span, until)` is what a hand-off asks for: the text the cache or
the upstream wrote, cut at a boundary, or None to decode the step locally. Every call is reserved
against the tenant's budget first and settled from what the upstream billed; a call whose request
ends first (the client left) runs to its end in the background and is billed all the same. A
refusal that the next call would meet too (the budget, the upstream refusing the request, no slot
free in time) sets `closed`: the request asks the upstream nothing more. A greedy request's
continuations are deterministic, so they are cached in the tenant's cache scope. The warm-up reads
the prompt into the upstream's prefix cache while the first local tokens decode; the first
hand-off waits for it and, at the answer's first token with span 1, uses the token it wrote.
With the upstream's `read_ahead`, a hand-off's call asks for that many tokens past its span; the
request's next hand-off takes its span from them, with no call, while the answer has gone on as
they read (`ReadAhead`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from adapters.store import Billed, Reservation
from adapters.upstream import Alternatives, Continuation, Continuations, Handoff, UpstreamUnavailable
from gateway.decoding.spans import cut_span
from gateway.decoding.values import CACHE, UPSTREAM, DecodeRequest, RoutingUsage, Written
from gateway.tenancy.budget import RESERVATION_MARGIN_S, billed
from gateway.traced import traced, wrote

log = logging.getLogger("gateway.decoding.handoffs")


class Gate(Protocol):
    """A request's door to upstream spending and to the continuation cache, as admission hands it
    over (gateway.tenancy.budget.HandoffGate). It never raises for a store fault."""

    allowed: bool  # may this request spend upstream at all
    refusal: str  # why the last reservation (or the request) was refused
    cache_scope: str  # the continuation cache's namespace for this request's tenant

    def tokens_left(self) -> int | None: ...

    async def reserve(self, tokens: int, cost_usd: float, ttl_s: float = 0.0) -> Reservation | None: ...

    async def settle(self, reservation: Reservation, billed: Billed) -> None: ...

    async def release(self, reservation: Reservation) -> None: ...

    def finish_in_background(self, reservation: Reservation, call: asyncio.Future,
                             settle: Callable[[Any], Awaitable[None]]) -> None: ...

    async def cache_get(self, key: str) -> str | None: ...

    async def cache_put(self, key: str, value: str) -> None: ...


@dataclass(frozen=True)
class ReadAhead:
    """What a call wrote past its span, in the provider's tokens (`pieces`): it continues `answer`,
    and the upstream's answer ended after it if `finished`."""

    answer: str
    pieces: tuple[str, ...]
    finished: bool

    def after(self, answer: str) -> tuple[str, ...] | None:
        """The pieces still ahead of `answer`, where it went on as they read (or not at all); else None."""
        since = answer[len(self.answer):]
        if not answer.startswith(self.answer) or not "".join(self.pieces).startswith(since):
            return None
        pieces, left = list(self.pieces), len(since)
        while pieces and left >= len(pieces[0]):
            left -= len(pieces.pop(0))
        if left:
            pieces[0] = pieces[0][left:]
        return tuple(pieces)


class HandoffCalls:
    """The upstream calls of one request (see the module's docstring); `usage` is billed as they end."""

    def __init__(self, upstream: Continuations | None, gate: Gate, usage: RoutingUsage, request: DecodeRequest,
                 closed: bool) -> None:
        self.upstream, self.gate, self.usage, self.request = upstream, gate, usage, request
        self.closed = closed  # no more calls for this request
        self.warming: asyncio.Future | None = None  # the warm-up call, until the first hand-off waits for it
        self.reusable_tokens = 0  # prompt tokens of this request's previous call, which the next one extends
        self.reply_s: float | None = None  # how long this request's last upstream call took to answer
        self.ahead: ReadAhead | None = None  # what the last hand-off's call read past its span

    def warm_up(self, handoff: Handoff) -> None:
        """Start reading the prompt into the upstream's cache (a call of span 0, see `call`)."""
        self.warming = asyncio.ensure_future(self.call(handoff, 0))

    async def end(self) -> None:
        """Stop waiting for a warm-up no hand-off used: it is billed when it ends (see `call`)."""
        if self.warming is not None:
            self.warming.cancel()
            await asyncio.gather(self.warming, return_exceptions=True)

    async def timed(self, handoff: Handoff, span: int, until: str, sent: float, read_ahead: bool) -> Written | None:
        """`continuation`, noting how long the upstream took to answer (`reply_s`: the guesses' deadline)."""
        got = await self.continuation(handoff, span, until, read_ahead)
        if got is not None and got.source == UPSTREAM:
            self.reply_s = time.monotonic() - sent
        return got

    async def continuation(self, handoff: Handoff, span: int, until: str, read_ahead: bool) -> Written | None:
        """What the cache or the upstream wrote, cut at the boundary `until` (word, line, sentence, tokens);
        None to decode the step locally. `read_ahead`: see `uncut`."""
        got = await self.uncut(handoff, span, read_ahead)
        if got is None:
            return None
        text, cut = cut_span(got.text, until)
        return Written(text, got.finished and not cut, got.source, None if cut else got.billed_tokens, got.first)

    @traced("gateway.handoff", wrote)
    async def uncut(self, handoff: Handoff, span: int, read_ahead: bool = False) -> Written | None:
        """What the cache or the upstream wrote for `span` tokens, whole; None to decode locally.
        `read_ahead`: take it from what the last call read ahead where that still continues the
        answer, and have a call read ahead (the upstream's `read_ahead` tokens) for the next; not
        where the hand-off asks for alternatives (a combined step needs its own)."""
        read_ahead = read_ahead and not handoff.alternatives
        read = self._read(handoff, span) if read_ahead else None
        if read is not None:
            return read
        ahead = self.upstream.read_ahead if read_ahead else 0
        key = self.upstream.cache_key(handoff, span, self.gate.cache_scope)
        if handoff.alternatives:  # kept apart: its entries hold the first token's alternatives too
            key = f"{key}:alternatives{handoff.alternatives}"
        if ahead:  # ... and what was read ahead, which the next steps of a request like this one take
            key = f"{key}:ahead{ahead}"
        structured = bool(handoff.alternatives or ahead)
        deterministic = self.request.sampling.greedy
        cached = await self.gate.cache_get(key) if deterministic else None
        if cached is not None:
            return self._written(handoff, cached_continuation(cached, structured), CACHE)
        continuation = await self._warmed(handoff, span) or await self.call(handoff, span, ahead)
        if continuation is None:
            return None
        if deterministic:
            await self.gate.cache_put(key, cache_entry(continuation, structured))
        return self._written(handoff, continuation, UPSTREAM)

    def _written(self, handoff: Handoff, continuation: Continuation, source: str) -> Written:
        """What a continuation writes at this hand-off; what it read ahead is kept for the next."""
        pieces = continuation.ahead
        self.ahead = ReadAhead(handoff.answer + continuation.text, pieces, continuation.finished) if pieces else None
        billed_tokens = continuation.completion_tokens if source == UPSTREAM and not pieces else None
        return Written(continuation.text, continuation.finished and not pieces, source, billed_tokens,
                       continuation.first)

    def _read(self, handoff: Handoff, span: int) -> Written | None:
        """The next `span` pieces the last call read ahead, where the answer went on as they read
        (the upstream's end too, where it wrote one); else None."""
        pieces = self.ahead.after(handoff.answer) if self.ahead is not None else None
        if pieces is None or not (pieces or self.ahead.finished):
            self.ahead = None
            return None
        text, rest = "".join(pieces[:span]), pieces[span:]
        self.ahead = ReadAhead(handoff.answer + text, rest, self.ahead.finished)
        return Written(text, self.ahead.finished and not rest, CACHE)

    async def _warmed(self, handoff: Handoff, span: int) -> Continuation | None:
        """Wait for the warm-up (this hand-off extends its sequence). The token it wrote is this
        hand-off's answer when the hand-off is at the first answer token with span 1: then it
        counts as the hand-off and no second call is made."""
        if self.warming is None:
            return None
        warming, self.warming = self.warming, None
        await asyncio.gather(warming, return_exceptions=True)
        if warming.cancelled() or warming.exception() is not None or warming.result() is None:
            return None
        if span != 1 or handoff.answer or handoff.answer_ids:
            return None
        self.usage.upstream_calls += 1
        return warming.result()

    async def call(self, handoff: Handoff, span: int, ahead: int = 0) -> Continuation | None:
        """Reserve, call, settle (asking `ahead` tokens past the span). `span` 0 is a warm-up: the
        upstream reads the prompt into its cache (and writes one token, since servers always sample
        one); it is billed, and counted as a hand-off only if the first hand-off uses that token."""
        warm, span = span == 0, max(1, span)
        prompt, completion = (self.upstream.estimate_prompt_tokens(handoff),
                              self.upstream.estimate_completion_tokens(handoff, span + ahead))
        reservation = await self.gate.reserve(prompt + completion, self.upstream.estimate_cost(prompt, completion),
                                              ttl_s=self.upstream.worst_case_s + RESERVATION_MARGIN_S)
        if reservation is None:
            self.usage.degrade(self.gate.refusal)
            if self.gate.refusal != "store_unavailable":  # that one may answer at the next routed step
                self.closed = True
            return None
        predicted = self.upstream.prices.predicted(prompt, completion, self.reusable_tokens)
        sampling = self.request.sampling
        call = asyncio.ensure_future(self.upstream.continue_text(
            handoff, span, sampling.temperature, sampling.top_p, self.request.seed, self.request.rules.upstream_params(),
            ahead=ahead))
        try:
            continuation = await asyncio.shield(call)  # a request that ends leaves the call running, to be billed
        except UpstreamUnavailable as exc:
            await asyncio.shield(self.gate.release(reservation))
            log.warning("hand-off decoded locally: %s", exc)
            self.usage.degrade(exc.reason)
            self.closed = self.closed or exc.final
            return None
        except BaseException:
            self.gate.finish_in_background(reservation, call, lambda done: self.gate.settle(reservation, billed(done)))
            raise
        self.usage.bill(continuation, warm)
        self.usage.predicted_cost_usd += predicted
        self.reusable_tokens = continuation.prompt_tokens  # the next call extends this prefix
        await asyncio.shield(self.gate.settle(reservation, billed(continuation)))
        return continuation


def cache_entry(continuation: Continuation, structured: bool) -> str:
    """A continuation as the cache keeps it: whether the upstream's answer ended in it, then its text;
    `structured`, the text, its first token's alternatives and what it read ahead as JSON (bytes as
    latin-1 text)."""
    finished = "1" if continuation.finished else "0"
    if not structured:
        return finished + continuation.text
    first = continuation.first
    listed = None if first is None else [first.token.decode("latin-1"),
                                         [[piece.decode("latin-1"), logprob] for piece, logprob in first.top]]
    return finished + json.dumps([continuation.text, listed, list(continuation.ahead)])


def cached_continuation(entry: str, structured: bool) -> Continuation:
    """What a cache entry (`cache_entry`) holds, as a continuation that bills nothing."""
    finished, body = entry[0] == "1", entry[1:]
    if not structured:
        return Continuation(body, finished, 0, 0, 0.0, 0.0)
    text, listed, ahead = json.loads(body)
    first = None if listed is None else Alternatives(
        listed[0].encode("latin-1"), tuple((piece.encode("latin-1"), logprob) for piece, logprob in listed[1]))
    return Continuation(text, finished, 0, 0, 0.0, 0.0, first=first, ahead=tuple(ahead))
