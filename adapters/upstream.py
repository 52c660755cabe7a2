"""Upstream models through litellm: continue a partial answer for a few tokens, or answer a
request passed through whole.

`Upstream` is one upstream: its continuation mode (adapters/continuation_modes.py: how a partial
answer is continued, per provider), retries and a circuit breaker, tenant isolation of its prefix
cache (adapters/cache_isolation.py), what its calls billed (adapters/upstream_usage.py) and cost
(adapters/pricing.py); `Upstream.whole` sends requests passed through whole
(adapters/whole_requests.py). `Continuations` is what the decoder asks of it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
import openai

from adapters.cache_isolation import CacheSalt, Hidden, Isolation, Shared, TenantSlots
from adapters.chat_template import COMMON_CONTROL, neutralize
from adapters.continuation_modes import Alternatives, Handoff, first_alternatives, mode_for
from adapters.litellm_client import litellm
from adapters.memory_store import MemoryStore
from adapters.pricing import Prices
from adapters.store import Store
from adapters.trace_context import note_failed_attempt, trace_params
from adapters.upstream_errors import (
    CircuitBreaker,
    Failure,
    UpstreamFailedRequest,
    UpstreamRejected,
    UpstreamUnavailable,
    failure_of,
)
from adapters.upstream_settings import UpstreamSettings, api_key_of
from adapters.upstream_usage import CallUsage, read_usage
from adapters.vocabulary import Vocabulary
from adapters.whole_requests import WholeRequests

SLOT_MARGIN_S = 10.0  # a slot lease outlives its call's own time-outs by this much


def prices_of(settings: UpstreamSettings) -> Prices:
    """An upstream's USD per token: the configured prices, else litellm's map for its model, else 0."""
    s = settings
    return Prices.of(s.model, s.input_usd_per_mtok, s.output_usd_per_mtok, s.cached_input_usd_per_mtok,
                     s.cache_write_usd_per_mtok, s.cache_min_prompt_tokens)


@dataclass(frozen=True)
class Continuation:
    text: str
    finished: bool  # the upstream ended its answer within this call
    prompt_tokens: int  # billed, cached ones included
    completion_tokens: int  # billed
    cost_usd: float  # cached prompt tokens at the cached price
    latency_s: float
    cached_tokens: int = 0  # prompt tokens the upstream read from its cache
    compute_ms: float | None = None  # the upstream's own prompt + generation time, where it reports it
    first: Alternatives | None = None  # its first token's alternatives, where asked for and returned
    ahead: tuple[str, ...] = ()  # what it wrote past the span where asked to read ahead, in the provider's
    # tokens (`finished` is after them)


class Continuations(Protocol):
    """What the decoder asks of an upstream: hand-offs of a growing answer, what they will cost, and
    the calls that continue them. `Upstream` is one; a wrapper that meters calls is another."""

    @property
    def available(self) -> bool: ...  # would a call pass the circuit breaker now?

    @property
    def warms(self) -> bool: ...  # should a routed request send its prompt ahead of the first hand-off?

    @property
    def worst_case_s(self) -> float: ...  # the longest one `continue_text` call can take

    @property
    def read_ahead(self) -> int: ...  # tokens a hand-off asks past its span (`continue_text`'s `ahead`)

    def handoff(self, messages: list[dict[str, Any]], continue_final: bool = False,
                scope: str = "shared") -> Handoff: ...

    def text_handoff(self, prompt: str, scope: str = "shared") -> Handoff | None: ...

    def with_answer(self, handoff: Handoff, answer: str) -> Handoff: ...

    def cache_key(self, handoff: Handoff, max_tokens: int, scope: str) -> str: ...

    def estimate_prompt_tokens(self, handoff: Handoff) -> int: ...

    def estimate_completion_tokens(self, handoff: Handoff, span: int) -> int: ...

    def estimate_cost(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> float: ...

    @property
    def prices(self) -> Prices: ...  # USD per token (adapters.pricing)

    async def continue_text(self, handoff: Handoff, max_tokens: int, temperature: float, top_p: float,
                            seed: int | None, extra: dict[str, Any] | None = None, ahead: int = 0) -> Continuation: ...


class Upstream:
    """A large model that continues partial answers. Safe to share across requests."""

    def __init__(self, name: str, settings: UpstreamSettings, vocab: Vocabulary | None,
                 store: Store | None = None) -> None:
        """`store` leases a llama-server's slots (shared by the processes that share it); without
        one, this process keeps them in memory."""
        self.name = name
        self.settings = settings
        self._vocab = vocab  # the upstream's own tokenizer and chat template, if known
        self._control = vocab.template.control if vocab else COMMON_CONTROL
        try:
            self._mode = mode_for(settings.mode, settings.model, vocab, self.neutral)
        except ValueError as exc:
            raise ValueError(f"upstream '{name}': {exc}") from exc
        self._breaker = CircuitBreaker(settings.breaker_failures, settings.breaker_cooldown_s)
        self.isolation = isolation_for(settings, store or MemoryStore())
        # requests passed through whole: the same server, breaker and cache isolation
        self.whole = WholeRequests(name, settings, vocab, self._breaker, self.isolation)

    @property
    def available(self) -> bool:
        return self._breaker.allows(time.monotonic())

    @property
    def warms(self) -> bool:
        """Should a routed request send its prompt ahead of the first hand-off (`warm`)?"""
        return self.settings.warm

    def handoff(self, messages: list[dict[str, Any]], continue_final: bool = False, scope: str = "shared") -> Handoff:
        """A hand-off of an empty answer in cache `scope`; the decoder replaces `answer` as the
        answer grows. Content reaches the upstream as text, never as markup of its template."""
        return self._mode.handoff(messages, continue_final, scope)

    def text_handoff(self, prompt: str, scope: str = "shared") -> Handoff | None:
        """A hand-off of raw text (a legacy completion's prompt, as plain text) with an empty
        answer; None when this upstream's mode continues chats only."""
        return self._mode.text_handoff(prompt, scope)

    def with_answer(self, handoff: Handoff, answer: str) -> Handoff:
        """The hand-off of `answer` so far, given the previous hand-off of this request."""
        return self._mode.with_answer(handoff, answer)

    def neutral(self, text: str) -> str:
        """`text` with this upstream's control-token strings broken (the common syntaxes where its
        vocabulary is unknown): what the upstream parses as markup arrives as plain text."""
        return neutralize(text, self._control)

    @property
    def worst_case_s(self) -> float:
        """The longest one `continue_text` call can take (every attempt timing out)."""
        return self.settings.timeout_s * (self.settings.retries + 1)

    @property
    def read_ahead(self) -> int:
        """Tokens a hand-off asks past its span, for the request's next hand-offs: `read_ahead`, else
        the mode's default (8 in chat_fallback, else 0)."""
        given = self.settings.read_ahead
        return self._mode.read_ahead if given is None else given

    def cache_key(self, handoff: Handoff, max_tokens: int, scope: str) -> str:
        """Key of a greedy continuation: everything that changes the upstream's answer, in `scope`
        (a tenant, or the tenants sharing a cache), hashed so no prompt text is stored in a key."""
        s = self.settings
        parts = [scope, self.name, s.model, s.api_base, s.mode, s.extra_body, handoff.continue_final, max_tokens,
                 self._mode.prompt(handoff)]
        return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode("utf-8")).hexdigest()

    def estimate_prompt_tokens(self, handoff: Handoff) -> int:
        """Billed prompt tokens of this hand-off: exact with the upstream's tokenizer, else an
        over-estimate from tiktoken (cl100k, plus 25%) so a reservation rarely falls short."""
        exact = self._mode.prompt_tokens(handoff)
        if exact is not None:
            return exact
        return int(litellm().token_counter(model="gpt-4o", text=handoff.text) * 1.25) + 8

    def estimate_completion_tokens(self, handoff: Handoff, span: int) -> int:
        """The most completion tokens a call for `span` answer tokens bills: the span, and in
        chat_fallback the echo of the answer's end the reply starts with."""
        return self._mode.completion_tokens(handoff, span)

    @functools.cached_property
    def prices(self) -> Prices:
        """USD per token (adapters.pricing): the configured prices, else litellm's map, else 0."""
        return prices_of(self.settings)

    def billed_usage(self, response: Any) -> CallUsage:
        """What a response (or a streamed chunk) billed, as the client may see it: with a cache that
        is not isolated per tenant, no cached count and no compute time (they would reveal another
        tenant's prefix), and so no cached price either."""
        usage = read_usage(response)
        if self.isolation.reveals_cache:
            return usage
        return dataclasses.replace(usage, cached_tokens=0, compute_ms=None)

    def estimate_cost(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> float:
        """Price of a call of this size, `cached_tokens` of its prompt at the cached price."""
        return self.prices.cost(prompt_tokens, completion_tokens, cached_tokens)

    async def continue_text(self, handoff: Handoff, max_tokens: int, temperature: float, top_p: float,
                            seed: int | None, extra: dict[str, Any] | None = None, ahead: int = 0) -> Continuation:
        """Ask the upstream for up to `max_tokens` tokens continuing the answer (`extra`: more
        sampling parameters, such as penalties); a hand-off that asks for `alternatives` gets its
        first token's likeliest ones too (`Continuation.first`; None from a mode without them). With
        `ahead`, as many tokens more are asked for in the same call and returned apart
        (`Continuation.ahead`, split where the provider's tokens count `max_tokens`).

        Transient failures are retried up to `retries` times and count against the circuit
        breaker, except 5xx answers to a call carrying the client's own `seed` or `extra`
        (adapters.upstream_errors.failure_of); raises UpstreamUnavailable when failures persist
        or the breaker is open (UpstreamFailedRequest when the last was such a 5xx), and
        UpstreamRejected (no retry) when the upstream refuses the request.
        """
        last: Exception | None = None
        failure: Failure = "outage"
        client_values = seed is not None or bool(extra)
        for _ in range(self.settings.retries + 1):
            trial = self._breaker.acquire(time.monotonic())
            if trial is None:
                raise UpstreamUnavailable(f"circuit breaker open for upstream '{self.name}'") from last
            started = time.monotonic()
            try:
                response = await self._call(handoff, max_tokens + ahead, temperature, top_p, seed, extra or {})
            except (openai.OpenAIError, httpx.HTTPError, asyncio.TimeoutError, ValueError) as exc:
                failure = failure_of(exc, client_values)
                note_failed_attempt(failure, exc)
                self._breaker.record_failure(failure, time.monotonic(), trial)
                if failure == "refused":
                    raise UpstreamRejected(f"upstream '{self.name}' refused the hand-off: {exc}") from exc
                last = exc
                continue
            except BaseException:
                self._breaker.abandon(trial)
                raise
            self._breaker.record(True, time.monotonic(), trial)
            return self._continuation(handoff, response, time.monotonic() - started, max_tokens if ahead else None)
        failed = UpstreamFailedRequest if failure == "request" else UpstreamUnavailable
        raise failed(f"upstream '{self.name}' failed: {type(last).__name__}: {last}") from last

    async def _call(self, handoff: Handoff, max_tokens: int, temperature: float, top_p: float,
                    seed: int | None, extra: dict[str, Any]) -> Any:
        s = self.settings
        common: dict[str, Any] = dict(
            model=s.model, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
            api_base=s.api_base, api_key=api_key_of(s), timeout=s.timeout_s, num_retries=0, **extra, **trace_params(),
        )
        if seed is not None:
            common["seed"] = int64(seed)
        if handoff.alternatives and self._mode.gives_alternatives:
            common.update(self._mode.alternatives_params(handoff.alternatives))
        async with self.isolation.lease(handoff.scope, handoff.request_key) as isolated:
            return await self._mode.call(handoff, common, {**s.extra_body, **isolated})

    def _continuation(self, handoff: Handoff, response: Any, latency_s: float, span: int | None) -> Continuation:
        """The reply as a continuation; with `span`, the text past that many tokens kept apart (`ahead`)."""
        choice = response.choices[0]
        whole = self._mode.text(handoff, response)
        text, ahead = whole, ()
        if span:
            pieces = self._mode.pieces(whole)
            text, ahead = "".join(pieces[:span]), tuple(pieces[span:])
        usage = self.billed_usage(response)
        prompt_tokens = usage.prompt_tokens or self.estimate_prompt_tokens(handoff)
        completion_tokens = usage.completion_tokens
        if completion_tokens is None:
            completion_tokens = litellm().token_counter(model="gpt-4o", text=whole)
        return Continuation(
            text=text, finished=choice.finish_reason == "stop" and not self._mode.dropped(whole, response),
            prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
            cost_usd=self.estimate_cost(prompt_tokens, completion_tokens, usage.cached_tokens), latency_s=latency_s,
            cached_tokens=usage.cached_tokens, compute_ms=usage.compute_ms,
            first=first_alternatives(response) if handoff.alternatives and self._mode.gives_alternatives else None,
            ahead=ahead,
        )


def int64(seed: int) -> int:
    """`seed` as OpenAI's 64-bit signed seed, wrapped as the local decoder wraps it (mod 2**64): a
    request's choices and samples offset its seed (`seed + choice`), which may pass 2**63 - 1."""
    return (seed + 2**63) % 2**64 - 2**63


def isolation_for(settings: UpstreamSettings, store: Store) -> Isolation:
    """How this upstream keeps tenants apart in its prefix cache (see adapters.cache_isolation);
    llama-server's slots are leased through `store`."""
    if settings.cache_isolation == "shared":
        return Shared()
    if settings.kind == "llama-server":
        # a call holds its slot for as long as it may run: a hand-off's retries, or a whole stream
        hold_s = max(settings.timeout_s * (settings.retries + 1), settings.passthrough_timeout_s) + SLOT_MARGIN_S
        return TenantSlots.of_server(settings.api_base or "", settings.slots or 1, settings.timeout_s, store, hold_s)
    return CacheSalt() if settings.kind == "vllm" else Hidden()
