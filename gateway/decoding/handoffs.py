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
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
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


class HandoffCalls:
    """The upstream calls of one request (see the module's docstring); `usage` is billed as they end."""

    def __init__(self, upstream: Continuations | None, gate: Gate, usage: RoutingUsage, request: DecodeRequest,
                 closed: bool) -> None:
        self.upstream, self.gate, self.usage, self.request = upstream, gate, usage, request
        self.closed = closed  # no more calls for this request
        self.warming: asyncio.Future | None = None  # the warm-up call, until the first hand-off waits for it
        self.reusable_tokens = 0  # prompt tokens of this request's previous call, which the next one extends
        self.reply_s: float | None = None  # how long this request's last upstream call took to answer

    def warm_up(self, handoff: Handoff) -> None:
        """Start reading the prompt into the upstream's cache (a call of span 0, see `call`)."""
        self.warming = asyncio.ensure_future(self.call(handoff, 0))

    async def end(self) -> None:
        """Stop waiting for a warm-up no hand-off used: it is billed when it ends (see `call`)."""
        if self.warming is not None:
            self.warming.cancel()
            await asyncio.gather(self.warming, return_exceptions=True)

    async def timed(self, handoff: Handoff, span: int, until: str, sent: float) -> Written | None:
        """`continuation`, noting how long the upstream took to answer (`reply_s`: the guesses' deadline)."""
        got = await self.continuation(handoff, span, until)
        if got is not None and got.source == UPSTREAM:
            self.reply_s = time.monotonic() - sent
        return got

    async def continuation(self, handoff: Handoff, span: int, until: str) -> Written | None:
        """What the cache or the upstream wrote, cut at the boundary `until` (word, line, sentence, tokens);
        None to decode the step locally."""
        got = await self.uncut(handoff, span)
        if got is None:
            return None
        text, cut = cut_span(got.text, until)
        return Written(text, got.finished and not cut, got.source, None if cut else got.billed_tokens, got.first)

    @traced("gateway.handoff", wrote)
    async def uncut(self, handoff: Handoff, span: int) -> Written | None:
        """What the cache or the upstream wrote for `span` tokens, whole; None to decode locally."""
        deterministic = self.request.sampling.greedy
        key = self.upstream.cache_key(handoff, span, self.gate.cache_scope)
        if handoff.alternatives:  # kept apart: its entries hold the first token's alternatives too
            key = f"{key}:alternatives{handoff.alternatives}"
        if deterministic:
            cached = await self.gate.cache_get(key)
            if cached is not None:
                return cached_written(cached, bool(handoff.alternatives))
        continuation = await self._warmed(handoff, span) or await self.call(handoff, span)
        if continuation is None:
            return None
        if deterministic:
            await self.gate.cache_put(key, cache_entry(continuation, bool(handoff.alternatives)))
        return Written(continuation.text, continuation.finished, UPSTREAM, continuation.completion_tokens,
                       continuation.first)

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

    async def call(self, handoff: Handoff, span: int) -> Continuation | None:
        """Reserve, call, settle. `span` 0 is a warm-up: the upstream reads the prompt into its cache
        (and writes one token, since servers always sample one); it is billed, and counted as a
        hand-off only if the first hand-off uses that token."""
        warm, span = span == 0, max(1, span)
        prompt, completion = (self.upstream.estimate_prompt_tokens(handoff),
                              self.upstream.estimate_completion_tokens(handoff, span))
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
            handoff, span, sampling.temperature, sampling.top_p, self.request.seed, self.request.rules.upstream_params()))
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


def cache_entry(continuation: Continuation, alternatives: bool) -> str:
    """A continuation as the cache keeps it: whether it finished, then its text (with `alternatives`,
    the text and its first token's alternatives as JSON, bytes as latin-1 text)."""
    finished = "1" if continuation.finished else "0"
    if not alternatives:
        return finished + continuation.text
    first = continuation.first
    listed = None if first is None else [first.token.decode("latin-1"),
                                         [[piece.decode("latin-1"), logprob] for piece, logprob in first.top]]
    return finished + json.dumps([continuation.text, listed])


def cached_written(entry: str, alternatives: bool) -> Written:
    """What a cache entry (`cache_entry`) holds, as written from the cache."""
    finished, body = entry[0] == "1", entry[1:]
    if not alternatives:
        return Written(body, finished, CACHE)
    text, listed = json.loads(body)
    first = None if listed is None else Alternatives(
        listed[0].encode("latin-1"), tuple((piece.encode("latin-1"), logprob) for piece, logprob in listed[1]))
    return Written(text, finished, CACHE, None, first)
