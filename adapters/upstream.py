"""Upstream models through litellm: continue a partial answer for a few tokens, or answer a
request passed through whole.

`Upstream` is one upstream: its continuation mode (adapters/continuation_modes.py: how a partial
answer is continued, per provider), retries and a circuit breaker, tenant isolation of its prefix
cache (adapters/cache_isolation.py), what its calls billed (adapters/upstream_usage.py) and cost
(adapters/pricing.py). `Continuations` is what the decoder asks of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
import openai

from adapters.cache_isolation import CacheSalt, Hidden, Isolation, Shared, TenantSlots
from adapters.chat_template import COMMON_CONTROL, neutralize
from adapters.continuation_modes import Handoff, mode_for
from adapters.litellm_client import litellm
from adapters.pricing import Prices
from adapters.upstream_settings import UpstreamSettings
from adapters.upstream_usage import CallUsage, read_usage
from adapters.vocabulary import Vocabulary

class UpstreamUnavailable(Exception):
    """The upstream failed, timed out, or its circuit breaker is open."""

    reason = "upstream_unavailable"


class UpstreamRejected(UpstreamUnavailable):
    """The upstream refused this request itself (a 4xx such as context length or a content filter):
    not retried, not held against the upstream, and the same request would be refused again."""

    reason = "upstream_rejected"


def status_of(exc: BaseException) -> int | None:
    status = getattr(exc, "status_code", None)
    if status is None and isinstance(exc, httpx.HTTPStatusError):
        status = exc.response.status_code
    return status if isinstance(status, int) else None


def is_transient(exc: BaseException) -> bool:
    """Transport errors, time-outs, 408, 429 and 5xx: worth a retry and held against the breaker."""
    status = status_of(exc)
    return status is None or status in (408, 429) or status >= 500


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


class Continuations(Protocol):
    """What the decoder asks of an upstream: hand-offs of a growing answer, what they will cost, and
    the calls that continue them. `Upstream` is one; a wrapper that meters calls is another."""

    @property
    def available(self) -> bool: ...  # would a call pass the circuit breaker now?

    @property
    def warms(self) -> bool: ...  # should a routed request send its prompt ahead of the first hand-off?

    @property
    def worst_case_s(self) -> float: ...  # the longest one `continue_text` call can take

    def handoff(self, messages: list[dict[str, Any]], continue_final: bool = False,
                scope: str = "shared") -> Handoff: ...

    def with_answer(self, handoff: Handoff, answer: str) -> Handoff: ...

    def cache_key(self, handoff: Handoff, max_tokens: int, scope: str) -> str: ...

    def estimate_prompt_tokens(self, handoff: Handoff) -> int: ...

    def estimate_cost(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> float: ...

    async def continue_text(self, handoff: Handoff, max_tokens: int, temperature: float, top_p: float,
                            seed: int | None, extra: dict[str, Any] | None = None) -> Continuation: ...


class CircuitBreaker:
    """Closed, calls pass; `failures` transient failures in a row open it for `cooldown_s`; then it is
    half-open: one trial call passes (others are refused meanwhile) and its outcome closes or re-opens it."""

    def __init__(self, failures: int, cooldown_s: float) -> None:
        self._limit, self._cooldown = failures, cooldown_s
        self._consecutive = 0
        self._opened_at: float | None = None
        self._trial_running = False

    def allows(self, now: float) -> bool:
        """Would a call pass now? (No side effect.)"""
        if self._opened_at is None:
            return True
        return not self._trial_running and now - self._opened_at >= self._cooldown

    def acquire(self, now: float) -> bool | None:
        """Let one call through: None if refused, True if it is the half-open trial, else False."""
        if not self.allows(now):
            return None
        if self._opened_at is None:
            return False
        self._trial_running = True
        return True

    def record(self, ok: bool, now: float, trial: bool = False) -> None:
        if trial:
            self._trial_running = False
        if ok:
            self._consecutive, self._opened_at = 0, None
            return
        self._consecutive += 1
        if self._consecutive >= self._limit or trial:
            self._opened_at = now

    def abandon(self, trial: bool) -> None:
        """A call ended without an outcome (cancelled): the next caller may try."""
        if trial:
            self._trial_running = False


class Upstream:
    """A large model that continues partial answers. Safe to share across requests."""

    def __init__(self, name: str, settings: UpstreamSettings, vocab: Vocabulary | None) -> None:
        self.name = name
        self.settings = settings
        self._vocab = vocab  # the upstream's own tokenizer and chat template, if known
        self._control = vocab.template.control if vocab else COMMON_CONTROL
        try:
            self._mode = mode_for(settings.mode, settings.model, vocab, self.neutral)
        except ValueError as exc:
            raise ValueError(f"upstream '{name}': {exc}") from exc
        self._breaker = CircuitBreaker(settings.breaker_failures, settings.breaker_cooldown_s)
        self.isolation = isolation_for(settings)

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

    def with_answer(self, handoff: Handoff, answer: str) -> Handoff:
        """The hand-off of `answer` so far, given the previous hand-off of this request."""
        return self._mode.with_answer(handoff, answer)

    @property
    def _api_key(self) -> str:
        return os.environ.get(self.settings.api_key_env, "") if self.settings.api_key_env else "none"

    def neutral(self, text: str) -> str:
        """`text` with this upstream's control-token strings broken (the common syntaxes where its
        vocabulary is unknown): what the upstream parses as markup arrives as plain text."""
        return neutralize(text, self._control)

    @property
    def worst_case_s(self) -> float:
        """The longest one `continue_text` call can take (every attempt timing out)."""
        return self.settings.timeout_s * (self.settings.retries + 1)

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

    @functools.cached_property
    def prices(self) -> Prices:
        """USD per token (adapters.pricing): the configured prices, else litellm's map, else 0."""
        s = self.settings
        return Prices.of(s.model, s.input_usd_per_mtok, s.output_usd_per_mtok, s.cached_input_usd_per_mtok)

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

    async def continue_text(self, handoff: Handoff, max_tokens: int, temperature: float,
                            top_p: float, seed: int | None, extra: dict[str, Any] | None = None) -> Continuation:
        """Ask the upstream for up to `max_tokens` tokens continuing the answer (`extra`: more
        sampling parameters, such as penalties).

        Transient failures are retried up to `retries` times and count against the circuit
        breaker; raises UpstreamUnavailable when they persist or the breaker is open, and
        UpstreamRejected (no retry, breaker untouched) when the upstream refuses the request.
        """
        last: Exception | None = None
        for _ in range(self.settings.retries + 1):
            trial = self._breaker.acquire(time.monotonic())
            if trial is None:
                raise UpstreamUnavailable(f"circuit breaker open for upstream '{self.name}'") from last
            started = time.monotonic()
            try:
                response = await self._call(handoff, max_tokens, temperature, top_p, seed, extra or {})
            except (openai.OpenAIError, httpx.HTTPError, asyncio.TimeoutError, ValueError) as exc:
                transient = is_transient(exc)
                self._breaker.record(not transient, time.monotonic(), trial)
                if not transient:
                    raise UpstreamRejected(f"upstream '{self.name}' refused the hand-off: {exc}") from exc
                last = exc
                continue
            except BaseException:
                self._breaker.abandon(trial)
                raise
            self._breaker.record(True, time.monotonic(), trial)
            return self._continuation(handoff, response, time.monotonic() - started)
        raise UpstreamUnavailable(f"upstream '{self.name}' failed: {type(last).__name__}: {last}") from last

    @property
    def chat_model(self) -> str:
        """litellm model name for whole chat requests: `chat_model`, else `model` with a text
        completion provider read as its chat one (text-completion-openai/x -> openai/x)."""
        provider, _, name = self.settings.model.partition("/")
        if self.settings.chat_model:
            return self.settings.chat_model
        return f"openai/{name}" if provider == "text-completion-openai" else self.settings.model

    def reads(self, medium: str) -> bool:
        """Does this upstream read `medium` (image, audio or file) in messages? (`inputs`, else litellm's map.)"""
        if self.settings.inputs is not None:
            return medium in self.settings.inputs
        check = {"image": litellm().supports_vision, "audio": litellm().supports_audio_input,
                 "file": litellm().supports_pdf_input}[medium]
        try:
            return bool(check(model=self.chat_model))
        except Exception:  # noqa: BLE001 - litellm raises bare Exception for unmapped models
            return False

    async def count_chat_tokens(self, params: dict[str, Any]) -> int | None:
        """The upstream's own count of the prompt of a whole chat request (its template and tool
        preamble included), where it can give one: llama-server renders it (/apply-template) and
        counts it (/tokenize). None elsewhere, or when the server does not answer."""
        if self.settings.kind != "llama-server" or not self.settings.api_base:
            return None
        root = self.settings.api_base.removesuffix("/").removesuffix("/v1")
        body = {k: params[k] for k in ("messages", "tools", "tool_choice", "parallel_tool_calls") if k in params}
        try:
            async with httpx.AsyncClient(timeout=self.settings.timeout_s) as client:
                rendered = (await client.post(f"{root}/apply-template", json=body)).raise_for_status().json()
                counted = await client.post(f"{root}/tokenize", json={
                    "content": rendered["prompt"], "add_special": True, "parse_special": True})
                return len(counted.raise_for_status().json()["tokens"])
        except (httpx.HTTPError, KeyError, TypeError, ValueError):
            return None

    def count_text_tokens(self, text: str) -> int:
        """Tokens of `text` in the upstream's vocabulary where it is known, else tiktoken's count."""
        if self._vocab is not None:
            return self._vocab.count(text)
        return litellm().token_counter(model="gpt-4o", text=text)

    def estimate_chat_tokens(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int:
        """Billed prompt tokens of a whole chat request, over-estimated (tiktoken, plus 25%) so that a
        reservation rarely falls short: the upstream's template and tool rendering add their own."""
        try:
            counted = litellm().token_counter(model="gpt-4o", messages=messages, tools=tools)
        except Exception:  # noqa: BLE001 - shapes its counter does not know (new part types): count the JSON
            counted = litellm().token_counter(model="gpt-4o", text=json.dumps([messages, tools], default=str))
        return int(counted * 1.25) + 16

    async def chat(self, params: dict[str, Any], scope: str = "shared") -> Any:
        """Send one whole chat request (the client's fields in `params`, `stream` included) in cache
        `scope`, and return litellm's response, or its chunk stream once the upstream has started
        answering (an async iterator that holds the call's cache lease until it ends or is closed).

        One attempt (the client retries, as it would with the provider); a transient failure
        counts against the circuit breaker and raises UpstreamUnavailable, a refusal (4xx) raises
        UpstreamRejected with the upstream's own message."""
        trial = self._breaker.acquire(time.monotonic())
        if trial is None:
            raise UpstreamUnavailable(f"circuit breaker open for upstream '{self.name}'")
        s = self.settings
        params = dict(params)
        # The client's metadata is OpenAI's string map for the provider, never litellm's own metadata.
        extra_body = {"metadata": params.pop("metadata")} if "metadata" in params else {}
        lease = contextlib.AsyncExitStack()
        try:
            extra_body.update(await lease.enter_async_context(self.isolation.lease(scope, uuid.uuid4().hex)))
            # allowed_openai_params: litellm would refuse fields it does not map for this provider
            # (verbosity, prompt_cache_key, ...); the client sent them for the upstream to judge.
            response = await litellm().acompletion(
                model=self.chat_model, api_base=s.api_base, api_key=self._api_key, timeout=s.passthrough_timeout_s,
                num_retries=0, allowed_openai_params=[name for name in params if name != "messages"],
                extra_body=extra_body, **params)
        except (openai.OpenAIError, httpx.HTTPError, asyncio.TimeoutError, ValueError) as exc:
            await lease.aclose()
            transient = is_transient(exc)
            # A 500 answering a client's own request body says little about the server (llama-server
            # answers 500 to messages it cannot parse): only outages count against the breaker here.
            self._breaker.record(not transient or status_of(exc) == 500, time.monotonic(), trial)
            if transient:
                raise UpstreamUnavailable(f"upstream '{self.name}' failed: {type(exc).__name__}: {exc}") from exc
            raise UpstreamRejected(upstream_message(exc)) from exc
        except BaseException:
            await lease.aclose()
            self._breaker.abandon(trial)
            raise
        self._breaker.record(True, time.monotonic(), trial)
        if not params.get("stream"):
            await lease.aclose()
            return response
        return _leased(response, lease)

    async def _call(self, handoff: Handoff, max_tokens: int, temperature: float, top_p: float,
                    seed: int | None, extra: dict[str, Any]) -> Any:
        s = self.settings
        common: dict[str, Any] = dict(
            model=s.model, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
            api_base=s.api_base, api_key=self._api_key, timeout=s.timeout_s, num_retries=0, **extra,
        )
        if seed is not None:
            common["seed"] = seed
        async with self.isolation.lease(handoff.scope, handoff.request_key) as isolated:
            return await self._mode.call(handoff, common, {**s.extra_body, **isolated})

    def _continuation(self, handoff: Handoff, response: Any, latency_s: float) -> Continuation:
        choice = response.choices[0]
        text = self._mode.text(handoff, response)
        usage = self.billed_usage(response)
        prompt_tokens = usage.prompt_tokens or self.estimate_prompt_tokens(handoff)
        completion_tokens = usage.completion_tokens
        if completion_tokens is None:
            completion_tokens = litellm().token_counter(model="gpt-4o", text=text)
        return Continuation(
            text=text, finished=choice.finish_reason == "stop",
            prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
            cost_usd=self.estimate_cost(prompt_tokens, completion_tokens, usage.cached_tokens), latency_s=latency_s,
            cached_tokens=usage.cached_tokens, compute_ms=usage.compute_ms,
        )


async def _leased(stream: Any, lease: contextlib.AsyncExitStack) -> Any:
    """A streamed answer that, when it ends or is closed, closes the upstream's stream (so the
    upstream stops writing) and gives its cache lease back."""
    try:
        async for chunk in stream:
            yield chunk
    finally:
        try:
            if hasattr(stream, "aclose"):
                await stream.aclose()
        finally:
            await lease.aclose()


def isolation_for(settings: UpstreamSettings) -> Isolation:
    """How this upstream keeps tenants apart in its prefix cache (see adapters.cache_isolation)."""
    if settings.cache_isolation == "shared":
        return Shared()
    if settings.kind == "llama-server":
        return TenantSlots.of_server(settings.api_base or "", settings.slots or 1, settings.timeout_s)
    return CacheSalt() if settings.kind == "vllm" else Hidden()


def upstream_message(exc: BaseException) -> str:
    """The upstream's own words from an error (its OpenAI-shaped body when there is one)."""
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
    return str(getattr(exc, "message", None) or exc)
